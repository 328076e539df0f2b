// The whole decode step of a Llama-family model in one native call: the lean path's `native` step and
// the slot engine's (infer_tune/native/step.py builds it from a model whose every part it recognizes;
// docs/tune.md, docs/batch.md).
//
// One new token per row (the lean loop: one row; the slot engine: rows 0..R-1 of its slot cache, each at
// its own position), fp32 residual stream, the model's own quantized weights in the w4a8 layout
// (modules.Int4A8Linear) and its int8 (w8a8) or int4 (w4a8) head, the static KV cache written in place.
// Per layer, what transformers' LlamaDecoderLayer computes, per row:
//     h = rms_norm(x) * w_in;  q, k, v = h W_q, h W_k, h W_v;  rotary embedding of q and k at the position;
//     k, v written at the position of the row's cache (a one-row step sets the length counter to position + 1);
//     x += attention(q, the row's cache up to its position) W_o;
//     h = rms_norm(x) * w_post;  x += (silu(h W_gate) * (h W_up)) W_down
// then logits = (rms_norm(x) * w_final) W_head. The matmuls are w4a8_rows_multi / w8a8_rows and the attention
// decode_attention, the kernels the compiled step calls, called directly: no dispatcher, no Python, no
// allocation but the attention's and the head's outputs, norms and rotary embedding in plain loops. The
// values equal the compiled step's up to fp32 rounding (the norms' sums and cos / sin are computed here);
// a row's values do not depend on the other rows (every kernel here treats rows independently).

#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/zeros.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "kernels.h"

namespace {

constexpr int64_t PER_LAYER = 9;  // input norm, q, k, v, o, post-attention norm, gate, up, down
constexpr int64_t LIMIT = int64_t{1} << 24;  // any one size (a 16M-wide layer is no model's)

// a * b fits in 2^40 elements (no buffer of a real model is near; no int64 product of two LIMITs overflows)
inline bool fits(int64_t a, int64_t b) { return a >= 0 && b >= 0 && a <= LIMIT && b <= LIMIT && a * b <= (int64_t{1} << 40); }

// bytes of a w4a8 matrix of n outputs and k inputs in groups of `group` (matmul.cpp's layout)
inline int64_t packed_bytes(int64_t n, int64_t k, int64_t group) { return (n / 8) * (k / group) * (32 + 4 * group); }

// out = w * (x / sqrt(mean(x^2) + eps)), transformers' LlamaRMSNorm in fp32
void rms_norm(const float* x, const float* w, int64_t n, float eps, float* out) {
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < n; ++i) sum += x[i] * x[i];
  const float r = 1.f / std::sqrt(sum / static_cast<float>(n) + eps);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) out[i] = w[i] * (x[i] * r);
}

// rotary embedding of one head's D values (rotate-half convention): cos / sin hold D/2 values
inline void rotate(const float* x, const float* cos, const float* sin, int64_t D, float* out) {
  const int64_t half = D / 2;
  for (int64_t i = 0; i < half; ++i) {
    out[i] = x[i] * cos[i] - x[i + half] * sin[i];
    out[i + half] = x[i + half] * cos[i] + x[i] * sin[i];
  }
}

const uint8_t* bytes(const at::Tensor& t) { return static_cast<const uint8_t*>(t.data_ptr()); }

// act = silu(gate) * up = gate / (1 + e^-gate) * up, n values (std::exp: an 8-lane polynomial exp here
// measured no faster in a whole step and moved SmolLM2's logits by a rounding of an int8 activation)
void silu_mul(const float* gate, const float* up, int64_t n, float* act) {
  for (int64_t i = 0; i < n; ++i) act[i] = gate[i] / (1.f + std::exp(-gate[i])) * up[i];
}

}  // namespace

