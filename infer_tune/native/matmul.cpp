// Low-bit weights x int8 activations: the CPU kernels of quantize's `activations: int8` (docs/quantize.md):
// w4a8_mm for the int4 layers (modules.Int4A8Linear), w8a8_mm for the int8 embedding-tied head
// (modules.Int8A8Linear). Both quantize the activations the same way (below).
//
// w4a8_mm.
// Numerics, exactly: each row of x is cut into blocks of 32 along K; a block's scale is dx = max|x| / 127
// and its int8 values a = round(x / dx) (half to even; 0 where dx == 0). The weight w = (q - 8) * s + z
// per group (q 0..15, s and z bf16, the int4pack convention). The kernel returns, per row and output,
//     y = sum over blocks b of dx_b * ( s_g * sum_k a_k (q_k - 8)  +  z_g * sum_k a_k )
// which is x_hat . w_hat (x_hat = dx * a) with the integer part exact and the rest in fp32, so the
// fake-quantized activations times the dequantized weights (the `dequant` kernel, modules.py) give the
// same value up to fp32 rounding.
//
// Weight layout (modules.pack_w4a8): one uint8 tensor [N/8, K/group, 32 + 4 * group], the weights of 8
// outputs (a tile) in the order the kernel reads them, so each thread streams one contiguous range. Per
// tile and group: 16 bf16, the scales and zeros of the 8 outputs as [s0 s2 s4 s6 z0 z2 z4 z6 s1 s3 s5 s7
// z1 z3 z5 z7] (lane l of a vector holds output LANE_OF^-1[l]: 0 2 4 6 1 3 5 7, the order bf16 -> fp32
// unpacking leaves the scales in); then each 32-block of the group as 4 x 32 bytes: in the i-th 32 bytes,
// lane l's 4 bytes hold its output's weights 4i..4i+3 in the low nibbles and 16+4i..16+4i+3 in the high
// ones. N is a multiple of 8 (padded at pack time).
//
// The AVX2 path unpacks each 32 bytes into two vectors of u8 weights (low and high nibbles), each lane
// 4 consecutive weights of one output, and multiplies them with the 4 matching activations broadcast to
// every lane (vpmaddubsw: u8 x s8 pairs into int16; the block's 8 such vectors added in int16 stay exact,
// 8 x 2 x 15 x 127 < 32767; one vpmaddwd then leaves each output's sum in its own int32 lane, no
// horizontal adds). With AVX-512 VNNI (and VL), vpdpbusd sums the u8 x s8 products straight into int32.
// The scales apply in fp32 as dx * (s * sum a q + (z - 8 s) * sum a), z - 8 s once per group, dx and
// sum a broadcast from memory. A tile's block is unpacked once for all rows. Threads split the tiles; one
// row (decode) streams each thread's tiles in several parts side by side (one_row).
// Without AVX2 a scalar loop computes the same value. Measured against the previous layout (two outputs
// per vector, three horizontal adds per block; same results bit for bit), interleaved, 120 layers of
// SmolLM2's shapes on an AVX-512 VNNI host: 0.796x [0.760, 0.834] of its time for four rows (0.851x
// [0.825, 0.878] without vpdpbusd), 0.971x [0.919, 1.026] for one row (bench/native_ab.py).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "kernels.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define W4A8_AVX2 1
#if !defined(W4A8_NO_VNNI) && defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define W4A8_VNNI 1  // vpdpbusd on 256-bit vectors (AVX-512 VNNI with VL)
#if !defined(W4A8_NO_ZMM) && defined(__AVX512F__) && defined(__AVX512BW__)
#define W4A8_ZMM 1  // w8a8 on 512-bit vectors for a few rows (decode, the slot engine's rows)
#endif
#endif
#endif

namespace {

constexpr int64_t BLOCK = 32;   // activation block and weight sub-block
constexpr int64_t TILE = 8;     // outputs per tile
constexpr int64_t ABYTES = 64;  // one quantized activation block, laid out for the kernel
#ifndef W4A8_PREFETCH
#define W4A8_PREFETCH 6  // groups ahead the tile's stream is prefetched
#endif
constexpr int LANE_OF[TILE] = {0, 4, 1, 5, 2, 6, 3, 7};  // output t sits in lane LANE_OF[t]

inline int64_t group_bytes(int64_t group) { return 4 * TILE + TILE * (group / 2); }

inline float bf16_to_float(uint16_t bits) {
  uint32_t wide = static_cast<uint32_t>(bits) << 16;
  float out;
  std::memcpy(&out, &wide, sizeof(out));
  return out;
}

// One block of 32 fp32 -> ABYTES bytes [a0..15, a0..15, a16..31, a16..31] (int8), its scale and sum.
inline void quantize_block(const float* src, int8_t* dst, float* dx, float* asum) {
#ifdef W4A8_AVX2
  const __m256 sign = _mm256_set1_ps(-0.0f);
  __m256 v[4], top = _mm256_setzero_ps();
  for (int i = 0; i < 4; ++i) {
    v[i] = _mm256_loadu_ps(src + 8 * i);
    top = _mm256_max_ps(top, _mm256_andnot_ps(sign, v[i]));
  }
  __m128 half = _mm_max_ps(_mm256_castps256_ps128(top), _mm256_extractf128_ps(top, 1));
  half = _mm_max_ps(half, _mm_movehl_ps(half, half));
  half = _mm_max_ss(half, _mm_movehdup_ps(half));
  const float d = _mm_cvtss_f32(half) / 127.0f;
  *dx = d;
  if (!(d > 0.f)) {
    std::memset(dst, 0, ABYTES);
    *asum = 0.f;
    return;
  }
  const __m256 dv = _mm256_set1_ps(d);
  __m256i q[4];
  for (int i = 0; i < 4; ++i)  // x / d rounded half to even, as torch.round(x / d)
    q[i] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_div_ps(v[i], dv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  const __m256i total = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
  __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(total), _mm256_extracti128_si256(total, 1));
  s4 = _mm_hadd_epi32(s4, s4);
  *asum = static_cast<float>(_mm_cvtsi128_si32(_mm_hadd_epi32(s4, s4)));
  // int32 -> int8 in order (the packs interleave 128-bit lanes; the permute puts them back)
  const __m256i bytes = _mm256_permutevar8x32_epi32(
      _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3])),
      _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), _mm256_permute2x128_si256(bytes, bytes, 0x00));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + 32), _mm256_permute2x128_si256(bytes, bytes, 0x11));
