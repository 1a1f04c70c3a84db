// pyembed::embedding: the lookup with its autograd node in C++, for eager calls on the
// C++ backends (cpu, cuda) -- and on triton, whose node runs Python kernels
// (LookupKernels, csrc/pyembed.cpp's PythonKernels; the call is embedding_python_kernels).
//
// Why: a one-token lookup is ~10 us in eager PyTorch. A Python autograd.Function alone
// costs ~5 us of apply, ctx and save overhead on top of the ~3 us kernel call, and the
// Python argument checks ~3 us more; a C++ node (as FBGEMM's TBE ops register theirs)
// costs ~2 us and the same checks in C++ (checks.h: check_lookup) well under one.
// pyembed/functional.py calls this op first for every call that needs nothing else: no
// dropout, a dense gradient, no forward-mode AD, no torch.func transform, not under
// torch.compile, plain tensors (those keep the Python FusedEmbeddingFunction, which
// serves every backend and every order); its bad-input errors are raised as pyembed's
// exception types (pyembed.checks.from_cpp), never retried.
//
// The node saves only the ids, positions and dropout key; its backward is the backend's
// dense (or sparse) backward op -- or, when autograd records the backward itself
// (create_graph=True, for double backward), the same sums written with differentiable ATen ops.
// For the common call (a C++ backend's dense gradient) the node is built by hand
// (LookupBackward), as PyTorch builds its own; the others take torch::autograd::Function's
// (EmbeddingFunction). Both run lookup_backward.
//
// Dropout (GPT-2's embedding dropout) and sparse=True take this node too: a Python
// Function's backward runs on autograd's device thread, where at d81f5b2 a GPT-2 8x2048
// forward + backward with dropout cost 787 us on an H100 against 232 us without it through
// this node. The dropout key is drawn here, after the checks (a refused call leaves the
// generator as it was), as pyembed/reference.py's draw_dropout_key draws it: the same mask
// as every other route.
#include <ATen/ATen.h>
#include <ATen/FuncTorchTLS.h>
#include <torch/autograd.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/dynamo/compiled_autograd.h>
#include <torch/csrc/jit/frontend/tracer.h>
#include <torch/library.h>

#include <algorithm>
#include <memory>
#include <mutex>
#include <string_view>
#include <type_traits>
#include <vector>

#include "autograd.h"
#include "checks.h"

namespace pyembed {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// The C++ backends' kernels: their ops through the dispatcher, which picks by device.
struct OpKernels final : LookupKernels {
  at::Tensor forward(const at::Tensor& ids, const at::Tensor& weight, const std::optional<at::Tensor>& pos_weight,
                     const std::optional<at::Tensor>& position_ids, std::string_view pos_encoding, double scale,
                     int64_t offset, const std::optional<at::Tensor>& dropout_key, double dropout_p,
                     int64_t error_record) const override {
    static const auto op = typed_op<ForwardOp>("pyembed::embedding_forward");
    return op.call(ids, weight, pos_weight, position_ids, pos_encoding, scale, offset, dropout_key, dropout_p, 0, 0,
                   error_record);
  }

  // The dense gradients (the kernel: fp32 sums, one rounding, deterministic). Returns
  // (dW, dP); an unneeded one is an empty tensor.
  std::tuple<at::Tensor, at::Tensor> backward(const at::Tensor& grad_out, const at::Tensor& ids,
                                              const std::optional<at::Tensor>& position_ids, int64_t offset,
                                              int64_t num_embeddings, int64_t num_positions, double scale,
                                              std::optional<int64_t> padding_idx, bool scale_grad_by_freq,
                                              bool need_weight_grad, bool need_pos_grad,
                                              const std::optional<at::Tensor>& dropout_key,
                                              double dropout_p) const override {
    static const auto op = typed_op<BackwardOp>("pyembed::embedding_backward");
    return op.call(grad_out, ids, position_ids, offset, num_embeddings, num_positions, scale, padding_idx,
                   scale_grad_by_freq, need_weight_grad, need_pos_grad, dropout_key, dropout_p);
  }

