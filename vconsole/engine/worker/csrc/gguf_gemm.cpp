// Linears over GGUF quantized weights, read as stored (`gguf_linear.py`, `--quantization gguf`):
//
//   out[m, n] = sum_k x[m, k] * W[n, k]        x float32 (M, K), W: N rows of GGUF blocks
//
// where W[n, k] is the weight the GGUF block format defines (Q4_0, Q4_1, Q8_0: 32 weights a
// block; Q4_K, Q6_K: 256 a super-block of eight groups of 32). The weights are never expanded
// to a float matrix: each group of 32 is decoded into float vectors in registers (its quants
// widened to float by the CPU's widening instructions, times its scale, plus its offset)
// right where it is used. The
// activations stay float32 and every product is summed in float32, so the result equals
// x @ dequantize(W)^T up to float rounding (summation order): the scheme's error is the
// stored weights' alone, and a model gives the tokens its dequantized float copy gives.
//
// Two shapes of step:
// - **GEMV, up to 8 rows** (a decode step of a few streams, or a speculative step's few draft
//   rows; memory-bound): each thread takes a range of output channels and streams their blocks
//   once, decoding each group in registers and multiplying it into every row's accumulators
//   (with 16-lane vectors all 8 rows' accumulators fit the 32 registers; with 8-lane vectors
//   rows 5-8 take a second pass over the same channels, while their blocks are in cache). The bytes read per token are the file's
//   (SmolLM2's Q4_1: 0.625 bytes a weight, against 4 for float32).
// - **GEMM, more rows** (prefill, wide decode batches; compute-bound): each thread decodes a
//   panel of `kNP` channels into a float buffer it keeps in cache (row-major, so decoding
//   writes contiguous vectors), and multiplies every block of up to `kMB` rows of x against it
//   with a register-blocked dot-product micro-kernel (`kMR` rows x `kNR` channels of vector
//   accumulators, reduced once at the end). The decode costs K x kNP per panel per row block,
//   shared by that block's rows.
//
// Vector width is the compiler's: the builder compiles for this CPU (-march=native,
// attention_kernel.py), so AVX-512 where the CPU has it, else AVX2, else the generic vectors
// (SSE2, NEON): the code holds no instruction the CPU lacks and never dies with SIGILL. The
// tests build the AVX2 and generic paths on an AVX-512 machine (-mno-avx512f, -mno-avx2) and
// compare each with the dequantized float reference. The layouts follow the GGUF format's
// block definitions (ggml's block_q4_0 ... block_q6_K); this code is our own.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#if defined(__AVX2__) || defined(__AVX512F__) || defined(__F16C__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#ifndef VC_OPS
#error "build with -DVC_OPS=<the operators' namespace>"
#endif
#define VC_FRAGMENT(ns, m) TORCH_LIBRARY_FRAGMENT(ns, m)

