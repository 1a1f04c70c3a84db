// What csrc/autograd.cpp shares with the Python module (csrc/pyembed.cpp) and the cpu op.
#pragma once

#include <ATen/ATen.h>

namespace pyembed {

// ``grad`` still holds the storages of a coalesced sparse gradient pyembed::embedding's
// node built (and its nnz): pyembed/_coalesced.py sets the flag AccumulateGrad dropped.
bool built_coalesced(const at::Tensor& grad);

// grad through the forward's dropout mask (key [seed, offset], p), by the forward's kernel:
// what the backward sums when the dense op does not apply the mask in its own reads.
at::Tensor dropout_masked(const at::Tensor& grad, const at::Tensor& key, double dropout_p);

}  // namespace pyembed