#else
  float amax = 0.f;
  for (int64_t k = 0; k < BLOCK; ++k) amax = std::max(amax, std::fabs(src[k]));
  const float d = amax / 127.0f;
  int32_t sum = 0;
  int8_t q[BLOCK];
  for (int64_t k = 0; k < BLOCK; ++k) {
    const int32_t v = d > 0.f ? static_cast<int32_t>(std::nearbyint(src[k] / d)) : 0;  // as torch.round(x / d)
    q[k] = static_cast<int8_t>(v);
    sum += v;
  }
  std::memcpy(dst, q, 16);
  std::memcpy(dst + 16, q, 16);
  std::memcpy(dst + 32, q + 16, 16);
  std::memcpy(dst + 48, q + 16, 16);
  *dx = d;
  *asum = static_cast<float>(sum);
#endif
}

void quantize_rows(const float* x, int64_t M, int64_t K, int8_t* a, float* dx, float* asum) {
  const int64_t blocks = K / BLOCK;
  by_rows(0, M, [&](int64_t m) {  // a prompt's rows over the threads, a decode step's in this one
    for (int64_t b = 0; b < blocks; ++b)
      quantize_block(x + m * K + b * BLOCK, a + (m * blocks + b) * ABYTES, dx + m * blocks + b, asum + m * blocks + b);
  });
}

// One tile (8 outputs) for rows 0..M-1: y[m * ldy + t] for t < 8. Scalar.
void tile_scalar(const int8_t* a, const float* dx, const float* asum, int64_t M, int64_t K, int64_t group,
                 const uint8_t* tile, float* y, int64_t ldy) {
  const int64_t groups = K / group, per_group = group / BLOCK, blocks = K / BLOCK;
  for (int64_t m = 0; m < M; ++m) {
    float acc[TILE] = {0.f};
    for (int64_t g = 0; g < groups; ++g) {
      const uint8_t* p = tile + g * group_bytes(group);
      uint16_t sz[2 * TILE];
      std::memcpy(sz, p, sizeof(sz));
      for (int64_t i = 0; i < per_group; ++i) {
        const int64_t b = g * per_group + i;
        const int8_t* av = a + (m * blocks + b) * ABYTES;
        for (int64_t t = 0; t < TILE; ++t) {
          const int lane = LANE_OF[t];
          const uint8_t* block = p + 4 * TILE + i * TILE * 16;
          int32_t dot = 0;
          for (int64_t j = 0; j < 16; ++j) {  // weight j: the (j / 4)-th 32 bytes, lane `lane`, byte j % 4
            const uint8_t byte = block[(j / 4) * 32 + lane * 4 + j % 4];
            dot += static_cast<int32_t>(av[j]) * (byte & 15);
            dot += static_cast<int32_t>(av[32 + j]) * (byte >> 4);
          }
          // lanes 0..3 are in bf16 slots 0..3 (s) and 4..7 (z); 4..7 in 8..15
          const int slot = lane < 4 ? lane : lane + 4;
          const float s = bf16_to_float(sz[slot]), zc = bf16_to_float(sz[slot + 4]) - 8.f * s;
          acc[t] += dx[m * blocks + b] * std::fma(s, static_cast<float>(dot), zc * asum[m * blocks + b]);
        }
      }
    }
    for (int64_t t = 0; t < TILE; ++t) y[m * ldy + t] = acc[t];
  }
}

#ifdef W4A8_AVX2
struct Weights {  // one 32-block of a tile, unpacked: lo[i] lane l = weights 4i..4i+3, hi[i] 16+4i..
  __m256i lo[4], hi[4];
};

inline void unpack(const uint8_t* q, Weights& w) {
  const __m256i mask = _mm256_set1_epi8(0x0F);
  for (int i = 0; i < 4; ++i) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + 32 * i));
    w.lo[i] = _mm256_and_si256(v, mask);
    w.hi[i] = _mm256_and_si256(_mm256_srli_epi16(v, 4), mask);
  }
}

inline __m256i quad(const int8_t* act) {  // 4 activations broadcast to every lane
  int32_t v;
  std::memcpy(&v, act, sizeof(v));
  return _mm256_set1_epi32(v);
}

// the 8 outputs' sums of a * q for one row's block, output t in lane LANE_OF[t];
// act: [a0..15, a0..15, a16..31, a16..31]
inline __m256i dot8(const Weights& w, const int8_t* act) {
#ifdef W4A8_VNNI
  __m256i lo = _mm256_setzero_si256(), hi = _mm256_setzero_si256();  // two chains of four
  for (int i = 0; i < 4; ++i) {
    lo = _mm256_dpbusd_epi32(lo, w.lo[i], quad(act + 4 * i));
    hi = _mm256_dpbusd_epi32(hi, w.hi[i], quad(act + 32 + 4 * i));
  }
  return _mm256_add_epi32(lo, hi);
#else
  __m256i d = _mm256_add_epi16(_mm256_maddubs_epi16(w.lo[0], quad(act)), _mm256_maddubs_epi16(w.hi[0], quad(act + 32)));
  for (int i = 1; i < 4; ++i)
    d = _mm256_add_epi16(d, _mm256_add_epi16(_mm256_maddubs_epi16(w.lo[i], quad(act + 4 * i)),
                                             _mm256_maddubs_epi16(w.hi[i], quad(act + 32 + 4 * i))));
  return _mm256_madd_epi16(d, _mm256_set1_epi16(1));
#endif
}

inline void load_scales(const uint8_t* p, __m256& s, __m256& z) {
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  const __m256i zero = _mm256_setzero_si256();
  s = _mm256_castsi256_ps(_mm256_unpacklo_epi16(zero, v));  // bf16 -> the high half of an fp32
  z = _mm256_fnmadd_ps(_mm256_set1_ps(8.f), s, _mm256_castsi256_ps(_mm256_unpackhi_epi16(zero, v)));  // z - 8 s
}