namespace {

// ggml's type ids (the GGUF file's tensor_type).
enum : int64_t { kQ4_0 = 2, kQ4_1 = 3, kQ8_0 = 8, kQ4_K = 12, kQ6_K = 14 };

typedef uint8_t u8x16 __attribute__((vector_size(16), aligned(1)));

#if defined(__AVX512F__)
typedef float vf __attribute__((vector_size(64), aligned(4)));
constexpr int64_t kLanes = 16;
constexpr int kNR = 4;   // channels per micro-kernel
#else
typedef float vf __attribute__((vector_size(32), aligned(4)));
constexpr int64_t kLanes = 8;
constexpr int kNR = 2;   // 4 x 2 accumulators of 16 registers
#endif
constexpr int kVG = static_cast<int>(32 / kLanes);   // vectors per group of 32 weights
#if defined(__AVX512F__)
constexpr int kMR = 6;            // rows per micro-kernel: 6 x 4 accumulators + 4 + 1 live
#else
constexpr int kMR = 4;            // rows per micro-kernel
#endif
constexpr int64_t kNP = 16;       // channels per decoded panel
constexpr int64_t kMB = 128;      // rows per cache block of x
constexpr int64_t kGemvRows = 8;  // up to this many rows: the GEMV
#if defined(__AVX512F__)
constexpr int kGemvPass = 8;      // rows one pass holds in registers (R x kVG accumulators)
#else
constexpr int kGemvPass = 4;
#endif

// A block's float16 scale: one instruction with F16C (c10's conversion is bit arithmetic,
// some fifteen operations, twice a group of 32 weights).
inline float f16(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
#if defined(__F16C__)
  return _cvtsh_ss(bits);
#else
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
#endif
}
inline u8x16 load_u8(const uint8_t* p) { return *reinterpret_cast<const u8x16*>(p); }
inline vf loadv(const float* p) { return *reinterpret_cast<const vf*>(p); }
inline void storev(float* p, vf v) { *reinterpret_cast<vf*>(p) = v; }

// 16 quants (unsigned, or signed bytes when S) as float vectors times d plus m: 16 / kLanes
// vectors into w. GCC's generic conversion of bytes to floats went one value at a time
// (2.3 cycles a weight); the widening instructions do 8 or 16 at once.
template <bool S>
inline void expand(u8x16 q, float d, float m, vf* w) {
#if defined(__AVX512F__)
  const __m128i b = (__m128i)q;
  const __m512i i = S ? _mm512_cvtepi8_epi32(b) : _mm512_cvtepu8_epi32(b);
  w[0] = (vf)_mm512_cvtepi32_ps(i) * d + m;
#elif defined(__AVX2__)
  const __m128i b = (__m128i)q;
  const __m128i b2 = _mm_srli_si128(b, 8);
  const __m256i i0 = S ? _mm256_cvtepi8_epi32(b) : _mm256_cvtepu8_epi32(b);
  const __m256i i1 = S ? _mm256_cvtepi8_epi32(b2) : _mm256_cvtepu8_epi32(b2);
  w[0] = (vf)_mm256_cvtepi32_ps(i0) * d + m;
  w[1] = (vf)_mm256_cvtepi32_ps(i1) * d + m;
#else
  float t[16];
  for (int j = 0; j < 16; ++j)
    t[j] = static_cast<float>(S ? static_cast<int>(static_cast<int8_t>(q[j]))
                                : static_cast<int>(q[j]));
  for (int v = 0; v < 16 / kLanes; ++v) w[v] = loadv(t + v * kLanes) * d + m;
#endif
}

// A group of 32 weights as quants: q[0] holds weights 0-15, q[1] 16-31, each weight
// float(q) * d[h] + m[h] for its half h.
struct Group {
  u8x16 q[2];
  float d[2], m[2];
};

// Per type: the bytes of one block, the weights it holds, whether its quants are signed bytes,
// and `group(row, g, out)`: weights g*32 .. g*32+31 of a row.
template <int64_t T> struct Fmt;

template <> struct Fmt<kQ4_0> {   // d: f16; 16 bytes of nibbles: w = d (nibble - 8)
  static constexpr int64_t kBytes = 18, kWeights = 32;
  static constexpr bool kSigned = false;
  static void group(const uint8_t* row, int64_t g, Group& o) {
    const uint8_t* b = row + g * kBytes;
    const float d = f16(b);
    const u8x16 q = load_u8(b + 2);
    o.q[0] = q & 15;
    o.q[1] = q >> 4;
    o.d[0] = o.d[1] = d;
    o.m[0] = o.m[1] = -8.f * d;
  }
};

template <> struct Fmt<kQ4_1> {   // d, m: f16; 16 bytes of nibbles: w = d q + m
  static constexpr int64_t kBytes = 20, kWeights = 32;
  static constexpr bool kSigned = false;
  static void group(const uint8_t* row, int64_t g, Group& o) {
    const uint8_t* b = row + g * kBytes;
    const u8x16 q = load_u8(b + 4);
    o.q[0] = q & 15;
    o.q[1] = q >> 4;
    o.d[0] = o.d[1] = f16(b);
    o.m[0] = o.m[1] = f16(b + 2);
  }
};

template <> struct Fmt<kQ8_0> {   // d: f16; 32 signed bytes: w = d q
  static constexpr int64_t kBytes = 34, kWeights = 32;
  static constexpr bool kSigned = true;
  static void group(const uint8_t* row, int64_t g, Group& o) {
    const uint8_t* b = row + g * kBytes;
    o.q[0] = load_u8(b + 2);
    o.q[1] = load_u8(b + 18);
    o.d[0] = o.d[1] = f16(b);
    o.m[0] = o.m[1] = 0.f;
  }
};

// Q4_K: d, dmin: f16; 12 bytes packing eight 6-bit scales and eight 6-bit mins; 128 bytes of
// nibbles, 32 bytes per pair of groups (the even group in the low nibbles, the odd one in the
// high). w = d * scale[g] * q - dmin * min[g].
template <> struct Fmt<kQ4_K> {
  static constexpr int64_t kBytes = 144, kWeights = 256;
  static constexpr bool kSigned = false;
  static void group(const uint8_t* row, int64_t g, Group& o) {
    const uint8_t* b = row + (g >> 3) * kBytes;
    const int j = static_cast<int>(g & 7);
    const uint8_t* s = b + 4;
    int sc, mn;
    if (j < 4) {
      sc = s[j] & 63;
      mn = s[j + 4] & 63;
    } else {
      sc = (s[j + 4] & 15) | ((s[j - 4] >> 6) << 4);
      mn = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    }
    const uint8_t* q = b + 16 + 32 * (j >> 1);
    const int shift = (j & 1) ? 4 : 0;
    o.q[0] = (load_u8(q) >> shift) & 15;
    o.q[1] = (load_u8(q + 16) >> shift) & 15;
    o.d[0] = o.d[1] = f16(b) * static_cast<float>(sc);
    o.m[0] = o.m[1] = -f16(b + 2) * static_cast<float>(mn);
  }
};

// Q6_K: 128 bytes of low nibbles, 64 bytes of 2-bit high parts, sixteen int8 scales (one per
// 16 weights), d: f16. Each half of 128 weights uses 64 low bytes and 32 high bytes: its
// quarter t (32 weights) takes the low (t = 0, 1) or high (t = 2, 3) nibbles of low bytes
// 0-31 (t even) or 32-63 (t odd), and bits 2t, 2t+1 of the high bytes; q = value - 32,
// w = d * scale * q.
template <> struct Fmt<kQ6_K> {
  static constexpr int64_t kBytes = 210, kWeights = 256;
  static constexpr bool kSigned = false;
  static void group(const uint8_t* row, int64_t g, Group& o) {
    const uint8_t* b = row + (g >> 3) * kBytes;
    const int j = static_cast<int>(g & 7), half = j >> 2, t = j & 3;
    const uint8_t* ql = b + 64 * half + ((t & 1) ? 32 : 0);
    const uint8_t* qh = b + 128 + 32 * half;
    const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192) + 8 * half + 2 * t;
    const float d = f16(b + 208);
    const int lshift = (t >> 1) * 4, hshift = 2 * t;
    o.q[0] = ((load_u8(ql) >> lshift) & 15) | (((load_u8(qh) >> hshift) & 3) << 4);
    o.q[1] = ((load_u8(ql + 16) >> lshift) & 15) | (((load_u8(qh + 16) >> hshift) & 3) << 4);
    for (int h = 0; h < 2; ++h) {
      o.d[h] = d * static_cast<float>(sc[h]);
      o.m[h] = -32.f * o.d[h];
    }
  }
};

