// The row kernels compiled for AVX-512 (F, BW, VL, DQ), chosen at run time when the CPU
// has them. Same construction as kernels_avx2.cpp: x86_target.h first, and this object
// links after the portable ones (setup.py).
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define PYEMBED_TARGET_AVX512
#include "x86_target.h"
#define CPU_CAPABILITY AVX512
#define CPU_CAPABILITY_AVX512
#define PYEMBED_ISA avx512
#include "kernels.h"

namespace pyembed::cpu {
const Kernels* kernels_avx512() { return &avx512::kKernels; }
}  // namespace pyembed::cpu
#else
#include "kernel_api.h"
namespace pyembed::cpu {
const Kernels* kernels_avx512() { return nullptr; }
}  // namespace pyembed::cpu
#endif
