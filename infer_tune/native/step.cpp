// The whole decode step of a Llama-like decoder in one native call: the lean path's `native` step and the
// slot engine's (infer_tune/native/step.py builds it from a model whose every part it recognizes: Llama,
// Mistral, Qwen2, Qwen3, Gemma 3; docs/tune.md, docs/batch.md). The class keeps the name of the first
// family it ran (LlamaStep).
//
// One new token per row (the lean loop: one row; the slot engine: rows 0..R-1 of its slot cache, each at
// its own position), fp32 residual stream, the model's own quantized weights in the w4a8 layout
// (modules.Int4A8Linear) and its int8 (w8a8) or int4 (w4a8) head, the static KV cache written in place.
// Per layer, what transformers' decoder layers of these families compute, per row (the parts in [brackets]
// only where the layer has them):
//     h = rms_norm(x) * w_in;  q, k, v = h W_q [+ b_q], h W_k [+ b_k], h W_v [+ b_v];
//     [q, k = rms_norm per head * w_qnorm, w_knorm (Qwen3, Gemma 3)];
//     rotary embedding of q and k at the position (the layer's own frequencies: Gemma 3's sliding layers
//     have theirs); k, v written at the position of the row's cache (position p at index p; a one-row step
//     sets the length counter to p + 1);
//     a = attention(q, the row's cache up to p [and from p - window + 1: a sliding-window layer]) W_o [+ b_o];
//     x += a [normed: rms_norm(a) * w_attn_out, Gemma 3];
//     h = rms_norm(x) * w_mlp_in;  m = (act(h W_gate) * (h W_up)) W_down, act SiLU or GELU (tanh);
//     x += m [normed: rms_norm(m) * w_mlp_out, Gemma 3]
// then logits = (rms_norm(x) * w_final) W_head [soft-capped: tanh(logits / c) * c]. Gemma's (1 + w) norms
// arrive as 1 + w (step.py). The matmuls are w4a8_rows_multi / w8a8_rows and the attention decode_attention,
// the kernels the compiled step calls, called directly: no dispatcher, no Python, no allocation but the
// attention's and the head's outputs, norms and rotary embedding in plain loops. The values equal the eager
// model's up to fp32 rounding (the norms' sums and cos / sin are computed here); a row's values do not
// depend on the other rows (every kernel here treats rows independently).
// The cache is fp32, or int8 (`kv8`: each new key and value vector of a head stored as int8 with one fp32 scale,
// max |x| / 127, a quarter of the bytes plus 4 bytes a vector; attended by decode_attention_q8, which dequantizes
// what it reads): values then equal the eager model's on keys and values rounded to that grid.

#include <ATen/Parallel.h>
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

// per layer, in this order (an absent part: an empty tensor): input norm, q, k, v, o, gate, up, down, the
// MLP's input norm, the attention output's norm, the MLP output's norm, q / k / v / o biases, q / k head norms
constexpr int64_t PER_LAYER = 17;
enum Part : int64_t { IN_NORM, Q, K, V, O, GATE, UP, DOWN, MLP_IN_NORM, ATTN_OUT_NORM, MLP_OUT_NORM, Q_BIAS, K_BIAS,
                      V_BIAS, O_BIAS, Q_NORM, K_NORM };
constexpr int64_t HEADER_INTS = 10, HEADER_FLOATS = 3;
enum Act : int64_t { SILU = 0, GELU_TANH = 1 };
constexpr int64_t LIMIT = int64_t{1} << 24;  // any one size (a 16M-wide layer is no model's)

// a * b fits in 2^40 elements (no buffer of a real model is near; no int64 product of two LIMITs overflows)
inline bool fits(int64_t a, int64_t b) { return a >= 0 && b >= 0 && a <= LIMIT && b <= LIMIT && a * b <= (int64_t{1} << 40); }

// bytes of a w4a8 matrix of n outputs and k inputs in groups of `group` (matmul.cpp's layout)
inline int64_t packed_bytes(int64_t n, int64_t k, int64_t group) { return (n / 8) * (k / group) * (32 + 4 * group); }

// out = w * (x / sqrt(mean(x^2) + eps)), transformers' LlamaRMSNorm in fp32 (Gemma's (1 + w) passed as w)
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

