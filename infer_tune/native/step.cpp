// The whole decode step of a Llama-family model in one native call: the lean path's `native` step
// (infer_tune/native/step.py builds it from a model whose every part it recognizes; docs/tune.md).
//
// One token, batch 1, fp32 residual stream, the model's own quantized weights in the w4a8 layout
// (modules.Int4A8Linear) and its int8 (w8a8) or int4 (w4a8) head, its static KV cache written in place.
// Per layer, what transformers' LlamaDecoderLayer computes:
//     h = rms_norm(x) * w_in;  q, k, v = h W_q, h W_k, h W_v;  rotary embedding of q and k at `position`;
//     k, v written at `position` of the layer's cache (its length counter set to position + 1);
//     x += attention(q, cache[0..position]) W_o;
//     h = rms_norm(x) * w_post;  x += (silu(h W_gate) * (h W_up)) W_down
// then logits = (rms_norm(x) * w_final) W_head. The matmuls are w4a8_row_multi / w8a8_mm and the attention
// decode_attention, the kernels the compiled step calls, called directly: no dispatcher, no Python, no
// allocation but the attention's and the head's outputs, norms and rotary embedding in plain loops. The
// values equal the compiled step's up to fp32 rounding (the norms' sums and cos / sin are computed here).

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

}  // namespace

struct LlamaStep : torch::CustomClassHolder {
  // weights: per layer PER_LAYER tensors, then the final norm, the head's packed weights and (w8a8) its scale
  std::vector<at::Tensor> weights, keys, values, lengths;
  at::Tensor inv_freq, mask, q;
  int64_t layers, heads, kv_heads, head_dim, hidden, inter, group, vocab, max_len;
  int64_t head_group;  // 0: a w8a8 head (packed, scale); else an int4 head in the w4a8 layout with this group
  double eps, scaling, rope_scale;
  std::vector<float> resid, h, qkv, act, proj, gate, up, cos, sin;

  LlamaStep(std::vector<at::Tensor> weights_, std::vector<at::Tensor> keys_, std::vector<at::Tensor> values_,
            std::vector<at::Tensor> lengths_, at::Tensor inv_freq_, std::vector<int64_t> ints,
            std::vector<double> floats)
      : weights(std::move(weights_)), keys(std::move(keys_)), values(std::move(values_)),
        lengths(std::move(lengths_)), inv_freq(inv_freq_.contiguous()) {
    TORCH_CHECK(ints.size() == 8 && floats.size() == 3, "LlamaStep: 8 ints and 3 floats");
    layers = ints[0], heads = ints[1], kv_heads = ints[2], head_dim = ints[3], hidden = ints[4], inter = ints[5];
    group = ints[6], head_group = ints[7];
    eps = floats[0], scaling = floats[1], rope_scale = floats[2];
    TORCH_CHECK(static_cast<int64_t>(weights.size()) == layers * PER_LAYER + 2 + (head_group ? 0 : 1),
                "LlamaStep: ", weights.size(), " weight tensors for ", layers, " layers");
    TORCH_CHECK(static_cast<int64_t>(keys.size()) == layers && static_cast<int64_t>(values.size()) == layers &&
                    static_cast<int64_t>(lengths.size()) == layers,
                "LlamaStep: one key, value and length tensor per layer");
    TORCH_CHECK(heads % kv_heads == 0 && head_dim % 2 == 0 && inv_freq.numel() == head_dim / 2,
                "LlamaStep: head shapes");
    for (int64_t l = 0; l < layers; ++l) {
      TORCH_CHECK(keys[l].dim() == 4 && keys[l].size(0) == 1 && keys[l].size(1) == kv_heads &&
                      keys[l].size(3) == head_dim && keys[l].stride(3) == 1 &&
                      keys[l].scalar_type() == at::kFloat && values[l].sizes() == keys[l].sizes() &&
                      values[l].stride(3) == 1 && values[l].scalar_type() == at::kFloat,
                  "LlamaStep: layer ", l, "'s cache is not [1, kv heads, length, head dim] fp32");
      TORCH_CHECK(lengths[l].scalar_type() == at::kLong && lengths[l].numel() == 1,
                  "LlamaStep: layer ", l, "'s length counter is not one int64");
    }
    max_len = keys[0].size(2);
    const at::Tensor& head = weights[layers * PER_LAYER + 1];
    vocab = head.size(0) * 8;  // padded to a multiple of 8; the caller narrows
    mask = at::zeros({1, 1, 1, max_len}, at::TensorOptions().dtype(at::kBool));
    q = at::empty({1, heads, 1, head_dim}, at::TensorOptions().dtype(at::kFloat));
    resid.resize(hidden), h.resize(std::max(hidden, heads * head_dim));
    qkv.resize((heads + 2 * kv_heads) * head_dim), act.resize(inter), proj.resize(hidden);
    gate.resize(inter), up.resize(inter), cos.resize(head_dim / 2), sin.resize(head_dim / 2);
  }

