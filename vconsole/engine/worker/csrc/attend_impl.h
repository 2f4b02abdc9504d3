// The decode-attention kernels' code, included once by each store's translation unit
// (attend_<store>.cpp), which instantiates `run` for its store only.
//
// One query token per sequence attends over its context, whose K/V rows live in the pool's
// blocks in the order its block table gives. transformers' and torch's attention need the
// context contiguous, so the pure-torch path first gathers every block (index_select) and then
// reads the copy again in SDPA; this kernel reads each K and V row once, where it lies.
//
// Work is one job per (row, KV head) on torch's thread pool (at::parallel_for), so a handful of
// rows still keeps every thread busy. For the usual shapes (G = 1..8 query heads per KV head,
// head_dim 64 or 128) the shape is a template argument: the G queries and the G x D output
// accumulators live in registers, each K and V row is loaded once for all G heads, and the
// positions are walked block by block (no division per key). Other shapes take the same two
// passes with plain loops. Softmax is the usual max-subtracted one in float32; built with
// -ffast-math so that the dot products, exp and sums vectorize (results agree with SDPA to float
// rounding, not bit for bit). On SmolLM2's shape (G 3, D 64) the fixed path takes about half the
// CPU time of plain loops with the context in cache; from DRAM the kernel is bound by memory
// (per key and KV head it reads 2 x D floats for 4 x G x D flops).
//
// Quantized pools (`kv_quant.py`) take the same passes with the rows stored as integers plus a
// float32 scale (int8: x = s q) or scale and minimum (int4: x = lo + s q, two values per byte,
// element j in the low nibble of byte j and element j + D/2 in the high one) per slot and KV
// head. Each row is widened to float in registers and the parameters are folded into scalars:
// q.k = s (q.q_k) + lo sum(q), and sum_p w_p v_p = sum_p (w_p s_p) q_p + sum_p w_p lo_p. Nothing
// is dequantized into memory. The int8 row is a quarter of the float32 row's bytes, int4 an
// eighth. An int4_kivi pool (`kv_open_blocks.py`) rounds keys per channel over a block instead:
// a sealed block's channel scales multiply the queries once per block, q.k = (q * s).q_k + q.lo;
// a block still filling is read from its staging entry (`entry_of[block] >= 0`): int8 rows
// with a scale per row (int4_kivi), or float16 rows (int8_kivi). An int8_kivi pool (kKIVI8) is
// the same with int8 keys and a scale per channel only, q.k = (q * s).q_k, and values as an int8
// pool's. Both per-channel pools keep their values' parameters in float16.

#pragma once

#include "attention.h"

#include <ATen/Parallel.h>

#if defined(__AVX512F__) || defined(__F16C__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <limits>
#include <utility>
#include <vector>

namespace vc {
namespace {

// One register of floats, any alignment, in GCC's vector extension so that the fixed-shape path
// needs no intrinsics: 16 floats (one AVX-512 register) where the compiler targets AVX-512, else
// 8 (one AVX2 register, two NEON ones). 16 floats on AVX2 (each operation split in two by GCC)
// took twice the compile, 30 s of CPU more for the fixed-shape instances, and ran 3-7x slower.
#if defined(__AVX512F__)
typedef float vf __attribute__((vector_size(64), aligned(4)));
constexpr int64_t kLanes = 16;
#else
typedef float vf __attribute__((vector_size(32), aligned(4)));
constexpr int64_t kLanes = 8;
#endif

// kLanes integers widened to kLanes floats. GCC 12 scalarises a one-step int8 -> float
// __builtin_convertvector (a scalar convert per value, 4x slower than reading float32), so on
// AVX-512 these are the sign/zero-extending moves and one convert each; elsewhere the widening
// goes through int32 first, which GCC does vectorise.
#if defined(__AVX512F__)
inline vf as_vf(__m512 x) { return reinterpret_cast<vf&>(x); }
inline vf widen_i8(const char* p) {
  return as_vf(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
      _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))));
}
// 16 bytes of two nibbles each: the low nibbles' 16 values and the high nibbles'.
inline void widen_u4(const char* p, vf& lo, vf& hi) {
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m128i m = _mm_set1_epi8(15);
  lo = as_vf(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(b, m))));
  hi = as_vf(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(b, 4), m))));
}
inline vf widen_f16(const c10::Half* p) {
  return as_vf(_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))));
}
#else
typedef int8_t vi8 __attribute__((vector_size(kLanes), aligned(1)));
typedef uint8_t vu8 __attribute__((vector_size(kLanes), aligned(1)));
typedef int32_t vi32 __attribute__((vector_size(kLanes * 4)));
inline vf widen_i8(const char* p) {
  return __builtin_convertvector(
      __builtin_convertvector(*reinterpret_cast<const vi8*>(p), vi32), vf);
}
// kLanes bytes of two nibbles each: the low nibbles' values and the high nibbles'.
inline void widen_u4(const char* p, vf& lo, vf& hi) {
  const vu8 b = *reinterpret_cast<const vu8*>(p);
  lo = __builtin_convertvector(__builtin_convertvector(b & 15, vi32), vf);
  hi = __builtin_convertvector(__builtin_convertvector(b >> 4, vi32), vf);
}
#if defined(__F16C__)
inline vf widen_f16(const c10::Half* p) {
  const __m256 x = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return reinterpret_cast<const vf&>(x);
}
#else
inline vf widen_f16(const c10::Half* p) {
  vf x;
  for (int l = 0; l < kLanes; ++l) x[l] = static_cast<float>(p[l]);
  return x;
}
#endif
#endif

