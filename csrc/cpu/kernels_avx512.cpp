// The row kernels compiled for AVX-512 (F, BW, VL, DQ: what ATen's own AVX512 kernels
// need), chosen at run time when the CPU has them. Same construction as
// kernels_avx2.cpp: the target pragma and the macros the -m flags would define come
// before any header, so at::vec and Sleef select their 512-bit paths; this object links
// after the portable ones (setup.py), so inline functions shared with them resolve to
// the portable copies.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#pragma GCC target("avx,avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq")
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
#ifndef __AVX512F__
#define __AVX512F__ 1
#endif
#ifndef __AVX512BW__
#define __AVX512BW__ 1
#endif
#ifndef __AVX512VL__
#define __AVX512VL__ 1
#endif
#ifndef __AVX512DQ__
#define __AVX512DQ__ 1
#endif
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
