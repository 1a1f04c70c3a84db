// Definitions every backend shares, kept free of ATen so the per-ISA CPU kernels
// (csrc/cpu/kernels.h) can include it too.
#pragma once

#include <type_traits>

namespace pyembed {

// The codes of pyembed/checks.py POS_CODES (a test checks they agree).
enum class PosEncoding : int { kNone = 0, kLearned = 1, kSinusoidal = 2 };

// A float64 table computes in float64; every other dtype in float32 (DESIGN §1).
template <typename scalar_t>
using acc_type = std::conditional_t<std::is_same_v<scalar_t, double>, double, float>;

}  // namespace pyembed