inline float hsum(vf v) {
  float s = 0.f;
  for (int l = 0; l < kLanes; ++l) s += v[l];
  return s;
}

// Rows of per-channel key parameters per (block, KV head): scale and minimum, or the scale only.
template <Store S>
constexpr int64_t kChannelRows = S == kKIVI ? 2 : 1;

// The parameters of KV head h of a sealed kKIVI / kKIVI8 block as float vectors (kKIVI8: no
// minimum, `lo` is left alone).
template <Store S, int DV>
inline void channel_params(const Pool& pool, int64_t blk, int64_t h, vf* scale, vf* lo) {
  const c10::Half* pc = pool.kc + (blk * pool.kvh + h) * kChannelRows<S> * pool.d;
  for (int c = 0; c < DV; ++c) {
    scale[c] = widen_f16(pc + c * kLanes);
    if constexpr (S == kKIVI) lo[c] = widen_f16(pc + pool.d + c * kLanes);
  }
}

// The index of a staged (open) key row of a kKIVI / kKIVI8 pool, in rows of D.
inline int64_t staged_index(const Pool& pool, int64_t entry, int64_t bs, int64_t off,
                            int64_t h) {
  return (entry * bs + off) * pool.kvh + h;
}

// A staged key row as DV float vectors and the scale its dot products take: float16 rows as
// they are, int8 rows in integer units with their row's scale.
template <int DV>
inline float load_staged(const Pool& pool, int64_t entry, int64_t bs, int64_t off, int64_t h,
                         vf* k) {
  const int64_t i = staged_index(pool, entry, bs, off, h);
  if (pool.stage8 != nullptr) {
    const char* r = reinterpret_cast<const char*>(pool.stage8 + i * pool.d);
    for (int c = 0; c < DV; ++c) k[c] = widen_i8(r + c * kLanes);
    return pool.stage_scale[i];
  }
  const c10::Half* r = pool.stage + i * pool.d;
  for (int c = 0; c < DV; ++c) k[c] = widen_f16(r + c * kLanes);
  return 1.f;
}

// The values' scale and minimum of a slot and KV head: float32 parameters, or (kKIVI, kKIVI8)
// float16 ones.
template <Store S>
inline void value_params(const Pool& pool, int64_t slot, int64_t h, float& vs, float& vl) {
  const int64_t at = slot * pool.slot_params + h * pool.head_params;
  if constexpr (S == kKIVI || S == kKIVI8) {
    vs = static_cast<float>(pool.vph[at]);
    if constexpr (S == kKIVI) vl = static_cast<float>(pool.vph[at + 1]);
  } else {
    vs = pool.vp[at];
    if constexpr (S == kI4) vl = pool.vp[at + 1];
  }
}

// Row `slot` of KV head `h` widened to DV float vectors (still in its integer units: the
// parameters are applied by the caller).
template <Store S, int DV>
inline void load_row(const char* base, int64_t slot, int64_t h, const Pool& pool, vf* x) {
  const char* r = base + slot * pool.slot_bytes + h * pool.head_bytes;
  if constexpr (S == kF32) {
    for (int c = 0; c < DV; ++c) x[c] = *reinterpret_cast<const vf*>(r + c * kLanes * 4);
  } else if constexpr (S == kI8) {
    for (int c = 0; c < DV; ++c) x[c] = widen_i8(r + c * kLanes);
  } else {
    for (int c = 0; c < DV / 2; ++c) widen_u4(r + c * kLanes, x[c], x[c + DV / 2]);
  }
}