struct LlamaStep : torch::CustomClassHolder {
  // weights: per layer PER_LAYER tensors, then the final norm, the head's packed weights and (w8a8) its scale
  std::vector<at::Tensor> weights, keys, values, lengths;
  at::Tensor inv_freq, mask, q;
  int64_t layers, heads, kv_heads, head_dim, hidden, inter, group, vocab, max_len, batch;
  int64_t head_group;  // 0: a w8a8 head (packed, scale); else an int4 head in the w4a8 layout with this group
  double eps, scaling, rope_scale;
  std::vector<float> resid, h, qs, ks, vs, proj, gate, up, act, cos, sin;
  // per layer and row count r: the caches' first r rows, and the mask's (views made once)
  std::vector<std::vector<at::Tensor>> key_rows, value_rows;
  std::vector<at::Tensor> mask_rows, q_rows;
  // raw pointers, taken once (each data_ptr() call checks the tensor: ~3% of a step when taken per use)
  struct Layer {
    const float *in_norm, *post_norm;
    const uint8_t *q, *k, *v, *o, *gate, *up, *down;
    float *keys, *values;
    int64_t k0, k1, k2, v0, v1, v2;
  };
  std::vector<Layer> at_layer;
  const float* final_norm = nullptr;
  const uint8_t* head = nullptr;
  const float* head_scale = nullptr;

