// Decode attention over an int4 pool (attend_impl.h), in a translation unit of its own so that
// the four stores' kernels compile side by side.
#include "attend_impl.h"

namespace vc {
void attend_i4(const Batch& batch, const Pool& pool) { run<kI4>(batch, pool); }
}  // namespace vc