// One (row, KV head) with G query heads and head_dim D = kLanes * DV known at compile time: the
// queries and the G x D output accumulators stay in registers, each K and V row is loaded once
// for all G heads.
template <Store S, int G, int DV>
void attend_fixed(const float* __restrict qh, const Pool& pool, const int64_t* table,
                  int64_t first, int64_t len, int64_t bs, int64_t h, float scale,
                  std::vector<float>& scores, float* __restrict out) {
  const int64_t span = len - first;
  scores.resize(static_cast<size_t>(G * span));
  float* __restrict sc = scores.data();
  vf q[G][DV];
  float qsum[G];
  for (int j = 0; j < G; ++j) {
    vf acc{};
    for (int c = 0; c < DV; ++c) {
      q[j][c] = *reinterpret_cast<const vf*>(qh + (j * DV + c) * kLanes);
      acc += q[j][c];
    }
    qsum[j] = hsum(acc);
  }
  float m[G];
  for (int j = 0; j < G; ++j) m[j] = -std::numeric_limits<float>::infinity();
  if constexpr (S == kKIVI || S == kKIVI8) {
    // Keys block by block: an open block's from staging (float), a sealed one's through its
    // channel parameters folded into the queries: q.k = (q * s).q_k + q.lo.
    for (int64_t b = first / bs, p = first; p < len; ++b) {
      const int64_t stop = std::min(len, (b + 1) * bs);
      const int64_t blk = table[b];
      const int64_t entry = pool.entry_of[blk];
      if (entry >= 0) {
        for (; p < stop; ++p) {
          vf k[DV];
          const float ks = load_staged<DV>(pool, entry, bs, p - b * bs, h, k) * scale;
          for (int j = 0; j < G; ++j) {
            vf acc = q[j][0] * k[0];
            for (int c = 1; c < DV; ++c) acc += q[j][c] * k[c];
            const float s = hsum(acc) * ks;
            sc[j * span + (p - first)] = s;
            m[j] = std::max(m[j], s);
          }
        }
        continue;
      }
      vf cs[DV], cl[DV], qs[G][DV];
      float qlo[G];
      channel_params<S, DV>(pool, blk, h, cs, cl);
      for (int j = 0; j < G; ++j) {
        vf acc{};
        for (int c = 0; c < DV; ++c) {
          qs[j][c] = q[j][c] * cs[c];
          if constexpr (S == kKIVI) acc += q[j][c] * cl[c];
        }
        qlo[j] = hsum(acc);
      }
      constexpr Store SK = S == kKIVI ? kI4 : kI8;   // the sealed keys' integers
      for (int64_t slot = blk * bs + p - b * bs; p < stop; ++p, ++slot) {
        vf k[DV];
        load_row<SK, DV>(pool.k, slot, h, pool, k);
        for (int j = 0; j < G; ++j) {
          vf acc = qs[j][0] * k[0];
          for (int c = 1; c < DV; ++c) acc += qs[j][c] * k[c];
          const float s = (hsum(acc) + qlo[j]) * scale;
          sc[j * span + (p - first)] = s;
          m[j] = std::max(m[j], s);
        }
      }
    }
  } else
  for (int64_t b = first / bs, p = first; p < len; ++b) {
    const int64_t stop = std::min(len, (b + 1) * bs);
    for (int64_t slot = table[b] * bs + p - b * bs; p < stop; ++p, ++slot) {
      vf k[DV];
      load_row<S, DV>(pool.k, slot, h, pool, k);
      float ks = scale, kl = 0.f;
      if constexpr (S != kF32) {
        const float* par = pool.kp + slot * pool.slot_params + h * pool.head_params;
        ks = par[0] * scale;
        if constexpr (S == kI4) kl = par[1] * scale;
      }
      for (int j = 0; j < G; ++j) {
        vf acc = q[j][0] * k[0];
        for (int c = 1; c < DV; ++c) acc += q[j][c] * k[c];
        float s = hsum(acc) * ks;
        if constexpr (S == kI4) s += kl * qsum[j];
        sc[j * span + (p - first)] = s;
        m[j] = std::max(m[j], s);
      }
    }
  }
  for (int j = 0; j < G; ++j) {
    float* s = sc + j * span;
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int64_t i = 0; i < span; ++i) {
      s[i] = std::exp(s[i] - m[j]);
      sum += s[i];
    }
    const float inv = 1.f / sum;
#pragma omp simd
    for (int64_t i = 0; i < span; ++i) s[i] *= inv;
  }
  vf o[G][DV];
  float lo_sum[G];
  for (int j = 0; j < G; ++j) {
    lo_sum[j] = 0.f;
    for (int c = 0; c < DV; ++c) o[j][c] = vf{};
  }
  for (int64_t b = first / bs, p = first; p < len; ++b) {
    const int64_t stop = std::min(len, (b + 1) * bs);
    for (int64_t slot = table[b] * bs + p - b * bs; p < stop; ++p, ++slot) {
      // values are per token either way
      constexpr Store SV = S == kKIVI ? kI4 : S == kKIVI8 ? kI8 : S;
      vf v[DV];
      load_row<SV, DV>(pool.v, slot, h, pool, v);
      float vs = 1.f, vl = 0.f;
      if constexpr (SV != kF32) value_params<S>(pool, slot, h, vs, vl);
      for (int j = 0; j < G; ++j) {
        const float w = sc[j * span + (p - first)];
        const float ws = SV == kF32 ? w : w * vs;
        for (int c = 0; c < DV; ++c) o[j][c] += ws * v[c];
        if constexpr (SV == kI4) lo_sum[j] += w * vl;
      }
    }
  }
  for (int j = 0; j < G; ++j)
    for (int c = 0; c < DV; ++c) {
      vf r = o[j][c];
      if constexpr (S == kI4 || S == kKIVI) r += lo_sum[j];
      *reinterpret_cast<vf*>(out + (j * DV + c) * kLanes) = r;
    }
}

