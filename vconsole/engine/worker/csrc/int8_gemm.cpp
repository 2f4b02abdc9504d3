// Int8 GEMM for int8 weights (`weight_quant.py`, `--quantization int8`, issue #49):
//
//   out[m, n] = scale[n] * sum_b a[m, b] * sum_{k in block b} xq[m, k] * q[n, k]
//
// x float32 (M, K) is quantized here, once per call, in blocks of 32 along K (as llama.cpp's
// Q8_0 activations): a[m, b] = max |x[m, block b]| / 127, xq = round(x / a) in [-127, 127].
// q int8 (N, K) are the weights (per-channel scale[n]), packed at load by `weight_quant.pack`:
//
//   packed[p][g][c][t] = q[16 p + c][4 g + t]      panels of 16 channels, K in groups of 4
//
// padded with zeros to whole panels and to K a multiple of 32, stored as unsigned bytes
// (q + 128, i.e. q ^ 0x80) for the paths marked u8 below and as signed bytes for `avx2`. One
// 64-byte load is then 16 channels x 4 k, the operand of one AVX-512 `vpdpbusd`.
//
// The products of a block are summed exactly in int32, converted to float once per block,
// times a[m, b], and summed in float32 over the blocks; the channel scales multiply at the end.
// The error against x @ (q s)^T is the activations' rounding alone, at most a[m, b] / 2 per
// element: |out - ref|[m, n] <= s[n] * sum_b a[m, b] / 2 * sum_{k in b} |q[n, k]|, plus float
// rounding of K / 32 block sums (tests/engine/worker/test_int8_gemm.py checks each path).
//
// The paths (`int8_gemm_paths` lists those this build holds and this CPU runs, best first):
//
//   avx512-vnni  u8 weights x s8 activations, `vpdpbusd` on 16 int32 lanes (4 products each):
//                the u8 trick, sum (q + 128) x = sum q x + 128 sum x, whose last term is one
//                number per row and block, subtracted by starting the block's sums at it;
//   avx-vnni     the same with 256-bit `vpdpbusd` (AVX-VNNI, or AVX-512 VL);
//   avx2         `vpmaddubsw` (u8 x s8 pairs into int16, saturating) cannot take q + 128
//                (255 x 127 x 2 overflows), so the weights stay signed and llama.cpp's sign
//                trick makes the unsigned operand: |x| times q with x's sign, pairs at most
//                2 x 127 x 127 (exact in int16), then `vpmaddwd` by ones into int32;
//   generic      plain C++ over the u8 layout (the compiler vectorizes what it may).
//
// Which paths exist is decided at compile time (the builder compiles for this CPU with
// -march=native; the tests build with -mno-avx512f too) and checked again at run time with
// __builtin_cpu_supports, so a path never runs an instruction the CPU lacks. The tests run each
// path by name on every build they make.
//
// Parallel over chunks of panels: a thread keeps its chunk's weights (K x 16 x panels bytes)
// in cache and passes every row over them; the rows' quantized activations (M x K bytes) stay
// in L2.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#ifndef VC_OPS
#error "build with -DVC_OPS=<the operators' namespace>"
#endif
#define VC_FRAGMENT(ns, m) TORCH_LIBRARY_FRAGMENT(ns, m)

