// The optimizer inside the backward (pyembed/optim.py): the per-element update rules,
// written once for every backend -- the CPU row kernels run them on at::vec vectors
// (csrc/cpu/kernels.h), the CUDA kernel on one float per thread (csrc/cuda/optim_kernels.cuh),
// the Triton kernel mirrors them (kernels/embedding.py). ATen-free, like common.h.
//
// Each rule is torch's single-tensor optimizer for one element, in the compute type
// (float32; float64 for float64 tables), with the gradient g = 0 for a row the batch did
// not touch (dense semantics) -- torch.optim.{SGD, Adam/AdamW, Adagrad, SparseAdam}:
//   SGD:        g += wd p; buf = first ? g : momentum buf + (1 - dampening) g;
//               g = nesterov ? g + momentum buf : buf; p -= lr g
//   Adam(W):    AdamW: p *= 1 - lr wd, Adam: g += wd p; m += (1 - b1)(g - m);
//               v = b2 v + (1 - b2) g^2; p -= (lr / bc1) m / (sqrt(v) / sqrt(bc2) + eps)
//   Adagrad:    g += wd p; sum += g^2; p -= clr g / (sqrt(sum) + eps)
//   SparseAdam: m += (1 - b1)(g - m); v += (1 - b2)(g^2 - v); p -= step_size m / (sqrt(v) + eps)
// (maximize negates g first). Step counts, bias corrections, clr = lr / (1 + (step - 1) lr_decay)
// and SparseAdam's step_size = lr sqrt(bc2) / bc1 are computed once on the host.
#pragma once

#include <cmath>
#include <cstdint>
#include <type_traits>

#if defined(__CUDACC__)
#define PYEMBED_HD __host__ __device__ __forceinline__
#else
#define PYEMBED_HD inline
#endif

namespace pyembed::optim {

// Shared with pyembed/optim.py (SGD, ADAM, ADAGRAD, SPARSE_ADAM); a test checks they agree.
enum Rule : int { kSGD = 0, kAdam = 1, kAdagrad = 2, kSparseAdam = 3 };
constexpr int kMaxHyper = 9;

// The host scalars of one update, named; built from pyembed/optim.py's hyper tuple (the
// order there, per rule). lr holds clr for Adagrad and step_size for SparseAdam.
template <typename A>
struct Scalars {
  A lr = 0, beta1 = 0, beta2 = 0, eps = 0, weight_decay = 0, momentum = 0, dampening = 0;
  A step_size = 0, bias_correction2_sqrt = 1;  // Adam: step_size = lr / bc1, divided here, not per thread
  bool decoupled = false, nesterov = false, maximize = false, first = false;

