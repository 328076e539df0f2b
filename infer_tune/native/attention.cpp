// Attention of one new token per row over a KV cache: the decode step's attention (infer_tune/native/
// attention.py registers it with transformers as the attention of a compiled lean step).
//
// q [B, H, 1, D]; k, v [B, Hkv, L, D] (the cache, any strides with D contiguous; H a multiple of Hkv:
// query head h reads kv head h / (H / Hkv), so grouped-query caches are read as they are, never
// repeated); mask: none, bool [B, 1 or H, 1, L] (true = attend) or additive float of that shape;
// returns [B, 1, H, D] (the layout transformers' attention functions return), fp32 throughout:
//     out = sum_j softmax_j(scale * q.k_j + mask_j) v_j
// Positions a bool mask hides are skipped (neither read nor exponentiated); a row that attends nowhere
// gets zeros. What torch's SDPA does in several small kernels (and a copy of every kv head per query head)
// is here one pass per (row, head), the (row, head) pairs split over torch's threads.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <c10/util/Optional.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

namespace {

inline float dot(const float* a, const float* b, int64_t n) {
  float s = 0.f;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

}  // namespace

at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            const c10::optional<at::Tensor>& mask, double scale) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4, "decode_attention: q, k, v must be 4-D");
  TORCH_CHECK(q.scalar_type() == at::kFloat && k.scalar_type() == at::kFloat && v.scalar_type() == at::kFloat,
              "decode_attention: float32 only");
  const int64_t B = q.size(0), H = q.size(1), D = q.size(3), Hkv = k.size(1), L = k.size(2);
  TORCH_CHECK(q.size(2) == 1, "decode_attention: one query per row");
  TORCH_CHECK(k.size(0) == B && v.size(0) == B && v.size(1) == Hkv && v.size(2) == L && k.size(3) == D &&
                  v.size(3) == D && H % Hkv == 0,
              "decode_attention: k / v do not match q");
  TORCH_CHECK(k.stride(3) == 1 && v.stride(3) == 1, "decode_attention: k / v need a contiguous head dimension");
  const bool has_mask = mask.has_value() && mask->defined();
  at::Tensor m;
  bool bool_mask = false;
  if (has_mask) {
    m = *mask;
    TORCH_CHECK(m.dim() == 4 && m.size(-1) == L && (m.size(1) == 1 || m.size(1) == H) && m.size(2) == 1 &&
                    (m.size(0) == 1 || m.size(0) == B),
                "decode_attention: mask must be [B, 1 or H, 1, L]");
    bool_mask = m.scalar_type() == at::kBool;
    TORCH_CHECK(bool_mask || m.scalar_type() == at::kFloat, "decode_attention: mask must be bool or float32");
  }
  auto qc = q.contiguous();
  auto out = at::empty({B, 1, H, D}, q.options());
  const float* qp = qc.data_ptr<float>();
  const float* kp = k.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t groups = H / Hkv;
  const int64_t ks0 = k.stride(0), ks1 = k.stride(1), ks2 = k.stride(2);
  const int64_t vs0 = v.stride(0), vs1 = v.stride(1), vs2 = v.stride(2);
  const int64_t ms0 = has_mask ? (m.size(0) == 1 ? 0 : m.stride(0)) : 0;
  const int64_t ms1 = has_mask ? (m.size(1) == 1 ? 0 : m.stride(1)) : 0;
  const int64_t ms3 = has_mask ? m.stride(3) : 0;
  const bool* mb = has_mask && bool_mask ? m.data_ptr<bool>() : nullptr;
  const float* mf = has_mask && !bool_mask ? m.data_ptr<float>() : nullptr;
  const float fscale = static_cast<float>(scale);
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(1, L * D));  // small work: one thread
  at::parallel_for(0, B * H, grain, [&](int64_t begin, int64_t end) {
    thread_local std::vector<float> scores;
    thread_local std::vector<float> acc;
    scores.resize(std::max<size_t>(scores.size(), L));
    acc.resize(std::max<size_t>(acc.size(), D));
    for (int64_t bh = begin; bh < end; ++bh) {
      const int64_t b = bh / H, h = bh % H, g = h / groups;
      const float* qv = qp + (b * H + h) * D;
      const float* kb = kp + b * ks0 + g * ks1;
      const float* vb = vp + b * vs0 + g * vs1;
      float top = -std::numeric_limits<float>::infinity();
      for (int64_t j = 0; j < L; ++j) {
        float s;
        if (mb != nullptr) {
          if (!mb[b * ms0 + h * ms1 + j * ms3]) {
            scores[j] = -std::numeric_limits<float>::infinity();
            continue;
          }
          s = fscale * dot(qv, kb + j * ks2, D);
        } else {
          s = fscale * dot(qv, kb + j * ks2, D) + (mf != nullptr ? mf[b * ms0 + h * ms1 + j * ms3] : 0.f);
        }
        scores[j] = s;
        top = std::max(top, s);
      }
      float* o = op + (b * H + h) * D;  // out[b, 0, h, :]
      std::fill(acc.begin(), acc.begin() + D, 0.f);
      if (top == -std::numeric_limits<float>::infinity()) {
        std::fill(o, o + D, 0.f);
        continue;
      }
      float total = 0.f;
      for (int64_t j = 0; j < L; ++j) {
        if (scores[j] == -std::numeric_limits<float>::infinity()) continue;
        const float p = std::exp(scores[j] - top);
        total += p;
        const float* vj = vb + j * vs2;
        float* a = acc.data();
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) a[d] += p * vj[d];
      }
      const float inv = 1.f / total;
      for (int64_t d = 0; d < D; ++d) o[d] = acc[d] * inv;
    }
  });
  return out;
}

TORCH_LIBRARY_FRAGMENT(infer_tune_native, m) {
  m.def("decode_attention(Tensor q, Tensor k, Tensor v, Tensor? mask, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(infer_tune_native, CPU, m) {
  m.impl("decode_attention", &decode_attention);
}