inline void store_tile(float* y, __m256 acc) {
  _mm256_storeu_ps(y, _mm256_permutevar8x32_ps(acc, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
}

// acc + dx * (s * sum a q + (z - 8 s) * sum a): the block's sum a (q - 8) s + a z, with zc = z - 8 s
inline __m256 apply(__m256 acc, __m256i dot, __m256 s, __m256 zc, const float* dx, const float* asum) {
  const __m256 inner = _mm256_fmadd_ps(s, _mm256_cvtepi32_ps(dot), _mm256_mul_ps(zc, _mm256_broadcast_ss(asum)));
  return _mm256_fmadd_ps(_mm256_broadcast_ss(dx), inner, acc);
}

void tile_avx2(const int8_t* a, const float* dx, const float* asum, int64_t M, int64_t K, int64_t group,
               const uint8_t* tile, float* y, int64_t ldy, float* acc) {
  const int64_t groups = K / group, per_group = group / BLOCK, blocks = K / BLOCK, gbytes = group_bytes(group);
  for (int64_t m = 0; m < M; ++m) _mm256_storeu_ps(acc + m * TILE, _mm256_setzero_ps());
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* p = tile + g * gbytes;
    for (int64_t ahead = 0; ahead < gbytes; ahead += 64)  // the stream, some groups ahead
      _mm_prefetch(reinterpret_cast<const char*>(p + W4A8_PREFETCH * gbytes + ahead), _MM_HINT_T0);
    __m256 s, z;
    load_scales(p, s, z);
    for (int64_t i = 0; i < per_group; ++i) {
      const int64_t b = g * per_group + i;
      Weights w;
      unpack(p + 4 * TILE + i * TILE * 16, w);
      for (int64_t m = 0; m < M; ++m) {
        const int64_t mb = m * blocks + b;
        float* out = acc + m * TILE;
        _mm256_storeu_ps(out, apply(_mm256_loadu_ps(out), dot8(w, a + mb * ABYTES), s, z, dx + mb, asum + mb));
      }
    }
  }
  for (int64_t m = 0; m < M; ++m) store_tile(y + m * ldy, _mm256_loadu_ps(acc + m * TILE));
}

// one row (decode), S tiles side by side (tile[j] -> y[j]), each from its own part of the weights: the
// accumulators stay in registers, and a thread keeps S streams of loads in flight instead of one. Each
// tile's arithmetic is the same, in the same order, whatever S.
template <int S>
void tiles1_avx2(const int8_t* a, const float* dx, const float* asum, int64_t K, int64_t group,
                 const uint8_t* const* tile, float* const* y) {
  const int64_t groups = K / group, per_group = group / BLOCK, gbytes = group_bytes(group);
  __m256 acc[S];
  for (int j = 0; j < S; ++j) acc[j] = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* p[S];
    __m256 s[S], z[S];
    for (int j = 0; j < S; ++j) {
      p[j] = tile[j] + g * gbytes;
      for (int64_t ahead = 0; ahead < gbytes; ahead += 64)
        _mm_prefetch(reinterpret_cast<const char*>(p[j] + W4A8_PREFETCH * gbytes + ahead), _MM_HINT_T0);
      load_scales(p[j], s[j], z[j]);
    }
    for (int64_t i = 0; i < per_group; ++i) {
      const int64_t b = g * per_group + i;
      for (int j = 0; j < S; ++j) {
        Weights w;
        unpack(p[j] + 4 * TILE + i * TILE * 16, w);
        acc[j] = apply(acc[j], dot8(w, a + b * ABYTES), s[j], z[j], dx + b, asum + b);
      }
    }
  }
  for (int j = 0; j < S; ++j) store_tile(y[j], acc[j]);
}

#ifdef W4A8_ZMM
// Prefill rows (PREFILL_ROWS or more): two tiles (16 outputs) per 512-bit vector, tile a in lanes 0..7 and
// tile b in 8..15, each in LANE_OF order. A block of the pair is unpacked once (8 zmm) for a chunk of up to
// ROW_CHUNK rows, and each row's 4 activations go straight from memory into vpdpbusd as a broadcast
// operand: 8 vpdpbusd of 64 products each per row and block, where tile_avx2 runs 8 of 32 for one tile.
// The int32 sums are exact and the fp32 steps (apply) are tile_avx2's, lane for lane, so every output is the
// same bit for bit as tile_avx2's and tile1_avx2's: a row's values do not depend on the batch.
// From 2 rows it measured 0.767x [0.650, 0.905] of tile_avx2's time on one layer in cache but 1.260x [1.204, 1.319]
// at 4 rows streaming 120 layers (a decode step's rows): below 16 rows the weight stream, not the products, decides.
constexpr int64_t PREFILL_ROWS = 16;
constexpr int64_t ROW_CHUNK = 64;  // rows whose activations (64 x K x 2 bytes) stay in L2 while a pair streams

inline __m512 join_ps(__m256 lo, __m256 hi) {
  return _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castpd256_pd512(_mm256_castps_pd(lo)), _mm256_castps_pd(hi), 1));
}

inline __m512i bcast4(const int8_t* act) {  // 4 activations broadcast to every lane (folded into vpdpbusd)
  int32_t v;
  std::memcpy(&v, act, sizeof(v));
  return _mm512_set1_epi32(v);
}