// Row `slot` of KV head `h` as d plain floats (parameters applied), for `attend_any`.
template <Store S>
inline const float* row_floats(const char* base, const float* params, int64_t slot, int64_t h,
                               int64_t d, const Pool& pool, float* tmp, bool key, int64_t bs) {
  const char* r = base + slot * pool.slot_bytes + h * pool.head_bytes;
  if constexpr (S == kKIVI || S == kKIVI8) {
    if (!key) {
      float vs = 1.f, vl = 0.f;
      value_params<S>(pool, slot, h, vs, vl);
      if constexpr (S == kKIVI8) {
        const int8_t* x = reinterpret_cast<const int8_t*>(r);
        for (int64_t i = 0; i < d; ++i) tmp[i] = vs * x[i];
      } else {
        const uint8_t* x = reinterpret_cast<const uint8_t*>(r);
        for (int64_t i = 0; i < d / 2; ++i) {
          tmp[i] = vl + vs * (x[i] & 15);
          tmp[i + d / 2] = vl + vs * (x[i] >> 4);
        }
      }
      return tmp;
    }
    const int64_t blk = slot / bs, entry = pool.entry_of[blk];
    if (entry >= 0) {
      const int64_t i = staged_index(pool, entry, bs, slot % bs, h);
      if (pool.stage8 != nullptr) {
        const int8_t* x = pool.stage8 + i * d;
        const float s = pool.stage_scale[i];
        for (int64_t c = 0; c < d; ++c) tmp[c] = s * x[c];
      } else {
        const c10::Half* x = pool.stage + i * d;
        for (int64_t c = 0; c < d; ++c) tmp[c] = static_cast<float>(x[c]);
      }
      return tmp;
    }
    const c10::Half* pc = pool.kc + (blk * pool.kvh + h) * kChannelRows<S> * d;
    if constexpr (S == kKIVI8) {
      const int8_t* x = reinterpret_cast<const int8_t*>(r);
      for (int64_t i = 0; i < d; ++i) tmp[i] = static_cast<float>(pc[i]) * x[i];
      return tmp;
    }
    const uint8_t* x = reinterpret_cast<const uint8_t*>(r);
    for (int64_t i = 0; i < d / 2; ++i) {
      tmp[i] = static_cast<float>(pc[d + i]) + static_cast<float>(pc[i]) * (x[i] & 15);
      tmp[i + d / 2] = static_cast<float>(pc[d + i + d / 2]) +
                       static_cast<float>(pc[i + d / 2]) * (x[i] >> 4);
    }
    return tmp;
  } else if constexpr (S == kF32) {
    return reinterpret_cast<const float*>(r);
  } else {
    const float* par = params + slot * pool.slot_params + h * pool.head_params;
    if constexpr (S == kI8) {
      const int8_t* x = reinterpret_cast<const int8_t*>(r);
      for (int64_t i = 0; i < d; ++i) tmp[i] = par[0] * x[i];
    } else {
      const uint8_t* x = reinterpret_cast<const uint8_t*>(r);
      for (int64_t i = 0; i < d / 2; ++i) {
        tmp[i] = par[1] + par[0] * (x[i] & 15);
        tmp[i + d / 2] = par[1] + par[0] * (x[i] >> 4);
      }
    }
    return tmp;
  }
}