  // keys / values: per layer the cache [rows, kv heads, length, head dim] fp32; lengths: per layer the
  // cache's int64 length counter, set to position + 1 by a one-row step (empty: none to keep)
  LlamaStep(std::vector<at::Tensor> weights_, std::vector<at::Tensor> keys_, std::vector<at::Tensor> values_,
            std::vector<at::Tensor> lengths_, at::Tensor inv_freq_, std::vector<int64_t> ints,
            std::vector<double> floats)
      : weights(std::move(weights_)), keys(std::move(keys_)), values(std::move(values_)),
        lengths(std::move(lengths_)), inv_freq(inv_freq_.contiguous()) {
    TORCH_CHECK(ints.size() == 8 && floats.size() == 3, "LlamaStep: 8 ints and 3 floats");
    layers = ints[0], heads = ints[1], kv_heads = ints[2], head_dim = ints[3], hidden = ints[4], inter = ints[5];
    group = ints[6], head_group = ints[7];
    eps = floats[0], scaling = floats[1], rope_scale = floats[2];
    // every count >= 1 and every size the buffers below multiply out fits (a caller's numbers, never trusted)
    TORCH_CHECK(layers >= 1 && heads >= 1 && kv_heads >= 1 && head_dim >= 2 && hidden >= 1 && inter >= 1,
                "LlamaStep: layers, heads, kv heads, head dim, hidden and intermediate sizes must be >= 1");
    TORCH_CHECK(layers <= LIMIT && heads <= LIMIT && kv_heads <= LIMIT && head_dim <= LIMIT && hidden <= LIMIT &&
                    inter <= LIMIT && group <= LIMIT && head_group <= LIMIT,
                "LlamaStep: a size above ", LIMIT);
    TORCH_CHECK(group >= 32 && group % 32 == 0 && (head_group == 0 || (head_group >= 32 && head_group % 32 == 0)),
                "LlamaStep: quantization groups must be positive multiples of 32, got ", group, " and ", head_group);
    TORCH_CHECK(static_cast<int64_t>(weights.size()) == layers * PER_LAYER + 2 + (head_group ? 0 : 1),
                "LlamaStep: ", weights.size(), " weight tensors for ", layers, " layers");
    TORCH_CHECK(static_cast<int64_t>(keys.size()) == layers && static_cast<int64_t>(values.size()) == layers &&
                    (lengths.empty() || static_cast<int64_t>(lengths.size()) == layers),
                "LlamaStep: one key and value tensor (and length counter) per layer");
    TORCH_CHECK(heads % kv_heads == 0 && head_dim % 2 == 0 && inv_freq.numel() == head_dim / 2,
                "LlamaStep: head shapes");
    TORCH_CHECK(inv_freq.scalar_type() == at::kFloat, "LlamaStep: inv_freq must be fp32");
    batch = keys[0].size(0), max_len = keys[0].size(2);
    TORCH_CHECK(batch >= 1 && max_len >= 1 && batch <= LIMIT && max_len <= LIMIT,
                "LlamaStep: the cache must hold >= 1 row and >= 1 position, got ", batch, " x ", max_len);
    const int64_t qn_ = heads * head_dim, kn_ = kv_heads * head_dim;
    TORCH_CHECK(fits(batch, std::max({hidden, inter, qn_})) && fits(batch, max_len) && qn_ <= LIMIT,
                "LlamaStep: rows x sizes overflow");
    TORCH_CHECK(hidden % group == 0 && inter % group == 0 && qn_ % group == 0 && qn_ % 8 == 0 && kn_ % 8 == 0 &&
                    hidden % 8 == 0 && inter % 8 == 0,
                "LlamaStep: sizes must be multiples of 8 and of the group ", group);
    for (int64_t l = 0; l < layers; ++l) {
      TORCH_CHECK(keys[l].dim() == 4 && keys[l].size(0) == batch && keys[l].size(1) == kv_heads &&
                      keys[l].size(2) == max_len && keys[l].size(3) == head_dim && keys[l].stride(3) == 1 &&
                      keys[l].scalar_type() == at::kFloat && values[l].sizes() == keys[l].sizes() &&
                      values[l].stride(3) == 1 && values[l].scalar_type() == at::kFloat,
                  "LlamaStep: layer ", l, "'s cache is not [rows, kv heads, length, head dim] fp32");
      if (!lengths.empty())
        TORCH_CHECK(lengths[l].scalar_type() == at::kLong && lengths[l].numel() == 1,
                    "LlamaStep: layer ", l, "'s length counter is not one int64");
    }
    vocab = weights[layers * PER_LAYER + 1].size(0) * 8;  // padded to a multiple of 8; the caller narrows
    const auto f32 = at::TensorOptions().dtype(at::kFloat);
    mask = at::zeros({batch, 1, 1, max_len}, at::TensorOptions().dtype(at::kBool));
    q = at::empty({batch, heads, 1, head_dim}, f32);
    key_rows.resize(layers), value_rows.resize(layers);
    for (int64_t r = 1; r <= batch; ++r) {
      mask_rows.push_back(mask.narrow(0, 0, r));
      q_rows.push_back(q.narrow(0, 0, r));
      for (int64_t l = 0; l < layers; ++l) {
        key_rows[l].push_back(keys[l].narrow(0, 0, r));
        value_rows[l].push_back(values[l].narrow(0, 0, r));
      }
    }
    for (int64_t l = 0; l < layers; ++l) {
      const at::Tensor* w = weights.data() + l * PER_LAYER;
      for (int64_t i : {0, 5}) TORCH_CHECK(w[i].scalar_type() == at::kFloat && w[i].numel() == hidden && w[i].is_contiguous(),
                                            "LlamaStep: layer ", l, "'s norms must be fp32 [hidden]");
      for (int64_t i : {1, 2, 3, 4, 6, 7, 8}) TORCH_CHECK(w[i].scalar_type() == at::kByte && w[i].is_contiguous(),
                                                          "LlamaStep: layer ", l, "'s projections must be packed uint8");
      const int64_t qn_ = heads * head_dim, kn_ = kv_heads * head_dim;
      const int64_t expect[9] = {0, packed_bytes(qn_, hidden, group), packed_bytes(kn_, hidden, group),
                                 packed_bytes(kn_, hidden, group), packed_bytes(hidden, qn_, group), 0,
                                 packed_bytes(inter, hidden, group), packed_bytes(inter, hidden, group),
                                 packed_bytes(hidden, inter, group)};
      for (int64_t i : {1, 2, 3, 4, 6, 7, 8})
        TORCH_CHECK(w[i].numel() == expect[i], "LlamaStep: layer ", l, "'s weight ", i, " holds ", w[i].numel(),
                    " bytes, its shapes need ", expect[i]);
      at_layer.push_back({w[0].data_ptr<float>(), w[5].data_ptr<float>(), bytes(w[1]), bytes(w[2]), bytes(w[3]),
                          bytes(w[4]), bytes(w[6]), bytes(w[7]), bytes(w[8]), keys[l].data_ptr<float>(),
                          values[l].data_ptr<float>(), keys[l].stride(0), keys[l].stride(1), keys[l].stride(2),
                          values[l].stride(0), values[l].stride(1), values[l].stride(2)});
    }
    const at::Tensor* tail = weights.data() + layers * PER_LAYER;
    TORCH_CHECK(tail[0].scalar_type() == at::kFloat && tail[0].numel() == hidden && tail[1].is_contiguous(),
                "LlamaStep: the final norm and the head");
    TORCH_CHECK(vocab >= 8 && hidden % 32 == 0 && (!head_group || hidden % head_group == 0),
                "LlamaStep: the head's shapes");
    TORCH_CHECK(tail[1].numel() == (head_group ? packed_bytes(vocab, hidden, head_group) : (vocab / 8) * (hidden / 32) * 256),
                "LlamaStep: the head holds ", tail[1].numel(), " bytes, its shapes need another size");
    TORCH_CHECK(!head_group || tail[1].scalar_type() == at::kByte, "LlamaStep: a w4a8 head is packed uint8");
    final_norm = tail[0].data_ptr<float>();
    head = bytes(tail[1]);
    if (!head_group) {
      TORCH_CHECK(tail[1].scalar_type() == at::kChar && tail[2].scalar_type() == at::kFloat &&
                      tail[2].numel() == vocab && tail[2].is_contiguous(),
                  "LlamaStep: a w8a8 head is int8 [N/8, K/32, 256] with fp32 scales [N]");
      head_scale = tail[2].data_ptr<float>();
    }
    const int64_t qn = heads * head_dim, kn = kv_heads * head_dim;
    resid.resize(batch * hidden), h.resize(batch * hidden), qs.resize(batch * qn);
    ks.resize(batch * kn), vs.resize(batch * kn), proj.resize(batch * hidden), gate.resize(batch * inter);
    up.resize(batch * inter), act.resize(batch * inter);
    cos.resize(batch * head_dim / 2), sin.resize(batch * head_dim / 2);
  }

