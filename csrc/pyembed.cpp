// The pyembed._C extension: op schemas and build facts.
//
// Each op is declared once here; its CPU kernel registers in csrc/cpu/ and its CUDA
// kernel in csrc/cuda/ (TORCH_LIBRARY_IMPL), so the dispatcher picks by device. The
// schemas match pyembed/reference.py, whose fake implementations serve these ops too.
#include <torch/extension.h>
#include <torch/library.h>

#include "cpu/kernel_api.h"

// Set by setup.py when the CUDA kernels are compiled in.
#ifndef PYEMBED_CUDA_ARCH_LIST
#define PYEMBED_CUDA_ARCH_LIST ""
#endif
#ifndef PYEMBED_CUDA_VERSION
#define PYEMBED_CUDA_VERSION ""
#endif

TORCH_LIBRARY(pyembed, m) {
  m.def(
      "embedding_forward(Tensor ids, Tensor weight, Tensor? pos_weight, Tensor? position_ids, "
      "str pos_encoding, float scale, int offset, bool validate) -> Tensor");
  m.def(
      "embedding_backward(Tensor grad_out, Tensor ids, Tensor? position_ids, int offset, "
      "int num_embeddings, int num_positions, float scale, int? padding_idx, bool scale_grad_by_freq, "
      "bool sparse, bool need_weight_grad, bool need_pos_grad) -> (Tensor, Tensor, Tensor)");
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "pyembed's compiled kernels; the ops live in torch.ops.pyembed";
#ifdef PYEMBED_WITH_CUDA
  m.attr("cuda_built") = true;
#else
  m.attr("cuda_built") = false;
#endif
  m.attr("cuda_version") = PYEMBED_CUDA_VERSION;
  m.attr("cuda_arch_list") = PYEMBED_CUDA_ARCH_LIST;
  m.def("cpu_isa", [] { return pyembed::cpu::row_kernels().isa; },
        "the instruction set of the CPU row kernels in use: 'avx2' or 'base'");
}
