// What the native sources call of each other (one library: matmul.cpp, attention.cpp, step.cpp).
#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/Optional.h>

#include <cstdint>

constexpr int64_t ROWS_APART = 16;  // rows from which a step's per-row work spreads over the threads

// f(b) for rows b in [first, last): over torch's threads where there are ROWS_APART rows or more (a prompt's
// chunk), in the calling thread otherwise (decode rows); every row's values are computed alone either way
template <typename F>
inline void by_rows(int64_t first, int64_t last, const F& f) {
  if (last - first < ROWS_APART) {
    for (int64_t b = first; b < last; ++b) f(b);
    return;
  }
  at::parallel_for(first, last, ROWS_APART / 2, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) f(b);
  });
}

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

// e^x for 8 lanes, x <= 0; 0 for x below -87.3 (and for -inf). Range reduction to r in [-ln2/2, ln2/2],
// a degree-6 polynomial, 2^n from the exponent bits.
inline __m256 exp8(__m256 x) {
  const __m256 low = _mm256_set1_ps(-87.3f);
  const __m256 gone = _mm256_cmp_ps(x, low, _CMP_LT_OQ);  // -inf included
  x = _mm256_max_ps(x, low);
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);  // ln 2, split in two parts
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  const __m256 r2 = _mm256_mul_ps(r, r);
  const __m256 y = _mm256_add_ps(_mm256_fmadd_ps(p, r2, r), _mm256_set1_ps(1.f));
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_andnot_ps(gone, _mm256_mul_ps(y, _mm256_castsi256_ps(bits)));
}
#endif

at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            const c10::optional<at::Tensor>& mask, double scale);

// decode_attention over an int8 cache: k, v int8 [B, Hkv, L, D] (D contiguous), each (row, kv head, position)'s
// vector scaled by k_scale / v_scale float32 [B, Hkv, L]; the values decode_attention gives on the dequantized
// cache (the rows a chunk reads are dequantized once into fp32 and read by every head of the group)
at::Tensor decode_attention_q8(const at::Tensor& q, const at::Tensor& k, const at::Tensor& k_scale,
                               const at::Tensor& v, const at::Tensor& v_scale, const c10::optional<at::Tensor>& mask,
                               double scale);

// Rows x [M, K] through up to 4 w4a8 matrices that read them (q, k, v; gate, up), in w4a8_mm's layout: the
// rows are quantized once and the tiles of all of them split over torch's threads in one parallel region;
// matrix i (tiles[i] tiles of 8 outputs) writes y[i] [M, 8 * tiles[i]]. The values w4a8_mm gives.
void w4a8_rows_multi(const float* x, int64_t M, int64_t K, int64_t group, int count, const uint8_t* const* packed,
                     const int64_t* tiles, float* const* y);

// Rows x [M, K] through w8a8 weights in w8a8_mm's layout (packed [N/8, K/32, 256] int8, scale [N]) into y [M, N]:
// the values w8a8_mm gives, without a tensor per call.
void w8a8_rows(const float* x, int64_t M, int64_t K, const int8_t* packed, const float* scale, int64_t N, float* y);
