// What csrc/autograd.cpp shares with the Python module (csrc/pyembed.cpp) and the cpu op.
#pragma once

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include <memory>
#include <optional>
#include <string_view>
#include <tuple>

namespace pyembed {

// The backends' ops as C++ signatures (pyembed/reference.py's schemas), for typed
// dispatcher calls: the node's OpKernels (csrc/autograd.cpp) and the eager Python callers'
// calls (csrc/pyembed.cpp). c10 checks a signature against its op's schema when typed_op
// makes the handle, so a schema change that a signature misses fails at import.
using ForwardOp = at::Tensor(const at::Tensor& ids, const at::Tensor& weight,
                             const std::optional<at::Tensor>& pos_weight,
                             const std::optional<at::Tensor>& position_ids, std::string_view pos_encoding,
                             double scale, int64_t offset, const std::optional<at::Tensor>& dropout_key,
                             double dropout_p, int64_t sinusoid_column_offset, int64_t sinusoid_dim,
                             int64_t error_record);
using BackwardOp = std::tuple<at::Tensor, at::Tensor>(
    const at::Tensor& grad_out, const at::Tensor& ids, const std::optional<at::Tensor>& position_ids, int64_t offset,
    int64_t num_embeddings, int64_t num_positions, double scale, std::optional<int64_t> padding_idx,
    bool scale_grad_by_freq, bool need_weight_grad, bool need_pos_grad, const std::optional<at::Tensor>& dropout_key,
    double dropout_p);
// embedding_sparse_backward and embedding_touched_rows: (rows, their sums).
using RowSumsOp = std::tuple<at::Tensor, at::Tensor>(const at::Tensor& grad_out, const at::Tensor& ids,
                                                     int64_t num_embeddings, double scale,
                                                     std::optional<int64_t> padding_idx, bool scale_grad_by_freq,
                                                     const std::optional<at::Tensor>& dropout_key, double dropout_p);

template <class Signature>
c10::TypedOperatorHandle<Signature> typed_op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Signature>();
}

// The kernels pyembed::embedding's node runs, with the schemas of pyembed/reference.py's
// embedding_forward (sinusoid columns left at their defaults), embedding_backward and
// embedding_sparse_backward: the C++ backends' ops through the dispatcher (csrc/autograd.cpp),
// or Python functions of a backend whose launches are Python (triton: csrc/pyembed.cpp).
struct LookupKernels {
  virtual ~LookupKernels() = default;
  virtual at::Tensor forward(const at::Tensor& ids, const at::Tensor& weight,
                             const std::optional<at::Tensor>& pos_weight,
                             const std::optional<at::Tensor>& position_ids, std::string_view pos_encoding,
                             double scale, int64_t offset, const std::optional<at::Tensor>& dropout_key,
                             double dropout_p, int64_t error_record) const = 0;
  virtual std::tuple<at::Tensor, at::Tensor> backward(
      const at::Tensor& grad_out, const at::Tensor& ids, const std::optional<at::Tensor>& position_ids,
      int64_t offset, int64_t num_embeddings, int64_t num_positions, double scale,
      std::optional<int64_t> padding_idx, bool scale_grad_by_freq, bool need_weight_grad, bool need_pos_grad,
      const std::optional<at::Tensor>& dropout_key, double dropout_p) const = 0;
  virtual std::tuple<at::Tensor, at::Tensor> sparse_backward(
      const at::Tensor& grad_out, const at::Tensor& ids, int64_t num_embeddings, double scale,
      std::optional<int64_t> padding_idx, bool scale_grad_by_freq, const std::optional<at::Tensor>& dropout_key,
      double dropout_p) const = 0;
};

// The Python backend's kernels, set at its import (never freed: they hold Python objects,
// which must not be released after the interpreter has gone; a second set replaces them).
void set_python_kernels(std::unique_ptr<LookupKernels> kernels);

// pyembed::embedding's call (its schema's arguments) with its node running the kernels
// set_python_kernels gave: every check and the node as for the C++ backends, only the
// forward, backward and sparse backward Python. Called directly, not through the dispatcher.
at::Tensor embedding_python_kernels(const at::Tensor& ids, const at::Tensor& weight,
                                    const std::optional<at::Tensor>& pos_weight,
                                    const std::optional<at::Tensor>& position_ids, std::string_view pos_encoding,
                                    double scale, int64_t offset, std::optional<int64_t> padding_idx,
                                    bool scale_grad_by_freq, bool validate, int64_t error_record, double dropout_p,
                                    const std::optional<at::Generator>& generator, bool sparse);

// The update of the tables whose optimizer runs in the backward (pyembed/_autograd.py's
// fused_step, pyembed/optim.py's step_tables), which the node of embedding_fused calls
// before it computes its gradients: each table given (the others are None) whose gradient
// is needed is updated from grad_out and ids. Returns the gradients still needed
// (weight's, pos_weight's). python: the kernels are Python (triton), else the device's ops.
struct FusedStep {
  virtual ~FusedStep() = default;
  virtual std::tuple<bool, bool> operator()(
      bool python, const at::Tensor& grad_out, const at::Tensor& ids, const std::optional<at::Tensor>& position_ids,
      const std::optional<at::Tensor>& dropout_key, const std::optional<at::Tensor>& weight,
      const std::optional<at::Tensor>& pos_weight, bool need_weight_grad, bool need_pos_grad, double scale,
      int64_t offset, std::optional<int64_t> padding_idx, bool scale_grad_by_freq, double dropout_p,
      bool sparse) const = 0;
};

// Set at import, as set_python_kernels (never freed; a second set replaces it).
void set_fused_step(std::unique_ptr<FusedStep> step);

// pyembed::embedding's call on tables of which fused_weight / fused_pos say which have their
// optimizer in the backward: the same checks and node, whose backward updates those tables
// (FusedStep) and gives them no gradient. python: the kernels set_python_kernels gave.
// Called directly, not through the dispatcher (an eager call only: pyembed/functional.py).
at::Tensor embedding_fused(bool python, bool fused_weight, bool fused_pos, const at::Tensor& ids,
                           const at::Tensor& weight, const std::optional<at::Tensor>& pos_weight,
                           const std::optional<at::Tensor>& position_ids, std::string_view pos_encoding, double scale,
                           int64_t offset, std::optional<int64_t> padding_idx, bool scale_grad_by_freq, bool validate,
                           int64_t error_record, double dropout_p, const std::optional<at::Generator>& generator,
                           bool sparse);

// grad through the forward's dropout mask (key [seed, offset], p), by the forward's kernel:
// what the backward sums when the dense op does not apply the mask in its own reads.
at::Tensor dropout_masked(const at::Tensor& grad, const at::Tensor& key, double dropout_p);

}  // namespace pyembed
