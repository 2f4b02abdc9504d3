// Decode attention read straight from the paged KV pool, for the CPU.
//
// One query token per sequence attends over its context, whose K/V rows live in the pool's
// blocks in the order its block table gives. transformers' and torch's attention need the
// context contiguous, so the pure-torch path first gathers every block (index_select) and then
// reads the copy again in SDPA; this kernel reads each K and V row once, where it lies.
//
// Shapes (float32, contiguous):
//   q        (n, KVH, G, D)   the query heads of each KV head folded together (GQA)
//   k_pool   (NB, B, KVH, D)  v_pool alike
//   tables   (n, MB) int64    block ids; only the first ceil(len / B) of a row are read
//                             (or (1, MB): one table every row shares, a prefill chunk's)
//   lens     (n,) int64       context length of each row (keys 0 .. len-1)
//   out      (n, KVH, G, D)
// window > 0 keeps only the last `window` keys (sliding-window attention).
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
// a block still filling is read from its float16 staging entry (`entry_of[block] >= 0`).

#include <torch/extension.h>
#include <ATen/Parallel.h>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace {

// 16 floats, any alignment: GCC's vector extension, which -march=native maps to one AVX-512
// register, two AVX2 ones or four NEON ones, so the fixed-shape path below needs no intrinsics.
typedef float vf __attribute__((vector_size(64), aligned(4)));
constexpr int64_t kLanes = 16;

// 16 integers widened to 16 floats. GCC 12 scalarises a one-step int8 -> float
// __builtin_convertvector (256 scalar converts per row, 4x slower than reading float32), so on
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
inline vf widen_f16(const at::Half* p) {
  return as_vf(_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))));
}
#else
typedef int8_t vi8 __attribute__((vector_size(16), aligned(1)));
typedef uint8_t vu8 __attribute__((vector_size(16), aligned(1)));
typedef int32_t vi32 __attribute__((vector_size(64)));
inline vf widen_i8(const char* p) {
  return __builtin_convertvector(
      __builtin_convertvector(*reinterpret_cast<const vi8*>(p), vi32), vf);
}
inline void widen_u4(const char* p, vf& lo, vf& hi) {
  const vu8 b = *reinterpret_cast<const vu8*>(p);
  lo = __builtin_convertvector(__builtin_convertvector(b & 15, vi32), vf);
  hi = __builtin_convertvector(__builtin_convertvector(b >> 4, vi32), vf);
}
inline vf widen_f16(const at::Half* p) {
  vf x;
  for (int l = 0; l < kLanes; ++l) x[l] = static_cast<float>(p[l]);
  return x;
}
#endif

inline float hsum(vf v) {
  float s = 0.f;
  for (int l = 0; l < kLanes; ++l) s += v[l];
  return s;
}

// How a pool stores its rows: float32, int8 + scale, int4 + scale and minimum, or int4 keys
// rounded per channel over a block (KIVI) with values as kI4.
enum Store { kF32 = 0, kI8 = 8, kI4 = 4, kKIVI = 5 };

// One layer's K and V: data addressed in bytes, parameters (float32) per slot and KV head.
struct Pool {
  const char* k;
  const char* v;
  const float* kp;      // null for kF32 and kKIVI (keys)
  const float* vp;
  int64_t slot_bytes;   // between two slots of the data
  int64_t head_bytes;   // between two KV heads of one slot
  int64_t slot_params;  // floats between two slots of the parameters (KVH * P)
  int64_t head_params;  // P
  // kKIVI only: each sealed block's per-channel key scale and minimum, (NB, KVH, 2, D) half;
  // the open blocks' keys, (E, B, KVH, D) float16; each block's entry there, or -1 if sealed.
  const at::Half* kc = nullptr;
  const at::Half* stage = nullptr;
  const int64_t* entry_of = nullptr;
  int64_t entries = 0;
  int64_t kvh = 0;
  int64_t d = 0;
};

// The parameters of KV head h of a sealed kKIVI block as float vectors.
template <int DV>
inline void channel_params(const Pool& pool, int64_t blk, int64_t h, vf* scale, vf* lo) {
  const at::Half* pc = pool.kc + (blk * pool.kvh + h) * 2 * pool.d;
  for (int c = 0; c < DV; ++c) {
    scale[c] = widen_f16(pc + c * kLanes);
    lo[c] = widen_f16(pc + pool.d + c * kLanes);
  }
}

