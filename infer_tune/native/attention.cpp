// Attention of one new token per row over a KV cache: the decode step's attention (infer_tune/native/
// attention.py registers it with transformers as the attention of a compiled lean step).
//
// q [B, H, 1, D]; k, v [B, Hkv, L, D] (the cache, any strides with D contiguous; H a multiple of Hkv:
// query head h reads kv head h / (H / Hkv), so grouped-query caches are read as they are, never
// repeated); mask: none, bool [B, 1 or H, 1, L] (true = attend) or additive float of that shape;
// returns [B, 1, H, D] (the layout transformers' attention functions return), fp32 throughout:
//     out = sum_j softmax_j(scale * q.k_j + mask_j) v_j
// Positions a bool mask hides are skipped (neither read nor exponentiated); a row that attends nowhere
// gets zeros.
//
// The work is split into items of (row, kv head, chunk of CHUNK positions): an item reads each of its
// keys and values once for every query head of the group (grouped-query heads share one read), and leaves
// per query head its chunk's maximum score m, sum of exp(score - m) and the exp-weighted sum of values;
// the calling thread then merges a head's chunks in order (weights exp(m_c - max_c m_c)). Items spread
// over torch's threads even for one row and a few kv heads (a long context is split along its length).
// Chunk boundaries sit at fixed positions (multiples of CHUNK), and a chunk whose positions are all
// hidden contributes nothing, so a row's result does not depend on how many positions past its last
// visible one the cache view holds: the slot engine's rows give the same values in any length bucket.
// exp runs 8 lanes at a time where the CPU has AVX2 and FMA (kernels.h's exp8: exactly 0 below -87.3),
// std::exp elsewhere.
//
// decode_attention_q8 reads an int8 cache (k, v int8 [B, Hkv, L, D], one fp32 scale per row, kv head and position
// [B, Hkv, L]: the native step's int8 KV cache, a quarter of fp32's bytes): an item dequantizes the keys and values
// of its chunk's visible positions once into fp32 rows, which every query head of the group then reads as above, so
// its values are exactly decode_attention's on the dequantized cache.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <c10/util/Optional.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <cstdint>
#include <limits>
#include <vector>

#include "kernels.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define ATTN_AVX2 1
#endif

namespace {

constexpr int64_t CHUNK = 64;  // positions per work item
constexpr int64_t ROW_BLOCK = 16;  // rows of one cache per work item
constexpr float NEG_INF = -std::numeric_limits<float>::infinity();

inline float dot(const float* a, const float* b, int64_t n) {
  float s = 0.f;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}


// p[j] = exp(s[j] - top) for j < n, in place; returns their sum (0 for hidden positions, s = -inf)
inline float exp_shifted(float* s, int64_t n, float top) {
  int64_t j = 0;
  float total = 0.f;
#ifdef ATTN_AVX2
  __m256 sum = _mm256_setzero_ps();
  const __m256 t = _mm256_set1_ps(top);
  for (; j + 8 <= n; j += 8) {
    const __m256 p = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + j), t));
    _mm256_storeu_ps(s + j, p);
    sum = _mm256_add_ps(sum, p);
  }
  float lanes[8];
  _mm256_storeu_ps(lanes, sum);
  for (float v : lanes) total += v;
  if (j < n) {  // the tail, padded with hidden positions
    float tail[8];
    for (int64_t i = 0; i < 8; ++i) tail[i] = j + i < n ? s[j + i] : NEG_INF;
    _mm256_storeu_ps(tail, exp8(_mm256_sub_ps(_mm256_loadu_ps(tail), t)));
    for (int64_t i = 0; j + i < n; ++i) {
      s[j + i] = tail[i];
      total += tail[i];
    }
  }
#else
  for (; j < n; ++j) {
    s[j] = s[j] == NEG_INF ? 0.f : std::exp(s[j] - top);
    total += s[j];
  }
#endif
  return total;
}

#ifdef ATTN_AVX2
// the 8 sums of v[0..7]'s lanes, in one vector (lane t = sum of v[t])
inline __m256 sums8(const __m256* v) {
  const __m256 ab = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
  const __m256 cd = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(ab, cd, 0x20), _mm256_permute2f128_ps(ab, cd, 0x31));
}

