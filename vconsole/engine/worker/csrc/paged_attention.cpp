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
//   lens     (n,) int64       context length of each row (keys 0 .. len-1)
//   out      (n, KVH, G, D)
// window > 0 keeps only the last `window` keys (sliding-window attention).
//
// Work is split over rows with at::parallel_for (torch's own thread pool). Softmax is the
// usual max-subtracted one in float32; built with -ffast-math so that the dot products, exp
// and sums vectorize (results agree with SDPA to float rounding, not bit for bit).

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace {

inline float dot(const float* __restrict a, const float* __restrict b, int64_t d) {
  float s = 0.f;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < d; ++i) s += a[i] * b[i];
  return s;
}

inline void axpy(float w, const float* __restrict x, float* __restrict y, int64_t d) {
#pragma omp simd
  for (int64_t i = 0; i < d; ++i) y[i] += w * x[i];
}

}  // namespace

void paged_decode_attention(const torch::Tensor& q, const torch::Tensor& k_pool,
                            const torch::Tensor& v_pool, const torch::Tensor& tables,
                            const torch::Tensor& lens, double scale, int64_t window,
                            torch::Tensor& out) {
  TORCH_CHECK(q.dim() == 4 && k_pool.dim() == 4 && v_pool.dim() == 4, "bad ranks");
  TORCH_CHECK(q.scalar_type() == torch::kFloat && k_pool.scalar_type() == torch::kFloat &&
                  v_pool.scalar_type() == torch::kFloat && out.scalar_type() == torch::kFloat,
              "float32 only");
  TORCH_CHECK(tables.scalar_type() == torch::kLong && lens.scalar_type() == torch::kLong,
              "int64 tables and lengths");
  TORCH_CHECK(q.is_contiguous() && k_pool.is_contiguous() && v_pool.is_contiguous() &&
                  tables.is_contiguous() && lens.is_contiguous() && out.is_contiguous(),
              "contiguous tensors only");
  const int64_t n = q.size(0), kvh = q.size(1), g = q.size(2), d = q.size(3);
  const int64_t nb = k_pool.size(0), bs = k_pool.size(1), mb = tables.size(1);
  TORCH_CHECK(k_pool.size(2) == kvh && k_pool.size(3) == d && v_pool.sizes() == k_pool.sizes(),
              "pool and query disagree");
  TORCH_CHECK(tables.size(0) == n && lens.size(0) == n, "one table and length per row");
  const float* qp = q.data_ptr<float>();
  const float* kp = k_pool.data_ptr<float>();
  const float* vp = v_pool.data_ptr<float>();
  const int64_t* tp = tables.data_ptr<int64_t>();
  const int64_t* lp = lens.data_ptr<int64_t>();
  float* op = out.data_ptr<float>();
  const float sc = static_cast<float>(scale);
  const int64_t row_stride = kvh * d;  // between two slots of the pool

  // One job per row: a slot's KV heads lie side by side in the pool, so each K/V row is read
  // once, whole, for every head.
  at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    for (int64_t r = begin; r < end; ++r) {
      const int64_t len = std::min(lp[r], mb * bs);
      const int64_t first = window > 0 ? std::max<int64_t>(0, len - window) : 0;
      const int64_t span = len - first;
      const float* qr = qp + r * kvh * g * d;   // (KVH, G, D)
      float* orow = op + r * kvh * g * d;
      std::fill(orow, orow + kvh * g * d, 0.f);
      if (span <= 0) continue;
      const int64_t heads = kvh * g;            // scores: (KVH * G, span)
      scores.resize(static_cast<size_t>(heads * span));
      float* sc_all = scores.data();
      const int64_t* table = tp + r * mb;
      for (int64_t b = first / bs; b <= (len - 1) / bs; ++b)
        TORCH_CHECK(table[b] >= 0 && table[b] < nb, "block id ", table[b], " of row ", r,
                    " is outside the pool of ", nb, " blocks");
      for (int64_t p = first; p < len; ++p) {
        const float* krow = kp + (table[p / bs] * bs + p % bs) * row_stride;
        for (int64_t h = 0; h < kvh; ++h)
          for (int64_t j = 0; j < g; ++j)
            sc_all[(h * g + j) * span + (p - first)] =
                dot(qr + (h * g + j) * d, krow + h * d, d) * sc;
      }
      for (int64_t hj = 0; hj < heads; ++hj) {
        float* s = sc_all + hj * span;
        float m = s[0];
        for (int64_t i = 1; i < span; ++i) m = std::max(m, s[i]);
        float sum = 0.f;
#pragma omp simd reduction(+ : sum)
        for (int64_t i = 0; i < span; ++i) {
          s[i] = std::exp(s[i] - m);
          sum += s[i];
        }
        const float inv = 1.f / sum;
#pragma omp simd
        for (int64_t i = 0; i < span; ++i) s[i] *= inv;
      }
      for (int64_t p = first; p < len; ++p) {
        const float* vrow = vp + (table[p / bs] * bs + p % bs) * row_stride;
        for (int64_t h = 0; h < kvh; ++h)
          for (int64_t j = 0; j < g; ++j)
            axpy(sc_all[(h * g + j) * span + (p - first)], vrow + h * d, orow + (h * g + j) * d, d);
      }
    }
  });
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention,
        "Decode attention over a paged KV pool, reading blocks through the block table (CPU).");
}
