// Decode attention over a float32 pool (attend_impl.h), in a translation unit of its own so that
// the four stores' kernels compile side by side.
#include "attend_impl.h"

namespace vc {
void attend_f32(const Batch& batch, const Pool& pool) { run<kF32>(batch, pool); }
}  // namespace vc
