// Decode attention over an int8_kivi pool (attend_impl.h), in a translation unit of its own so
// that the stores' kernels compile side by side.
#include "attend_impl.h"

namespace vc {
void attend_kivi8(const Batch& batch, const Pool& pool) { run<kKIVI8>(batch, pool); }
}  // namespace vc
