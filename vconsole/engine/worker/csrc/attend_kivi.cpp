// Decode attention over an int4_kivi pool (attend_impl.h), in a translation unit of its own so that
// the four stores' kernels compile side by side.
#include "attend_impl.h"

namespace vc {
void attend_kivi(const Batch& batch, const Pool& pool) { run<kKIVI>(batch, pool); }
}  // namespace vc