// rows [m0, m0 + rows) of tiles ta and tb (tb == ta: only ta's 8 outputs are stored) into y[m * ldy]
void tile2_zmm(const int8_t* a, const float* dx, const float* asum, int64_t m0, int64_t rows, int64_t K,
               int64_t group, const uint8_t* ta, const uint8_t* tb, float* y, int64_t ldy, float* acc) {
  const int64_t groups = K / group, per_group = group / BLOCK, blocks = K / BLOCK, gbytes = group_bytes(group);
  const __m512i mask = _mm512_set1_epi8(0x0F);
  for (int64_t r = 0; r < rows; ++r) _mm512_storeu_ps(acc + r * 2 * TILE, _mm512_setzero_ps());
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* pa = ta + g * gbytes;
    const uint8_t* pb = tb + g * gbytes;
    for (int64_t ahead = 0; ahead < gbytes; ahead += 64) {
      _mm_prefetch(reinterpret_cast<const char*>(pa + 2 * gbytes + ahead), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(pb + 2 * gbytes + ahead), _MM_HINT_T0);
    }
    __m256 sa, za, sb, zb;
    load_scales(pa, sa, za);
    load_scales(pb, sb, zb);
    const __m512 s = join_ps(sa, sb), zc = join_ps(za, zb);
    for (int64_t i = 0; i < per_group; ++i) {
      const int64_t b = g * per_group + i;
      const uint8_t* qa = pa + 4 * TILE + i * TILE * 16;
      const uint8_t* qb = pb + 4 * TILE + i * TILE * 16;
      __m512i lo[4], hi[4];
      for (int j = 0; j < 4; ++j) {
        const __m512i v = _mm512_inserti64x4(
            _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(qa + 32 * j))),
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qb + 32 * j)), 1);
        lo[j] = _mm512_and_si512(v, mask);
        hi[j] = _mm512_and_si512(_mm512_srli_epi16(v, 4), mask);
      }
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t mb = (m0 + r) * blocks + b;
        const int8_t* act = a + mb * ABYTES;  // [a0..15, a0..15, a16..31, a16..31]
        __m512i dlo = _mm512_setzero_si512(), dhi = _mm512_setzero_si512();
        for (int j = 0; j < 4; ++j) {
          dlo = _mm512_dpbusd_epi32(dlo, lo[j], bcast4(act + 4 * j));
          dhi = _mm512_dpbusd_epi32(dhi, hi[j], bcast4(act + 32 + 4 * j));
        }
        const __m512 inner = _mm512_fmadd_ps(s, _mm512_cvtepi32_ps(_mm512_add_epi32(dlo, dhi)),
                                             _mm512_mul_ps(zc, _mm512_set1_ps(asum[mb])));
        float* out = acc + r * 2 * TILE;
        _mm512_storeu_ps(out, _mm512_fmadd_ps(_mm512_set1_ps(dx[mb]), inner, _mm512_loadu_ps(out)));
      }
    }
  }
  const __m512i order = _mm512_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7, 8, 12, 9, 13, 10, 14, 11, 15);
  for (int64_t r = 0; r < rows; ++r) {
    const __m512 v = _mm512_permutexvar_ps(order, _mm512_loadu_ps(acc + r * 2 * TILE));
    if (tb != ta)
      _mm512_storeu_ps(y + (m0 + r) * ldy, v);
    else
      _mm256_storeu_ps(y + (m0 + r) * ldy, _mm512_castps512_ps256(v));
  }
}

// One row (decode), 2 * P tiles side by side, two to a 512-bit vector (tile[2q] in lanes 0..7, tile[2q + 1] in
// 8..15, as tile2_zmm), each from its own part of the weights, the accumulators in registers. The decode GEMV
// is bound by the loads a core keeps in flight, and one stream per thread left bandwidth unused: on qwen3-4b's
// matrices at g128 (one row, 2 threads, 2-core AMD EPYC Zen 4) a plain read gained with each stream a thread
// adds (1 -> 2 streams 29.7 -> 34.6 GB/s in one run, 4 -> 8 40.6 -> 43.8 in another); this loop with 4 streams
// took 0.719x [0.699, 0.739] of the one-stream loop's time (bench/gemv_ab.py), 8 streams were not clearly
// better than 4 (0.73x / 0.81x in one run, 0.89x / 0.87x in another), and software prefetching on top of
// several streams measured slower (load slots taken, no more bandwidth), so there is none here. The arithmetic
// is tile2_zmm's for one row: every output the same bit for bit as tiles1_avx2's.
constexpr int ROW_STREAMS = 4;  // tiles a thread streams at once in the one-row loop (2 vectors)

template <int P>
void tiles1_zmm(const int8_t* a, const float* dx, const float* asum, int64_t K, int64_t group,
                const uint8_t* const* tile, float* const* y) {
  const int64_t groups = K / group, per_group = group / BLOCK, gbytes = group_bytes(group);
  const __m512i mask = _mm512_set1_epi8(0x0F);
  __m512 acc[P];
  for (int q = 0; q < P; ++q) acc[q] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* p[2 * P];
    for (int j = 0; j < 2 * P; ++j) p[j] = tile[j] + g * gbytes;
    __m512 s[P], zc[P];
    for (int q = 0; q < P; ++q) {
      __m256 sa, za, sb, zb;
      load_scales(p[2 * q], sa, za);
      load_scales(p[2 * q + 1], sb, zb);
      s[q] = join_ps(sa, sb), zc[q] = join_ps(za, zb);
    }
    for (int64_t i = 0; i < per_group; ++i) {
      const int64_t b = g * per_group + i;
      const int8_t* act = a + b * ABYTES;  // [a0..15, a0..15, a16..31, a16..31]
      for (int q = 0; q < P; ++q) {
        const uint8_t* qa = p[2 * q] + 4 * TILE + i * TILE * 16;
        const uint8_t* qb = p[2 * q + 1] + 4 * TILE + i * TILE * 16;
        __m512i dlo = _mm512_setzero_si512(), dhi = _mm512_setzero_si512();
        for (int j = 0; j < 4; ++j) {
          const __m512i v = _mm512_inserti64x4(
              _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(qa + 32 * j))),
              _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qb + 32 * j)), 1);
          dlo = _mm512_dpbusd_epi32(dlo, _mm512_and_si512(v, mask), bcast4(act + 4 * j));
          dhi = _mm512_dpbusd_epi32(dhi, _mm512_and_si512(_mm512_srli_epi16(v, 4), mask), bcast4(act + 32 + 4 * j));
        }
        const __m512 inner = _mm512_fmadd_ps(s[q], _mm512_cvtepi32_ps(_mm512_add_epi32(dlo, dhi)),
                                             _mm512_mul_ps(zc[q], _mm512_set1_ps(asum[b])));
        acc[q] = _mm512_fmadd_ps(_mm512_set1_ps(dx[b]), inner, acc[q]);
      }
    }
  }
  const __m512i order = _mm512_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7, 8, 12, 9, 13, 10, 14, 11, 15);
  for (int q = 0; q < P; ++q) {
    const __m512 v = _mm512_permutexvar_ps(order, acc[q]);
    _mm256_storeu_ps(y[2 * q], _mm512_castps512_ps256(v));
    _mm256_storeu_ps(y[2 * q + 1], _mm512_extractf32x8_ps(v, 1));
  }
}
#endif

#endif