// Weights g*32 .. g*32+31 of a row as kVG float vectors.
template <int64_t T>
inline void decode(const uint8_t* row, int64_t g, vf* w) {
  Group o;
  Fmt<T>::group(row, g, o);
  expand<Fmt<T>::kSigned>(o.q[0], o.d[0], o.m[0], w);
  expand<Fmt<T>::kSigned>(o.q[1], o.d[1], o.m[1], w + kVG / 2);
}

// A vector's lanes summed: a shuffle tree (a loop over the lanes went one lane at a time,
// 16 scalar adds for each of the micro-kernel's 16 accumulators).
inline float hsumv(vf v) {
#if defined(__AVX512F__)
  return _mm512_reduce_add_ps((__m512)v);
#elif defined(__AVX2__)
  const __m256 x = (__m256)v;
  __m128 r = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  r = _mm_add_ps(r, _mm_movehl_ps(r, r));
  r = _mm_add_ss(r, _mm_movehdup_ps(r));
  return _mm_cvtss_f32(r);
#else
  float s = 0.f;
  for (int i = 0; i < kLanes; ++i) s += v[i];
  return s;
#endif
}

// Up to kGemvRows rows: channels n0 .. n1-1, each row's blocks decoded once and multiplied
// into every row of x.
template <int64_t T, int R>
void gemv(const float* x, int64_t K, const uint8_t* w, int64_t row_bytes, int64_t n0,
          int64_t n1, float* out, int64_t N) {
  const int64_t groups = K / 32;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = w + n * row_bytes;
    vf acc[R][kVG];
    for (int r = 0; r < R; ++r)
      for (int v = 0; v < kVG; ++v) acc[r][v] = vf{};
    for (int64_t g = 0; g < groups; ++g) {
      vf w[kVG];
      decode<T>(row, g, w);
      for (int r = 0; r < R; ++r) {
        const float* xr = x + r * K + g * 32;
        for (int v = 0; v < kVG; ++v) acc[r][v] += w[v] * loadv(xr + v * kLanes);
      }
    }
    for (int r = 0; r < R; ++r) {
      vf sum = acc[r][0];
      for (int v = 1; v < kVG; ++v) sum += acc[r][v];
      out[r * N + n] = hsumv(sum);
    }
  }
}