namespace {

#if defined(__AVX512F__)
constexpr const char* kIsa = "avx512";
#elif defined(__AVX2__)
constexpr const char* kIsa = "avx2";
#else
constexpr const char* kIsa = "generic";
#endif

constexpr int64_t kPanel = 16;   // output channels per panel
constexpr int64_t kGroup = 4;    // k per packed group (one int32 lane of vpdpbusd)
constexpr int64_t kBlock = 32;   // k per activation scale
constexpr int64_t kGroupsPerBlock = kBlock / kGroup;

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define VC_HAVE_VNNI512 1
#endif
#if defined(__AVXVNNI__) || (defined(__AVX512VNNI__) && defined(__AVX512VL__))
#define VC_HAVE_VNNI256 1
#endif
#if defined(__AVX2__)
#define VC_HAVE_AVX2 1
#endif
// A CPU (or VM) may grant AVX2 without FMA: the scales' multiply-add is then two instructions.
#if defined(__FMA__)
#define VC_MADD256(a, b, c) _mm256_fmadd_ps(a, b, c)
#else
#define VC_MADD256(a, b, c) _mm256_add_ps(_mm256_mul_ps(a, b), c)
#endif

// The quantized rows: xq (M, Kp) int8, a (M, nb) scales, c (M, nb) = -128 x each block's sum
// of xq (the u8 paths' correction).
struct Rows {
  const int8_t* xq;
  const float* a;
  const int32_t* c;
  int64_t kp, nb;
};

// One chunk of panels: its packed weights, scales and output columns.
struct Cols {
  const uint8_t* w;   // panel p0's bytes; panel j at w + j * kp * kPanel
  const float* s;     // scale + n0
  float* out;         // out + n0
  int64_t ldo;        // N
  int64_t cols;       // valid columns from n0 (may be less than np * kPanel)
};

inline int32_t load4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// Stores a row's panel j (16 floats in `v`) where its columns are valid.
inline void store_cols(const float* v, const Cols& c, int r, int j) {
  const int64_t n = j * kPanel, valid = std::min<int64_t>(kPanel, c.cols - n);
  if (valid > 0) std::copy(v, v + valid, c.out + r * c.ldo + n);
}

inline void scales_of(const Cols& c, int j, float* s) {
  const int64_t n = j * kPanel, valid = std::max<int64_t>(0, std::min(kPanel, c.cols - n));
  std::fill(s, s + kPanel, 0.f);
  std::copy(c.s + n, c.s + n + valid, s);
}

// ---- avx512-vnni --------------------------------------------------------------------------

#ifdef VC_HAVE_VNNI512
template <int R, int NP>
__attribute__((always_inline)) inline void micro_vnni512(const Rows& x, int64_t m0,
                                                         const Cols& c) {
  __m512 acc[R][NP];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < NP; ++j) acc[r][j] = _mm512_setzero_ps();
  const int64_t pstride = x.kp * kPanel;
  for (int64_t b = 0; b < x.nb; ++b) {
    __m512i sum[R][NP];
    for (int r = 0; r < R; ++r) {
      const __m512i init = _mm512_set1_epi32(x.c[(m0 + r) * x.nb + b]);
      for (int j = 0; j < NP; ++j) sum[r][j] = init;
    }
    const uint8_t* wb = c.w + b * kBlock * kPanel;
    const int8_t* xb = x.xq + m0 * x.kp + b * kBlock;
    for (int g = 0; g < kGroupsPerBlock; ++g) {
      __m512i w[NP];
      for (int j = 0; j < NP; ++j)
        w[j] = _mm512_loadu_si512(wb + j * pstride + g * kGroup * kPanel);
      for (int r = 0; r < R; ++r) {
        const __m512i xv = _mm512_set1_epi32(load4(xb + r * x.kp + g * kGroup));
        for (int j = 0; j < NP; ++j) sum[r][j] = _mm512_dpbusd_epi32(sum[r][j], w[j], xv);
      }
    }
    for (int r = 0; r < R; ++r) {
      const __m512 av = _mm512_set1_ps(x.a[(m0 + r) * x.nb + b]);
      for (int j = 0; j < NP; ++j)
        acc[r][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum[r][j]), av, acc[r][j]);
    }
  }
  for (int j = 0; j < NP; ++j) {
    alignas(64) float s[kPanel];
    scales_of(c, j, s);
    const __m512 sv = _mm512_load_ps(s);
    for (int r = 0; r < R; ++r) {
      if ((j + 1) * kPanel <= c.cols) {
        _mm512_storeu_ps(c.out + (m0 + r) * c.ldo + j * kPanel, _mm512_mul_ps(acc[r][j], sv));
      } else {
        alignas(64) float v[kPanel];
        _mm512_store_ps(v, _mm512_mul_ps(acc[r][j], sv));
        store_cols(v, c, static_cast<int>(m0 + r), j);
      }
    }
  }
}

struct Vnni512 {
  static constexpr int kMR = 4, kNP = 3;
  template <int R, int NP>
  static void micro(const Rows& x, int64_t m0, const Cols& c) { micro_vnni512<R, NP>(x, m0, c); }
};
#endif

// ---- avx-vnni / avx2 (256-bit) ------------------------------------------------------------