// s[t] = scale * q . k[at[t]] for t < n (D a multiple of 8): 8 positions at a time, one vector sum each,
// reduced together
inline void scores_avx2(const float* qv, const float* kb, int64_t ks2, const int64_t* at, int64_t n, int64_t D,
                        float scale, float* s) {
  const __m256 sc = _mm256_set1_ps(scale);
  for (int64_t t = 0; t < n; t += 8) {
    __m256 acc[8];
    const float* rows[8];
    for (int u = 0; u < 8; ++u) {
      rows[u] = kb + at[std::min<int64_t>(t + u, n - 1)] * ks2;  // past n: the last row again, dropped below
      acc[u] = _mm256_setzero_ps();
    }
    for (int64_t d = 0; d < D; d += 8) {
      const __m256 qd = _mm256_loadu_ps(qv + d);
      for (int u = 0; u < 8; ++u) acc[u] = _mm256_fmadd_ps(qd, _mm256_loadu_ps(rows[u] + d), acc[u]);
    }
    const __m256 out = _mm256_mul_ps(sums8(acc), sc);
    if (t + 8 <= n) {
      _mm256_storeu_ps(s + t, out);
    } else {
      float lanes[8];
      _mm256_storeu_ps(lanes, out);
      for (int64_t u = 0; t + u < n; ++u) s[t + u] = lanes[u];
    }
  }
}

// a[:] = sum_t p[t] * v[at[t]] for a head dimension of 8 * DB, the sum in DB registers
template <int DB>
inline void values_avx2(const float* p, const float* vb, int64_t vs2, const int64_t* at, int64_t n, float* a) {
  __m256 acc[DB];
  for (int d = 0; d < DB; ++d) acc[d] = _mm256_setzero_ps();
  for (int64_t t = 0; t < n; ++t) {
    const __m256 pt = _mm256_set1_ps(p[t]);
    const float* vj = vb + at[t] * vs2;
    for (int d = 0; d < DB; ++d) acc[d] = _mm256_fmadd_ps(pt, _mm256_loadu_ps(vj + 8 * d), acc[d]);
  }
  for (int d = 0; d < DB; ++d) _mm256_storeu_ps(a + 8 * d, acc[d]);
}

// Tiles of several queries against the same keys and values: the key and value rows a tile loads serve every
// query of it, where the one-query loops above load them once a query. Each (query, position) score and each
// query's weighted sum is computed by the same operations in the same order as in scores_avx2 and values_avx2,
// so a query's values do not depend on the tile it sits in (nor on the other queries beside it).
#ifdef __AVX512VL__
constexpr int QTILE = 4;  // queries a tile: 16 accumulators of 32 vector registers
#else
constexpr int QTILE = 2;  // 16 vector registers
#endif

// the lane sums of v[0..3] (lane t = sum of v[t]), added in sums8's order
inline __m128 sums4(const __m256* v) {
  const __m256 ab = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
  return _mm_add_ps(_mm256_castps256_ps128(ab), _mm256_extractf128_ps(ab, 1));
}

// s[i][t] = scale * q[i] . k[at[t]] for QT queries, 4 positions at a time (D a multiple of 8)
template <int QT>
inline void scores_tile(const float* const* q, const float* kb, int64_t ks2, const int64_t* at, int64_t n, int64_t D,
                        float scale, float* const* s) {
  const __m128 sc = _mm_set1_ps(scale);
  for (int64_t t = 0; t < n; t += 4) {
    const float* rows[4];
    for (int u = 0; u < 4; ++u) rows[u] = kb + at[std::min<int64_t>(t + u, n - 1)] * ks2;  // past n: dropped
    __m256 acc[QT][4];
    for (int i = 0; i < QT; ++i)
      for (int u = 0; u < 4; ++u) acc[i][u] = _mm256_setzero_ps();
    for (int64_t d = 0; d < D; d += 8) {
      __m256 kd[4];
      for (int u = 0; u < 4; ++u) kd[u] = _mm256_loadu_ps(rows[u] + d);
      for (int i = 0; i < QT; ++i) {
        const __m256 qd = _mm256_loadu_ps(q[i] + d);
        for (int u = 0; u < 4; ++u) acc[i][u] = _mm256_fmadd_ps(qd, kd[u], acc[i][u]);
      }
    }
    for (int i = 0; i < QT; ++i) {
      const __m128 out = _mm_mul_ps(sums4(acc[i]), sc);
      if (t + 4 <= n) {
        _mm_storeu_ps(s[i] + t, out);
      } else {
        float lanes[4];
        _mm_storeu_ps(lanes, out);
        for (int64_t u = 0; t + u < n; ++u) s[i][t + u] = lanes[u];
      }
    }
  }
}

