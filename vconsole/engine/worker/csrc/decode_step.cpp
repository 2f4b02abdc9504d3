// A whole decode step of a Llama-family decoder in one call (`native_decode.py`, issue #47):
// every layer of a step of 1-8 single-token rows, with no Python between the ops.
//
// On a small model the Python around each op costs as much as the op: SmolLM2's 30 layers
// issue some 40 torch calls each (norms, RoPE, the KV write, views, adds), each a few
// microseconds of interpreter and dispatcher, against ~80 us of kernel per layer. Here the
// layer loop is C++: the elementwise work of a few rows (RMSNorm, RoPE, the residual adds,
// SiLU * up) is plain loops over at most 8 x 1536 floats, the matmuls and the attention are the
// very kernels the Python path calls:
//   - GGUF blocks: this build's `gguf_linear` operator (csrc/gguf_gemm.cpp), through the
//     dispatcher (one lookup, then a typed call: the same code with the same threads);
//   - float32 weights: at::linear, which is what F.linear calls (same BLAS call);
//   - int8 weights: at::_weight_int8pack_mm, as `weight_quant.Int8Linear` calls it for <= 4 rows
//     (a plan with int8 linears runs at most those 4 rows: `max_rows`);
//   - attention: vc::attend_f32 (attend_f32.cpp) over the float32 pool, read in place through
//     the block table, after this step's K/V are copied into their slots (what index_copy_ does).
//
// A row is one token at one position with its own slot, block table and context length. Two
// rows may be one request's: a speculative step's draft row (1 + k tokens at consecutive
// positions, `native_decode.py`) comes as 1 + k rows, each with the request's block table and
// the context up to its own position. Each layer writes every row's K/V into its slot before any
// row attends, so row j reads the tokens before it in the same step and none after it: the
// causal attention a draft's verification needs, with the per-row kernel the Python path runs
// for such a row too (paged_attention.py).
//
// The elementwise loops do the Python path's operations in its order, IEEE and one rounding
// each, and the two places where torch's own vector code decides the rounding are torch's: the
// RMSNorm's mean of squares (at::mean) and SiLU (at::silu, its exp). So the step is the Python
// path's bit for bit: same hidden states, same logits, same tokens, on int8 weights too, whose
// bfloat16 activations would turn an ulp of difference into a different token within a few
// dozen steps (the tests compare hidden states exactly and tokens over dozens of steps). That
// needs this file compiled without fast math and without contraction into fused multiply-adds:
// the build gives it its own flags (attention_kernel.FILE_CFLAGS: -fno-fast-math
// -ffp-contract=off after the library's -ffast-math), and a build with fast math stops at the
// #error below (GCC's optimize pragma would not be enough: clang ignores it).
//
// A model is packed once (`decode_plan`): its tensors are held by the plan (no copy), which
// lives in a registry under an integer handle until `decode_plan_free`; `decode_plan_pools`
// points it at the KV pool (per layer K and V, float32 (NB, B, KVH, D)). `decode_step` runs
// one step: the embedded rows h (R, hidden), cos/sin (R, D) from the model's rotary module,
// each row's slot, block table and context length; it returns the final-normed hidden states
// (R, hidden). Torch's thread pool is used by the kernels it calls; the loops here are serial
// (a few thousand floats a layer).
//
// Threads: a plan's GGUF output buffers are reused every step, so a step and a change of its
// pools take the plan's own lock: two threads stepping one plan run one after the other (the
// engine runs one step at a time; an uncontended lock costs nothing next to a step). Freeing a
// plan while a step runs is safe too: the step holds its own reference.
//
// Only torch/library.h is included (no custom class, no pybind11): the file compiles beside the
// others in a few seconds.

#if defined(__FAST_MATH__)
#error "decode_step.cpp must be compiled without fast math (-fno-fast-math -ffp-contract=off): its bit-equality with the Python path needs IEEE operations"
#endif

#include "attention.h"