  // The table's touched rows (sorted, unique) and their sums.
  std::tuple<at::Tensor, at::Tensor> sparse_backward(const at::Tensor& grad_out, const at::Tensor& ids,
                                                     int64_t num_embeddings, double scale,
                                                     std::optional<int64_t> padding_idx, bool scale_grad_by_freq,
                                                     const std::optional<at::Tensor>& dropout_key,
                                                     double dropout_p) const override {
    static const auto op = typed_op<RowSumsOp>("pyembed::embedding_sparse_backward");
    return op.call(grad_out, ids, num_embeddings, scale, padding_idx, scale_grad_by_freq, dropout_key, dropout_p);
  }
};

const OpKernels op_kernels;
const LookupKernels* python_kernels = nullptr;  // set_python_kernels; never freed
const FusedStep* fused_step = nullptr;           // set_fused_step; never freed

// The kernels a node runs, by the flag it saved (a pointer is not an IValue).
const LookupKernels& kernels_of(bool python) { return python ? *python_kernels : op_kernels; }

// [seed, offset] as pyembed/reference.py's draw_dropout_key draws it (torch.randint(0,
// 2^62, (2,), generator) on the tables' device); none without dropout.
std::optional<at::Tensor> draw_dropout_key(double dropout_p, const std::optional<at::Generator>& generator,
                                           const at::Device& device) {
  if (dropout_p == 0.0) return std::nullopt;
  return at::randint(0, int64_t(1) << 62, {2}, generator, at::TensorOptions().dtype(at::kLong).device(device));
}

// grad * keep / (1 - p) with the forward's mask, by the forward's own kernel: grad is
// looked up as a table whose row n is flat token n (ids 0..N-1), so element (n, j) meets
// the keep bit it met in the forward; rounded once to grad's dtype, as nn.Dropout's
// backward (pyembed/_autograd.py, _dropout_mask_forward: the same call).
at::Tensor dropout_masked_by(const LookupKernels& kernels, const at::Tensor& grad, const at::Tensor& key,
                             double dropout_p) {
  const int64_t dim = grad.size(-1);
  const at::Tensor rows = dim ? grad.reshape({-1, dim}).contiguous() : grad.new_empty({0, 0});
  at::AutoDispatchBelowADInplaceOrView below_autograd;
  return kernels.forward(at::arange(rows.size(0), key.options()), rows, std::nullopt, std::nullopt, "none", 1.0, 0,
                         key, dropout_p, 0)
      .reshape(grad.sizes());
}

}  // namespace

at::Tensor dropout_masked(const at::Tensor& grad, const at::Tensor& key, double dropout_p) {
  return dropout_masked_by(op_kernels, grad, key, dropout_p);
}