// a[i][:] = sum_t p[i][t] * v[at[t]] for QT queries, 32 values of the head dimension a pass (D a multiple of 32)
template <int QT>
inline void values_tile(const float* const* p, const float* vb, int64_t vs2, const int64_t* at, int64_t n, int64_t D,
                        float* const* a) {
  for (int64_t d0 = 0; d0 < D; d0 += 32) {
    __m256 acc[QT][4];
    for (int i = 0; i < QT; ++i)
      for (int e = 0; e < 4; ++e) acc[i][e] = _mm256_setzero_ps();
    for (int64_t t = 0; t < n; ++t) {
      const float* vj = vb + at[t] * vs2 + d0;
      __m256 vd[4];
      for (int e = 0; e < 4; ++e) vd[e] = _mm256_loadu_ps(vj + 8 * e);
      for (int i = 0; i < QT; ++i) {
        const __m256 pt = _mm256_set1_ps(p[i][t]);
        for (int e = 0; e < 4; ++e) acc[i][e] = _mm256_fmadd_ps(pt, vd[e], acc[i][e]);
      }
    }
    for (int i = 0; i < QT; ++i)
      for (int e = 0; e < 4; ++e) _mm256_storeu_ps(a[i] + d0 + 8 * e, acc[i][e]);
  }
}

// nq queries in tiles of QTILE (the rest in one smaller tile)
inline void scores_tiles(const float* const* q, int64_t nq, const float* kb, int64_t ks2, const int64_t* at, int64_t n,
                         int64_t D, float scale, float* const* s) {
  int64_t i = 0;
  for (; i + QTILE <= nq; i += QTILE) scores_tile<QTILE>(q + i, kb, ks2, at, n, D, scale, s + i);
  if (nq - i == 1) scores_tile<1>(q + i, kb, ks2, at, n, D, scale, s + i);
  if (nq - i == 2) scores_tile<2>(q + i, kb, ks2, at, n, D, scale, s + i);
  if (nq - i == 3) scores_tile<3>(q + i, kb, ks2, at, n, D, scale, s + i);
}

inline void values_tiles(const float* const* p, int64_t nq, const float* vb, int64_t vs2, const int64_t* at, int64_t n,
                         int64_t D, float* const* a) {
  int64_t i = 0;
  for (; i + QTILE <= nq; i += QTILE) values_tile<QTILE>(p + i, vb, vs2, at, n, D, a + i);
  if (nq - i == 1) values_tile<1>(p + i, vb, vs2, at, n, D, a + i);
  if (nq - i == 2) values_tile<2>(p + i, vb, vs2, at, n, D, a + i);
  if (nq - i == 3) values_tile<3>(p + i, vb, vs2, at, n, D, a + i);
}
#endif

}  // namespace