#if defined(VC_HAVE_VNNI256) || defined(VC_HAVE_AVX2)
// One 256-bit step: sum += the 8 channels x 4 k of `w` times the 4 activations in `xv`.
template <bool Vnni>
__attribute__((always_inline)) inline __m256i dot4(__m256i sum, __m256i w, __m256i xv) {
  if constexpr (Vnni) {
#if defined(__AVXVNNI__)
    return _mm256_dpbusd_avx_epi32(sum, w, xv);
#elif defined(VC_HAVE_VNNI256)
    return _mm256_dpbusd_epi32(sum, w, xv);
#else
    return sum;
#endif
  } else {
    // w signed; |x| as the unsigned operand, w with x's sign as the signed one.
    const __m256i p16 = _mm256_maddubs_epi16(_mm256_abs_epi8(xv), _mm256_sign_epi8(w, xv));
    return _mm256_add_epi32(sum, _mm256_madd_epi16(p16, _mm256_set1_epi16(1)));
  }
}

// R rows x one panel (two 8-channel halves).
template <bool Vnni, int R, int NP>
__attribute__((always_inline)) inline void micro_256(const Rows& x, int64_t m0, const Cols& c) {
  constexpr int H = 2 * NP;
  __m256 acc[R][H];
  for (int r = 0; r < R; ++r)
    for (int h = 0; h < H; ++h) acc[r][h] = _mm256_setzero_ps();
  const int64_t pstride = x.kp * kPanel;
  for (int64_t b = 0; b < x.nb; ++b) {
    __m256i sum[R][H];
    for (int r = 0; r < R; ++r) {
      const __m256i init = Vnni ? _mm256_set1_epi32(x.c[(m0 + r) * x.nb + b])
                                : _mm256_setzero_si256();
      for (int h = 0; h < H; ++h) sum[r][h] = init;
    }
    const uint8_t* wb = c.w + b * kBlock * kPanel;
    const int8_t* xb = x.xq + m0 * x.kp + b * kBlock;
    for (int g = 0; g < kGroupsPerBlock; ++g) {
      __m256i w[H];
      for (int h = 0; h < H; ++h)
        w[h] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(
            wb + (h / 2) * pstride + g * kGroup * kPanel + (h % 2) * 32));
      for (int r = 0; r < R; ++r) {
        const __m256i xv = _mm256_set1_epi32(load4(xb + r * x.kp + g * kGroup));
        for (int h = 0; h < H; ++h) sum[r][h] = dot4<Vnni>(sum[r][h], w[h], xv);
      }
    }
    for (int r = 0; r < R; ++r) {
      const __m256 av = _mm256_set1_ps(x.a[(m0 + r) * x.nb + b]);
      for (int h = 0; h < H; ++h)
        acc[r][h] = VC_MADD256(_mm256_cvtepi32_ps(sum[r][h]), av, acc[r][h]);
    }
  }
  for (int j = 0; j < NP; ++j) {
    alignas(32) float s[kPanel];
    scales_of(c, j, s);
    const __m256 s0 = _mm256_load_ps(s), s1 = _mm256_load_ps(s + 8);
    for (int r = 0; r < R; ++r) {
      alignas(32) float v[kPanel];
      _mm256_store_ps(v, _mm256_mul_ps(acc[r][2 * j], s0));
      _mm256_store_ps(v + 8, _mm256_mul_ps(acc[r][2 * j + 1], s1));
      store_cols(v, c, static_cast<int>(m0 + r), j);
    }
  }
}

#ifdef VC_HAVE_VNNI256
struct Vnni256 {
  static constexpr int kMR = 2, kNP = 1;
  template <int R, int NP>
  static void micro(const Rows& x, int64_t m0, const Cols& c) { micro_256<true, R, NP>(x, m0, c); }
};
#endif
#ifdef VC_HAVE_AVX2
struct Avx2 {
  static constexpr int kMR = 2, kNP = 1;
  template <int R, int NP>
  static void micro(const Rows& x, int64_t m0, const Cols& c) { micro_256<false, R, NP>(x, m0, c); }
};
#endif
#endif

// ---- generic ------------------------------------------------------------------------------