// ---------------------------------------------------------------------------------------------------
// w8a8_mm: int8 weights per output channel (w = q * s_n, q -127..127) x the same int8 activations:
//     y = s_n * sum over blocks b of dx_b * sum_k a_k q_k
// Layout (modules.pack_w8a8): int8 [N/8, K/32, 8 x 32], per tile and block the 8 outputs' 32 weights;
// scales fp32 [N]. AVX2: vpsignb moves each weight's sign onto the activation (|q| x a, exact in int16:
// 2 x 127 x 127 < 32767), vpmaddubsw / vpmaddwd, then the 8 outputs' lanes reduced into one vector.
void tile8_scalar(const int8_t* a, const float* dx, int64_t M, int64_t K, const int8_t* tile, const float* scale,
                  float* y, int64_t ldy) {
  const int64_t blocks = K / BLOCK;
  for (int64_t m = 0; m < M; ++m) {
    float acc[TILE] = {0.f};
    for (int64_t b = 0; b < blocks; ++b) {
      const int8_t* av = a + (m * blocks + b) * ABYTES;  // [a0..15, a0..15, a16..31, a16..31]
      for (int64_t t = 0; t < TILE; ++t) {
        const int8_t* q = tile + (b * TILE + t) * BLOCK;
        int32_t dot = 0;
        for (int64_t j = 0; j < 16; ++j) dot += int32_t(av[j]) * q[j] + int32_t(av[32 + j]) * q[16 + j];
        acc[t] += dx[m * blocks + b] * static_cast<float>(dot);
      }
    }
    for (int64_t t = 0; t < TILE; ++t) y[m * ldy + t] = acc[t] * scale[t];
  }
}

#ifdef W4A8_AVX2
void tile8_avx2(const int8_t* a, const float* dx, int64_t M, int64_t K, const int8_t* tile, const float* scale,
                float* y, int64_t ldy, float* acc) {
  const int64_t blocks = K / BLOCK;
  const __m256i ones = _mm256_set1_epi16(1);
  for (int64_t m = 0; m < M; ++m) _mm256_storeu_ps(acc + m * TILE, _mm256_setzero_ps());
  for (int64_t b = 0; b < blocks; ++b) {
    const int8_t* q = tile + b * TILE * BLOCK;
    _mm_prefetch(reinterpret_cast<const char*>(q + 4 * TILE * BLOCK), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(q + 4 * TILE * BLOCK + 64), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(q + 4 * TILE * BLOCK + 128), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(q + 4 * TILE * BLOCK + 192), _MM_HINT_T0);
    __m256i w[TILE], mag[TILE];
    for (int t = 0; t < TILE; ++t) {
      w[t] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + t * BLOCK));
      mag[t] = _mm256_sign_epi8(w[t], w[t]);
    }
    for (int64_t m = 0; m < M; ++m) {
      const int8_t* act = a + (m * blocks + b) * ABYTES;
      const __m256i av = _mm256_permute2x128_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(act)),
                                                   _mm256_loadu_si256(reinterpret_cast<const __m256i*>(act + 32)), 0x20);
      __m256i d[TILE];
      for (int t = 0; t < TILE; ++t)
        d[t] = _mm256_madd_epi16(_mm256_maddubs_epi16(mag[t], _mm256_sign_epi8(av, w[t])), ones);
      const __m256i u0 = _mm256_hadd_epi32(_mm256_hadd_epi32(d[0], d[1]), _mm256_hadd_epi32(d[2], d[3]));
      const __m256i u1 = _mm256_hadd_epi32(_mm256_hadd_epi32(d[4], d[5]), _mm256_hadd_epi32(d[6], d[7]));
      const __m256i dot = _mm256_add_epi32(_mm256_permute2x128_si256(u0, u1, 0x20), _mm256_permute2x128_si256(u0, u1, 0x31));
      float* out = acc + m * TILE;
      _mm256_storeu_ps(out, _mm256_fmadd_ps(_mm256_set1_ps(dx[m * blocks + b]), _mm256_cvtepi32_ps(dot), _mm256_loadu_ps(out)));
    }
  }
  const __m256 s = _mm256_loadu_ps(scale);
  for (int64_t m = 0; m < M; ++m) _mm256_storeu_ps(y + m * ldy, _mm256_mul_ps(_mm256_loadu_ps(acc + m * TILE), s));
}

#ifdef W4A8_ZMM
// The same with 512-bit vectors, for up to ZMM_ROWS rows: each zmm holds two outputs' 32 weights, flipped to
// unsigned (q + 128, one xor) for vpdpbusd against the row's 32 activations in both halves; the block's sum
// is then sum (q + 128) a - 128 sum a, taken in fp32 where it is exact (every term < 2^24). The 8 outputs'
// lanes are reduced with in-lane unpacks (no horizontal adds) into the w4a8 lane order (LANE_OF). The int32
// sums and the fp32 steps are tile8_avx2's, so the values are the same bit for bit. Measured against
// tile8_avx2 on SmolLM2's head (576 -> 49152), interleaved, 2 threads, a 2-core AVX-512 VNNI Xeon: 0.857x
// [0.825, 0.889] of its time at 1 row, 0.689x [0.662, 0.717] at 4 (bench/native_ab.py --parts w8a8). The
// same 512-bit route for w4a8 (pre-broadcast activations, high nibbles masked in place) measured 0.988x
// [0.958, 1.020] at 1 row and 1.140x [1.124, 1.156] at 4, so w4a8 keeps its 256-bit loop.
constexpr int64_t ZMM_ROWS = 8;