namespace {

// The mask applied to an output gradient as a node of its own, for create_graph=True:
// multiplying by the mask is linear and diagonal, so its backward is itself.
struct DropoutMaskFunction : public torch::autograd::Function<DropoutMaskFunction> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& grad, const at::Tensor& key, double dropout_p,
                            bool python) {
    ctx->save_for_backward({key});
    ctx->saved_data["dropout_p"] = dropout_p;
    ctx->saved_data["python"] = python;
    return dropout_masked_by(kernels_of(python), grad, key, dropout_p);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    const at::Tensor key = ctx->get_saved_variables()[0];
    return {DropoutMaskFunction::apply(grad_outputs[0], key, ctx->saved_data["dropout_p"].toDouble(),
                                       ctx->saved_data["python"].toBool()),
            at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

// The coalesced COO gradient of a (num_embeddings, d) table from its rows and their sums.
at::Tensor sparse_gradient(const at::Tensor& rows, const at::Tensor& values, int64_t num_embeddings) {
  return at::_sparse_coo_tensor_with_dims_and_tensors(
      1, 1, {num_embeddings, values.size(1)}, rows.unsqueeze(0), values, values.options().layout(at::kSparse),
      /*is_coalesced=*/true);
}

// The same gradients as differentiable ATen ops (fp32 sums for half/bf16, one rounding),
// for create_graph=True: autograd then differentiates them again (their derivative is a
// lookup). Semantics as the kernels: out-of-range ids and the padding row get nothing,
// scale_grad_by_freq divides each term by its id's count, every token adds to dP.
std::tuple<at::Tensor, at::Tensor> differentiable_backward(
    const at::Tensor& grad_out, const at::Tensor& ids, const at::Tensor& position_ids, int64_t offset,
    int64_t num_embeddings, int64_t num_positions, double scale, std::optional<int64_t> padding_idx,
    bool scale_grad_by_freq, bool need_weight_grad, bool need_pos_grad) {
  const int64_t dim = grad_out.size(-1);
  const auto acc = grad_out.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  const at::Tensor grad = grad_out.reshape({ids.numel(), dim}).to(acc);  // not -1: ambiguous for a 0-wide table
  const at::Tensor flat = ids.reshape(-1).to(at::kLong);
  at::Tensor grad_weight, grad_pos;
  if (need_weight_grad) {
    const at::Tensor in_range = (flat >= 0) & (flat < num_embeddings);
    const at::Tensor keep = padding_idx.has_value() ? in_range & (flat != *padding_idx) : in_range;
    const at::Tensor rows = flat.clamp(0, std::max<int64_t>(num_embeddings - 1, 0));
    at::Tensor factor = keep.to(acc) * scale;
    if (scale_grad_by_freq) {  // counts include the padding row's tokens, as nn.Embedding's
      const at::Tensor counts = at::zeros({num_embeddings}, grad.options()).index_add(0, rows, in_range.to(acc));
      factor = factor / counts.index_select(0, rows).clamp_min(1);
    }
    grad_weight = at::zeros({num_embeddings, dim}, grad.options())
                      .index_add(0, rows, grad * factor.unsqueeze(1))
                      .to(grad_out.scalar_type());
  }
  if (need_pos_grad) {
    at::Tensor positions = position_ids.defined()
                               ? position_ids.reshape(-1).to(at::kLong)
                               : (at::arange(ids.size(-1), flat.options()) + offset).expand(ids.sizes()).reshape(-1);
    const at::Tensor keep = ((positions >= 0) & (positions < num_positions)).to(acc).unsqueeze(1);
    positions = positions.clamp(0, std::max<int64_t>(num_positions - 1, 0));
    grad_pos = at::zeros({num_positions, dim}, grad.options())
                   .index_add(0, positions, grad * keep)
                   .to(grad_out.scalar_type());
  }
  return {grad_weight, grad_pos};
}

// What the node needs besides the tables: not autograd inputs (ids never require a
// gradient), so Function::apply tracks two tensors, not four -- each input it tracks costs
// a VariableInfo (a sizes vector) and an edge, on every call of a one-token lookup.
struct Lookup {
  at::Tensor ids;
  std::optional<at::Tensor> position_ids;
  std::string_view pos_encoding;
  double scale;
  int64_t offset;
  std::optional<int64_t> padding_idx;
  bool scale_grad_by_freq;
  int64_t error_record;
  std::optional<at::Tensor> dropout_key;
  double dropout_p;
  bool sparse;  // the table's gradient as a coalesced COO tensor
  bool python;  // the kernels: Python (set_python_kernels), else the backend's ops
  // The tables whose optimizer runs in the backward (embedding_fused): updated there by
  // fused_step, held by the node (not saved: the update changes them).
  bool fused_weight = false, fused_pos = false;
};

// What the lookup's backward reads besides the output gradient, as a node saved it.
struct Saved {
  at::Tensor ids, position_ids, dropout_key;  // position_ids, dropout_key: undefined when absent
  int64_t num_embeddings, num_positions, offset;
  bool learned;  // learned positions: pos_weight's gradient
  double scale;
  std::optional<int64_t> padding_idx;
  bool scale_grad_by_freq;
  double dropout_p;
  bool sparse, python;
  // The tables whose optimizer runs in the backward, held by the node; none: no update.
  std::optional<at::Tensor> fused_weight, fused_pos;
  bool fused;
};

// (weight's gradient, pos_weight's) for grad_out, each undefined where not needed: the
// backend's dense (or sparse) backward op -- after the update of the tables whose optimizer
// runs here -- or, where autograd records the backward (create_graph=True), differentiable ops.
std::tuple<at::Tensor, at::Tensor> lookup_backward(const Saved& saved, at::Tensor grad_out, bool need_weight_grad,
                                                   bool need_pos_grad) {
  const LookupKernels& kernels = kernels_of(saved.python);
  const std::optional<at::Tensor> positions =
      saved.position_ids.defined() ? std::optional<at::Tensor>(saved.position_ids) : std::nullopt;
  if (!need_weight_grad && !need_pos_grad) return {};
  // With dropout the gradient goes through the forward's mask: in the ops' own reads (the
  // key passed on: CUDA's kernels, Triton's), else first -- create_graph=True, where the mask
  // is a node; on the CPU, whose ops would each mask it by a pass of their own
  // (csrc/cpu/embedding_cpu.cpp), where two or more of them read it (counted as
  // pyembed/_autograd.py's gradient_readers counts them): once, here.
  const bool fused_weight = saved.fused_weight.has_value() && need_weight_grad;
  const bool fused_pos = saved.fused_pos.has_value() && need_pos_grad;
  const bool weight_left = need_weight_grad && !fused_weight, pos_left = need_pos_grad && !fused_pos;
  const int readers = int(fused_weight) + int(fused_pos) + int((weight_left && !saved.sparse) || pos_left) +
                      int(weight_left && saved.sparse);
  const bool record_mask = saved.dropout_key.defined() && at::GradMode::is_enabled();
  const bool mask_first =
      record_mask || (saved.dropout_key.defined() && !saved.python && grad_out.is_cpu() && readers > 1);
  if (record_mask) {
    grad_out = DropoutMaskFunction::apply(grad_out, saved.dropout_key, saved.dropout_p, saved.python);
  } else if (mask_first) {
    grad_out = dropout_masked(grad_out, saved.dropout_key, saved.dropout_p);
  }
  const std::optional<at::Tensor> op_dropout_key =
      saved.dropout_key.defined() && !mask_first ? std::optional<at::Tensor>(saved.dropout_key) : std::nullopt;
  if (saved.fused) {  // the tables whose optimizer runs here are updated, and need no gradient
    std::tie(need_weight_grad, need_pos_grad) =
        (*fused_step)(saved.python, grad_out, saved.ids, positions, op_dropout_key, saved.fused_weight,
                      saved.fused_pos, need_weight_grad, need_pos_grad, saved.scale, saved.offset,
                      saved.padding_idx, saved.scale_grad_by_freq, saved.dropout_p, saved.sparse);
    if (!need_weight_grad && !need_pos_grad) return {};
  }
  const bool sparse_weight_grad = saved.sparse && need_weight_grad;
  at::Tensor grad_weight, grad_pos;
  if (at::GradMode::is_enabled()) {  // create_graph=True: the backward is recorded too
    std::tie(grad_weight, grad_pos) = differentiable_backward(
        grad_out, saved.ids, saved.position_ids, saved.offset, saved.num_embeddings, saved.num_positions,
        saved.scale, saved.padding_idx, saved.scale_grad_by_freq, need_weight_grad, need_pos_grad);
    if (sparse_weight_grad) {  // the dense sums' touched rows, differentiably
      at::Tensor rows;
      {
        at::AutoDispatchBelowADInplaceOrView below_autograd;
        rows = std::get<0>(kernels.sparse_backward(grad_out.detach(), saved.ids, saved.num_embeddings, saved.scale,
                                                   saved.padding_idx, saved.scale_grad_by_freq, std::nullopt, 0.0));
      }
      grad_weight = sparse_gradient(rows, grad_weight.index_select(0, rows), saved.num_embeddings);
    }
  } else {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    if (need_pos_grad || !sparse_weight_grad) {  // a sparse table alone needs no dense op
      std::tie(grad_weight, grad_pos) =
          kernels.backward(grad_out, saved.ids, positions, saved.offset, saved.num_embeddings, saved.num_positions,
                           saved.scale, saved.padding_idx, saved.scale_grad_by_freq,
                           need_weight_grad && !saved.sparse, need_pos_grad, op_dropout_key, saved.dropout_p);
    }
    if (sparse_weight_grad) {
      const auto [rows, values] = kernels.sparse_backward(grad_out, saved.ids, saved.num_embeddings, saved.scale,
                                                          saved.padding_idx, saved.scale_grad_by_freq,
                                                          op_dropout_key, saved.dropout_p);
      grad_weight = sparse_gradient(rows, values, saved.num_embeddings);
    }
  }
  return {need_weight_grad ? grad_weight : at::Tensor(), need_pos_grad ? grad_pos : at::Tensor()};
}

// The node as torch::autograd::Function builds it: for the calls LookupBackward does not
// take (Python kernels, a sparse gradient, tables updated in the backward, and forward-mode
// AD on a direct call of the op, which this Function refuses).
struct EmbeddingFunction : public torch::autograd::Function<EmbeddingFunction> {
  // The tables come first: autograd numbers the tensor inputs in this order, so
  // needs_input_grad(0) is the weight and (1) the positional table when there is one.
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& weight, const std::optional<at::Tensor>& pos_weight,
                            const Lookup& lookup) {
    ctx->save_for_backward(
        {lookup.ids, lookup.position_ids.value_or(at::Tensor()), lookup.dropout_key.value_or(at::Tensor())});
    // One entry, not one per scalar: each insertion into saved_data (a hash map that grows
    // as it fills) cost the forward of a one-token lookup tens of nanoseconds.
    ctx->saved_data["lookup"] = c10::ivalue::Tuple::create(
        {weight.size(0), lookup.pos_encoding == "learned" && pos_weight.has_value(),
         pos_weight.has_value() ? pos_weight->size(0) : int64_t(0), lookup.scale, lookup.offset, lookup.padding_idx,
         lookup.scale_grad_by_freq, lookup.dropout_p, lookup.sparse, lookup.python,
         lookup.fused_weight || lookup.fused_pos});
    if (lookup.fused_weight || lookup.fused_pos) {
      ctx->saved_data["fused"] = c10::ivalue::Tuple::create(
          {lookup.fused_weight ? c10::IValue(weight) : c10::IValue(),
           lookup.fused_pos && pos_weight.has_value() ? c10::IValue(*pos_weight) : c10::IValue()});
    }
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    return kernels_of(lookup.python)
        .forward(lookup.ids, weight, pos_weight, lookup.position_ids, lookup.pos_encoding, lookup.scale,
                 lookup.offset, lookup.dropout_key, lookup.dropout_p, lookup.error_record);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    const auto saved_variables = ctx->get_saved_variables();
    const auto& lookup = ctx->saved_data["lookup"].toTupleRef().elements();
    Saved saved{saved_variables[0], saved_variables[1], saved_variables[2], lookup[0].toInt(), lookup[2].toInt(),
                lookup[4].toInt(), lookup[1].toBool(), lookup[3].toDouble(), lookup[5].toOptional<int64_t>(),
                lookup[6].toBool(), lookup[7].toDouble(), lookup[8].toBool(), lookup[9].toBool(), std::nullopt,
                std::nullopt, lookup[10].toBool()};
    if (saved.fused) {
      const auto& tables = ctx->saved_data["fused"].toTupleRef().elements();
      saved.fused_weight = tables[0].toOptional<at::Tensor>();
      saved.fused_pos = tables[1].toOptional<at::Tensor>();
    }
    auto [grad_weight, grad_pos] = lookup_backward(saved, grad_outputs[0].contiguous(), ctx->needs_input_grad(0),
                                                   saved.learned && ctx->needs_input_grad(1));
    // One entry per forward argument: the weight, pos_weight, nothing for the lookup.
    return {grad_weight, grad_pos, at::Tensor()};
  }
};

// The node of the common call -- the C++ backends' kernels, a dense gradient, no table
// updated in the backward -- built by hand, as PyTorch's generated nodes are
// (EmbeddingBackward0): torch::autograd::Function's apply builds a general node (a context
// with a hash map and sets, per-input and per-output metadata, forward-AD and view handling
// of the outputs) that cost a one-token `cpu` lookup with a gradient ~0.7 us of its 3.4 on the
// development VM (2.7 with this node; F.embedding 2.4-2.5). Its backward is lookup_backward,
// as EmbeddingFunction's. Under compiled autograd (torch._dynamo.compiled_autograd) apply
// runs on the traced tensors, so the backward's op -- pyembed::embedding_backward, which has
// a fake -- is traced into the compiled graph (EmbeddingFunction's node is called there as an
// opaque function).
struct LookupBackward final : public torch::autograd::Node {
  torch::autograd::SavedVariable ids, position_ids, dropout_key;
  Saved saved;  // its tensors unset: they are the SavedVariables above

  std::string name() const override { return "pyembed::EmbeddingBackward"; }

  variable_list apply(variable_list&& grads) override {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!grads[0].defined()) return {at::Tensor(), at::Tensor()};  // no gradient reached the output
    Saved unpacked = saved;
    unpacked.ids = ids.unpack();
    unpacked.position_ids = position_ids.unpack();
    unpacked.dropout_key = dropout_key.unpack();
    auto [grad_weight, grad_pos] =
        lookup_backward(unpacked, grads[0].contiguous(), task_should_compute_output(0),
                        saved.learned && task_should_compute_output(1));
    return {grad_weight, grad_pos};
  }

  void release_variables() override {
    std::lock_guard<std::mutex> lock(mutex_);
    ids.reset_data();
    position_ids.reset_data();
    dropout_key.reset_data();
  }

  void compiled_args(torch::dynamo::autograd::CompiledNodeArgs& args) const override {
    args.collect(ids, false);
    args.collect(position_ids, false);
    args.collect(dropout_key, false);
    args.collect(saved.num_embeddings);
    args.collect(saved.num_positions);
    args.collect(saved.offset);
    args.collect(saved.learned);
    args.collect(saved.scale);
    args.collect(saved.padding_idx);
    args.collect(saved.scale_grad_by_freq);
    args.collect(saved.dropout_p);
  }

  variable_list apply_with_saved(const variable_list& grads,
                                 torch::dynamo::autograd::SwapSavedVariables& swap) override {
    swap.before(ids);
    swap.before(position_ids);
    swap.before(dropout_key);
    variable_list result = apply(variable_list(grads));
    swap.after(ids);
    swap.after(position_ids);
    swap.after(dropout_key);
    return result;
  }
};