struct Generic {
  static constexpr int kMR = 1, kNP = 1;
  template <int R, int NP>
  static void micro(const Rows& x, int64_t m0, const Cols& c) {
    float acc[kPanel] = {};
    for (int64_t b = 0; b < x.nb; ++b) {
      int32_t sum[kPanel];
      std::fill(sum, sum + kPanel, x.c[m0 * x.nb + b]);
      const uint8_t* wb = c.w + b * kBlock * kPanel;
      const int8_t* xb = x.xq + m0 * x.kp + b * kBlock;
      for (int64_t g = 0; g < kGroupsPerBlock; ++g)
        for (int64_t n = 0; n < kPanel; ++n)
          for (int64_t t = 0; t < kGroup; ++t)
            sum[n] += static_cast<int32_t>(wb[(g * kPanel + n) * kGroup + t]) *
                      static_cast<int32_t>(xb[g * kGroup + t]);
      const float a = x.a[m0 * x.nb + b];
      for (int64_t n = 0; n < kPanel; ++n) acc[n] += static_cast<float>(sum[n]) * a;
    }
    float s[kPanel];
    scales_of(c, 0, s);
    for (int64_t n = 0; n < kPanel; ++n) acc[n] *= s[n];
    store_cols(acc, c, static_cast<int>(m0), 0);
  }
};

// ---- driver -------------------------------------------------------------------------------

template <class P, int R>
void rows_of(const Rows& x, int64_t m0, const Cols& c, int64_t np) {
  if constexpr (P::kNP >= 3) {
    if (np == 3) return P::template micro<R, 3>(x, m0, c);
  }
  if constexpr (P::kNP >= 2) {
    if (np == 2) return P::template micro<R, 2>(x, m0, c);
  }
  P::template micro<R, 1>(x, m0, c);
}

template <class P, int R = P::kMR>
void tail_rows(int rows, const Rows& x, int64_t m0, const Cols& c, int64_t np) {
  if constexpr (R > 1) {
    if (rows == R - 1) return rows_of<P, R - 1>(x, m0, c, np);
    return tail_rows<P, R - 1>(rows, x, m0, c, np);
  }
}

template <class P>
void run(const Rows& x, int64_t M, const uint8_t* w, const float* s, float* out, int64_t N) {
  const int64_t panels = (N + kPanel - 1) / kPanel;
  const int64_t chunks = (panels + P::kNP - 1) / P::kNP;
  at::parallel_for(0, chunks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t ch = begin; ch < end; ++ch) {
      const int64_t p0 = ch * P::kNP, np = std::min<int64_t>(P::kNP, panels - p0);
      const int64_t n0 = p0 * kPanel;
      const Cols c{w + p0 * x.kp * kPanel, s + n0, out + n0, N, N - n0};
      int64_t m = 0;
      for (; m + P::kMR <= M; m += P::kMR)
        rows_of<P, P::kMR>(x, m, c, np);
      if (m < M) tail_rows<P>(static_cast<int>(M - m), x, m, c, np);
    }
  });
}

// Quantizes x (M, K) into blocks of 32: xq (M, kp), a and c (M, nb); the padding is zero.
void quantize_rows(const float* x, int64_t M, int64_t K, int64_t kp, int8_t* xq, float* a,
                   int32_t* c) {
  const int64_t nb = kp / kBlock;
  at::parallel_for(0, M, 16, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      for (int64_t b = 0; b < nb; ++b) {
        const int64_t k0 = b * kBlock, k1 = std::min(K, k0 + kBlock);
        const float* xr = x + m * K;
        float amax = 0.f;
        for (int64_t k = k0; k < k1; ++k) amax = std::max(amax, std::fabs(xr[k]));
        const float scale = amax / 127.f, inv = amax > 0.f ? 127.f / amax : 0.f;
        int8_t* q = xq + m * kp + k0;
        int32_t sum = 0;
        for (int64_t k = k0; k < k1; ++k) {
          const float v = std::nearbyint(xr[k] * inv);
          const int32_t qi = static_cast<int32_t>(std::min(127.f, std::max(-127.f, v)));
          q[k - k0] = static_cast<int8_t>(qi);
          sum += qi;
        }
        for (int64_t k = k1; k < k0 + kBlock; ++k) q[k - k0] = 0;
        a[m * nb + b] = scale;
        c[m * nb + b] = -128 * sum;
      }
    }
  });
}

