// The first include of kernels_avx2.cpp and kernels_avx512.cpp (the latter defines
// PYEMBED_TARGET_AVX512 before it). setuptools cannot give one source its own flags, so
// the target pragma (code generation) and the macros -mavx2 -mfma -mf16c [-mavx512*]
// would define (g++ does not define them for a pragma) come before ATen's headers, so
// at::vec and Sleef select their 256-bit [512-bit] paths. GCC on x86-64 only: the files
// check that before including this.
//
// Except the C++ standard library, which comes first: with GCC 13's libstdc++ a target
// pragma ahead of <string> makes std::allocator's always_inline destructor (declared
// under the pragma) uninlinable into the implicitly defined destructors of its users
// ("inlining failed in call to always_inline ~allocator: target specific option
// mismatch", GCC PR 109753; seen on the H100 machine's g++ 13). Defined before the
// pragma, these templates keep the default target, which any AVX function may inline.
// They hold no ISA-dependent code, so nothing is lost.
#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <deque>
#include <functional>
#include <list>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <sstream>
#include <string>
#include <tuple>
#include <unordered_map>
#include <unordered_set>
#include <variant>
#include <vector>

#ifdef PYEMBED_TARGET_AVX512
// F, BW, VL, DQ: what ATen's own AVX512 kernels need.
#pragma GCC target("avx,avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq")
#else
#pragma GCC target("avx,avx2,fma,f16c")
#endif
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
#ifdef PYEMBED_TARGET_AVX512
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
#endif