#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/_weight_int8pack_mm.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/linear.h>
#include <ATen/ops/mean.h>
#include <ATen/ops/silu.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <utility>
#include <vector>

#ifndef VC_OPS
#error "build with -DVC_OPS=<the operators' namespace>"
#endif
#define VC_FRAGMENT(ns, m) TORCH_LIBRARY_FRAGMENT(ns, m)
#define VC_STR2(x) #x
#define VC_STR(x) VC_STR2(x)


namespace {

using at::Tensor;

enum Kind : int64_t { kFloat = 0, kGGUF = 1, kInt8 = 2 };
constexpr int64_t kMaxRows = 8;   // the GGUF GEMV's width (gguf_gemm.cpp kGemvRows)

struct Linear {
  int64_t kind = kFloat;
  Tensor w;       // float (N, K); GGUF blocks (N, row bytes) uint8; int8 (N, K)
  Tensor bias;    // (N,) float32, or undefined
  Tensor scale;   // int8: the bfloat16 scales _weight_int8pack_mm takes
  int64_t qtype = 0;
  int64_t n = 0;
};

struct Layer {
  Tensor ln1, ln2;
  float eps1 = 0.f, eps2 = 0.f;
  Linear qkv, o, gate_up, down;
  int64_t window = 0;
};

struct Plan {
  int64_t nh = 0, nkv = 0, hd = 0, hidden = 0, inter = 0;
  int64_t max_rows = kMaxRows;   // the widest step it runs as the Python path does
  std::mutex lock;               // one step (or change of pools) at a time
  float scaling = 1.f;
  Tensor norm_w;
  float norm_eps = 0.f;
  std::vector<Layer> layers;
  std::vector<Tensor> k_pools, v_pools;
  // Output buffers of the GGUF linears, by (rows, width): reused every step.
  std::map<std::pair<int64_t, int64_t>, Tensor> buffers;

