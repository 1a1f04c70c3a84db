// Fused dropout (DESIGN §1), shared by the CPU and CUDA kernels (and the host emulation).
//
// Element (token n, column j) is kept iff its 32-bit Philox word r >= ceil(p * 2^32)
// (u = r * 2^-32 >= p), where r is word j % 4 of Philox4x32-10 keyed by the call's seed
// with counter (offset + j / 4, n) -- ATen's own engine, at::philox_engine(seed,
// subsequence = n, offset = offset + j / 4). pyembed/reference.py computes the same words
// in torch ops and kernels/embedding.py with tl.philox, so every backend drops the same
// elements. [seed, offset] is an int64 tensor on the kernel's device, drawn per call on
// the device (no host sync); nothing else is stored: the backward regenerates the mask.
#pragma once

#include <ATen/core/PhiloxRNGEngine.h>
#include <c10/macros/Macros.h>

#include <cmath>
#include <cstdint>

namespace pyembed {

struct Dropout {
  const int64_t* key = nullptr;  // (2,) [seed, offset] on the kernel's device; nullptr: no dropout
  uint64_t threshold = 0;        // ceil(p * 2^32): 2^32 for p = 1 keeps nothing
  double scale = 1.0;            // kept elements are multiplied by 1 / (1 - p) (0 for p = 1)

  C10_HOST_DEVICE bool active() const { return key != nullptr; }

  static uint64_t threshold_for(double p) { return static_cast<uint64_t>(std::ceil(std::ldexp(p, 32))); }
  static double scale_for(double p) { return p < 1.0 ? 1.0 / (1.0 - p) : 0.0; }
};

// The keep bits of columns 4 * group .. 4 * group + 3 of `token` (bit i: column 4 * group + i).
C10_HOST_DEVICE inline unsigned dropout_keep_bits(uint64_t seed, uint64_t offset, int64_t token, int64_t group,
                                                  uint64_t threshold) {
  at::philox_engine engine(seed, static_cast<uint64_t>(token), offset + static_cast<uint64_t>(group));
  unsigned bits = 0;
  for (int i = 0; i < 4; ++i) bits |= (static_cast<uint64_t>(engine()) >= threshold ? 1u : 0u) << i;
  return bits;
}

}  // namespace pyembed