// This build's paths that this CPU runs, best first.
std::vector<std::string> paths() {
  std::vector<std::string> out;
#if defined(__x86_64__) || defined(__i386__)
  __builtin_cpu_init();
#ifdef VC_HAVE_VNNI512
  if (__builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512bw"))
    out.emplace_back("avx512-vnni");
#endif
#ifdef VC_HAVE_VNNI256
#if defined(__AVXVNNI__)
  if (__builtin_cpu_supports("avxvnni")) out.emplace_back("avx-vnni");
#else
  if (__builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512vl"))
    out.emplace_back("avx-vnni");
#endif
#endif
#ifdef VC_HAVE_AVX2
  if (__builtin_cpu_supports("avx2")) out.emplace_back("avx2");
#endif
#endif
  out.emplace_back("generic");
  return out;
}

std::string int8_gemm_paths() {
  std::string out;
  for (const auto& p : paths()) out += (out.empty() ? "" : ",") + p;
  return out;
}

void int8_gemm(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale,
               at::Tensor& out, const std::string& path) {
  TORCH_CHECK(x.dim() == 2 && packed.dim() == 4 && scale.dim() == 1 && out.dim() == 2,
              "bad ranks");
  TORCH_CHECK(x.scalar_type() == at::kFloat && packed.scalar_type() == at::kChar &&
                  scale.scalar_type() == at::kFloat && out.scalar_type() == at::kFloat,
              "float32 x, int8 packed weights, float32 scale and out");
  TORCH_CHECK(x.is_contiguous() && packed.is_contiguous() && scale.is_contiguous() &&
                  out.is_contiguous(),
              "contiguous tensors only");
  const int64_t M = x.size(0), K = x.size(1), N = out.size(1);
  const int64_t kp = (K + kBlock - 1) / kBlock * kBlock, panels = (N + kPanel - 1) / kPanel;
  TORCH_CHECK(packed.size(0) == panels && packed.size(1) == kp / kGroup &&
                  packed.size(2) == kPanel && packed.size(3) == kGroup,
              "packed weights must be (", panels, ", ", kp / kGroup, ", 16, 4) for K = ", K,
              " and N = ", N, ": (weight_quant.pack)");
  TORCH_CHECK(scale.size(0) == N, "one scale per output channel");
  TORCH_CHECK(out.size(0) == M, "out must be (M, N)");
  const std::vector<std::string> have = paths();
  const std::string use = path == "auto" ? have.front() : path;
  TORCH_CHECK(std::find(have.begin(), have.end(), use) != have.end(), "int8 path '", path,
              "' is not in this build or not on this CPU (", int8_gemm_paths(), ")");
  if (M == 0) return;
  const int64_t nb = kp / kBlock;
  std::vector<int8_t> xq(M * kp);
  std::vector<float> a(M * nb);
  std::vector<int32_t> c(M * nb);
  quantize_rows(x.data_ptr<float>(), M, K, kp, xq.data(), a.data(), c.data());
  const Rows rows{xq.data(), a.data(), c.data(), kp, nb};
  const auto* w = reinterpret_cast<const uint8_t*>(packed.data_ptr<int8_t>());
  const float* s = scale.data_ptr<float>();
  float* o = out.data_ptr<float>();
#ifdef VC_HAVE_VNNI512
  if (use == "avx512-vnni") return run<Vnni512>(rows, M, w, s, o, N);
#endif
#ifdef VC_HAVE_VNNI256
  if (use == "avx-vnni") return run<Vnni256>(rows, M, w, s, o, N);
#endif
#ifdef VC_HAVE_AVX2
  if (use == "avx2") return run<Avx2>(rows, M, w, s, o, N);
#endif
  run<Generic>(rows, M, w, s, o, N);
}

std::string int8_gemm_isa() { return kIsa; }

}  // namespace

VC_FRAGMENT(VC_OPS, m) {
  m.def("int8_gemm(Tensor x, Tensor packed, Tensor scale, Tensor(a!) out, str path) -> ()",
        &int8_gemm);
  m.def("int8_gemm_paths() -> str", &int8_gemm_paths);
  m.def("int8_gemm_isa() -> str", &int8_gemm_isa);
}
