// Decode attention read straight from the paged KV pool, for the CPU: the interface between the
// operators torch calls (ops.cpp) and the kernels, one translation unit per way of storing K/V
// (attend_f32.cpp, attend_i8.cpp, attend_i4.cpp, attend_kivi.cpp, attend_kivi8.cpp).
//
// Plain pointers and sizes, no torch types: the kernels include ATen's parallel_for and c10's
// Half only, so each compiles in seconds and they compile side by side (the builder runs one
// compiler per core); only ops.cpp parses torch's operator headers. ops.cpp checks the tensors,
// the block ids and the staging entries before it calls a kernel: the kernels trust their input.
//
// Shapes (float32, contiguous):
//   q        (n, KVH, G, D)   the query heads of each KV head folded together (GQA)
//   k_pool   (NB, B, KVH, D)  v_pool alike
//   tables   (n, MB) int64    block ids; only the first ceil(len / B) of a row are read
//                             (or (1, MB): one table every row shares, a prefill chunk's)
//   lens     (n,) int64       context length of each row (keys 0 .. len-1)
//   out      (n, KVH, G, D)
// window > 0 keeps only the last `window` keys (sliding-window attention).

#pragma once

#include <c10/util/Half.h>

#include <cstdint>

namespace vc {

// How a pool stores its rows: float32, int8 + scale, int4 + scale and minimum, int4 keys
// rounded per channel over a block (KIVI) with values as kI4, or int8 keys rounded per channel
// over a block (a float16 scale per channel, no minimum) with values as kI8.
enum Store { kF32 = 0, kI8 = 8, kI4 = 4, kKIVI = 5, kKIVI8 = 9 };

// One layer's K and V: data addressed in bytes, parameters (float32) per slot and KV head.
struct Pool {
  const char* k;
  const char* v;
  const float* kp;      // null for kF32, kKIVI and kKIVI8 (keys)
  const float* vp;
  int64_t slot_bytes;   // between two slots of the data
  int64_t head_bytes;   // between two KV heads of one slot
  int64_t slot_params;  // floats between two slots of the parameters (KVH * P)
  int64_t head_params;  // P
  // kKIVI / kKIVI8 only: each sealed block's per-channel key scale and minimum, (NB, KVH, 2, D)
  // half (kKIVI8: the scale only, (NB, KVH, 1, D)); the values' parameters in half (`vp` is
  // null); the open blocks' keys, (E, B, KVH, D) float16 (`stage`), or int8 (`stage8`) with a
  // float32 scale per row (`stage_scale`, (E, B, KVH)); each block's entry there, or -1 if
  // sealed.
  const c10::Half* kc = nullptr;
  const c10::Half* vph = nullptr;
  const c10::Half* stage = nullptr;
  const int8_t* stage8 = nullptr;
  const float* stage_scale = nullptr;
  const int64_t* entry_of = nullptr;
  int64_t entries = 0;
  int64_t kvh = 0;
  int64_t d = 0;
};

// One call's queries, block tables, lengths and output.
struct Batch {
  const float* q;
  float* out;
  const int64_t* tables;
  const int64_t* lens;
  int64_t n, kvh, g, d;
  int64_t mb;            // entries per table
  int64_t table_stride;  // mb, or 0 when every row shares the one table
  int64_t bs;            // block size
  float scale;
  int64_t window;
};

void attend_f32(const Batch& batch, const Pool& pool);
void attend_i8(const Batch& batch, const Pool& pool);
void attend_i4(const Batch& batch, const Pool& pool);
void attend_kivi(const Batch& batch, const Pool& pool);
void attend_kivi8(const Batch& batch, const Pool& pool);

}  // namespace vc
