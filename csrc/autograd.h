// What csrc/autograd.cpp shares with the Python module (csrc/pyembed.cpp).
#pragma once

#include <ATen/ATen.h>

namespace pyembed {

// ``grad`` still holds the storages of a coalesced sparse gradient pyembed::embedding's
// node built (and its nnz): pyembed/_coalesced.py sets the flag AccumulateGrad dropped.
bool built_coalesced(const at::Tensor& grad);

}  // namespace pyembed
