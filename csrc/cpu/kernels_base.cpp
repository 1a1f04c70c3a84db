// The row kernels for any CPU (at::vec's portable Vectorized).
#define PYEMBED_ISA base
#include "kernels.h"

namespace pyembed::cpu {
const Kernels& kernels_base() { return base::kKernels; }
}  // namespace pyembed::cpu