// an optional fp32 part: its values, or nullptr where the layer has none (an empty tensor)
const float* optional_floats(const at::Tensor& t, int64_t n, int64_t layer, const char* what) {
  if (t.numel() == 0) return nullptr;
  TORCH_CHECK(t.scalar_type() == at::kFloat && t.numel() == n && t.is_contiguous(), "LlamaStep: layer ", layer, "'s ",
              what, " must be fp32 [", n, "]");
  return t.data_ptr<float>();
}

// act = silu(gate) * up = gate / (1 + e^-gate) * up, n values (std::exp: an 8-lane polynomial exp here
// measured no faster in a whole step and moved SmolLM2's logits by a rounding of an int8 activation)
void silu_mul(const float* gate, const float* up, int64_t n, float* act) {
  for (int64_t i = 0; i < n; ++i) act[i] = gate[i] / (1.f + std::exp(-gate[i])) * up[i];
}

// act = gelu_tanh(gate) * up, torch's gelu(approximate="tanh"): x / 2 (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))
void gelu_tanh_mul(const float* gate, const float* up, int64_t n, float* act) {
  const float beta = static_cast<float>(M_SQRT2 * M_2_SQRTPI * 0.5), kappa = 0.044715f;
  for (int64_t i = 0; i < n; ++i) {
    const float x = gate[i];
    act[i] = 0.5f * x * (1.f + std::tanh(beta * (x + kappa * x * x * x))) * up[i];
  }
}

inline void add(float* y, const float* b, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] += b[i];
}

// one key or value vector into the int8 cache: q = round(x / s), s = max |x| / 127 (all zeros: s = 0, q = 0)
inline void quantize8(const float* x, int64_t n, int8_t* q, float* scale) {
  float top = 0.f;
  for (int64_t i = 0; i < n; ++i) top = std::max(top, std::fabs(x[i]));
  const float s = top / 127.f;
  *scale = s;
  const float inv = s > 0.f ? 1.f / s : 0.f;
  for (int64_t i = 0; i < n; ++i)
    q[i] = static_cast<int8_t>(std::max(-127.f, std::min(127.f, std::nearbyint(x[i] * inv))));
}

}  // namespace

struct LlamaStep : torch::CustomClassHolder {
  // weights: per layer PER_LAYER tensors, then the final norm, the head's packed weights and (w8a8) its scale
  std::vector<at::Tensor> weights, keys, values, lengths;
  // an int8 cache (keys, values int8): per layer the fp32 scale of each row, kv head and position [rows, kv heads,
  // length]; empty for an fp32 cache
  std::vector<at::Tensor> key_scales, value_scales;
  bool kv8 = false;
  at::Tensor inv_freq, q;
  int64_t layers, heads, kv_heads, head_dim, hidden, inter, group, vocab, max_len, batch;
  int64_t head_group;  // 0: a w8a8 head (packed, scale); else an int4 head in the w4a8 layout with this group
  int64_t act_kind, ropes;
  double eps, scaling, softcap;  // softcap: the final logits' soft cap, 0 for none
  std::vector<double> rope_scale;  // per rotary table: its attention scaling of cos and sin
  std::vector<int64_t> windows;    // per mask: 0 (the whole cache up to the position) or a sliding window
  std::vector<float> resid, h, qs, ks, vs, proj, normed, gate, up, act, cos, sin, att;
  int64_t cap = 0;  // rows the buffers below hold (grown by `ensure`: a mixed step may hold more rows than slots)
  std::vector<int64_t> slot_of;  // per row of the current step: the cache row (slot) it reads and writes
  // per mask (the full one, then one per sliding window) [batch, 1, 1, max_len] and its first r rows' views
  std::vector<at::Tensor> masks;
  std::vector<std::vector<at::Tensor>> mask_rows;
  // per layer and row count r: the caches' first r rows (views made once)
  std::vector<std::vector<at::Tensor>> key_rows, value_rows, key_scale_rows, value_scale_rows;
  std::vector<at::Tensor> q_rows;
  // raw pointers, taken once (each data_ptr() call checks the tensor: ~3% of a step when taken per use)
  struct Layer {
    const float *in_norm, *mlp_in_norm, *attn_out_norm, *mlp_out_norm, *q_bias, *k_bias, *v_bias, *o_bias, *q_norm,
        *k_norm;
    const uint8_t *q, *k, *v, *o, *gate, *up, *down;
    float *keys, *values;     // an fp32 cache (nullptr for int8)
    int8_t *keys8, *values8;  // an int8 cache (nullptr for fp32), its scales below
    float *key_scale, *value_scale;
    int64_t k0, k1, k2, v0, v1, v2, s0, s1;  // s0, s1: the scales' row and kv-head strides (position stride 1)
    int64_t rope, mask;  // which rotary table and which mask the layer uses
  };
  std::vector<Layer> at_layer;
  const float* final_norm = nullptr;
  const uint8_t* head = nullptr;
  const float* head_scale = nullptr;