// A new node N, held as autograd holds nodes -- the pointer type of Edge::function: a
// c10::intrusive_ptr since torch 2.13, a std::shared_ptr before (torch 2.11 is the GPU
// machine's), made with torch's deleteNode, which frees a long graph without deep recursion
// (found by argument-dependent lookup, so that a torch without it compiles the other branch).
template <class N>
auto make_node() {
  if constexpr (std::is_same_v<decltype(torch::autograd::Edge::function), std::shared_ptr<torch::autograd::Node>>) {
    return std::shared_ptr<N>(new N(), [](auto* node) { deleteNode(node); });
  } else {
    return c10::make_intrusive<N>();
  }
}

// The output of `lookup` (computed) with a LookupBackward node as its history.
at::Tensor with_lookup_backward(at::Tensor out, const at::Tensor& weight,
                                const std::optional<at::Tensor>& pos_weight, const Lookup& lookup) {
  auto node = make_node<LookupBackward>();
  node->set_next_edges(torch::autograd::collect_next_edges(weight, pos_weight));
  node->ids = torch::autograd::SavedVariable(lookup.ids, false);
  if (lookup.position_ids) node->position_ids = torch::autograd::SavedVariable(*lookup.position_ids, false);
  if (lookup.dropout_key) node->dropout_key = torch::autograd::SavedVariable(*lookup.dropout_key, false);
  const bool learned = lookup.pos_encoding == "learned" && pos_weight.has_value();
  node->saved = Saved{{}, {}, {}, weight.size(0), pos_weight.has_value() ? pos_weight->size(0) : int64_t(0),
                      lookup.offset, learned, lookup.scale, lookup.padding_idx, lookup.scale_grad_by_freq,
                      lookup.dropout_p, /*sparse=*/false, /*python=*/false, std::nullopt, std::nullopt,
                      /*fused=*/false};
  torch::autograd::set_history(out, node);
#if __has_include(<torch/csrc/autograd/node_creation_hook.h>)
  torch::autograd::fire_node_creation_hooks(node);  // torch.autograd.graph's node creation hooks (torch 2.14)
#endif
  return out;
}