  Tensor& buffer(int64_t rows, int64_t width) {
    auto& t = buffers[{rows, width}];
    if (!t.defined()) t = at::empty({rows, width}, at::kFloat);
    return t;
  }
};

std::mutex registry_lock;
std::map<int64_t, std::shared_ptr<Plan>> registry;
int64_t next_handle = 1;

std::shared_ptr<Plan> find(int64_t handle) {
  std::lock_guard<std::mutex> g(registry_lock);
  auto it = registry.find(handle);
  TORCH_CHECK(it != registry.end(), "no decode plan ", handle, " (freed, or never made)");
  return it->second;
}

using GGUFLinearFn = void(const Tensor&, const Tensor&, int64_t, Tensor&);

c10::TypedOperatorHandle<GGUFLinearFn>& gguf_linear_op() {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow(VC_STR(VC_OPS) "::gguf_linear", "")
                       .typed<GGUFLinearFn>();
  return op;
}

Linear make_linear(int64_t kind, const Tensor& w, const Tensor& bias, const Tensor& scale,
                   int64_t qtype, int64_t k) {
  TORCH_CHECK(kind == kFloat || kind == kGGUF || kind == kInt8, "linear kind ", kind,
              " is not 0 (float32), 1 (GGUF blocks) or 2 (int8)");
  TORCH_CHECK(w.device().is_cpu() && w.dim() == 2 && w.is_contiguous(),
              "a linear's weight must be a contiguous 2-D CPU tensor");
  Linear lin;
  lin.kind = kind;
  lin.w = w;
  lin.qtype = qtype;
  lin.n = w.size(0);
  if (kind == kFloat)
    TORCH_CHECK(w.scalar_type() == at::kFloat && w.size(1) == k, "float32 (N, ", k,
                ") weights expected");
  if (kind == kGGUF) TORCH_CHECK(w.scalar_type() == at::kByte, "GGUF blocks are uint8");
  if (kind == kInt8) {
    TORCH_CHECK(w.scalar_type() == at::kChar && w.size(1) == k, "int8 (N, ", k,
                ") weights expected");
    TORCH_CHECK(scale.defined() && scale.numel() == lin.n, "int8 weights need N scales");
    lin.scale = scale;
  }
  if (bias.defined() && bias.numel() > 0) {
    TORCH_CHECK(bias.scalar_type() == at::kFloat && bias.is_contiguous() &&
                    bias.numel() == lin.n,
                "a bias is (N,) contiguous float32");
    lin.bias = bias;
  }
  return lin;
}

// y (R, N) float32 = x (R, K) @ W^T + b, by the kernel the Python path calls for this kind.
Tensor apply(Plan& p, const Linear& lin, const Tensor& x) {
  Tensor y;
  if (lin.kind == kGGUF) {
    y = p.buffer(x.size(0), lin.n);
    Tensor& out = y;
    gguf_linear_op().call(x, lin.w, lin.qtype, out);
  } else if (lin.kind == kInt8) {
    y = at::_weight_int8pack_mm(x.to(at::kBFloat16), lin.w, lin.scale).to(at::kFloat);
  } else {
    return at::linear(x, lin.w, lin.bias.defined() ? c10::optional<Tensor>(lin.bias)
                                                   : c10::optional<Tensor>());
  }
  if (lin.bias.defined()) {
    float* yp = y.data_ptr<float>();
    const float* bp = lin.bias.data_ptr<float>();
    for (int64_t r = 0; r < y.size(0); ++r)
      for (int64_t i = 0; i < lin.n; ++i) yp[r * lin.n + i] += bp[i];
  }
  return y;
}

// transformers' LlamaRMSNorm on the rows of x (R, n) into out: w * (x * rsqrt(mean(x^2) +
// eps)). The squares are this loop's (x * x is what pow(2) computes), their mean is at::mean's
// (the reduction the Python path runs, in its order), the rest IEEE operations in its order: the
// result is the Python path's bit for bit. `sq` and `mean` are (R, n) and (R, 1) scratch.
void rmsnorm(const float* x, const float* w, float eps, Tensor& sq, Tensor& mean, float* out) {
  const int64_t rows = sq.size(0), n = sq.size(1);
  float* sp = sq.data_ptr<float>();
  for (int64_t i = 0; i < rows * n; ++i) sp[i] = x[i] * x[i];
  at::mean_out(mean, sq, {-1}, true);
  const float* mp = mean.data_ptr<float>();
  for (int64_t r = 0; r < rows; ++r) {
    const float inv = 1.f / std::sqrt(mp[r] + eps);
    const float* xr = x + r * n;
    float* o = out + r * n;
    for (int64_t i = 0; i < n; ++i) o[i] = w[i] * (xr[i] * inv);
  }
}

// q * cos + rotate_half(q) * sin on `heads` heads of D at x (in place), rotate_half(q) being
// (-q[D/2:], q[:D/2]).
void rope(float* x, int64_t heads, int64_t d, const float* cos, const float* sin) {
  const int64_t half = d / 2;
  float tmp[512];
  for (int64_t h = 0; h < heads; ++h) {
    float* v = x + h * d;
    std::memcpy(tmp, v, sizeof(float) * d);
    for (int64_t i = 0; i < half; ++i) {
      const float a = tmp[i] * cos[i];
      const float b = (-tmp[i + half]) * sin[i];
      v[i] = a + b;
    }
    for (int64_t i = half; i < d; ++i) {
      const float a = tmp[i] * cos[i];
      const float b = tmp[i - half] * sin[i];
      v[i] = a + b;
    }
  }
}

int64_t decode_plan(std::vector<Tensor> tensors, std::vector<int64_t> ints,
                    std::vector<double> floats) {
  // ints: nh, nkv, hd, hidden, inter, layers, max rows (at most kMaxRows; 4 with int8
  // linears, whose Python path leaves _weight_int8pack_mm past 4 rows), then per layer: window
  // and, per linear (qkv, o, gate_up, down), kind and qtype. floats: scaling, norm eps, then per layer eps1, eps2.
  // tensors: norm weight, then per layer ln1, ln2 and per linear weight, bias, scale (an empty
  // tensor where there is none).
  TORCH_CHECK(ints.size() >= 7, "decode_plan: the model's sizes first");
  auto p = std::make_shared<Plan>();
  p->nh = ints[0];
  p->nkv = ints[1];
  p->hd = ints[2];
  p->hidden = ints[3];
  p->inter = ints[4];
  const int64_t num_layers = ints[5];
  p->max_rows = ints[6];
  TORCH_CHECK(p->max_rows >= 1 && p->max_rows <= kMaxRows, "decode_plan: steps of 1 to ",
              p->max_rows, " rows: at most ", kMaxRows);
  TORCH_CHECK(p->nh > 0 && p->nkv > 0 && p->nh % p->nkv == 0 && p->hd > 0 && p->hd % 2 == 0 &&
                  p->hd <= 512,
              "decode_plan: heads ", p->nh, "/", p->nkv, " of ", p->hd, " are not supported");
  TORCH_CHECK(ints.size() == static_cast<size_t>(7 + num_layers * 9) &&
                  floats.size() == static_cast<size_t>(2 + num_layers * 2) &&
                  tensors.size() == static_cast<size_t>(1 + num_layers * 14),
              "decode_plan: ", num_layers, " layers need ", 7 + num_layers * 9, " ints, ",
              2 + num_layers * 2, " floats and ", 1 + num_layers * 14, " tensors");
  p->scaling = static_cast<float>(floats[0]);
  p->norm_eps = static_cast<float>(floats[1]);
  const auto vec = [&](const Tensor& t, const char* what) {
    TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat && t.is_contiguous() &&
                    t.numel() == p->hidden,
                what, " must be a contiguous float32 (", p->hidden, ",) CPU tensor");
    return t;
  };
  p->norm_w = vec(tensors[0], "the final norm's weight");
  const int64_t qkv_n = (p->nh + 2 * p->nkv) * p->hd;
  for (int64_t l = 0; l < num_layers; ++l) {
    const int64_t* li = ints.data() + 7 + l * 9;
    const Tensor* lt = tensors.data() + 1 + l * 14;
    Layer layer;
    layer.window = li[0];
    layer.ln1 = vec(lt[0], "a layer norm's weight");
    layer.ln2 = vec(lt[1], "a layer norm's weight");
    layer.eps1 = static_cast<float>(floats[2 + 2 * l]);
    layer.eps2 = static_cast<float>(floats[3 + 2 * l]);
    const int64_t widths[4] = {p->hidden, p->nh * p->hd, p->hidden, p->inter};
    Linear* lins[4] = {&layer.qkv, &layer.o, &layer.gate_up, &layer.down};
    for (int j = 0; j < 4; ++j)
      *lins[j] = make_linear(li[1 + 2 * j], lt[2 + 3 * j], lt[3 + 3 * j], lt[4 + 3 * j],
                             li[2 + 2 * j], widths[j]);
    TORCH_CHECK(layer.qkv.n == qkv_n && layer.o.n == p->hidden &&
                    layer.gate_up.n == 2 * p->inter && layer.down.n == p->hidden,
                "decode_plan: layer ", l, "'s linears do not have the model's widths");
    p->layers.push_back(std::move(layer));
  }
  if (p->layers.size() > 0 && p->layers[0].qkv.kind == kGGUF) gguf_linear_op();  // found now
  std::lock_guard<std::mutex> g(registry_lock);
  const int64_t handle = next_handle++;
  registry[handle] = std::move(p);
  return handle;
}