void tile8_zmm(const int8_t* a, const float* dx, const float* asum, int64_t M, int64_t K, const int8_t* tile,
               const float* scale, float* y, int64_t ldy) {
  const int64_t blocks = K / BLOCK;
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
  const __m256 bias = _mm256_set1_ps(128.f);
  __m256 acc[ZMM_ROWS];
  for (int64_t m = 0; m < M; ++m) acc[m] = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const int8_t* q = tile + b * TILE * BLOCK;
    for (int ahead = 0; ahead < 256; ahead += 64)
      _mm_prefetch(reinterpret_cast<const char*>(q + 4 * TILE * BLOCK + ahead), _MM_HINT_T0);
    __m512i w[4];
    for (int j = 0; j < 4; ++j) w[j] = _mm512_xor_si512(_mm512_loadu_si512(q + 64 * j), flip);
    for (int64_t m = 0; m < M; ++m) {
      const int64_t mb = m * blocks + b;
      const __m512i act = _mm512_loadu_si512(a + mb * ABYTES);  // [a0..15, a0..15, a16..31, a16..31]
      const __m512i both = _mm512_shuffle_i64x2(act, act, _MM_SHUFFLE(2, 0, 2, 0));  // [a0..31, a0..31]
      __m512i d[4];
      for (int j = 0; j < 4; ++j) d[j] = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w[j], both);
      // per 128 bits: d0 d1 -> p, d2 d3 -> r: then each 128 bits holds one chunk's sum of d0, d1, d2, d3
      const __m512i p01 = _mm512_add_epi32(_mm512_unpacklo_epi32(d[0], d[1]), _mm512_unpackhi_epi32(d[0], d[1]));
      const __m512i p23 = _mm512_add_epi32(_mm512_unpacklo_epi32(d[2], d[3]), _mm512_unpackhi_epi32(d[2], d[3]));
      const __m512i r = _mm512_add_epi32(_mm512_unpacklo_epi64(p01, p23), _mm512_unpackhi_epi64(p01, p23));
      // chunks 0, 1: outputs 0 2 4 6; chunks 2, 3: outputs 1 3 5 7
      const __m256i dot = _mm256_add_epi32(_mm512_castsi512_si256(_mm512_shuffle_i64x2(r, r, _MM_SHUFFLE(3, 1, 2, 0))),
                                           _mm512_castsi512_si256(_mm512_shuffle_i64x2(r, r, _MM_SHUFFLE(2, 0, 3, 1))));
      const __m256 exact = _mm256_fnmadd_ps(_mm256_broadcast_ss(asum + mb), bias, _mm256_cvtepi32_ps(dot));
      acc[m] = _mm256_fmadd_ps(_mm256_set1_ps(dx[mb]), exact, acc[m]);
    }
  }
  const __m256 s = _mm256_loadu_ps(scale);
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  for (int64_t m = 0; m < M; ++m) _mm256_storeu_ps(y + m * ldy, _mm256_mul_ps(_mm256_permutevar8x32_ps(acc[m], order), s));
}
#endif
#endif

}  // namespace

namespace {

struct Activations {
  const int8_t* a;
  const float* dx;
  const float* asum;
};

// x [M, K] quantized into the calling thread's scratch (no allocation per call once grown)
Activations quantize_input(const float* x, int64_t M, int64_t K) {
  const int64_t blocks = K / BLOCK;
  thread_local std::vector<int8_t> a;
  thread_local std::vector<float> dx;
  thread_local std::vector<float> asum;
  a.resize(std::max<size_t>(a.size(), M * blocks * ABYTES));
  dx.resize(std::max<size_t>(dx.size(), M * blocks));
  asum.resize(std::max<size_t>(asum.size(), M * blocks));
  quantize_rows(x, M, K, a.data(), dx.data(), asum.data());
  return {a.data(), dx.data(), asum.data()};
}

// rows 0..M-1 of one tile: 8 outputs of each row to y[m * ldy], acc [M * TILE] scratch
inline void tile_rows(const Activations& act, int64_t M, int64_t K, int64_t group, const uint8_t* tile, float* y,
                      int64_t ldy, float* acc) {
#ifdef W4A8_AVX2
  if (M == 1)
    tiles1_avx2<1>(act.a, act.dx, act.asum, K, group, &tile, &y);
  else
    tile_avx2(act.a, act.dx, act.asum, M, K, group, tile, y, ldy, acc);
#else
  tile_scalar(act.a, act.dx, act.asum, M, K, group, tile, y, ldy);
#endif
}

// One row through a thread's tiles [begin, end) (tile(t): its weights, out(t): its 8 outputs), the range cut
// into S equal parts run side by side, tile begin + j with begin + chunk + j, ...: S streams of weights instead
// of one (S = ROW_STREAMS with AVX-512, tiles1_zmm; 2 on AVX2, tiles1_avx2), the last (end - begin) % S tiles one
// by one. Returns false where there is no AVX2 loop (the caller runs tile by tile).
template <class Tile, class Out>
inline bool one_row(const Activations& act, int64_t K, int64_t group, int64_t begin, int64_t end, Tile tile, Out out) {
#ifdef W4A8_AVX2
#ifdef W4A8_ZMM
  constexpr int S = ROW_STREAMS;
#else
  constexpr int S = 2;
#endif
  const int64_t chunk = (end - begin) / S;
  for (int64_t j = 0; j < chunk; ++j) {
    const uint8_t* w[S];
    float* y[S];
    for (int c = 0; c < S; ++c) w[c] = tile(begin + c * chunk + j), y[c] = out(begin + c * chunk + j);
#ifdef W4A8_ZMM
    tiles1_zmm<S / 2>(act.a, act.dx, act.asum, K, group, w, y);
#else
    tiles1_avx2<S>(act.a, act.dx, act.asum, K, group, w, y);
#endif
  }
  for (int64_t t = begin + S * chunk; t < end; ++t) {
    const uint8_t* w = tile(t);
    float* y = out(t);
    tiles1_avx2<1>(act.a, act.dx, act.asum, K, group, &w, &y);
  }
  return true;
#else
  (void)act, (void)K, (void)group, (void)begin, (void)end, (void)tile, (void)out;
  return false;
#endif
}

// The prefill loop: rows x up to 4 matrices, the work split over threads by pairs of tiles (a matrix with an odd
// count of tiles ends in a single); each thread runs its pairs for one chunk of rows, then the next chunk,
// so its weights come back from cache while the chunk's activations stay near.
bool prefill_rows(const Activations& act, int64_t M, int64_t K, int64_t group, int count,
                  const uint8_t* const* packed, const int64_t* tiles, float* const* y) {
#ifdef W4A8_ZMM
  if (M < PREFILL_ROWS) return false;
  const int64_t tile_bytes = (K / group) * group_bytes(group);
  int64_t start[5] = {0};
  for (int i = 0; i < count; ++i) start[i + 1] = start[i] + (tiles[i] + 1) / 2;
  at::parallel_for(0, start[count], 1, [&](int64_t begin, int64_t end) {
    thread_local std::vector<float> acc;
    acc.resize(std::max<size_t>(acc.size(), ROW_CHUNK * 2 * TILE));
    for (int64_t m0 = 0; m0 < M; m0 += ROW_CHUNK) {
      const int64_t rows = std::min(ROW_CHUNK, M - m0);
      int mat = 0;
      for (int64_t p = begin; p < end; ++p) {
        while (p >= start[mat + 1]) ++mat;
        const int64_t first = 2 * (p - start[mat]), second = std::min(first + 1, tiles[mat] - 1);
        tile2_zmm(act.a, act.dx, act.asum, m0, rows, K, group, packed[mat] + first * tile_bytes,
                  packed[mat] + second * tile_bytes, y[mat] + first * TILE, tiles[mat] * TILE, acc.data());
      }
    }
  });
  return true;
#else
  (void)act, (void)M, (void)K, (void)group, (void)count, (void)packed, (void)tiles, (void)y;
  return false;
#endif
}

}  // namespace