template <int64_t T>
void run_gemv(int64_t M, const float* x, int64_t K, const uint8_t* w, int64_t row_bytes,
              int64_t N, float* out) {
  // Enough channels a task that a thread streams long runs of rows.
  const int64_t grain = std::max<int64_t>(8, std::min<int64_t>(256, N / 64));
  auto pass = [&](int64_t m, const float* xs, float* os, int64_t n0, int64_t n1) {
    switch (m) {
      case 1: gemv<T, 1>(xs, K, w, row_bytes, n0, n1, os, N); break;
      case 2: gemv<T, 2>(xs, K, w, row_bytes, n0, n1, os, N); break;
      case 3: gemv<T, 3>(xs, K, w, row_bytes, n0, n1, os, N); break;
      case 4: gemv<T, 4>(xs, K, w, row_bytes, n0, n1, os, N); break;
#if defined(__AVX512F__)
      case 5: gemv<T, 5>(xs, K, w, row_bytes, n0, n1, os, N); break;
      case 6: gemv<T, 6>(xs, K, w, row_bytes, n0, n1, os, N); break;
      case 7: gemv<T, 7>(xs, K, w, row_bytes, n0, n1, os, N); break;
      default: gemv<T, 8>(xs, K, w, row_bytes, n0, n1, os, N); break;
#else
      default: break;               // never: a pass holds at most kGemvPass rows
#endif
    }
  };
  at::parallel_for(0, N, grain, [&](int64_t n0, int64_t n1) {
    for (int64_t r = 0; r < M; r += kGemvPass)
      pass(std::min<int64_t>(kGemvPass, M - r), x + r * K, out + r * N, n0, n1);
  });
}

