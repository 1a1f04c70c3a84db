// The row kernels compiled for AVX2 + FMA + F16C (chosen at run time when the CPU has
// them). setuptools cannot give one source its own flags, so the target pragma (code
// generation) and the macros -mavx2 -mfma -mf16c would define (g++ does not define them
// for a pragma) come first, before any header, so at::vec and Sleef select their 256-bit
// paths. Everything of ours here has internal linkage, and this object links after the
// portable ones, so inline functions shared with them resolve to the portable copies.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#pragma GCC target("avx,avx2,fma,f16c")
#ifndef __AVX__
#define __AVX__ 1
#endif
#ifndef __AVX2__
#define __AVX2__ 1
#endif
#ifndef __FMA__
#define __FMA__ 1
#endif
#ifndef __F16C__
#define __F16C__ 1
#endif
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