void w4a8_rows_multi(const float* x, int64_t M, int64_t K, int64_t group, int count, const uint8_t* const* packed,
                     const int64_t* tiles, float* const* y) {
  TORCH_CHECK(count >= 1 && count <= 4 && M >= 0 && group >= BLOCK && group % BLOCK == 0 && K % group == 0,
              "w4a8_rows_multi: bad shapes");
  if (M == 0) return;
  const Activations act = quantize_input(x, M, K);
  if (prefill_rows(act, M, K, group, count, packed, tiles, y)) return;
  const int64_t tile_bytes = (K / group) * group_bytes(group);
  int64_t start[5] = {0};
  for (int i = 0; i < count; ++i) start[i + 1] = start[i] + tiles[i];
  at::parallel_for(0, start[count], 1, [&](int64_t begin, int64_t end) {
    if (M == 1) {
      auto matrix = [&](int64_t t) {
        int m = 0;
        while (t >= start[m + 1]) ++m;
        return m;
      };
      auto tile = [&](int64_t t) { const int m = matrix(t); return packed[m] + (t - start[m]) * tile_bytes; };
      auto out = [&](int64_t t) { const int m = matrix(t); return y[m] + (t - start[m]) * TILE; };
      if (one_row(act, K, group, begin, end, tile, out)) return;
    }
    thread_local std::vector<float> acc;
    acc.resize(std::max<size_t>(acc.size(), M * TILE));
    int m = 0;
    for (int64_t t = begin; t < end; ++t) {
      while (t >= start[m + 1]) ++m;
      const int64_t local = t - start[m];
      tile_rows(act, M, K, group, packed[m] + local * tile_bytes, y[m] + local * TILE, tiles[m] * TILE, acc.data());
    }
  });
}

// x [M, K] fp32; packed [N/8, K/group, 32 + 4 * group] uint8 (the layout above) -> y [M, N] fp32
at::Tensor w4a8_mm(const at::Tensor& x, const at::Tensor& packed, int64_t group) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "w4a8_mm: x must be [M, K] float32");
  TORCH_CHECK(packed.dim() == 3 && packed.scalar_type() == at::kByte, "w4a8_mm: packed must be uint8 [N/8, K/group, bytes]");
  TORCH_CHECK(group >= BLOCK && group % BLOCK == 0 && group <= (int64_t{1} << 20), "w4a8_mm: group must be a positive "
              "multiple of ", BLOCK, ", got ", group);
  TORCH_CHECK(packed.size(2) == group_bytes(group), "w4a8_mm: packed does not hold groups of ", group);
  const int64_t M = x.size(0), K = x.size(1), N = packed.size(0) * TILE;
  TORCH_CHECK(packed.size(1) * group == K, "w4a8_mm: x has ", K, " inputs, the weights ", packed.size(1) * group);
  auto xc = x.contiguous();
  auto pc = packed.contiguous();
  auto y = at::empty({M, N}, x.options());
  const Activations act = quantize_input(xc.data_ptr<float>(), M, K);
  const uint8_t* pp = pc.data_ptr<uint8_t>();
  const int64_t tile_bytes = packed.size(1) * packed.size(2);
  float* yp = y.data_ptr<float>();
  const int64_t tiles = N / TILE;
  if (prefill_rows(act, M, K, group, 1, &pp, &tiles, &yp)) return y;
  // its own loop, not w4a8_rows_multi's: that measured 1.048x [1.001, 1.098] of this one's time at one row
  at::parallel_for(0, N / TILE, 1, [&](int64_t begin, int64_t end) {
    if (M == 1 && one_row(act, K, group, begin, end, [&](int64_t t) { return pp + t * tile_bytes; },
                          [&](int64_t t) { return yp + t * TILE; }))
      return;
    thread_local std::vector<float> acc;
    acc.resize(std::max<size_t>(acc.size(), M * TILE));
    for (int64_t tile = begin; tile < end; ++tile)
      tile_rows(act, M, K, group, pp + tile * tile_bytes, yp + tile * TILE, N, acc.data());
  });
  return y;
}

// x [M, K] fp32; packed int8 [N/8, K/32, 256] (w8a8's layout); scale fp32 [N] -> y [M, N] fp32
at::Tensor w8a8_mm(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "w8a8_mm: x must be [M, K] float32");
  TORCH_CHECK(packed.dim() == 3 && packed.scalar_type() == at::kChar && packed.size(2) == TILE * BLOCK,
              "w8a8_mm: packed must be int8 [N/8, K/32, 256]");
  const int64_t M = x.size(0), K = x.size(1), N = packed.size(0) * TILE;
  TORCH_CHECK(packed.size(1) * BLOCK == K, "w8a8_mm: x has ", K, " inputs, the weights ", packed.size(1) * BLOCK);
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.numel() == N, "w8a8_mm: scale must be float32 [N]");
  auto xc = x.contiguous();
  auto pc = packed.contiguous();
  auto sc = scale.contiguous();
  auto y = at::empty({M, N}, x.options());
  w8a8_rows(xc.data_ptr<float>(), M, K, pc.data_ptr<int8_t>(), sc.data_ptr<float>(), N, y.data_ptr<float>());
  return y;
}

