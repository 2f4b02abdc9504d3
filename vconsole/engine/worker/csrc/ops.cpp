// The operators torch calls (`torch.ops.<VC_OPS>.*`): each checks its tensors, the block ids its
// tables name and, for int4_kivi / int8_kivi, the staging entries, then hands plain pointers to the store's
// kernel (attention.h). Registered with TORCH_LIBRARY rather than bound with pybind11: the
// operator headers are a fifth of torch/extension.h's compile, and nothing here depends on the
// Python ABI. VC_OPS, the operators' namespace, is named by the builder (it carries the build's
// tag, so two builds can be loaded in one process).

#include "attention.h"

#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>

#ifndef VC_OPS
#error "build with -DVC_OPS=<the operators' namespace>"
#endif
// TORCH_LIBRARY stringizes and pastes its argument: expand VC_OPS first.
#define VC_LIBRARY(ns, m) TORCH_LIBRARY(ns, m)

namespace {

using at::Tensor;

void check_common(const Tensor& q, const Tensor& tables, const Tensor& lens, const Tensor& out) {
  TORCH_CHECK(q.dim() == 4 && out.dim() == 4 && tables.dim() == 2 && lens.dim() == 1,
              "bad ranks");
  TORCH_CHECK(q.scalar_type() == at::kFloat && out.scalar_type() == at::kFloat,
              "float32 queries and output");
  TORCH_CHECK(tables.scalar_type() == at::kLong && lens.scalar_type() == at::kLong,
              "int64 tables and lengths");
  TORCH_CHECK(q.is_contiguous() && tables.is_contiguous() && lens.is_contiguous() &&
                  out.is_contiguous(),
              "contiguous tensors only");
  TORCH_CHECK(tables.size(0) == q.size(0) || tables.size(0) == 1,
              "one table per row, or one shared");
  TORCH_CHECK(lens.size(0) == q.size(0), "one length per row");
  TORCH_CHECK(out.sizes() == q.sizes(), "out and q disagree");
}

// Pool data (NB, B, KVH, Dd) of one-byte elements whose slot rows (KVH x Dd) are contiguous
// and whose slots are evenly spaced across blocks: a contiguous tensor, or one half of a slot's
// K-and-V bytes.
bool slot_rows_ok(const Tensor& data, int64_t bs) {
  return data.dim() == 4 && data.size(1) == bs && data.stride(3) == 1 &&
         data.stride(2) == data.size(3) && data.stride(1) >= data.size(2) * data.size(3) &&
         data.stride(0) == bs * data.stride(1);
}

// The batch, once every block a row reads is known to lie in the pool of `nb` blocks (and, for
// int4_kivi, its staging entry among the `pool.entries`).
vc::Batch batch_of(const Tensor& q, const Tensor& tables, const Tensor& lens, double scale,
                   int64_t window, Tensor& out, int64_t nb, int64_t bs, const vc::Pool& pool,
                   bool kivi) {
  const int64_t n = q.size(0), mb = tables.size(1);
  const vc::Batch b{q.data_ptr<float>(), out.data_ptr<float>(), tables.data_ptr<int64_t>(),
                    lens.data_ptr<int64_t>(), n, q.size(1), q.size(2), q.size(3), mb,
                    tables.size(0) == 1 ? 0 : mb, bs, static_cast<float>(scale), window};
  for (int64_t r = 0; r < n; ++r) {
    const int64_t len = std::min(b.lens[r], mb * bs);
    const int64_t first = window > 0 ? std::max<int64_t>(0, len - window) : 0;
    const int64_t* table = b.tables + r * b.table_stride;
    for (int64_t k = first / bs; len > first && k <= (len - 1) / bs; ++k) {
      TORCH_CHECK(table[k] >= 0 && table[k] < nb, "block id ", table[k], " of row ", r,
                  " is outside the pool of ", nb, " blocks");
      if (kivi)
        TORCH_CHECK(pool.entry_of[table[k]] < pool.entries, "staging entry ",
                    pool.entry_of[table[k]], " of block ", table[k], " is outside the ",
                    pool.entries, " entries");
    }
  }
  return b;
}

void paged_decode_attention(const Tensor& q, const Tensor& k_pool, const Tensor& v_pool,
                            const Tensor& tables, const Tensor& lens, double scale,
                            int64_t window, Tensor& out) {
  check_common(q, tables, lens, out);
  TORCH_CHECK(k_pool.dim() == 4 && v_pool.dim() == 4, "bad pool ranks");
  TORCH_CHECK(k_pool.scalar_type() == at::kFloat && v_pool.scalar_type() == at::kFloat,
              "float32 pools");
  TORCH_CHECK(k_pool.is_contiguous() && v_pool.is_contiguous(), "contiguous pools");
  const int64_t kvh = q.size(1), d = q.size(3);
  TORCH_CHECK(k_pool.size(2) == kvh && k_pool.size(3) == d && v_pool.sizes() == k_pool.sizes(),
              "pool and query disagree");
  const vc::Pool pool{static_cast<const char*>(k_pool.data_ptr()),
                      static_cast<const char*>(v_pool.data_ptr()), nullptr, nullptr,
                      kvh * d * 4, d * 4, 0, 0};
  vc::attend_f32(batch_of(q, tables, lens, scale, window, out, k_pool.size(0), k_pool.size(1),
                          pool, false),
                 pool);
}

void paged_decode_attention_quant(const Tensor& q, const Tensor& k_data, const Tensor& v_data,
                                  const Tensor& k_params, const Tensor& v_params,
                                  const Tensor& tables, const Tensor& lens, double scale,
                                  int64_t window, int64_t bits, Tensor& out) {
  check_common(q, tables, lens, out);
  TORCH_CHECK(bits == 8 || bits == 4, "bits must be 8 or 4");
  TORCH_CHECK(k_data.dim() == 4 && v_data.sizes() == k_data.sizes() && k_params.dim() == 4 &&
                  v_params.sizes() == k_params.sizes(),
              "bad pool shapes");
  TORCH_CHECK(k_data.scalar_type() == (bits == 8 ? at::kChar : at::kByte) &&
                  v_data.scalar_type() == k_data.scalar_type(),
              bits == 8 ? "int8 data" : "uint8 data");
  TORCH_CHECK(k_params.scalar_type() == at::kFloat && v_params.scalar_type() == at::kFloat,
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
  const vc::Pool pool{static_cast<const char*>(k_data.data_ptr()),
                      static_cast<const char*>(v_data.data_ptr()), k_params.data_ptr<float>(),
                      v_params.data_ptr<float>(), kvh * dd, dd, kvh * np, np};
  const vc::Batch b = batch_of(q, tables, lens, scale, window, out, k_data.size(0),
                               k_data.size(1), pool, false);
  if (bits == 8)
    vc::attend_i8(b, pool);
  else
    vc::attend_i4(b, pool);
}

void paged_decode_attention_kivi(const Tensor& q, const Tensor& k_data, const Tensor& v_data,
                                 const Tensor& k_channel, const Tensor& v_params,
                                 const Tensor& k_stage, const Tensor& k_stage_scale,
                                 const Tensor& entry_of, const Tensor& tables,
                                 const Tensor& lens, double scale, int64_t window, Tensor& out) {
  check_common(q, tables, lens, out);
  // int8 data: int8_kivi (a scale per key channel; values' scale per token), else int4_kivi.
  const bool i8 = k_data.scalar_type() == at::kChar;
  const int64_t kvh = q.size(1), d = q.size(3), nb = k_data.size(0), bs = k_data.size(1);
  const int64_t dd = i8 ? d : d / 2, rows = i8 ? 1 : 2;
  TORCH_CHECK(i8 || d % 2 == 0, "int4 needs an even head_dim");
  TORCH_CHECK(k_data.scalar_type() == (i8 ? at::kChar : at::kByte) &&
                  v_data.scalar_type() == k_data.scalar_type(),
              "int8 or uint8 data, K and V alike");
  TORCH_CHECK(k_data.dim() == 4 && v_data.sizes() == k_data.sizes() && k_data.size(2) == kvh &&
                  k_data.size(3) == dd,
              "pool and query disagree");
  TORCH_CHECK(k_channel.scalar_type() == at::kHalf &&
                  k_channel.sizes() == at::IntArrayRef({nb, kvh, rows, d}),
              "key channel parameters: (NB, KVH, 2, D) float16 (int8: (NB, KVH, 1, D))");
  TORCH_CHECK(v_params.scalar_type() == at::kHalf &&
                  v_params.sizes() == at::IntArrayRef({nb, bs, kvh, rows}),
              "value parameters: (NB, B, KVH, 2) float16 (int8: (NB, B, KVH, 1))");
  const bool stage8 = k_stage.scalar_type() == at::kChar;
  TORCH_CHECK((stage8 || k_stage.scalar_type() == at::kHalf) && k_stage.dim() == 4 &&
                  k_stage.size(1) == bs && k_stage.size(2) == kvh && k_stage.size(3) == d,
              "staging: (E, B, KVH, D) float16 or int8");
  TORCH_CHECK(k_stage_scale.scalar_type() == at::kFloat && k_stage_scale.is_contiguous() &&
                  (stage8 ? k_stage_scale.sizes() ==
                                at::IntArrayRef({k_stage.size(0), bs, kvh, 1})
                          : k_stage_scale.numel() == 0),
              "staging scales: (E, B, KVH, 1) float32 for int8 staging, else empty");
  TORCH_CHECK(entry_of.scalar_type() == at::kLong && entry_of.dim() == 1 &&
                  entry_of.size(0) == nb,
              "entry_of: (NB,) int64");
  // K and V may be the two halves of one slot's bytes (kv_quant.allocate: a block's K and V
  // data side by side, so that a block of the pool can hold an open block's staged keys):
  // rows of a slot contiguous, the slots of a block evenly spaced, K's spacing V's.
  TORCH_CHECK(slot_rows_ok(k_data, bs) && k_data.strides() == v_data.strides() &&
                  k_channel.is_contiguous() && v_params.is_contiguous() &&
                  k_stage.is_contiguous() && entry_of.is_contiguous(),
              "contiguous pools (K and V data: contiguous heads, slots evenly spaced)");
  vc::Pool pool{static_cast<const char*>(k_data.data_ptr()),
                static_cast<const char*>(v_data.data_ptr()), nullptr, nullptr,
                k_data.stride(1), dd, kvh * rows, rows};
  pool.kc = k_channel.data_ptr<at::Half>();
  pool.vph = v_params.data_ptr<at::Half>();
  if (stage8) {
    pool.stage8 = k_stage.data_ptr<int8_t>();
    pool.stage_scale = k_stage_scale.data_ptr<float>();
  } else {
    pool.stage = k_stage.data_ptr<at::Half>();
  }
  pool.entry_of = entry_of.data_ptr<int64_t>();
  pool.entries = k_stage.size(0);
  pool.kvh = kvh;
  pool.d = d;
  const vc::Batch b = batch_of(q, tables, lens, scale, window, out, nb, bs, pool, true);
  if (i8)
    vc::attend_kivi8(b, pool);
  else
    vc::attend_kivi(b, pool);
}

// The write side: rows x (T, KVH, D) float32 rounded per (row, KV head) into a quantized pool at
// `slots`, as kv_quant.quantize does in torch (int8: symmetric, scale = max|x| / 127; int4:
// scale = (max - min) / 15 and the minimum, element j in the low nibble of byte j and j + D/2 in
// the high one), in one call instead of a dozen torch ops per K and V per layer. Parameters in
// float16 (a per-channel pool's values) are rounded to float16 before the rows are.
void quantize_store(const Tensor& x, const Tensor& slots, Tensor& data, Tensor& params,
                    int64_t bits) {
  TORCH_CHECK(bits == 8 || bits == 4, "bits must be 8 or 4");
  TORCH_CHECK(x.dim() == 3 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "rows: (T, KVH, D) contiguous float32");
  TORCH_CHECK(slots.dim() == 1 && slots.scalar_type() == at::kLong && slots.is_contiguous() &&
                  slots.size(0) == x.size(0),
              "one int64 slot per row");
  const int64_t t = x.size(0), kvh = x.size(1), d = x.size(2);
  const int64_t dd = bits == 8 ? d : d / 2, np = bits == 8 ? 1 : 2;
  TORCH_CHECK(bits == 8 || d % 2 == 0, "int4 needs an even head_dim");
  TORCH_CHECK(data.dim() == 4 && data.size(2) == kvh && data.size(3) == dd &&
                  data.scalar_type() == (bits == 8 ? at::kChar : at::kByte) &&
                  slot_rows_ok(data, data.size(1)),
              "pool data and rows disagree");
  TORCH_CHECK(params.dim() == 4 && params.size(0) == data.size(0) &&
                  params.size(1) == data.size(1) && params.size(2) == kvh &&
                  params.size(3) == np &&
                  (params.scalar_type() == at::kFloat || params.scalar_type() == at::kHalf) &&
                  params.is_contiguous(),
              "pool parameters and rows disagree");
  const bool half = params.scalar_type() == at::kHalf;
  // A parameter as stored: float16's rounding where the pool keeps them so.
  const auto stored = [half](float x) {
    return half ? static_cast<float>(static_cast<at::Half>(x)) : x;
  };
  const int64_t num_slots = data.size(0) * data.size(1), slot_bytes = data.stride(1);
  const float* xp = x.data_ptr<float>();
  const int64_t* sp = slots.data_ptr<int64_t>();
  char* dp = static_cast<char*>(data.data_ptr());
  float* pp = half ? nullptr : params.data_ptr<float>();
  at::Half* ph = half ? params.data_ptr<at::Half>() : nullptr;
  const auto put = [pp, ph](int64_t i, float x) {
    if (ph != nullptr)
      ph[i] = static_cast<at::Half>(x);
    else
      pp[i] = x;
  };
  for (int64_t i = 0; i < t; ++i)
    TORCH_CHECK(sp[i] >= 0 && sp[i] < num_slots, "slot ", sp[i], " is outside the pool");
  for (int64_t i = 0; i < t; ++i)
    for (int64_t h = 0; h < kvh; ++h) {
      const float* r = xp + (i * kvh + h) * d;
      const int64_t at = sp[i] * kvh + h;
      char* row = dp + sp[i] * slot_bytes + h * dd;
      float lo = r[0], hi = r[0], amax = std::fabs(r[0]);
      for (int64_t j = 1; j < d; ++j) {
        lo = std::min(lo, r[j]);
        hi = std::max(hi, r[j]);
        amax = std::max(amax, std::fabs(r[j]));
      }
      if (bits == 8) {
        const float scale = stored(amax / 127.f);
        const float safe = scale > 0.f ? scale : 1.f;
        int8_t* q = reinterpret_cast<int8_t*>(row);
        for (int64_t j = 0; j < d; ++j)
          q[j] = static_cast<int8_t>(std::clamp(std::nearbyint(r[j] / safe), -127.f, 127.f));
        put(at, scale);
      } else {
        lo = stored(lo);
        const float scale = stored((hi - lo) / 15.f);
        const float safe = scale > 0.f ? scale : 1.f;
        uint8_t* q = reinterpret_cast<uint8_t*>(row);
        for (int64_t j = 0; j < d / 2; ++j) {
          const float a = std::clamp(std::nearbyint((r[j] - lo) / safe), 0.f, 15.f);
          const float b = std::clamp(std::nearbyint((r[j + d / 2] - lo) / safe), 0.f, 15.f);
          q[j] = static_cast<uint8_t>(a) | static_cast<uint8_t>(static_cast<uint8_t>(b) << 4);
        }
        put(2 * at, scale);
        put(2 * at + 1, lo);
      }
    }
}

}  // namespace

VC_LIBRARY(VC_OPS, m) {
  m.def("paged_decode_attention(Tensor q, Tensor k_pool, Tensor v_pool, Tensor tables, "
        "Tensor lens, float scale, int window, Tensor(a!) out) -> ()");
  m.def("paged_decode_attention_quant(Tensor q, Tensor k_data, Tensor v_data, Tensor k_params, "
        "Tensor v_params, Tensor tables, Tensor lens, float scale, int window, int bits, "
        "Tensor(a!) out) -> ()");
  m.def("paged_decode_attention_kivi(Tensor q, Tensor k_data, Tensor v_data, "
        "Tensor k_channel, Tensor v_params, Tensor k_stage, Tensor k_stage_scale, "
        "Tensor entry_of, Tensor tables, Tensor lens, float scale, int window, "
        "Tensor(a!) out) -> ()");
  m.def("quantize_store(Tensor x, Tensor slots, Tensor(a!) data, Tensor(b!) params, int bits) "
        "-> ()");
}

TORCH_LIBRARY_IMPL(VC_OPS, CPU, m) {
  m.impl("paged_decode_attention", &paged_decode_attention);
  m.impl("paged_decode_attention_quant", &paged_decode_attention_quant);
  m.impl("paged_decode_attention_kivi", &paged_decode_attention_kivi);
  m.impl("quantize_store", &quantize_store);
}
