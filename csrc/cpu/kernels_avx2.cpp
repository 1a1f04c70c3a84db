// The row kernels compiled for AVX2 + FMA + F16C (chosen at run time when the CPU has
// them); x86_target.h sets the code generation up. Everything of ours here has internal
// linkage, and this object links after the portable ones, so inline functions shared with
// them resolve to the portable copies.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#include "x86_target.h"
#define CPU_CAPABILITY AVX2
#define CPU_CAPABILITY_AVX2
#define PYEMBED_ISA avx2
#include "kernels.h"

namespace pyembed::cpu {
const Kernels* kernels_avx2() { return &avx2::kKernels; }
}  // namespace pyembed::cpu
#else
#include "kernel_api.h"
namespace pyembed::cpu {
const Kernels* kernels_avx2() { return nullptr; }
}  // namespace pyembed::cpu
#endif