inline float dot(const float* __restrict a, const float* __restrict b, int64_t d) {
  float s = 0.f;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < d; ++i) s += a[i] * b[i];
  return s;
}

// Any G and D: the same two passes with loops over them.
template <Store S>
void attend_any(const float* qh, const Pool& pool, const int64_t* table, int64_t first,
                int64_t len, int64_t bs, int64_t h, int64_t g, int64_t d, float scale,
                std::vector<float>& scores, float* out) {
  const int64_t span = len - first;
  scores.resize(static_cast<size_t>(g * span + d));
  float* sc = scores.data();
  float* tmp = sc + g * span;
  for (int64_t p = first; p < len; ++p) {
    const float* kr = row_floats<S>(pool.k, pool.kp, table[p / bs] * bs + p % bs, h, d, pool,
                                    tmp, true, bs);
    for (int64_t j = 0; j < g; ++j) sc[j * span + (p - first)] = dot(qh + j * d, kr, d) * scale;
  }
  for (int64_t j = 0; j < g; ++j) {
    float* s = sc + j * span;
    float mx = s[0];
    for (int64_t i = 1; i < span; ++i) mx = std::max(mx, s[i]);
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int64_t i = 0; i < span; ++i) {
      s[i] = std::exp(s[i] - mx);
      sum += s[i];
    }
    const float inv = 1.f / sum;
#pragma omp simd
    for (int64_t i = 0; i < span; ++i) s[i] *= inv;
  }
  std::fill(out, out + g * d, 0.f);
  for (int64_t p = first; p < len; ++p) {
    const float* vr = row_floats<S>(pool.v, pool.vp, table[p / bs] * bs + p % bs, h, d, pool,
                                    tmp, false, bs);
    for (int64_t j = 0; j < g; ++j) {
      const float w = sc[j * span + (p - first)];
      float* __restrict o = out + j * d;
#pragma omp simd
      for (int64_t x = 0; x < d; ++x) o[x] += w * vr[x];
    }
  }
}

using FixedFn = void (*)(const float*, const Pool&, const int64_t*, int64_t, int64_t, int64_t,
                         int64_t, float, std::vector<float>&, float*);

// The fixed-shape instance for (g, d), or null: G 1..8, D 64 or 128.
template <Store S, int... Gs>
FixedFn pick_fixed(int64_t g, int64_t d, std::integer_sequence<int, Gs...>) {
  FixedFn fn = nullptr;
  ((g == Gs + 1 && d == 64 ? (fn = &attend_fixed<S, Gs + 1, 64 / kLanes>, 0) : 0), ...);
  ((g == Gs + 1 && d == 128 ? (fn = &attend_fixed<S, Gs + 1, 128 / kLanes>, 0) : 0), ...);
  return fn;
}

// The shared driver: one job per (row, KV head) on torch's threads. `tables` has one row per
// query row, or one row they all share (a prefill chunk's query tokens over its one context).
template <Store S>
void run(const Batch& b, const Pool& pool) {
  const int64_t kvh = b.kvh, g = b.g, d = b.d, bs = b.bs, mb = b.mb;
  const FixedFn fixed = pick_fixed<S>(g, d, std::make_integer_sequence<int, 8>{});
  at::parallel_for(0, b.n * kvh, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    for (int64_t job = begin; job < end; ++job) {
      const int64_t r = job / kvh, h = job % kvh;
      const int64_t len = std::min(b.lens[r], mb * bs);
      const int64_t first = b.window > 0 ? std::max<int64_t>(0, len - b.window) : 0;
      float* oh = b.out + (r * kvh + h) * g * d;
      if (len - first <= 0) {
        std::fill(oh, oh + g * d, 0.f);
        continue;
      }
      const float* qh = b.q + (r * kvh + h) * g * d;
      const int64_t* table = b.tables + r * b.table_stride;
      if (fixed != nullptr)
        fixed(qh, pool, table, first, len, bs, h, b.scale, scores, oh);
      else
        attend_any<S>(qh, pool, table, first, len, bs, h, g, d, b.scale, scores, oh);
    }
  });
}

}  // namespace
}  // namespace vc