  // the lean loop's step: x the token's embedding [1, hidden] fp32 at `position` -> logits [1, vocab padded]
  at::Tensor step(const at::Tensor& x, int64_t position) {
    TORCH_CHECK(x.numel() == hidden && x.scalar_type() == at::kFloat, "LlamaStep: x must be [1, hidden] fp32");
    const at::Tensor logits = run(1, x.contiguous().data_ptr<float>(), &position);
    for (const at::Tensor& counter : lengths) *counter.data_ptr<int64_t>() = position + 1;
    return logits;
  }

  // the slot engine's step: rows 0..R-1 of the caches, row b's token x[b] at positions[b] -> logits [R, vocab padded]
  at::Tensor step_rows(const at::Tensor& x, const at::Tensor& positions) {
    const int64_t rows = x.size(0);
    TORCH_CHECK(x.dim() == 2 && x.size(1) == hidden && x.scalar_type() == at::kFloat && rows >= 1 && rows <= batch,
                "LlamaStep: x must be [rows <= ", batch, ", hidden] fp32");
    TORCH_CHECK(positions.scalar_type() == at::kLong && positions.numel() == rows, "LlamaStep: one int64 position per row");
    return run(rows, x.contiguous().data_ptr<float>(), positions.contiguous().data_ptr<int64_t>());
  }