namespace {

// the attention of both cache kinds: fp32 k / v (k_scale, v_scale undefined), or int8 k / v with fp32 scales
// [B, Hkv, L] (value = int8 * the scale of its row, kv head and position)
at::Tensor attend(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& k_scale,
                  const at::Tensor& v_scale, const c10::optional<at::Tensor>& mask, double scale) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4, "decode_attention: q, k, v must be 4-D");
  const bool q8 = k_scale.defined();
  TORCH_CHECK(q.scalar_type() == at::kFloat, "decode_attention: q must be float32");
  TORCH_CHECK(q8 ? (k.scalar_type() == at::kChar && v.scalar_type() == at::kChar)
                 : (k.scalar_type() == at::kFloat && v.scalar_type() == at::kFloat),
              q8 ? "decode_attention_q8: k / v must be int8" : "decode_attention: float32 only");
  const int64_t B = q.size(0), H = q.size(1), D = q.size(3), Hkv = k.size(1), L = k.size(2);
  TORCH_CHECK(q.size(2) == 1, "decode_attention: one query per row");
  TORCH_CHECK(H >= 1 && Hkv >= 1 && D >= 1 && L >= 1, "decode_attention: heads, kv heads, head dim and cache length "
              "must be >= 1, got ", H, ", ", Hkv, ", ", D, ", ", L);
  TORCH_CHECK(k.size(0) == B && v.size(0) == B && v.size(1) == Hkv && v.size(2) == L && k.size(3) == D &&
                  v.size(3) == D && H % Hkv == 0,
              "decode_attention: k / v do not match q");
  TORCH_CHECK(k.stride(3) == 1 && v.stride(3) == 1, "decode_attention: k / v need a contiguous head dimension");
  if (q8)
    TORCH_CHECK(v_scale.defined() && k_scale.scalar_type() == at::kFloat && v_scale.scalar_type() == at::kFloat &&
                    k_scale.dim() == 3 && v_scale.dim() == 3 && k_scale.size(0) == B && v_scale.size(0) == B &&
                    k_scale.size(1) == Hkv && v_scale.size(1) == Hkv && k_scale.size(2) == L && v_scale.size(2) == L,
                "decode_attention_q8: k / v scales must be float32 [B, Hkv, L]");
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
  const float* kp = q8 ? nullptr : k.data_ptr<float>();
  const float* vp = q8 ? nullptr : v.data_ptr<float>();
  const int8_t* kp8 = q8 ? k.data_ptr<int8_t>() : nullptr;
  const int8_t* vp8 = q8 ? v.data_ptr<int8_t>() : nullptr;
  const float* ksp = q8 ? k_scale.data_ptr<float>() : nullptr;
  const float* vsp = q8 ? v_scale.data_ptr<float>() : nullptr;
  const int64_t kss0 = q8 ? k_scale.stride(0) : 0, kss1 = q8 ? k_scale.stride(1) : 0, kss2 = q8 ? k_scale.stride(2) : 0;
  const int64_t vss0 = q8 ? v_scale.stride(0) : 0, vss1 = q8 ? v_scale.stride(1) : 0, vss2 = q8 ? v_scale.stride(2) : 0;
  float* op = out.data_ptr<float>();
  const int64_t G = H / Hkv;  // query heads per kv head
  const int64_t ks0 = k.stride(0), ks1 = k.stride(1), ks2 = k.stride(2);
  const int64_t vs0 = v.stride(0), vs1 = v.stride(1), vs2 = v.stride(2);
  const int64_t ms0 = has_mask ? (m.size(0) == 1 ? 0 : m.stride(0)) : 0;
  const int64_t ms1 = has_mask ? (m.size(1) == 1 ? 0 : m.stride(1)) : 0;
  const int64_t ms3 = has_mask ? m.stride(3) : 0;
  const bool* mb = has_mask && bool_mask ? m.data_ptr<bool>() : nullptr;
  const float* mf = has_mask && !bool_mask ? m.data_ptr<float>() : nullptr;
  const float fscale = static_cast<float>(scale);
  int64_t chunks = std::max<int64_t>(1, (L + CHUNK - 1) / CHUNK);
  if (mb != nullptr) {  // chunks past the last position any row sees add nothing: not made into items, so
    // the threads split the chunks that hold work (a 240-token context in a 512-position cache: 4 of 8)
    int64_t last = -1;
    for (int64_t b = 0; b < (ms0 ? B : 1); ++b)
      for (int64_t h = 0; h < (ms1 ? H : 1); ++h)
        for (int64_t j = L - 1; j > last; --j)
          if (mb[b * ms0 + h * ms1 + j * ms3]) {
            last = j;
            break;
          }
    chunks = std::max<int64_t>(1, last / CHUNK + 1);
  }
  // per (row, query head, chunk): the chunk's maximum score, its sum of exp, its weighted values [D];
  // the calling thread's scratch (every slot is written by exactly one item before the merge reads it)
  thread_local std::vector<float> part_max, part_sum, part_acc;
  part_max.resize(std::max<size_t>(part_max.size(), B * H * chunks));
  part_sum.resize(std::max<size_t>(part_sum.size(), B * H * chunks));
  part_acc.resize(std::max<size_t>(part_acc.size(), B * H * chunks * D));
  // pointers, not the names: inside the worker lambda a thread_local name would be the worker's own
  float* const pmax = part_max.data();
  float* const psum = part_sum.data();
  float* const pacc = part_acc.data();
  // The tiled path (AVX2, D a multiple of 32, heads of a row sharing its mask): the queries of an item, every
  // query head of the group for each of its rows, are scored and summed in tiles (scores_tiles / values_tiles).
  // Rows that read one cache (a prompt's rows in its slot: k / v expanded along the rows, stride 0) are taken
  // ROW_BLOCK at a time, so a chunk of keys and values read once serves every query of the block, where all of
  // its rows see the whole chunk; a row that sees part of it goes alone, as any lone row does. A query's values
  // are the same in a block, alone, or on the one-query path.