// Below autograd (inference_mode, no_grad, or tables that need no gradient): the forward
// alone. kPython: the kernels set_python_kernels gave, else the backend's ops.
template <bool kPython>
at::Tensor lookup_forward(const at::Tensor& ids, const at::Tensor& weight, const std::optional<at::Tensor>& pos_weight,
                          const std::optional<at::Tensor>& position_ids, std::string_view pos_encoding, double scale,
                          int64_t offset, std::optional<int64_t> padding_idx, bool /*scale_grad_by_freq*/,
                          bool validate, int64_t error_record, double dropout_p,
                          const std::optional<at::Generator>& generator, bool /*sparse*/) {
  check_dropout_p(dropout_p);
  const LookupArgs args =
      check_lookup(ids, weight, pos_weight, position_ids, pos_encoding, offset, padding_idx, validate);
  return kernels_of(kPython).forward(ids, weight, pos_weight, args.position_ids, pos_encoding, scale, offset,
                                     draw_dropout_key(dropout_p, generator, weight.device()), dropout_p,
                                     error_record);
}

// The lookup, with its node where a table needs a gradient; fused_weight / fused_pos: the
// tables its backward updates (embedding_fused).
template <bool kPython>
at::Tensor lookup_node(bool fused_weight, bool fused_pos, const at::Tensor& ids, const at::Tensor& weight,
                       const std::optional<at::Tensor>& pos_weight, const std::optional<at::Tensor>& position_ids,
                       std::string_view pos_encoding, double scale, int64_t offset,
                       std::optional<int64_t> padding_idx, bool scale_grad_by_freq, bool validate,
                       int64_t error_record, double dropout_p, const std::optional<at::Generator>& generator,
                       bool sparse) {
  // torch.jit.trace records ATen and dispatcher ops; the triton kernels' launches are neither
  // (this call is not an op either), so its trace would hold the output's allocation alone,
  // and the traced module return that memory unwritten.
  TORCH_CHECK_NOT_IMPLEMENTED(!kPython || !torch::jit::tracer::isTracing(),
                              "pyembed: torch.jit.trace cannot record the triton backend's kernel launches (they "
                              "are not ATen ops); trace with backend='cuda' or 'cpu', or use torch.export or "
                              "torch.compile, which record pyembed's ops");
  const bool needs_grad = weight.requires_grad() || (pos_weight.has_value() && pos_weight->requires_grad());
  if (!at::GradMode::is_enabled() || !needs_grad) {  // no_grad decoding: no node to build (~1 us)
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    return lookup_forward<kPython>(ids, weight, pos_weight, position_ids, pos_encoding, scale, offset, padding_idx,
                                   scale_grad_by_freq, validate, error_record, dropout_p, generator, sparse);
  }
  check_dropout_p(dropout_p);
  const LookupArgs args =
      check_lookup(ids, weight, pos_weight, position_ids, pos_encoding, offset, padding_idx, validate);
  const Lookup lookup{ids, args.position_ids, pos_encoding, scale, offset, args.padding_idx, scale_grad_by_freq,
                      error_record, draw_dropout_key(dropout_p, generator, weight.device()), dropout_p, sparse,
                      kPython, fused_weight, fused_pos};
  // Forward-mode AD and functorch transforms reach here only by a direct call of the op
  // (pyembed's own calls take the Python Function there), and are refused as
  // torch::autograd::Function refuses them: the check it makes, and its node for tangents.
  if (const auto& functorch_tls = at::functorch::functorchTLSAccessor()) {
    functorch_tls->checkSupportsCppAutogradFunction();
  }
  if (kPython || sparse || fused_weight || fused_pos || weight._fw_grad(/*level=*/0).defined() ||
      (pos_weight && pos_weight->_fw_grad(/*level=*/0).defined())) {
    return EmbeddingFunction::apply(weight, pos_weight, lookup);
  }
  at::Tensor out;
  {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    out = op_kernels.forward(ids, weight, pos_weight, lookup.position_ids, pos_encoding, scale, offset,
                             lookup.dropout_key, dropout_p, error_record);
  }
  return with_lookup_backward(std::move(out), weight, pos_weight, lookup);
}