  static Scalars from(int rule, const double* h) {
    Scalars s;
    switch (rule) {
      case kSGD:  // lr, momentum, dampening, weight_decay, nesterov, maximize, first
        s.lr = A(h[0]), s.momentum = A(h[1]), s.dampening = A(h[2]), s.weight_decay = A(h[3]);
        s.nesterov = h[4] != 0, s.maximize = h[5] != 0, s.first = h[6] != 0;
        break;
      case kAdam:  // lr, beta1, beta2, eps, weight_decay, decoupled, maximize, bc1, sqrt(bc2)
        s.lr = A(h[0]), s.beta1 = A(h[1]), s.beta2 = A(h[2]), s.eps = A(h[3]), s.weight_decay = A(h[4]);
        s.decoupled = h[5] != 0, s.maximize = h[6] != 0;
        s.step_size = s.lr / A(h[7]), s.bias_correction2_sqrt = A(h[8]);
        break;
      case kAdagrad:  // clr, weight_decay, eps, maximize
        s.lr = A(h[0]), s.weight_decay = A(h[1]), s.eps = A(h[2]), s.maximize = h[3] != 0;
        break;
      default:  // kSparseAdam: step_size, beta1, beta2, eps, maximize
        s.lr = A(h[0]), s.beta1 = A(h[1]), s.beta2 = A(h[2]), s.eps = A(h[3]), s.maximize = h[4] != 0;
    }
    return s;
  }
  // How many hyper values each rule reads (the op checks the list is that long).
  static constexpr int count(int rule) { return rule == kSGD ? 7 : rule == kAdam ? 9 : rule == kAdagrad ? 4 : 5; }
};

// sqrt(x) and a / b in the compute type. In float on a GPU, the instructions Triton emits
// for tl.sqrt and `/` (sqrt.approx.f32; div.full.f32, within 2 ulp): the IEEE forms compile
// to a range check and a slow-path call per element, and each such branch kept the compiler
// from overlapping one element's MUFU latency with the next one's. The H200 at de2aee7
// measured the AdamW update over a Llama-2 bf16 table instruction-bound that way: 691 us at
// 47% of DRAM bandwidth (74% SM throughput), against the Triton kernel's 404 us at 80%. The
// update's result moves by a few ulp of itself, far below a table element's ulp (lr << 1).
template <typename V>
PYEMBED_HD V root(V x) {
#if defined(__CUDA_ARCH__)
  if constexpr (std::is_same_v<V, float>) {
    float r;
    asm("sqrt.approx.f32 %0, %1;" : "=f"(r) : "f"(x));
    return r;
  }
#endif
  if constexpr (std::is_arithmetic_v<V>) {
    return std::sqrt(x);
  } else {
    return x.sqrt();  // at::vec::Vectorized
  }
}

template <typename V>
PYEMBED_HD V quotient(V a, V b) {
#if defined(__CUDA_ARCH__)
  if constexpr (std::is_same_v<V, float>) {
    float q;
    asm("div.full.f32 %0, %1, %2;" : "=f"(q) : "f"(a), "f"(b));
    return q;
  }
#endif
  return a / b;
}

// a * b + c: on a GPU one fma, as kernels' _apply_rule writes it. Left to the compiler,
// whether a product is fused into its sum can differ between the kernels that inline a
// rule (Triton's AdamW did at 1b594a4: segment_update fused v * beta2, optimizer_update
// (1 - beta2) * g * g), and the fused optimizer_backward then rounds the state otherwise
// than the two-op form it replaces. On the host the same two roundings as before.
template <typename V>
PYEMBED_HD V madd(V a, V b, V c) {
#if defined(__CUDA_ARCH__)
  if constexpr (std::is_arithmetic_v<V>) return fma(a, b, c);
#endif
  return a * b + c;
}

// One element (V = a scalar) or one vector of elements (V = at::vec::Vectorized<A>) of p
// and its state s1, s2 (SGD: momentum buffer; Adam, SparseAdam: m, v; Adagrad: sum);
// g = 0 where the batch did not touch the row.
template <int RULE, typename V, typename A>
PYEMBED_HD void update(V& p, V& s1, V& s2, V g, const Scalars<A>& h) {
  if (h.maximize) g = V(A(0)) - g;
  if constexpr (RULE == kSGD) {
    if (h.weight_decay != A(0)) g = madd(V(h.weight_decay), p, g);
    if (h.momentum != A(0)) {
      s1 = h.first ? g : madd(V(h.momentum), s1, V(A(1) - h.dampening) * g);
      g = h.nesterov ? madd(V(h.momentum), s1, g) : s1;
    }
    p = madd(V(-h.lr), g, p);
  } else if constexpr (RULE == kAdam) {
    if (h.weight_decay != A(0)) {
      if (h.decoupled) {
        p = p * V(madd(-h.lr, h.weight_decay, A(1)));
      } else {
        g = madd(V(h.weight_decay), p, g);
      }
    }
    s1 = madd(V(A(1) - h.beta1), g - s1, s1);
    s2 = madd(V(A(1) - h.beta2), g * g, s2 * V(h.beta2));
    const V denom = quotient(root(s2), V(h.bias_correction2_sqrt)) + V(h.eps);
    p = madd(V(-h.step_size), quotient(s1, denom), p);
  } else if constexpr (RULE == kAdagrad) {
    if (h.weight_decay != A(0)) g = madd(V(h.weight_decay), p, g);
    s1 = madd(g, g, s1);
    p = madd(V(-h.lr), quotient(g, root(s1) + V(h.eps)), p);
  } else {  // kSparseAdam
    s1 = madd(V(A(1) - h.beta1), g - s1, s1);
    s2 = madd(V(A(1) - h.beta2), madd(g, g, V(A(0)) - s2), s2);
    p = madd(V(-h.lr), quotient(s1, root(s2) + V(h.eps)), p);
  }
}

}  // namespace pyembed::optim
