// Weight-only int8 GEMM for many rows (`weight_quant.py`, `--quantization int8`):
//
//   out[m, n] = scale[n] * sum_k x[m, k] * q[n, k]        x float32 (M, K), q int8 (N, K)
//
// the many-rows path of an int8 linear on CPUs without native bfloat16. Each thread takes a
// panel of NB output channels at a time and widens its int8 weights to float32 into a K x NB
// buffer it keeps in cache (NB = two vector registers); each block of up to MB rows of x is
// then multiplied against that panel by a register-blocked micro-kernel (MR rows x NB columns
// of accumulators, one broadcast of x and two panel loads per k, MR x 2 FMAs), and the channel
// scales multiply the accumulators once at the end. Rows go in blocks of MB (96) that stay in
// cache, and each panel is read and widened again for each block: the weights are read from
// memory ceil(M / MB) times per call, at a quarter of float32's bytes, and the widening costs
// K x NB conversions per panel per block, shared by that block's rows (at most MB).
// Activations stay float32 and the sums are float32: the result differs from x @ (q s)^T
// only by float rounding (summation order), so the scheme's error is the weights' alone.
//
// Vector width is chosen at compile time by the builder's -march=native (attention_kernel.py
// builds per CPU, so the code never holds an instruction the CPU lacks): 16-float registers
// where the compiler targets AVX-512, else 8 (AVX2; two NEON registers). `int8_gemm_isa` names
// the path the build took; the tests build the AVX2 path on an AVX-512 machine with
// -mno-avx512f and compare both with the float reference.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#ifndef VC_OPS
#error "build with -DVC_OPS=<the operators' namespace>"
#endif
#define VC_FRAGMENT(ns, m) TORCH_LIBRARY_FRAGMENT(ns, m)

namespace {

#if defined(__AVX512F__)
typedef float vf __attribute__((vector_size(64), aligned(4)));
constexpr int64_t kLanes = 16;
constexpr const char* kIsa = "avx512";
#else
typedef float vf __attribute__((vector_size(32), aligned(4)));
constexpr int64_t kLanes = 8;
#if defined(__AVX2__)
constexpr const char* kIsa = "avx2";
#else
constexpr const char* kIsa = "generic";
#endif
#endif

constexpr int64_t kNB = 2 * kLanes;   // output channels per panel
constexpr int kMR = 6;                // rows per micro-kernel: 12 accumulators + 3 live values
constexpr int64_t kMB = 16 * kMR;     // rows per cache block

// Unaligned loads and stores through the vector type (aligned(4)): one vmovups each. memcpy
// here became two 16-byte halves through the stack on some targets (a stalled store forward
// per load, 5-10x slower).
inline vf load(const float* p) { return *reinterpret_cast<const vf*>(p); }
inline void store(float* p, vf v) { *reinterpret_cast<vf*>(p) = v; }

// Rows m0 .. m0+R-1 of x against one widened panel (K x kNB floats): the R x kNB block of out,
// of which the first `cols` columns are kept, each times its channel's scale.
template <int R>
void micro(const float* x, int64_t ldx, const float* panel, int64_t K, const float* scale,
           float* out, int64_t ldo, int64_t cols) {
  vf acc0[R], acc1[R];
  for (int r = 0; r < R; ++r) acc0[r] = acc1[r] = vf{};
  for (int64_t k = 0; k < K; ++k) {
    const vf w0 = load(panel + k * kNB), w1 = load(panel + k * kNB + kLanes);
    for (int r = 0; r < R; ++r) {
      const float xv = x[r * ldx + k];
      acc0[r] += xv * w0;
      acc1[r] += xv * w1;
    }
  }
  float s[kNB] = {};
  std::copy(scale, scale + cols, s);
  const vf s0 = load(s), s1 = load(s + kLanes);
  for (int r = 0; r < R; ++r) {
    if (cols == kNB) {
      store(out + r * ldo, acc0[r] * s0);
      store(out + r * ldo + kLanes, acc1[r] * s1);
    } else {
      float tmp[kNB];
      store(tmp, acc0[r] * s0);
      store(tmp + kLanes, acc1[r] * s1);
      std::copy(tmp, tmp + cols, out + r * ldo);
    }
  }
}

void rows_tail(int rows, const float* x, int64_t ldx, const float* panel, int64_t K,
               const float* scale, float* out, int64_t ldo, int64_t cols) {
  switch (rows) {
    case 1: micro<1>(x, ldx, panel, K, scale, out, ldo, cols); break;
    case 2: micro<2>(x, ldx, panel, K, scale, out, ldo, cols); break;
    case 3: micro<3>(x, ldx, panel, K, scale, out, ldo, cols); break;
    case 4: micro<4>(x, ldx, panel, K, scale, out, ldo, cols); break;
    case 5: micro<5>(x, ldx, panel, K, scale, out, ldo, cols); break;
    default: break;
  }
}

void int8_gemm(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale,
               at::Tensor& out) {
  TORCH_CHECK(x.dim() == 2 && q.dim() == 2 && scale.dim() == 1 && out.dim() == 2, "bad ranks");
  TORCH_CHECK(x.scalar_type() == at::kFloat && q.scalar_type() == at::kChar &&
                  scale.scalar_type() == at::kFloat && out.scalar_type() == at::kFloat,
              "float32 x, int8 q, float32 scale and out");
  TORCH_CHECK(x.is_contiguous() && q.is_contiguous() && scale.is_contiguous() &&
                  out.is_contiguous(),
              "contiguous tensors only");
  const int64_t M = x.size(0), K = x.size(1), N = q.size(0);
  TORCH_CHECK(q.size(1) == K, "x has ", K, " columns, q ", q.size(1));
  TORCH_CHECK(scale.size(0) == N, "one scale per output channel");
  TORCH_CHECK(out.size(0) == M && out.size(1) == N, "out must be (M, N)");
  const float* xp = x.data_ptr<float>();
  const int8_t* qp = q.data_ptr<int8_t>();
  const float* sp = scale.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t panels = (N + kNB - 1) / kNB;
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> panel(K * kNB);
    // Rows in blocks that stay in cache while this thread's panels pass over them; each
    // panel is widened again for each block (K x kNB conversions against kMB x K x kNB FMAs).
    for (int64_t m0 = 0; m0 < M; m0 += kMB) {
      const int64_t m1 = std::min(M, m0 + kMB);
      for (int64_t p = begin; p < end; ++p) {
        const int64_t n0 = p * kNB, cols = std::min(kNB, N - n0);
        const int8_t* rows = qp + n0 * K;
        for (int64_t k = 0; k < K; ++k) {
          float* to = panel.data() + k * kNB;
          for (int64_t j = 0; j < cols; ++j) to[j] = static_cast<float>(rows[j * K + k]);
          for (int64_t j = cols; j < kNB; ++j) to[j] = 0.f;
        }
        int64_t m = m0;
        for (; m + kMR <= m1; m += kMR)
          micro<kMR>(xp + m * K, K, panel.data(), K, sp + n0, op + m * N + n0, N, cols);
        if (m < m1)
          rows_tail(static_cast<int>(m1 - m), xp + m * K, K, panel.data(), K, sp + n0,
                    op + m * N + n0, N, cols);
      }
    }
  });
}

std::string int8_gemm_isa() { return kIsa; }

}  // namespace

VC_FRAGMENT(VC_OPS, m) {
  m.def("int8_gemm(Tensor x, Tensor q, Tensor scale, Tensor(a!) out) -> ()", &int8_gemm);
  m.def("int8_gemm_isa() -> str", &int8_gemm_isa);
}