void w8a8_rows(const float* x, int64_t M, int64_t K, const int8_t* packed, const float* scale, int64_t N, float* y) {
  TORCH_CHECK(M >= 0 && K % BLOCK == 0 && N % TILE == 0, "w8a8_rows: bad shapes");
  if (M == 0) return;
  const Activations act = quantize_input(x, M, K);
  const int64_t tile_bytes = K * TILE, tiles = N / TILE;
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    thread_local std::vector<float> acc;
    acc.resize(std::max<size_t>(acc.size(), M * TILE));
    for (int64_t tile = begin; tile < end; ++tile) {
#if defined(W4A8_ZMM)
      if (M <= ZMM_ROWS) {
        tile8_zmm(act.a, act.dx, act.asum, M, K, packed + tile * tile_bytes, scale + tile * TILE, y + tile * TILE, N);
        continue;
      }
#endif
#ifdef W4A8_AVX2
      tile8_avx2(act.a, act.dx, M, K, packed + tile * tile_bytes, scale + tile * TILE, y + tile * TILE, N, acc.data());
#else
      tile8_scalar(act.a, act.dx, M, K, packed + tile * tile_bytes, scale + tile * TILE, y + tile * TILE, N);
#endif
    }
  });
}

const char* w4a8_isa() {
#if defined(W4A8_ZMM)
  return "avx512";
#elif defined(W4A8_AVX2)
  return "avx2";
#else
  return "scalar";
#endif
}


// A plain read of every byte of `tensors`: the roofline probe's read (env.read_gb_s). The bytes are split over
// torch's threads like the decode GEMV splits its tiles, and each thread reads its share as 4 streams in
// lockstep with the widest loads this build has (the GEMV's access pattern), folding them into an XOR so the
// loads cannot be dropped. Returns that checksum (the XOR of every 8-byte word, the tail bytes zero-padded).
static int64_t stream_read(const std::vector<at::Tensor>& tensors) {
  uint64_t total = 0;
  for (const auto& t : tensors) {
    TORCH_CHECK(t.device().is_cpu() && t.is_contiguous(), "stream_read: contiguous CPU tensors only");
    const uint8_t* base = static_cast<const uint8_t*>(t.data_ptr());
    const int64_t nbytes = t.numel() * static_cast<int64_t>(t.element_size());
    const int64_t blocks = nbytes / 64;
    std::vector<uint64_t> parts(std::max<int64_t>(1, at::get_num_threads()) * 8, 0);
    at::parallel_for(0, blocks, 1 << 12, [&](int64_t begin, int64_t end) {
      const int64_t n = end - begin, q = n / 4;
      const uint8_t* s0 = base + begin * 64;
      const uint8_t* s1 = s0 + q * 64;
      const uint8_t* s2 = s1 + q * 64;
      const uint8_t* s3 = s2 + q * 64;
      uint64_t folded = 0;
#if defined(W4A8_ZMM)
      __m512i a0 = _mm512_setzero_si512(), a1 = a0, a2 = a0, a3 = a0;
      for (int64_t i = 0; i < q; ++i) {
        a0 = _mm512_xor_si512(a0, _mm512_loadu_si512(s0 + i * 64));
        a1 = _mm512_xor_si512(a1, _mm512_loadu_si512(s1 + i * 64));
        a2 = _mm512_xor_si512(a2, _mm512_loadu_si512(s2 + i * 64));
        a3 = _mm512_xor_si512(a3, _mm512_loadu_si512(s3 + i * 64));
      }
      alignas(64) uint64_t lanes[8];
      _mm512_store_si512(lanes, _mm512_xor_si512(_mm512_xor_si512(a0, a1), _mm512_xor_si512(a2, a3)));
      for (uint64_t lane : lanes) folded ^= lane;
#elif defined(W4A8_AVX2)
      __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0;
      for (int64_t i = 0; i < q; ++i) {
        for (int h = 0; h < 64; h += 32) {
          a0 = _mm256_xor_si256(a0, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s0 + i * 64 + h)));
          a1 = _mm256_xor_si256(a1, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s1 + i * 64 + h)));
          a2 = _mm256_xor_si256(a2, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s2 + i * 64 + h)));
          a3 = _mm256_xor_si256(a3, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s3 + i * 64 + h)));
        }
      }
      alignas(32) uint64_t lanes[4];
      _mm256_store_si256(reinterpret_cast<__m256i*>(lanes),
                         _mm256_xor_si256(_mm256_xor_si256(a0, a1), _mm256_xor_si256(a2, a3)));
      for (uint64_t lane : lanes) folded ^= lane;
#else
      for (int64_t i = 0; i < 4 * q * 8; ++i) {
        uint64_t word;
        std::memcpy(&word, s0 + i * 8, 8);
        folded ^= word;
      }
#endif
      for (const uint8_t* p = s0 + 4 * q * 64; p < base + end * 64; p += 8) {  // the share's last n - 4q blocks
        uint64_t word;
        std::memcpy(&word, p, 8);
        folded ^= word;
      }
      parts[at::get_thread_num() * 8] ^= folded;
    });
    for (size_t i = 0; i < parts.size(); i += 8) total ^= parts[i];
    uint64_t tail = 0;  // the bytes after the last whole block, 8 at a time, zero-padded
    for (int64_t off = blocks * 64; off < nbytes; off += 8) {
      uint64_t word = 0;
      std::memcpy(&word, base + off, std::min<int64_t>(8, nbytes - off));
      tail ^= word;
    }
    total ^= tail;
  }
  return static_cast<int64_t>(total);
}

TORCH_LIBRARY_FRAGMENT(infer_tune_native, m) {
  m.def("w4a8_mm(Tensor x, Tensor packed, int group) -> Tensor");
  m.def("w8a8_mm(Tensor x, Tensor packed, Tensor scale) -> Tensor");
  m.def("isa() -> str", []() { return std::string(w4a8_isa()); });
  m.def("stream_read(Tensor[] tensors) -> int", &stream_read);
  m.def("w4a8_prefill_rows() -> int", []() -> int64_t {  // from this many rows w4a8 runs tile2_zmm; 0: never
#ifdef W4A8_ZMM
    return PREFILL_ROWS;
#else
    return 0;
#endif
  });
}

TORCH_LIBRARY_IMPL(infer_tune_native, CPU, m) {
  m.impl("w4a8_mm", &w4a8_mm);
  m.impl("w8a8_mm", &w8a8_mm);
}
