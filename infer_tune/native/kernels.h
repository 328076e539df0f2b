// What the native sources call of each other (one library: matmul.cpp, attention.cpp, step.cpp).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Optional.h>

#include <cstdint>

at::Tensor w4a8_mm(const at::Tensor& x, const at::Tensor& packed, int64_t group);
at::Tensor w8a8_mm(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale);
at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            const c10::optional<at::Tensor>& mask, double scale);

// Rows x [M, K] through up to 4 w4a8 matrices that read them (q, k, v; gate, up), in w4a8_mm's layout: the
// rows are quantized once and the tiles of all of them split over torch's threads in one parallel region;
// matrix i (tiles[i] tiles of 8 outputs) writes y[i] [M, 8 * tiles[i]]. The values w4a8_mm gives.
void w4a8_rows_multi(const float* x, int64_t M, int64_t K, int64_t group, int count, const uint8_t* const* packed,
                     const int64_t* tiles, float* const* y);