// R rows of x (stride K) against C decoded channels (stride K): out[r * N + c].
template <int R, int C>
void micro(const float* x, const float* panel, int64_t K, float* out, int64_t N) {
  vf acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = vf{};
  for (int64_t k = 0; k < K; k += kLanes) {
    vf wv[C];
    for (int c = 0; c < C; ++c) wv[c] = loadv(panel + c * K + k);
    for (int r = 0; r < R; ++r) {
      const vf xv = loadv(x + r * K + k);
      for (int c = 0; c < C; ++c) acc[r][c] += xv * wv[c];
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) out[r * N + c] = hsumv(acc[r][c]);
}

template <int R>
void micro_cols(int cols, const float* x, const float* panel, int64_t K, float* out, int64_t N) {
  switch (cols) {
    case 1: micro<R, 1>(x, panel, K, out, N); break;
#if defined(__AVX512F__)
    case 2: micro<R, 2>(x, panel, K, out, N); break;
    case 3: micro<R, 3>(x, panel, K, out, N); break;
#endif
    default: micro<R, kNR>(x, panel, K, out, N); break;
  }
}

void micro_tile(int rows, int cols, const float* x, const float* panel, int64_t K, float* out,
                int64_t N) {
  switch (rows) {
    case 1: micro_cols<1>(cols, x, panel, K, out, N); break;
    case 2: micro_cols<2>(cols, x, panel, K, out, N); break;
    case 3: micro_cols<3>(cols, x, panel, K, out, N); break;
#if defined(__AVX512F__)
    case 4: micro_cols<4>(cols, x, panel, K, out, N); break;
    case 5: micro_cols<5>(cols, x, panel, K, out, N); break;
#endif
    default: micro_cols<kMR>(cols, x, panel, K, out, N); break;
  }
}

// Channels n0 .. n0+cols-1 decoded into panel (cols rows of K floats).
template <int64_t T>
void decode_rows(const uint8_t* w, int64_t row_bytes, int64_t n0, int64_t cols, int64_t K,
                 float* panel) {
  const int64_t groups = K / 32;
  for (int64_t c = 0; c < cols; ++c) {
    const uint8_t* row = w + (n0 + c) * row_bytes;
    float* to = panel + c * K;
    for (int64_t g = 0; g < groups; ++g) {
      vf w[kVG];
      decode<T>(row, g, w);
      for (int v = 0; v < kVG; ++v) storev(to + g * 32 + v * kLanes, w[v]);
    }
  }
}

template <int64_t T>
void run_gemm(int64_t M, const float* x, int64_t K, const uint8_t* w, int64_t row_bytes,
              int64_t N, float* out) {
  const int64_t panels = (N + kNP - 1) / kNP;
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> panel(kNP * K);
    for (int64_t m0 = 0; m0 < M; m0 += kMB) {
      const int64_t m1 = std::min(M, m0 + kMB);
      for (int64_t p = begin; p < end; ++p) {
        const int64_t n0 = p * kNP, cols = std::min(kNP, N - n0);
        decode_rows<T>(w, row_bytes, n0, cols, K, panel.data());
        for (int64_t m = m0; m < m1; m += kMR) {
          const int rows = static_cast<int>(std::min<int64_t>(kMR, m1 - m));
          for (int64_t c = 0; c < cols; c += kNR) {
            const int nc = static_cast<int>(std::min<int64_t>(kNR, cols - c));
            micro_tile(rows, nc, x + m * K, panel.data() + c * K, K, out + m * N + n0 + c, N);
          }
        }
      }
    }
  });
}

int64_t block_bytes(int64_t t, int64_t* weights) {
  switch (t) {
    case kQ4_0: *weights = 32; return Fmt<kQ4_0>::kBytes;
    case kQ4_1: *weights = 32; return Fmt<kQ4_1>::kBytes;
    case kQ8_0: *weights = 32; return Fmt<kQ8_0>::kBytes;
    case kQ4_K: *weights = 256; return Fmt<kQ4_K>::kBytes;
    case kQ6_K: *weights = 256; return Fmt<kQ6_K>::kBytes;
    default: TORCH_CHECK(false, "GGUF quant type ", t, " is not one this kernel reads");
  }
  return 0;
}