// pyembed::embedding's kernel (Autograd key): no table updated in the backward.
template <bool kPython>
at::Tensor lookup(const at::Tensor& ids, const at::Tensor& weight, const std::optional<at::Tensor>& pos_weight,
                  const std::optional<at::Tensor>& position_ids, std::string_view pos_encoding, double scale,
                  int64_t offset, std::optional<int64_t> padding_idx, bool scale_grad_by_freq, bool validate,
                  int64_t error_record, double dropout_p, const std::optional<at::Generator>& generator,
                  bool sparse) {
  return lookup_node<kPython>(false, false, ids, weight, pos_weight, position_ids, pos_encoding, scale, offset,
                              padding_idx, scale_grad_by_freq, validate, error_record, dropout_p, generator, sparse);
}

}  // namespace

void set_python_kernels(std::unique_ptr<LookupKernels> kernels) {
  python_kernels = kernels.release();  // a previous set is kept (a node may be running it)
}

at::Tensor embedding_python_kernels(const at::Tensor& ids, const at::Tensor& weight,
                                    const std::optional<at::Tensor>& pos_weight,
                                    const std::optional<at::Tensor>& position_ids, std::string_view pos_encoding,
                                    double scale, int64_t offset, std::optional<int64_t> padding_idx,
                                    bool scale_grad_by_freq, bool validate, int64_t error_record, double dropout_p,
                                    const std::optional<at::Generator>& generator, bool sparse) {
  TORCH_CHECK(python_kernels != nullptr, "pyembed: no Python kernels were set");
  return lookup<true>(ids, weight, pos_weight, position_ids, pos_encoding, scale, offset, padding_idx,
                      scale_grad_by_freq, validate, error_record, dropout_p, generator, sparse);
}