// A staged (open) key row of a kKIVI pool.
inline const at::Half* staged_row(const Pool& pool, int64_t entry, int64_t bs, int64_t off,
                                  int64_t h) {
  return pool.stage + ((entry * bs + off) * pool.kvh + h) * pool.d;
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

// One (row, KV head) with G query heads and head_dim D = 16 * DV known at compile time: the
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
  if constexpr (S == kKIVI) {
    // Keys block by block: an open block's from staging (float), a sealed one's through its
    // channel parameters folded into the queries: q.k = (q * s).q_k + q.lo.
    for (int64_t b = first / bs, p = first; p < len; ++b) {
      const int64_t stop = std::min(len, (b + 1) * bs);
      const int64_t blk = table[b];
      const int64_t entry = pool.entry_of[blk];
      if (entry >= 0) {
        for (; p < stop; ++p) {
          const at::Half* kr = staged_row(pool, entry, bs, p - b * bs, h);
          vf k[DV];
          for (int c = 0; c < DV; ++c) k[c] = widen_f16(kr + c * kLanes);
          for (int j = 0; j < G; ++j) {
            vf acc = q[j][0] * k[0];
            for (int c = 1; c < DV; ++c) acc += q[j][c] * k[c];
            const float s = hsum(acc) * scale;
            sc[j * span + (p - first)] = s;
            m[j] = std::max(m[j], s);
          }
        }
        continue;
      }
      vf cs[DV], cl[DV], qs[G][DV];
      float qlo[G];
      channel_params<DV>(pool, blk, h, cs, cl);
      for (int j = 0; j < G; ++j) {
        vf acc{};
        for (int c = 0; c < DV; ++c) {
          qs[j][c] = q[j][c] * cs[c];
          acc += q[j][c] * cl[c];
        }
        qlo[j] = hsum(acc);
      }
      for (int64_t slot = blk * bs + p - b * bs; p < stop; ++p, ++slot) {
        vf k[DV];
        load_row<kI4, DV>(pool.k, slot, h, pool, k);
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
      constexpr Store SV = S == kKIVI ? kI4 : S;   // values are per token either way
      vf v[DV];
      load_row<SV, DV>(pool.v, slot, h, pool, v);
      float vs = 1.f, vl = 0.f;
      if constexpr (SV != kF32) {
        const float* par = pool.vp + slot * pool.slot_params + h * pool.head_params;
        vs = par[0];
        if constexpr (SV == kI4) vl = par[1];
      }
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
  if constexpr (S == kKIVI) {
    if (!key) return row_floats<kI4>(base, params, slot, h, d, pool, tmp, false, bs);
    const int64_t blk = slot / bs, entry = pool.entry_of[blk];
    if (entry >= 0) {
      const at::Half* x = staged_row(pool, entry, bs, slot % bs, h);
      for (int64_t i = 0; i < d; ++i) tmp[i] = static_cast<float>(x[i]);
      return tmp;
    }
    const at::Half* pc = pool.kc + (blk * pool.kvh + h) * 2 * d;
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
  ((g == Gs + 1 && d == 64 ? (fn = &attend_fixed<S, Gs + 1, 4>, 0) : 0), ...);
  ((g == Gs + 1 && d == 128 ? (fn = &attend_fixed<S, Gs + 1, 8>, 0) : 0), ...);
  return fn;
}

// The shared driver. `tables` has one row per query row, or one row they all share (a prefill
// chunk's query tokens over its one context).
template <Store S>
void run(const torch::Tensor& q, const Pool& pool, int64_t nb, int64_t bs,
         const torch::Tensor& tables, const torch::Tensor& lens, double scale, int64_t window,
         torch::Tensor& out) {
  const int64_t n = q.size(0), kvh = q.size(1), g = q.size(2), d = q.size(3);
  const int64_t mb = tables.size(1);
  TORCH_CHECK(tables.size(0) == n || tables.size(0) == 1, "one table per row, or one shared");
  TORCH_CHECK(lens.size(0) == n, "one length per row");
  TORCH_CHECK(out.sizes() == q.sizes(), "out and q disagree");
  const int64_t table_stride = tables.size(0) == 1 ? 0 : mb;
  const float* qp = q.data_ptr<float>();
  const int64_t* tp = tables.data_ptr<int64_t>();
  const int64_t* lp = lens.data_ptr<int64_t>();
  float* op = out.data_ptr<float>();
  const float sc = static_cast<float>(scale);
  const FixedFn fixed = pick_fixed<S>(g, d, std::make_integer_sequence<int, 8>{});

  for (int64_t r = 0; r < n; ++r) {
    const int64_t len = std::min(lp[r], mb * bs);
    const int64_t first = window > 0 ? std::max<int64_t>(0, len - window) : 0;
    const int64_t* table = tp + r * table_stride;
    for (int64_t b = first / bs; len > first && b <= (len - 1) / bs; ++b)
    {
      TORCH_CHECK(table[b] >= 0 && table[b] < nb, "block id ", table[b], " of row ", r,
                  " is outside the pool of ", nb, " blocks");
      if constexpr (S == kKIVI)
        TORCH_CHECK(pool.entry_of[table[b]] < pool.entries, "staging entry ",
                    pool.entry_of[table[b]], " of block ", table[b], " is outside the ",
                    pool.entries, " entries");
    }
  }

  // One job per (row, KV head).
  at::parallel_for(0, n * kvh, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    for (int64_t job = begin; job < end; ++job) {
      const int64_t r = job / kvh, h = job % kvh;
      const int64_t len = std::min(lp[r], mb * bs);
      const int64_t first = window > 0 ? std::max<int64_t>(0, len - window) : 0;
      float* oh = op + (r * kvh + h) * g * d;
      if (len - first <= 0) {
        std::fill(oh, oh + g * d, 0.f);
        continue;
      }
      const float* qh = qp + (r * kvh + h) * g * d;
      const int64_t* table = tp + r * table_stride;
      if (fixed != nullptr)
        fixed(qh, pool, table, first, len, bs, h, sc, scores, oh);
      else
        attend_any<S>(qh, pool, table, first, len, bs, h, g, d, sc, scores, oh);
    }
  });
}

void check_common(const torch::Tensor& q, const torch::Tensor& tables, const torch::Tensor& lens,
                  const torch::Tensor& out) {
  TORCH_CHECK(q.dim() == 4 && out.dim() == 4 && tables.dim() == 2 && lens.dim() == 1,
              "bad ranks");
  TORCH_CHECK(q.scalar_type() == torch::kFloat && out.scalar_type() == torch::kFloat,
              "float32 queries and output");
  TORCH_CHECK(tables.scalar_type() == torch::kLong && lens.scalar_type() == torch::kLong,
              "int64 tables and lengths");
  TORCH_CHECK(q.is_contiguous() && tables.is_contiguous() && lens.is_contiguous() &&
                  out.is_contiguous(),
              "contiguous tensors only");
}

}  // namespace

void paged_decode_attention(const torch::Tensor& q, const torch::Tensor& k_pool,
                            const torch::Tensor& v_pool, const torch::Tensor& tables,
                            const torch::Tensor& lens, double scale, int64_t window,
                            torch::Tensor& out) {
  check_common(q, tables, lens, out);
  TORCH_CHECK(k_pool.dim() == 4 && v_pool.dim() == 4, "bad pool ranks");
  TORCH_CHECK(k_pool.scalar_type() == torch::kFloat && v_pool.scalar_type() == torch::kFloat,
              "float32 pools");
  TORCH_CHECK(k_pool.is_contiguous() && v_pool.is_contiguous(), "contiguous pools");
  const int64_t kvh = q.size(1), d = q.size(3);
  TORCH_CHECK(k_pool.size(2) == kvh && k_pool.size(3) == d && v_pool.sizes() == k_pool.sizes(),
              "pool and query disagree");
  const Pool pool{static_cast<const char*>(k_pool.data_ptr()),
                  static_cast<const char*>(v_pool.data_ptr()), nullptr, nullptr,
                  kvh * d * 4, d * 4, 0, 0};
  run<kF32>(q, pool, k_pool.size(0), k_pool.size(1), tables, lens, scale, window, out);
}

void paged_decode_attention_quant(const torch::Tensor& q, const torch::Tensor& k_data,
                                  const torch::Tensor& v_data, const torch::Tensor& k_params,
                                  const torch::Tensor& v_params, const torch::Tensor& tables,
                                  const torch::Tensor& lens, double scale, int64_t window,
                                  int64_t bits, torch::Tensor& out) {
  check_common(q, tables, lens, out);
  TORCH_CHECK(bits == 8 || bits == 4, "bits must be 8 or 4");
  TORCH_CHECK(k_data.dim() == 4 && v_data.sizes() == k_data.sizes() && k_params.dim() == 4 &&
                  v_params.sizes() == k_params.sizes(),
              "bad pool shapes");
  TORCH_CHECK(k_data.scalar_type() == (bits == 8 ? torch::kChar : torch::kByte) &&
                  v_data.scalar_type() == k_data.scalar_type(),
              bits == 8 ? "int8 data" : "uint8 data");
  TORCH_CHECK(k_params.scalar_type() == torch::kFloat && v_params.scalar_type() == torch::kFloat,
              "float32 parameters");
  TORCH_CHECK(k_data.is_contiguous() && v_data.is_contiguous() && k_params.is_contiguous() &&
                  v_params.is_contiguous(),
              "contiguous pools");
  const int64_t kvh = q.size(1), d = q.size(3);
  const int64_t dd = bits == 8 ? d : d / 2, np = bits == 8 ? 1 : 2;
  TORCH_CHECK(bits == 8 || d % 2 == 0, "int4 needs an even head_dim");
  TORCH_CHECK(k_data.size(2) == kvh && k_data.size(3) == dd && k_params.size(2) == kvh &&
                  k_params.size(3) == np && k_params.size(0) == k_data.size(0) &&
                  k_params.size(1) == k_data.size(1),
              "pool, parameters and query disagree");
  const Pool pool{static_cast<const char*>(k_data.data_ptr()),
                  static_cast<const char*>(v_data.data_ptr()), k_params.data_ptr<float>(),
                  v_params.data_ptr<float>(), kvh * dd, dd, kvh * np, np};
  if (bits == 8)
    run<kI8>(q, pool, k_data.size(0), k_data.size(1), tables, lens, scale, window, out);
  else
    run<kI4>(q, pool, k_data.size(0), k_data.size(1), tables, lens, scale, window, out);
}

void paged_decode_attention_kivi(const torch::Tensor& q, const torch::Tensor& k_data,
                                 const torch::Tensor& v_data, const torch::Tensor& k_channel,
                                 const torch::Tensor& v_params, const torch::Tensor& k_stage,
                                 const torch::Tensor& entry_of, const torch::Tensor& tables,
                                 const torch::Tensor& lens, double scale, int64_t window,
                                 torch::Tensor& out) {
  check_common(q, tables, lens, out);
  const int64_t kvh = q.size(1), d = q.size(3), nb = k_data.size(0), bs = k_data.size(1);
  TORCH_CHECK(d % 2 == 0, "int4 needs an even head_dim");
  TORCH_CHECK(k_data.scalar_type() == torch::kByte && v_data.scalar_type() == torch::kByte,
              "uint8 data");
  TORCH_CHECK(k_data.dim() == 4 && v_data.sizes() == k_data.sizes() && k_data.size(2) == kvh &&
                  k_data.size(3) == d / 2,
              "pool and query disagree");
  TORCH_CHECK(k_channel.scalar_type() == torch::kHalf &&
                  k_channel.sizes() == torch::IntArrayRef({nb, kvh, 2, d}),
              "key channel parameters: (NB, KVH, 2, D) float16");
  TORCH_CHECK(v_params.scalar_type() == torch::kFloat &&
                  v_params.sizes() == torch::IntArrayRef({nb, bs, kvh, 2}),
              "value parameters: (NB, B, KVH, 2) float32");
  TORCH_CHECK(k_stage.scalar_type() == torch::kHalf && k_stage.dim() == 4 &&
                  k_stage.size(1) == bs && k_stage.size(2) == kvh && k_stage.size(3) == d,
              "staging: (E, B, KVH, D) float16");
  TORCH_CHECK(entry_of.scalar_type() == torch::kLong && entry_of.dim() == 1 &&
                  entry_of.size(0) == nb,
              "entry_of: (NB,) int64");
  TORCH_CHECK(k_data.is_contiguous() && v_data.is_contiguous() && k_channel.is_contiguous() &&
                  v_params.is_contiguous() && k_stage.is_contiguous() && entry_of.is_contiguous(),
              "contiguous pools");
  const int64_t* eo = entry_of.data_ptr<int64_t>();
  Pool pool{static_cast<const char*>(k_data.data_ptr()),
            static_cast<const char*>(v_data.data_ptr()), nullptr, v_params.data_ptr<float>(),
            kvh * d / 2, d / 2, kvh * 2, 2};
  pool.kc = k_channel.data_ptr<at::Half>();
  pool.stage = k_stage.data_ptr<at::Half>();
  pool.entry_of = eo;
  pool.entries = k_stage.size(0);
  pool.kvh = kvh;
  pool.d = d;
  run<kKIVI>(q, pool, nb, bs, tables, lens, scale, window, out);
}

// The write side: rows x (T, KVH, D) float32 rounded per (row, KV head) into a quantized pool at
// `slots`, as kv_quant.quantize does in torch (int8: symmetric, scale = max|x| / 127; int4:
// scale = (max - min) / 15 and the minimum, element j in the low nibble of byte j and j + D/2 in
// the high one), in one call instead of a dozen torch ops per K and V per layer.
void quantize_store(const torch::Tensor& x, const torch::Tensor& slots, torch::Tensor& data,
                    torch::Tensor& params, int64_t bits) {
  TORCH_CHECK(bits == 8 || bits == 4, "bits must be 8 or 4");
  TORCH_CHECK(x.dim() == 3 && x.scalar_type() == torch::kFloat && x.is_contiguous(),
              "rows: (T, KVH, D) contiguous float32");
  TORCH_CHECK(slots.dim() == 1 && slots.scalar_type() == torch::kLong && slots.is_contiguous() &&
                  slots.size(0) == x.size(0),
              "one int64 slot per row");
  const int64_t t = x.size(0), kvh = x.size(1), d = x.size(2);
  const int64_t dd = bits == 8 ? d : d / 2, np = bits == 8 ? 1 : 2;
  TORCH_CHECK(bits == 8 || d % 2 == 0, "int4 needs an even head_dim");
  TORCH_CHECK(data.dim() == 4 && data.size(2) == kvh && data.size(3) == dd &&
                  data.scalar_type() == (bits == 8 ? torch::kChar : torch::kByte) &&
                  data.is_contiguous(),
              "pool data and rows disagree");
  TORCH_CHECK(params.dim() == 4 && params.size(0) == data.size(0) &&
                  params.size(1) == data.size(1) && params.size(2) == kvh &&
                  params.size(3) == np && params.scalar_type() == torch::kFloat &&
                  params.is_contiguous(),
              "pool parameters and rows disagree");
  const int64_t num_slots = data.size(0) * data.size(1);
  const float* xp = x.data_ptr<float>();
  const int64_t* sp = slots.data_ptr<int64_t>();
  char* dp = static_cast<char*>(data.data_ptr());
  float* pp = params.data_ptr<float>();
  for (int64_t i = 0; i < t; ++i)
    TORCH_CHECK(sp[i] >= 0 && sp[i] < num_slots, "slot ", sp[i], " is outside the pool");
  for (int64_t i = 0; i < t; ++i)
    for (int64_t h = 0; h < kvh; ++h) {
      const float* r = xp + (i * kvh + h) * d;
      const int64_t at = sp[i] * kvh + h;
      float lo = r[0], hi = r[0], amax = std::fabs(r[0]);
      for (int64_t j = 1; j < d; ++j) {
        lo = std::min(lo, r[j]);
        hi = std::max(hi, r[j]);
        amax = std::max(amax, std::fabs(r[j]));
      }
      if (bits == 8) {
        const float scale = amax / 127.f;
        const float safe = scale > 0.f ? scale : 1.f;
        int8_t* q = reinterpret_cast<int8_t*>(dp) + at * d;
        for (int64_t j = 0; j < d; ++j)
          q[j] = static_cast<int8_t>(std::clamp(std::nearbyint(r[j] / safe), -127.f, 127.f));
        pp[at] = scale;
      } else {
        const float scale = (hi - lo) / 15.f;
        const float safe = scale > 0.f ? scale : 1.f;
        uint8_t* q = reinterpret_cast<uint8_t*>(dp) + at * (d / 2);
        for (int64_t j = 0; j < d / 2; ++j) {
          const float a = std::clamp(std::nearbyint((r[j] - lo) / safe), 0.f, 15.f);
          const float b = std::clamp(std::nearbyint((r[j + d / 2] - lo) / safe), 0.f, 15.f);
          q[j] = static_cast<uint8_t>(a) | static_cast<uint8_t>(static_cast<uint8_t>(b) << 4);
        }
        pp[2 * at] = scale;
        pp[2 * at + 1] = lo;
      }
    }
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention,
        "Decode attention over a paged KV pool, reading blocks through the block table (CPU).");
  m.def("paged_decode_attention_quant", &paged_decode_attention_quant,
        "The same over an int8 or int4 pool with per (slot, KV head) parameters (CPU).");
  m.def("quantize_store", &quantize_store,
        "Round rows per (row, KV head) into an int8 / int4 pool at the given slots (CPU).");
  m.def("paged_decode_attention_kivi", &paged_decode_attention_kivi,
        "The same over an int4_kivi pool: keys per channel per block, open blocks staged (CPU).");
}