// The checks every operator shares: w is (N, row bytes) uint8 of K weights a row.
int64_t check_weights(const at::Tensor& w, int64_t qtype, int64_t K) {
  TORCH_CHECK(w.device().is_cpu(), "GGUF blocks must be on the CPU");
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kByte && w.is_contiguous(),
              "w must be a contiguous uint8 (N, row bytes) tensor");
  int64_t per = 0;
  const int64_t bytes = block_bytes(qtype, &per);
  TORCH_CHECK(K % per == 0, "K = ", K, " is not a whole number of blocks of ", per);
  TORCH_CHECK(w.size(1) == K / per * bytes, "w rows are ", w.size(1), " bytes; K = ", K,
              " needs ", K / per * bytes);
  return w.size(1);
}

void gguf_linear(const at::Tensor& x, const at::Tensor& w, int64_t qtype, at::Tensor& out) {
  TORCH_CHECK(x.device().is_cpu() && out.device().is_cpu(), "x and out must be on the CPU");
  TORCH_CHECK(x.dim() == 2 && out.dim() == 2, "x and out must be 2-D");
  TORCH_CHECK(x.scalar_type() == at::kFloat && out.scalar_type() == at::kFloat,
              "float32 x and out");
  TORCH_CHECK(x.is_contiguous() && out.is_contiguous(), "contiguous x and out");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  const int64_t row_bytes = check_weights(w, qtype, K);
  TORCH_CHECK(out.size(0) == M && out.size(1) == N, "out must be (M, N)");
  if (M == 0 || N == 0) return;
  const float* xp = x.data_ptr<float>();
  const uint8_t* wp = w.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  auto go = [&](auto fmt) {
    constexpr int64_t T = decltype(fmt)::value;
    if (M <= kGemvRows) {
      run_gemv<T>(M, xp, K, wp, row_bytes, N, op);
    } else {
      run_gemm<T>(M, xp, K, wp, row_bytes, N, op);
    }
  };
  switch (qtype) {
    case kQ4_0: go(std::integral_constant<int64_t, kQ4_0>{}); break;
    case kQ4_1: go(std::integral_constant<int64_t, kQ4_1>{}); break;
    case kQ8_0: go(std::integral_constant<int64_t, kQ8_0>{}); break;
    case kQ4_K: go(std::integral_constant<int64_t, kQ4_K>{}); break;
    case kQ6_K: go(std::integral_constant<int64_t, kQ6_K>{}); break;
    default: break;
  }
}

// The weights as float32 (N, K): the kernel's own decoding, for the tests and for a tensor a
// float op must read (the embedding rows).
void gguf_dequantize(const at::Tensor& w, int64_t qtype, at::Tensor& out) {
  TORCH_CHECK(out.device().is_cpu(), "out must be on the CPU");
  TORCH_CHECK(out.dim() == 2 && out.scalar_type() == at::kFloat && out.is_contiguous(),
              "out must be contiguous float32 (N, K)");
  const int64_t N = w.size(0), K = out.size(1);
  const int64_t row_bytes = check_weights(w, qtype, K);
  TORCH_CHECK(out.size(0) == N, "out must have w's rows");
  const uint8_t* wp = w.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  auto go = [&](auto fmt) {
    constexpr int64_t T = decltype(fmt)::value;
    at::parallel_for(0, N, 64, [&](int64_t n0, int64_t n1) {
      decode_rows<T>(wp, row_bytes, n0, n1 - n0, K, op + n0 * K);
    });
  };
  switch (qtype) {
    case kQ4_0: go(std::integral_constant<int64_t, kQ4_0>{}); break;
    case kQ4_1: go(std::integral_constant<int64_t, kQ4_1>{}); break;
    case kQ8_0: go(std::integral_constant<int64_t, kQ8_0>{}); break;
    case kQ4_K: go(std::integral_constant<int64_t, kQ4_K>{}); break;
    case kQ6_K: go(std::integral_constant<int64_t, kQ6_K>{}); break;
    default: break;
  }
}

}  // namespace

VC_FRAGMENT(VC_OPS, m) {
  m.def("gguf_linear(Tensor x, Tensor w, int qtype, Tensor(a!) out) -> ()", &gguf_linear);
  m.def("gguf_dequantize(Tensor w, int qtype, Tensor(a!) out) -> ()", &gguf_dequantize);
}