void set_fused_step(std::unique_ptr<FusedStep> step) {
  fused_step = step.release();  // a previous set is kept (a node may be running it)
}

at::Tensor embedding_fused(bool python, bool fused_weight, bool fused_pos, const at::Tensor& ids,
                           const at::Tensor& weight, const std::optional<at::Tensor>& pos_weight,
                           const std::optional<at::Tensor>& position_ids, std::string_view pos_encoding, double scale,
                           int64_t offset, std::optional<int64_t> padding_idx, bool scale_grad_by_freq, bool validate,
                           int64_t error_record, double dropout_p, const std::optional<at::Generator>& generator,
                           bool sparse) {
  TORCH_CHECK(fused_step != nullptr, "pyembed: no fused optimizer step was set");
  TORCH_CHECK(!python || python_kernels != nullptr, "pyembed: no Python kernels were set");
  auto call = python ? &lookup_node<true> : &lookup_node<false>;
  return call(fused_weight, fused_pos, ids, weight, pos_weight, position_ids, pos_encoding, scale, offset,
              padding_idx, scale_grad_by_freq, validate, error_record, dropout_p, generator, sparse);
}

// The op's kernels: the C++ backends'.
TORCH_LIBRARY_IMPL(pyembed, Autograd, m) {
  m.impl("embedding", &lookup<false>);
}

TORCH_LIBRARY_IMPL(pyembed, CompositeExplicitAutograd, m) {
  m.impl("embedding", &lookup_forward<false>);
}

}  // namespace pyembed