  at::Tensor run(int64_t rows, const float* x, const int64_t* positions) {
    const int64_t D = head_dim, half = head_dim / 2, qn = heads * D, kn = kv_heads * D;
    const float fe = static_cast<float>(eps), rs = static_cast<float>(rope_scale);
    const float* inv = inv_freq.data_ptr<float>();
    bool* mb = mask.data_ptr<bool>();
    for (int64_t b = 0; b < rows; ++b) {
      const int64_t p = positions[b];
      TORCH_CHECK(p >= 0 && p < max_len, "LlamaStep: position ", p, " outside the cache of ", max_len);
      for (int64_t i = 0; i < half; ++i) {  // as transformers: freqs = position * inv_freq in fp32
        const float f = static_cast<float>(p) * inv[i];
        cos[b * half + i] = std::cos(f) * rs;
        sin[b * half + i] = std::sin(f) * rs;
      }
      std::fill(mb + b * max_len, mb + b * max_len + p + 1, true);
      std::fill(mb + b * max_len + p + 1, mb + (b + 1) * max_len, false);
    }
    std::copy_n(x, rows * hidden, resid.data());
    float* qp = q.data_ptr<float>();
    for (int64_t l = 0; l < layers; ++l) {
      const Layer& L = at_layer[l];
      for (int64_t b = 0; b < rows; ++b) rms_norm(resid.data() + b * hidden, L.in_norm, hidden, fe, h.data() + b * hidden);
      {
        const uint8_t* packed[3] = {L.q, L.k, L.v};
        const int64_t tiles[3] = {qn / 8, kn / 8, kn / 8};
        float* out[3] = {qs.data(), ks.data(), vs.data()};
        w4a8_rows_multi(h.data(), rows, hidden, group, 3, packed, tiles, out);
      }
      for (int64_t b = 0; b < rows; ++b) {
        const float* c = cos.data() + b * half;
        const float* sn = sin.data() + b * half;
        const int64_t p = positions[b];
        for (int64_t i = 0; i < heads; ++i) rotate(qs.data() + b * qn + i * D, c, sn, D, qp + b * qn + i * D);
        for (int64_t g = 0; g < kv_heads; ++g) {
          rotate(ks.data() + b * kn + g * D, c, sn, D, L.keys + b * L.k0 + g * L.k1 + p * L.k2);
          std::copy_n(vs.data() + b * kn + g * D, D, L.values + b * L.v0 + g * L.v1 + p * L.v2);
        }
      }
      const at::Tensor attended = decode_attention(q_rows[rows - 1], key_rows[l][rows - 1], value_rows[l][rows - 1],
                                                   mask_rows[rows - 1], scaling);  // [rows, 1, H, D]
      {
        const uint8_t* packed[1] = {L.o};
        const int64_t tiles[1] = {hidden / 8};
        float* out[1] = {proj.data()};
        w4a8_rows_multi(attended.data_ptr<float>(), rows, qn, group, 1, packed, tiles, out);
      }
      for (int64_t i = 0; i < rows * hidden; ++i) resid[i] += proj[i];
      for (int64_t b = 0; b < rows; ++b) rms_norm(resid.data() + b * hidden, L.post_norm, hidden, fe, h.data() + b * hidden);
      {
        const uint8_t* packed[2] = {L.gate, L.up};
        const int64_t tiles[2] = {inter / 8, inter / 8};
        float* out[2] = {gate.data(), up.data()};
        w4a8_rows_multi(h.data(), rows, hidden, group, 2, packed, tiles, out);
      }
      silu_mul(gate.data(), up.data(), rows * inter, act.data());
      {
        const uint8_t* packed[1] = {L.down};
        const int64_t tiles[1] = {hidden / 8};
        float* out[1] = {proj.data()};
        w4a8_rows_multi(act.data(), rows, inter, group, 1, packed, tiles, out);
      }
      for (int64_t i = 0; i < rows * hidden; ++i) resid[i] += proj[i];
    }
    for (int64_t b = 0; b < rows; ++b) rms_norm(resid.data() + b * hidden, final_norm, hidden, fe, h.data() + b * hidden);
    at::Tensor logits = at::empty({rows, vocab}, at::TensorOptions().dtype(at::kFloat));
    if (head_group) {
      const uint8_t* packed[1] = {head};
      const int64_t tiles[1] = {vocab / 8};
      float* out[1] = {logits.data_ptr<float>()};
      w4a8_rows_multi(h.data(), rows, hidden, head_group, 1, packed, tiles, out);
    } else {
      w8a8_rows(h.data(), rows, hidden, reinterpret_cast<const int8_t*>(head), head_scale, vocab, logits.data_ptr<float>());
    }
    return logits;
  }
};

TORCH_LIBRARY_FRAGMENT(infer_tune_native, m) {
  m.class_<LlamaStep>("LlamaStep")
      .def(torch::init<std::vector<at::Tensor>, std::vector<at::Tensor>, std::vector<at::Tensor>,
                       std::vector<at::Tensor>, at::Tensor, std::vector<int64_t>, std::vector<double>>())
      .def("step", &LlamaStep::step)
      .def("step_rows", &LlamaStep::step_rows);
}