void decode_plan_free(int64_t handle) {
  std::lock_guard<std::mutex> g(registry_lock);
  registry.erase(handle);
}

void decode_plan_pools(int64_t handle, std::vector<Tensor> k_pools, std::vector<Tensor> v_pools) {
  auto p = find(handle);
  std::lock_guard<std::mutex> step(p->lock);
  TORCH_CHECK(k_pools.size() == p->layers.size() && v_pools.size() == p->layers.size(),
              "one K and one V pool per layer");
  for (size_t l = 0; l < k_pools.size(); ++l) {
    const Tensor& k = k_pools[l];
    const Tensor& v = v_pools[l];
    TORCH_CHECK(k.device().is_cpu() && k.scalar_type() == at::kFloat && k.is_contiguous() &&
                    k.dim() == 4 && k.size(2) == p->nkv && k.size(3) == p->hd &&
                    v.sizes() == k.sizes() && v.scalar_type() == at::kFloat &&
                    v.is_contiguous(),
                "pools are contiguous float32 (NB, B, ", p->nkv, ", ", p->hd, ") K and V");
    TORCH_CHECK(k.sizes() == k_pools[0].sizes(), "every layer's pool has one shape");
  }
  p->k_pools = std::move(k_pools);
  p->v_pools = std::move(v_pools);
}