#ifdef ATTN_AVX2
  const bool tiled = D % 32 == 0 && (mb != nullptr ? ms1 == 0 : mf == nullptr);
#else
  const bool tiled = false;
#endif
  const bool blocked = tiled && B > 1 && ks0 == 0 && vs0 == 0 && (!q8 || (kss0 == 0 && vss0 == 0));
  const int64_t RB = blocked ? ROW_BLOCK : 1, blocks = (B + RB - 1) / RB;
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(1, CHUNK * D * G * RB));  // small work: one thread
  at::parallel_for(0, blocks * Hkv * chunks, grain, [&](int64_t begin, int64_t end) {
    thread_local std::vector<float> scores;  // [RB * G, CHUNK]
    thread_local std::vector<int64_t> seen;  // the chunk's positions some head of the group attends to
    thread_local std::vector<float> kdq, vdq;  // int8 caches: the chunk's seen keys / values in fp32 [n, D]
    thread_local std::vector<int64_t> order;  // int8 caches: 0..n-1 (row t of kdq / vdq is position seen[t])
    thread_local std::vector<const float*> queries;
    thread_local std::vector<float*> rows_out, accs;
    scores.resize(std::max<size_t>(scores.size(), RB * G * CHUNK));
    seen.resize(std::max<size_t>(seen.size(), CHUNK));
    if (q8) {
      kdq.resize(std::max<size_t>(kdq.size(), CHUNK * D)), vdq.resize(std::max<size_t>(vdq.size(), CHUNK * D));
      order.resize(std::max<size_t>(order.size(), CHUNK));
      for (int64_t t = 0; t < CHUNK; ++t) order[t] = t;
    }
    for (int64_t item = begin; item < end; ++item) {
      const int64_t c = item % chunks, bg = item / chunks, b0 = (bg / Hkv) * RB, g = bg % Hkv;
      const int64_t b1 = std::min(B, b0 + RB);
      const int64_t j0 = c * CHUNK, j1 = std::min(L, j0 + CHUNK);
      // row b's positions of the chunk that some head of the group attends to -> seen[0..n)
      auto visible = [&](int64_t b) {
        int64_t n = 0;
        if (mb != nullptr && (ms1 == 0 || G == 1)) {  // the heads of the group share the row's mask: one read
          const bool* row = mb + b * ms0 + g * G * ms1;
          for (int64_t j = j0; j < j1; ++j)
            if (row[j * ms3]) seen[n++] = j;
          return n;
        }
        for (int64_t j = j0; j < j1; ++j) {
          bool any = mb == nullptr;
          for (int64_t i = 0; i < G && !any; ++i) any = mb[b * ms0 + (g * G + i) * ms1 + j * ms3];
          if (any) seen[n++] = j;
        }
        return n;
      };
      // rows [r0, r1) over positions seen[0..n) of row r0's cache (the same cache for every row of a block)
      auto run_rows = [&](int64_t r0, int64_t r1, int64_t n) {
        const float* kb = q8 ? kdq.data() : kp + r0 * ks0 + g * ks1;
        const float* vb = q8 ? vdq.data() : vp + r0 * vs0 + g * vs1;
        // where the chunk's rows are read: the cache (strides ks2 / vs2 at positions seen[t]), or the int8 rows
        // dequantized once per item into kdq / vdq (stride D at row t), read there by every query
        const int64_t* at = seen.data();
        int64_t kstep = ks2, vstep = vs2;
        if (q8) {
          const int8_t* k8 = kp8 + r0 * ks0 + g * ks1;
          const int8_t* v8 = vp8 + r0 * vs0 + g * vs1;
          const float* ksc = ksp + r0 * kss0 + g * kss1;
          const float* vsc = vsp + r0 * vss0 + g * vss1;
          for (int64_t t = 0; t < n; ++t) {
            const int64_t j = seen[t];
            const int8_t* kr = k8 + j * ks2;
            const int8_t* vr = v8 + j * vs2;
            const float sk = ksc[j * kss2], sv = vsc[j * vss2];
            float* kd = kdq.data() + t * D;
            float* vd = vdq.data() + t * D;
#pragma omp simd
            for (int64_t d = 0; d < D; ++d) kd[d] = static_cast<float>(kr[d]) * sk;
#pragma omp simd
            for (int64_t d = 0; d < D; ++d) vd[d] = static_cast<float>(vr[d]) * sv;
          }
          at = order.data(), kstep = D, vstep = D;
        }
        if (r1 - r0 > 1) {  // a block (only where `blocked`)
#ifdef ATTN_AVX2
          const int64_t nq = (r1 - r0) * G;
          queries.resize(nq), rows_out.resize(nq), accs.resize(nq);
          for (int64_t r = r0; r < r1; ++r)
            for (int64_t i = 0; i < G; ++i) {
              const int64_t k = (r - r0) * G + i, h = g * G + i;
              queries[k] = qp + (r * H + h) * D;
              rows_out[k] = scores.data() + k * CHUNK;
              accs[k] = pacc + ((r * H + h) * chunks + c) * D;
            }
          scores_tiles(queries.data(), nq, kb, kstep, at, n, D, fscale, rows_out.data());
          for (int64_t r = r0; r < r1; ++r)
            for (int64_t i = 0; i < G; ++i) {
              const int64_t k = (r - r0) * G + i, slot = (r * H + g * G + i) * chunks + c;
              float* s = rows_out[k];
              float top = NEG_INF;
              for (int64_t t = 0; t < n; ++t) top = std::max(top, s[t]);
              pmax[slot] = top;
              psum[slot] = top == NEG_INF ? 0.f : exp_shifted(s, n, top);
              if (top == NEG_INF) std::fill(s, s + n, 0.f);
            }
          values_tiles(rows_out.data(), nq, vb, vstep, at, n, D, accs.data());
#endif
          return;
        }
        const int64_t b = r0;  // one row: each head of the group in turn (faster for a lone row's streamed cache)
        for (int64_t i = 0; i < G; ++i) {
          const int64_t h = g * G + i, slot = (b * H + h) * chunks + c;
          const float* qv = qp + (b * H + h) * D;
          float* s = scores.data() + i * CHUNK;
          float top = NEG_INF;
#ifdef ATTN_AVX2
          if (D % 8 == 0)
            scores_avx2(qv, kb, kstep, at, n, D, fscale, s);
          else
#endif
            for (int64_t t = 0; t < n; ++t) s[t] = fscale * dot(qv, kb + at[t] * kstep, D);
          for (int64_t t = 0; t < n; ++t) {
            const int64_t j = seen[t];
            if (mb != nullptr && !mb[b * ms0 + h * ms1 + j * ms3])
              s[t] = NEG_INF;
            else if (mf != nullptr)
              s[t] += mf[b * ms0 + h * ms1 + j * ms3];
            top = std::max(top, s[t]);
          }
          pmax[slot] = top;
          psum[slot] = top == NEG_INF ? 0.f : exp_shifted(s, n, top);
          float* a = pacc + slot * D;
          std::fill(a, a + D, 0.f);
          if (top == NEG_INF) std::fill(s, s + n, 0.f);
        }
        for (int64_t i = 0; i < G; ++i) {  // the chunk's values stay in L1 across the group's heads
          const float* p = scores.data() + i * CHUNK;
          float* a = pacc + ((b * H + g * G + i) * chunks + c) * D;
#ifdef ATTN_AVX2
          if (D == 64) {  // the head's accumulator in registers
            values_avx2<8>(p, vb, vstep, at, n, a);
            continue;
          }
          if (D == 128) {
            values_avx2<16>(p, vb, vstep, at, n, a);
            continue;
          }
#endif
          for (int64_t t = 0; t < n; ++t) {
            const float* vj = vb + at[t] * vstep;
#pragma omp simd
            for (int64_t d = 0; d < D; ++d) a[d] += p[t] * vj[d];
          }
        }
      };
      if (b1 - b0 > 1) {  // a block: together where every row sees the whole chunk
        bool whole = true;
        if (mb != nullptr && ms3 == 1) {  // (the tiled path's heads share a row's mask) no hidden position
          for (int64_t b = b0; b < b1 && whole; ++b) whole = std::memchr(mb + b * ms0 + j0, 0, j1 - j0) == nullptr;
        } else {
          for (int64_t b = b0; b < b1 && whole; ++b) whole = visible(b) == j1 - j0;
        }
        if (whole) {
          for (int64_t j = j0; j < j1; ++j) seen[j - j0] = j;
          run_rows(b0, b1, j1 - j0);
          continue;
        }
      }
      for (int64_t b = b0; b < b1; ++b) run_rows(b, b + 1, visible(b));
    }
  });
  // merge each head's chunks, in order (the heads spread over the threads)
  at::parallel_for(0, B * H, std::max<int64_t>(1, 8192 / (chunks * D)), [&](int64_t first, int64_t last_bh) {
    for (int64_t bh = first; bh < last_bh; ++bh) {
      float* o = op + bh * D;  // out[b, 0, h, :] ([B, 1, H, D] contiguous)
      const float* mx = pmax + bh * chunks;
      float top = NEG_INF;
      for (int64_t c = 0; c < chunks; ++c) top = std::max(top, mx[c]);
      std::fill(o, o + D, 0.f);
      if (top == NEG_INF) continue;
      float total = 0.f;
      for (int64_t c = 0; c < chunks; ++c) {
        if (mx[c] == NEG_INF) continue;
        const float w = mx[c] == top ? 1.f : std::exp(mx[c] - top);
        total += w * psum[bh * chunks + c];
        const float* a = pacc + (bh * chunks + c) * D;
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) o[d] += w * a[d];
      }
      const float inv = 1.f / total;
      for (int64_t d = 0; d < D; ++d) o[d] *= inv;
    }
  });
  return out;
}

}  // namespace

at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            const c10::optional<at::Tensor>& mask, double scale) {
  return attend(q, k, v, at::Tensor(), at::Tensor(), mask, scale);
}

at::Tensor decode_attention_q8(const at::Tensor& q, const at::Tensor& k, const at::Tensor& k_scale,
                               const at::Tensor& v, const at::Tensor& v_scale, const c10::optional<at::Tensor>& mask,
                               double scale) {
  TORCH_CHECK(k_scale.defined() && v_scale.defined(), "decode_attention_q8: k / v scales are needed");
  return attend(q, k, v, k_scale, v_scale, mask, scale);
}

TORCH_LIBRARY_FRAGMENT(infer_tune_native, m) {
  m.def("decode_attention(Tensor q, Tensor k, Tensor v, Tensor? mask, float scale) -> Tensor");
  m.def("decode_attention_q8(Tensor q, Tensor k, Tensor k_scale, Tensor v, Tensor v_scale, Tensor? mask, "
        "float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(infer_tune_native, CPU, m) {
  m.impl("decode_attention", &decode_attention);
  m.impl("decode_attention_q8", &decode_attention_q8);
}