  // x: the token's embedding [1, hidden] fp32 -> logits [1, vocab padded to 8] fp32
  at::Tensor step(const at::Tensor& x, int64_t position) {
    TORCH_CHECK(x.numel() == hidden && x.scalar_type() == at::kFloat, "LlamaStep: x must be [1, hidden] fp32");
    TORCH_CHECK(position >= 0 && position < max_len, "LlamaStep: position ", position, " outside the cache of ",
                max_len);
    const float fe = static_cast<float>(eps);
    std::copy_n(x.contiguous().data_ptr<float>(), hidden, resid.data());
    const float* inv = inv_freq.data_ptr<float>();
    const float rs = static_cast<float>(rope_scale);
    for (int64_t i = 0; i < head_dim / 2; ++i) {  // as transformers: freqs = position * inv_freq in fp32
      const float f = static_cast<float>(position) * inv[i];
      cos[i] = std::cos(f) * rs;
      sin[i] = std::sin(f) * rs;
    }
    bool* mb = mask.data_ptr<bool>();
    std::fill(mb, mb + position + 1, true);
    std::fill(mb + position + 1, mb + max_len, false);
    const int64_t D = head_dim, qn = heads * D, kn = kv_heads * D;
    float* qp = q.data_ptr<float>();
    for (int64_t l = 0; l < layers; ++l) {
      const at::Tensor* w = weights.data() + l * PER_LAYER;
      rms_norm(resid.data(), w[0].data_ptr<float>(), hidden, fe, h.data());
      {
        const uint8_t* packed[3] = {bytes(w[1]), bytes(w[2]), bytes(w[3])};
        const int64_t tiles[3] = {qn / 8, kn / 8, kn / 8};
        float* out[3] = {qkv.data(), qkv.data() + qn, qkv.data() + qn + kn};
        w4a8_row_multi(h.data(), hidden, group, 3, packed, tiles, out);
      }
      for (int64_t i = 0; i < heads; ++i) rotate(qkv.data() + i * D, cos.data(), sin.data(), D, qp + i * D);
      float* kc = keys[l].data_ptr<float>();
      float* vc = values[l].data_ptr<float>();
      for (int64_t g = 0; g < kv_heads; ++g) {
        rotate(qkv.data() + qn + g * D, cos.data(), sin.data(), D, kc + g * keys[l].stride(1) + position * keys[l].stride(2));
        std::copy_n(qkv.data() + qn + kn + g * D, D, vc + g * values[l].stride(1) + position * values[l].stride(2));
      }
      *lengths[l].data_ptr<int64_t>() = position + 1;
      const at::Tensor attended = decode_attention(q, keys[l], values[l], mask, scaling);  // [1, 1, H, D]
      {
        const uint8_t* packed[1] = {bytes(w[4])};
        const int64_t tiles[1] = {hidden / 8};
        float* out[1] = {proj.data()};
        w4a8_row_multi(attended.data_ptr<float>(), qn, group, 1, packed, tiles, out);
      }
      for (int64_t i = 0; i < hidden; ++i) resid[i] += proj[i];
      rms_norm(resid.data(), w[5].data_ptr<float>(), hidden, fe, h.data());
      {
        const uint8_t* packed[2] = {bytes(w[6]), bytes(w[7])};
        const int64_t tiles[2] = {inter / 8, inter / 8};
        float* out[2] = {gate.data(), up.data()};
        w4a8_row_multi(h.data(), hidden, group, 2, packed, tiles, out);
      }
#pragma omp simd
      for (int64_t i = 0; i < inter; ++i) act[i] = gate[i] / (1.f + std::exp(-gate[i])) * up[i];
      {
        const uint8_t* packed[1] = {bytes(w[8])};
        const int64_t tiles[1] = {hidden / 8};
        float* out[1] = {proj.data()};
        w4a8_row_multi(act.data(), inter, group, 1, packed, tiles, out);
      }
      for (int64_t i = 0; i < hidden; ++i) resid[i] += proj[i];
    }
    const at::Tensor* tail = weights.data() + layers * PER_LAYER;
    rms_norm(resid.data(), tail[0].data_ptr<float>(), hidden, fe, h.data());
    if (head_group) {
      at::Tensor logits = at::empty({1, vocab}, at::TensorOptions().dtype(at::kFloat));
      const uint8_t* packed[1] = {bytes(tail[1])};
      const int64_t tiles[1] = {vocab / 8};
      float* out[1] = {logits.data_ptr<float>()};
      w4a8_row_multi(h.data(), hidden, head_group, 1, packed, tiles, out);
      return logits;
    }
    const at::Tensor row = at::from_blob(h.data(), {1, hidden}, at::TensorOptions().dtype(at::kFloat));
    return w8a8_mm(row, tail[1], tail[2]);
  }
};

TORCH_LIBRARY_FRAGMENT(infer_tune_native, m) {
  m.class_<LlamaStep>("LlamaStep")
      .def(torch::init<std::vector<at::Tensor>, std::vector<at::Tensor>, std::vector<at::Tensor>,
                       std::vector<at::Tensor>, at::Tensor, std::vector<int64_t>, std::vector<double>>())
      .def("step", &LlamaStep::step);
}