Tensor decode_step(int64_t handle, const Tensor& h, const Tensor& cos, const Tensor& sin,
                   const Tensor& slots, const Tensor& tables, const Tensor& lens) {
  auto plan = find(handle);
  Plan& p = *plan;
  std::lock_guard<std::mutex> step(p.lock);
  TORCH_CHECK(!p.k_pools.empty(), "decode_step: no KV pool (decode_plan_pools first)");
  const int64_t R = h.size(0), H = p.hidden, D = p.hd;
  TORCH_CHECK(R >= 1 && R <= p.max_rows, "decode_step runs 1 to ", p.max_rows,
              " rows with this plan; got ", R);
  TORCH_CHECK(h.dim() == 2 && h.size(1) == H && h.scalar_type() == at::kFloat &&
                  h.device().is_cpu(),
              "h: (R, ", H, ") float32");
  for (const Tensor* t : {&cos, &sin})
    TORCH_CHECK(t->dim() == 2 && t->size(0) == R && t->size(1) == D &&
                    t->scalar_type() == at::kFloat && t->is_contiguous(),
                "cos and sin: contiguous (R, ", D, ") float32");
  TORCH_CHECK(slots.dim() == 1 && slots.size(0) == R && tables.dim() == 2 &&
                  tables.size(0) == R && lens.dim() == 1 && lens.size(0) == R &&
                  slots.scalar_type() == at::kLong && tables.scalar_type() == at::kLong &&
                  lens.scalar_type() == at::kLong && slots.is_contiguous() &&
                  tables.is_contiguous() && lens.is_contiguous(),
              "slots (R,), tables (R, MB) and lens (R,): contiguous int64");
  const int64_t nb = p.k_pools[0].size(0), bs = p.k_pools[0].size(1), mb = tables.size(1);
  const int64_t* sp = slots.data_ptr<int64_t>();
  const int64_t* tp = tables.data_ptr<int64_t>();
  const int64_t* lp = lens.data_ptr<int64_t>();
  for (int64_t r = 0; r < R; ++r) {
    TORCH_CHECK(sp[r] >= 0 && sp[r] < nb * bs, "slot ", sp[r], " is outside the pool");
    TORCH_CHECK(lp[r] >= 1 && lp[r] <= mb * bs, "row ", r, "'s context of ", lp[r],
                " does not fit its table of ", mb, " blocks");
    for (int64_t k = 0; k <= (lp[r] - 1) / bs; ++k)
      TORCH_CHECK(tp[r * mb + k] >= 0 && tp[r * mb + k] < nb, "block id ", tp[r * mb + k],
                  " of row ", r, " is outside the pool of ", nb, " blocks");
  }
  const int64_t nh = p.nh, nkv = p.nkv, G = nh / nkv, I = p.inter;
  const int64_t q_n = nh * D, kv_n = nkv * D, qkv_n = q_n + 2 * kv_n;

  Tensor res = h.contiguous().clone();                    // the residual stream (R, H)
  Tensor xn = at::empty({R, H}, at::kFloat);
  Tensor q = at::empty({R, q_n}, at::kFloat);
  Tensor attn = at::empty({R, q_n}, at::kFloat);
  Tensor act = at::empty({R, I}, at::kFloat);
  Tensor sq = at::empty({R, H}, at::kFloat);
  Tensor mean = at::empty({R, 1}, at::kFloat);
  float* rp = res.data_ptr<float>();
  float* xp = xn.data_ptr<float>();
  float* qp = q.data_ptr<float>();
  float* ap = attn.data_ptr<float>();
  float* actp = act.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* snp = sin.data_ptr<float>();

  for (size_t l = 0; l < p.layers.size(); ++l) {
    const Layer& L = p.layers[l];
    rmsnorm(rp, L.ln1.data_ptr<float>(), L.eps1, sq, mean, xp);
    Tensor qkv = apply(p, L.qkv, xn);
    TORCH_CHECK(qkv.is_contiguous(), "qkv output");
    float* qkvp = qkv.data_ptr<float>();
    char* kpool = static_cast<char*>(p.k_pools[l].data_ptr());
    char* vpool = static_cast<char*>(p.v_pools[l].data_ptr());
    for (int64_t r = 0; r < R; ++r) {
      float* row = qkvp + r * qkv_n;
      rope(row, nh + nkv, D, cp + r * D, snp + r * D);   // q and k heads, as the Python path
      std::memcpy(qp + r * q_n, row, sizeof(float) * q_n);
      std::memcpy(kpool + sp[r] * kv_n * 4, row + q_n, sizeof(float) * kv_n);
      std::memcpy(vpool + sp[r] * kv_n * 4, row + q_n + kv_n, sizeof(float) * kv_n);
    }
    const vc::Pool pool{static_cast<const char*>(kpool), static_cast<const char*>(vpool),
                        nullptr, nullptr, kv_n * 4, D * 4, 0, 0};
    const vc::Batch b{qp, ap, tp, lp, R, nkv, G, D, mb, mb, bs, p.scaling, L.window};
    vc::attend_f32(b, pool);
    Tensor o = apply(p, L.o, attn);
    const float* op = o.data_ptr<float>();
    for (int64_t i = 0; i < R * H; ++i) rp[i] = rp[i] + op[i];
    rmsnorm(rp, L.ln2.data_ptr<float>(), L.eps2, sq, mean, xp);
    Tensor gu = apply(p, L.gate_up, xn);
    // F.silu(gate) * up: torch's SiLU over the gate half (its exp, as the Python path), the
    // product here.
    const Tensor silu = at::silu(gu.narrow(1, 0, I));
    const float* sl = silu.data_ptr<float>();
    const float* up = gu.data_ptr<float>() + I;
    for (int64_t r = 0; r < R; ++r)
      for (int64_t i = 0; i < I; ++i) actp[r * I + i] = sl[r * I + i] * up[r * 2 * I + i];
    Tensor d = apply(p, L.down, act);
    const float* dp = d.data_ptr<float>();
    for (int64_t i = 0; i < R * H; ++i) rp[i] = rp[i] + dp[i];
  }
  Tensor out = at::empty({R, H}, at::kFloat);
  rmsnorm(rp, p.norm_w.data_ptr<float>(), p.norm_eps, sq, mean, out.data_ptr<float>());
  return out;
}

}  // namespace

VC_FRAGMENT(VC_OPS, m) {
  m.def("decode_plan(Tensor[] tensors, int[] ints, float[] floats) -> int", &decode_plan);
  m.def("decode_plan_free(int handle) -> ()", &decode_plan_free);
  m.def("decode_plan_pools(int handle, Tensor[] k_pools, Tensor[] v_pools) -> ()",
        &decode_plan_pools);
  m.def("decode_step(int handle, Tensor h, Tensor cos, Tensor sin, Tensor slots, "
        "Tensor tables, Tensor lens) -> Tensor",
        &decode_step);
}