  // keys / values: per layer the cache [rows, kv heads, length, head dim] fp32, position p at index p; or an
  // int8 cache: per layer the int8 cache, then per layer its fp32 scales [rows, kv heads, length] (2 x layers
  // tensors each: each new key / value vector of a head is stored as round(x / s) with s = max |x| / 127);
  // lengths: per layer the cache's int64 length counter, set to position + 1 by a one-row step (empty: none
  // to keep); inv_freq [rotary tables, head dim / 2];
  // ints: layers, heads, kv heads, head dim, hidden, intermediate, group, head group (0: w8a8), activation
  //   (0 SiLU, 1 GELU tanh), rotary tables; then per layer its window (0: full) and its rotary table;
  // floats: norm epsilon, attention scale, final soft cap (0: none); then per rotary table its cos / sin scale
  LlamaStep(std::vector<at::Tensor> weights_, std::vector<at::Tensor> keys_, std::vector<at::Tensor> values_,
            std::vector<at::Tensor> lengths_, at::Tensor inv_freq_, std::vector<int64_t> ints,
            std::vector<double> floats)
      : weights(std::move(weights_)), keys(std::move(keys_)), values(std::move(values_)),
        lengths(std::move(lengths_)), inv_freq(inv_freq_.contiguous()) {
    TORCH_CHECK(ints.size() >= HEADER_INTS && floats.size() >= HEADER_FLOATS, "LlamaStep: ", HEADER_INTS,
                " ints and ", HEADER_FLOATS, " floats at least");
    layers = ints[0], heads = ints[1], kv_heads = ints[2], head_dim = ints[3], hidden = ints[4], inter = ints[5];
    group = ints[6], head_group = ints[7], act_kind = ints[8], ropes = ints[9];
    eps = floats[0], scaling = floats[1], softcap = floats[2];
    TORCH_CHECK(layers >= 1 && static_cast<int64_t>(ints.size()) == HEADER_INTS + 2 * layers &&
                    ropes >= 1 && static_cast<int64_t>(floats.size()) == HEADER_FLOATS + ropes,
                "LlamaStep: per layer a window and a rotary table, per rotary table a scale");
    TORCH_CHECK(act_kind == SILU || act_kind == GELU_TANH, "LlamaStep: activation ", act_kind);
    rope_scale.assign(floats.begin() + HEADER_FLOATS, floats.end());
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
    kv8 = !keys.empty() && keys[0].scalar_type() == at::kChar;
    if (kv8) {
      TORCH_CHECK(static_cast<int64_t>(keys.size()) == 2 * layers && static_cast<int64_t>(values.size()) == 2 * layers &&
                      lengths.empty(),
                  "LlamaStep: an int8 cache is per layer its keys (values), then per layer their scales; no counters");
      key_scales.assign(keys.begin() + layers, keys.end()), value_scales.assign(values.begin() + layers, values.end());
      keys.resize(layers), values.resize(layers);
    }
    TORCH_CHECK(static_cast<int64_t>(keys.size()) == layers && static_cast<int64_t>(values.size()) == layers &&
                    (lengths.empty() || static_cast<int64_t>(lengths.size()) == layers),
                "LlamaStep: one key and value tensor (and length counter) per layer");
    TORCH_CHECK(heads % kv_heads == 0 && head_dim % 2 == 0 && inv_freq.scalar_type() == at::kFloat &&
                    inv_freq.dim() == 2 && inv_freq.size(0) == ropes && inv_freq.size(1) == head_dim / 2,
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
      const auto kind = kv8 ? at::kChar : at::kFloat;
      TORCH_CHECK(keys[l].dim() == 4 && keys[l].size(0) == batch && keys[l].size(1) == kv_heads &&
                      keys[l].size(2) == max_len && keys[l].size(3) == head_dim && keys[l].stride(3) == 1 &&
                      keys[l].scalar_type() == kind && values[l].sizes() == keys[l].sizes() &&
                      values[l].stride(3) == 1 && values[l].scalar_type() == kind,
                  "LlamaStep: layer ", l, "'s cache is not [rows, kv heads, length, head dim] ", kv8 ? "int8" : "fp32");
      if (kv8)
        TORCH_CHECK(key_scales[l].scalar_type() == at::kFloat && value_scales[l].scalar_type() == at::kFloat &&
                        key_scales[l].is_contiguous() && value_scales[l].is_contiguous() && key_scales[l].dim() == 3 &&
                        key_scales[l].size(0) == batch && key_scales[l].size(1) == kv_heads &&
                        key_scales[l].size(2) == max_len && value_scales[l].sizes() == key_scales[l].sizes(),
                    "LlamaStep: layer ", l, "'s cache scales are not contiguous [rows, kv heads, length] fp32");
      if (!lengths.empty())
        TORCH_CHECK(lengths[l].scalar_type() == at::kLong && lengths[l].numel() == 1,
                    "LlamaStep: layer ", l, "'s length counter is not one int64");
    }
    vocab = weights[layers * PER_LAYER + 1].size(0) * 8;  // padded to a multiple of 8; the caller narrows
    key_rows.resize(layers), value_rows.resize(layers), key_scale_rows.resize(layers), value_scale_rows.resize(layers);
    for (int64_t r = 1; r <= batch; ++r) {
      for (int64_t l = 0; l < layers; ++l) {
        key_rows[l].push_back(keys[l].narrow(0, 0, r));
        value_rows[l].push_back(values[l].narrow(0, 0, r));
        if (kv8) {
          key_scale_rows[l].push_back(key_scales[l].narrow(0, 0, r));
          value_scale_rows[l].push_back(value_scales[l].narrow(0, 0, r));
        }
      }
    }
    windows.push_back(0);  // mask 0: the whole cache up to the position
    const int64_t qn = heads * head_dim, kn = kv_heads * head_dim;
    for (int64_t l = 0; l < layers; ++l) {
      const at::Tensor* w = weights.data() + l * PER_LAYER;
      const int64_t window = ints[HEADER_INTS + 2 * l], rope = ints[HEADER_INTS + 2 * l + 1];
      TORCH_CHECK(window >= 0 && rope >= 0 && rope < ropes, "LlamaStep: layer ", l, "'s window or rotary table");
      int64_t mask_index = 0;
      if (window) {
        const auto found = std::find(windows.begin(), windows.end(), window);
        mask_index = found - windows.begin();
        if (found == windows.end()) windows.push_back(window);
      }
      for (int64_t i : {IN_NORM, MLP_IN_NORM})
        TORCH_CHECK(w[i].scalar_type() == at::kFloat && w[i].numel() == hidden && w[i].is_contiguous(),
                    "LlamaStep: layer ", l, "'s norms must be fp32 [hidden]");
      for (int64_t i : {Q, K, V, O, GATE, UP, DOWN})
        TORCH_CHECK(w[i].scalar_type() == at::kByte && w[i].is_contiguous(),
                    "LlamaStep: layer ", l, "'s projections must be packed uint8");
      const int64_t expect[PER_LAYER] = {0, packed_bytes(qn, hidden, group), packed_bytes(kn, hidden, group),
                                         packed_bytes(kn, hidden, group), packed_bytes(hidden, qn, group),
                                         packed_bytes(inter, hidden, group), packed_bytes(inter, hidden, group),
                                         packed_bytes(hidden, inter, group)};
      for (int64_t i : {Q, K, V, O, GATE, UP, DOWN})
        TORCH_CHECK(w[i].numel() == expect[i], "LlamaStep: layer ", l, "'s weight ", i, " holds ", w[i].numel(),
                    " bytes, its shapes need ", expect[i]);
      at_layer.push_back({w[IN_NORM].data_ptr<float>(), w[MLP_IN_NORM].data_ptr<float>(),
                          optional_floats(w[ATTN_OUT_NORM], hidden, l, "attention output norm"),
                          optional_floats(w[MLP_OUT_NORM], hidden, l, "MLP output norm"),
                          optional_floats(w[Q_BIAS], qn, l, "q bias"), optional_floats(w[K_BIAS], kn, l, "k bias"),
                          optional_floats(w[V_BIAS], kn, l, "v bias"), optional_floats(w[O_BIAS], hidden, l, "o bias"),
                          optional_floats(w[Q_NORM], head_dim, l, "q norm"),
                          optional_floats(w[K_NORM], head_dim, l, "k norm"), bytes(w[Q]), bytes(w[K]), bytes(w[V]),
                          bytes(w[O]), bytes(w[GATE]), bytes(w[UP]), bytes(w[DOWN]),
                          kv8 ? nullptr : keys[l].data_ptr<float>(), kv8 ? nullptr : values[l].data_ptr<float>(),
                          kv8 ? keys[l].data_ptr<int8_t>() : nullptr, kv8 ? values[l].data_ptr<int8_t>() : nullptr,
                          kv8 ? key_scales[l].data_ptr<float>() : nullptr,
                          kv8 ? value_scales[l].data_ptr<float>() : nullptr, keys[l].stride(0), keys[l].stride(1),
                          keys[l].stride(2), values[l].stride(0), values[l].stride(1), values[l].stride(2),
                          kv8 ? key_scales[l].stride(0) : 0, kv8 ? key_scales[l].stride(1) : 0, rope, mask_index});
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
    ensure(batch);
  }

  // buffers for `rows` rows of one step (the slots' decode rows and the prompt rows of a mixed step)
  void ensure(int64_t rows) {
    if (rows <= cap) return;
    TORCH_CHECK(rows <= LIMIT && fits(rows, std::max({hidden, inter, heads * head_dim})) && fits(rows, max_len),
                "LlamaStep: ", rows, " rows overflow");
    const int64_t qn = heads * head_dim, kn = kv_heads * head_dim;
    cap = rows;
    resid.resize(cap * hidden), h.resize(cap * hidden), qs.resize(cap * qn), att.resize(cap * qn);
    ks.resize(cap * kn), vs.resize(cap * kn), proj.resize(cap * hidden), normed.resize(cap * hidden);
    gate.resize(cap * inter), up.resize(cap * inter), act.resize(cap * inter);
    cos.resize(ropes * cap * head_dim / 2), sin.resize(ropes * cap * head_dim / 2);
    slot_of.resize(cap);
    const auto f32 = at::TensorOptions().dtype(at::kFloat);
    q = at::empty({cap, heads, 1, head_dim}, f32);
    q_rows.clear();
    for (int64_t r = 1; r <= batch; ++r) q_rows.push_back(q.narrow(0, 0, r));
    masks.clear(), mask_rows.assign(windows.size(), {});
    for (size_t m = 0; m < windows.size(); ++m) {
      masks.push_back(at::zeros({cap, 1, 1, max_len}, at::TensorOptions().dtype(at::kBool)));
      for (int64_t r = 1; r <= batch; ++r) mask_rows[m].push_back(masks[m].narrow(0, 0, r));
    }
  }

  // the lean loop's step: x the token's embedding [1, hidden] fp32 at `position` -> logits [1, vocab padded]
  at::Tensor step(const at::Tensor& x, int64_t position) {
    TORCH_CHECK(x.numel() == hidden && x.scalar_type() == at::kFloat, "LlamaStep: x must be [1, hidden] fp32");
    slot_of[0] = 0;
    const at::Tensor logits = run(1, x.contiguous().data_ptr<float>(), &position, 1, nullptr, 1);
    for (const at::Tensor& counter : lengths) *counter.data_ptr<int64_t>() = position + 1;
    return logits;
  }

  // the slot engine's step: rows 0..R-1 of the caches, row b's token x[b] at positions[b] -> logits [R, vocab padded]
  at::Tensor step_rows(const at::Tensor& x, const at::Tensor& positions) {
    const int64_t rows = x.size(0);
    TORCH_CHECK(x.dim() == 2 && x.size(1) == hidden && x.scalar_type() == at::kFloat && rows >= 1 && rows <= batch,
                "LlamaStep: x must be [rows <= ", batch, ", hidden] fp32");
    TORCH_CHECK(positions.scalar_type() == at::kLong && positions.numel() == rows, "LlamaStep: one int64 position per row");
    for (int64_t b = 0; b < rows; ++b) slot_of[b] = b;
    return run(rows, x.contiguous().data_ptr<float>(), positions.contiguous().data_ptr<int64_t>(), rows, nullptr,
               rows);
  }

  // The slot engine's mixed step: `decode` rows, row b < decode the token of slot b (as step_rows), then the
  // prompt rows of new requests: row b >= decode is the token x[b] of slot slots[b] at positions[b] (a prompt's
  // chunk: consecutive rows of one slot at consecutive positions, so each row sees the rows before it, whose
  // keys and values this step writes first). Every row runs through the same matmuls, whose weights are read
  // once for all rows. Returns the logits of the rows `keep` names [len(keep), vocab padded] (the decode rows
  // and each finished prompt's last row: a prompt's other rows need none). A row's values are the ones it gets
  // in a step of its own: every kernel treats rows independently.
  at::Tensor step_mixed(const at::Tensor& x, const at::Tensor& slots, const at::Tensor& positions, int64_t decode,
                        const at::Tensor& keep) {
    const int64_t rows = x.size(0);
    TORCH_CHECK(x.dim() == 2 && x.size(1) == hidden && x.scalar_type() == at::kFloat && rows >= 1,
                "LlamaStep: x must be [rows, hidden] fp32");
    TORCH_CHECK(slots.scalar_type() == at::kLong && slots.numel() == rows && positions.scalar_type() == at::kLong &&
                    positions.numel() == rows && keep.scalar_type() == at::kLong && keep.numel() >= 1 &&
                    keep.numel() <= rows,
                "LlamaStep: one int64 slot and position per row, and at least one int64 row to keep");
    TORCH_CHECK(decode >= 0 && decode <= batch && decode <= rows, "LlamaStep: ", decode, " decode rows of ", batch,
                " slots");
    ensure(rows);
    const at::Tensor sc = slots.contiguous(), kc = keep.contiguous();
    const int64_t* sp = sc.data_ptr<int64_t>();
    const int64_t* kp = kc.data_ptr<int64_t>();
    for (int64_t b = 0; b < rows; ++b) {
      TORCH_CHECK(sp[b] >= 0 && sp[b] < batch && (b >= decode || sp[b] == b), "LlamaStep: row ", b, "'s slot ", sp[b]);
      slot_of[b] = sp[b];
    }
    for (int64_t i = 0; i < keep.numel(); ++i)
      TORCH_CHECK(kp[i] >= 0 && kp[i] < rows, "LlamaStep: kept row ", kp[i], " of ", rows);
    return run(rows, x.contiguous().data_ptr<float>(), positions.contiguous().data_ptr<int64_t>(), decode, kp,
               keep.numel());
  }

  // the decode rows 0..last of layer l's cache attended by q (their views made once)
  at::Tensor attend(int64_t l, const at::Tensor& q_view, int64_t last, const at::Tensor& mask) {
    if (kv8)
      return decode_attention_q8(q_view, key_rows[l][last], key_scale_rows[l][last], value_rows[l][last],
                                 value_scale_rows[l][last], mask, scaling);
    return decode_attention(q_view, key_rows[l][last], value_rows[l][last], mask, scaling);
  }

  // x [n] += rms_norm(y) * w, or += y where the layer has no such norm (w nullptr), per row
  void add_residual(int64_t rows, const float* y, const float* w, float fe) {
    if (w == nullptr) {
      add(resid.data(), y, rows * hidden);
      return;
    }
    by_rows(0, rows, [&](int64_t b) {
      rms_norm(y + b * hidden, w, hidden, fe, normed.data() + b * hidden);
      add(resid.data() + b * hidden, normed.data() + b * hidden, hidden);
    });
  }

  // rows 0..decode-1: slots 0..decode-1; rows from `decode` on: runs of one slot each (slot_of); the logits of
  // rows keep[0..nkeep) (keep nullptr: rows 0..nkeep-1)
  at::Tensor run(int64_t rows, const float* x, const int64_t* positions, int64_t decode, const int64_t* keep,
                 int64_t nkeep) {
    const int64_t D = head_dim, half = head_dim / 2, qn = heads * D, kn = kv_heads * D;
    const float fe = static_cast<float>(eps);
    const float* inv = inv_freq.data_ptr<float>();
    for (int64_t b = 0; b < rows; ++b)
      TORCH_CHECK(positions[b] >= 0 && positions[b] < max_len, "LlamaStep: position ", positions[b],
                  " outside the cache of ", max_len);
    by_rows(0, rows, [&](int64_t b) {
      const int64_t p = positions[b];
      for (int64_t t = 0; t < ropes; ++t) {
        const float rs = static_cast<float>(rope_scale[t]);
        float* c = cos.data() + (t * cap + b) * half;
        float* sn = sin.data() + (t * cap + b) * half;
        for (int64_t i = 0; i < half; ++i) {  // as transformers: freqs = position * inv_freq in fp32
          const float f = static_cast<float>(p) * inv[t * half + i];
          c[i] = std::cos(f) * rs;
          sn[i] = std::sin(f) * rs;
        }
      }
      for (size_t m = 0; m < windows.size(); ++m) {  // positions (p - window, p] of a sliding window, else [0, p]
        bool* mb = masks[m].data_ptr<bool>() + b * max_len;
        const int64_t first = windows[m] ? std::max<int64_t>(0, p - windows[m] + 1) : 0;
        std::fill(mb, mb + max_len, false);
        std::fill(mb + first, mb + p + 1, true);
      }
    });
    std::copy_n(x, rows * hidden, resid.data());
    float* qp = q.data_ptr<float>();
    for (int64_t l = 0; l < layers; ++l) {
      const Layer& L = at_layer[l];
      by_rows(0, rows, [&](int64_t b) { rms_norm(resid.data() + b * hidden, L.in_norm, hidden, fe, h.data() + b * hidden); });
      {
        const uint8_t* packed[3] = {L.q, L.k, L.v};
        const int64_t tiles[3] = {qn / 8, kn / 8, kn / 8};
        float* out[3] = {qs.data(), ks.data(), vs.data()};
        w4a8_rows_multi(h.data(), rows, hidden, group, 3, packed, tiles, out);
      }
      // a decode row may write where a prompt row of its slot, later in the step, writes again: the decode rows
      // first, in order, then the prompt rows (each its own slot position) over the threads
      auto place = [&](int64_t b) {
        float* qb = qs.data() + b * qn;
        float* kb = ks.data() + b * kn;
        float* vb = vs.data() + b * kn;
        if (L.q_bias) add(qb, L.q_bias, qn);
        if (L.k_bias) add(kb, L.k_bias, kn);
        if (L.v_bias) add(vb, L.v_bias, kn);
        if (L.q_norm)  // per head, in place (rms_norm reads each value before it writes it)
          for (int64_t i = 0; i < heads; ++i) rms_norm(qb + i * D, L.q_norm, D, fe, qb + i * D);
        if (L.k_norm)
          for (int64_t g = 0; g < kv_heads; ++g) rms_norm(kb + g * D, L.k_norm, D, fe, kb + g * D);
        const float* c = cos.data() + (L.rope * cap + b) * half;
        const float* sn = sin.data() + (L.rope * cap + b) * half;
        const int64_t p = positions[b];
        for (int64_t i = 0; i < heads; ++i) rotate(qb + i * D, c, sn, D, qp + b * qn + i * D);
        for (int64_t g = 0; g < kv_heads; ++g) {
          const int64_t s = slot_of[b];
          if (kv8) {
            thread_local std::vector<float> rotated;  // this thread's rotated key
            rotated.resize(D);
            rotate(kb + g * D, c, sn, D, rotated.data());
            quantize8(rotated.data(), D, L.keys8 + s * L.k0 + g * L.k1 + p * L.k2, L.key_scale + s * L.s0 + g * L.s1 + p);
            quantize8(vb + g * D, D, L.values8 + s * L.v0 + g * L.v1 + p * L.v2, L.value_scale + s * L.s0 + g * L.s1 + p);
            continue;
          }
          rotate(kb + g * D, c, sn, D, L.keys + s * L.k0 + g * L.k1 + p * L.k2);
          std::copy_n(vb + g * D, D, L.values + s * L.v0 + g * L.v1 + p * L.v2);
        }
      };
      for (int64_t b = 0; b < decode; ++b) place(b);
      by_rows(decode, rows, place);
      const float* attended_rows;
      at::Tensor attended;
      if (decode == rows) {
        attended = attend(l, q_rows[rows - 1], rows - 1, mask_rows[L.mask][rows - 1]);  // [rows, 1, H, D]
        attended_rows = attended.data_ptr<float>();
      } else {  // the decode rows together, then each prompt's rows over its slot's cache (one row repeated)
        if (decode > 0) {
          attended = attend(l, q_rows[decode - 1], decode - 1, mask_rows[L.mask][decode - 1]);
          std::copy_n(attended.data_ptr<float>(), decode * qn, att.data());
        }
        for (int64_t r0 = decode; r0 < rows;) {
          const int64_t s = slot_of[r0];
          int64_t r1 = r0 + 1;
          while (r1 < rows && slot_of[r1] == s) ++r1;
          const int64_t n = r1 - r0;
          const at::Tensor part =
              kv8 ? decode_attention_q8(q.narrow(0, r0, n), keys[l].narrow(0, s, 1).expand({n, kv_heads, max_len, D}),
                                        key_scales[l].narrow(0, s, 1).expand({n, kv_heads, max_len}),
                                        values[l].narrow(0, s, 1).expand({n, kv_heads, max_len, D}),
                                        value_scales[l].narrow(0, s, 1).expand({n, kv_heads, max_len}),
                                        masks[L.mask].narrow(0, r0, n), scaling)
                  : decode_attention(q.narrow(0, r0, n), keys[l].narrow(0, s, 1).expand({n, kv_heads, max_len, D}),
                                     values[l].narrow(0, s, 1).expand({n, kv_heads, max_len, D}),
                                     masks[L.mask].narrow(0, r0, n), scaling);
          std::copy_n(part.data_ptr<float>(), n * qn, att.data() + r0 * qn);
          r0 = r1;
        }
        attended_rows = att.data();
      }
      {
        const uint8_t* packed[1] = {L.o};
        const int64_t tiles[1] = {hidden / 8};
        float* out[1] = {proj.data()};
        w4a8_rows_multi(attended_rows, rows, qn, group, 1, packed, tiles, out);
      }
      if (L.o_bias)
        for (int64_t b = 0; b < rows; ++b) add(proj.data() + b * hidden, L.o_bias, hidden);
      add_residual(rows, proj.data(), L.attn_out_norm, fe);
      by_rows(0, rows, [&](int64_t b) { rms_norm(resid.data() + b * hidden, L.mlp_in_norm, hidden, fe, h.data() + b * hidden); });
      {
        const uint8_t* packed[2] = {L.gate, L.up};
        const int64_t tiles[2] = {inter / 8, inter / 8};
        float* out[2] = {gate.data(), up.data()};
        w4a8_rows_multi(h.data(), rows, hidden, group, 2, packed, tiles, out);
      }
      by_rows(0, rows, [&](int64_t b) {
        const int64_t o = b * inter;
        if (act_kind == GELU_TANH)
          gelu_tanh_mul(gate.data() + o, up.data() + o, inter, act.data() + o);
        else
          silu_mul(gate.data() + o, up.data() + o, inter, act.data() + o);
      });
      {
        const uint8_t* packed[1] = {L.down};
        const int64_t tiles[1] = {hidden / 8};
        float* out[1] = {proj.data()};
        w4a8_rows_multi(act.data(), rows, inter, group, 1, packed, tiles, out);
      }
      add_residual(rows, proj.data(), L.mlp_out_norm, fe);
    }
    for (int64_t i = 0; i < nkeep; ++i)
      rms_norm(resid.data() + (keep ? keep[i] : i) * hidden, final_norm, hidden, fe, h.data() + i * hidden);
    rows = nkeep;
    at::Tensor logits = at::empty({rows, vocab}, at::TensorOptions().dtype(at::kFloat));
    if (head_group) {
      const uint8_t* packed[1] = {head};
      const int64_t tiles[1] = {vocab / 8};
      float* out[1] = {logits.data_ptr<float>()};
      w4a8_rows_multi(h.data(), rows, hidden, head_group, 1, packed, tiles, out);
    } else {
      w8a8_rows(h.data(), rows, hidden, reinterpret_cast<const int8_t*>(head), head_scale, vocab, logits.data_ptr<float>());
    }
    if (softcap > 0) {  // as transformers: logits / cap, tanh, * cap
      const float cap = static_cast<float>(softcap);
      float* y = logits.data_ptr<float>();
      for (int64_t i = 0; i < rows * vocab; ++i) y[i] = std::tanh(y[i] / cap) * cap;
    }
    return logits;
  }
};

TORCH_LIBRARY_FRAGMENT(infer_tune_native, m) {
  m.class_<LlamaStep>("LlamaStep")
      .def(torch::init<std::vector<at::Tensor>, std::vector<at::Tensor>, std::vector<at::Tensor>,
                       std::vector<at::Tensor>, at::Tensor, std::vector<int64_t>, std::vector<double>>())
      .def("step", &LlamaStep::step)
      .def("step_rows", &LlamaStep::step_rows)
      .def("step_mixed", &LlamaStep::step_mixed);
}
