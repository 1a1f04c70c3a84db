// pyembed::embedding: the lookup with its autograd node in C++, for eager calls on the
// C++ backends (cpu, cuda).
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
// The node saves only the ids and positions; its backward is the backend's dense
// backward op -- or, when autograd records the backward itself (create_graph=True, for
// double backward), the same sums written with differentiable ATen ops.
#include <ATen/ATen.h>
#include <torch/autograd.h>
#include <torch/library.h>

#include <string_view>

#include "checks.h"

namespace pyembed {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

at::Tensor call_forward(const at::Tensor& ids, const at::Tensor& weight, const std::optional<at::Tensor>& pos_weight,
                        const std::optional<at::Tensor>& position_ids, std::string_view pos_encoding, double scale,
                        int64_t offset, int64_t error_record) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("pyembed::embedding_forward", "")
                       .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
                                         const std::optional<at::Tensor>&, std::string_view, double, int64_t,
                                         const std::optional<at::Tensor>&, double, int64_t, int64_t, int64_t)>();
  return op.call(ids, weight, pos_weight, position_ids, pos_encoding, scale, offset, std::nullopt, 0.0, 0, 0,
                 error_record);
}

// The dense gradients from the backend's op (the kernel: fp32 sums, one rounding,
// deterministic). Returns (dW, dP); an unneeded one is an empty tensor.
std::tuple<at::Tensor, at::Tensor> call_backward(const at::Tensor& grad_out, const at::Tensor& ids,
                                                 const std::optional<at::Tensor>& position_ids, int64_t offset,
                                                 int64_t num_embeddings, int64_t num_positions, double scale,
                                                 std::optional<int64_t> padding_idx, bool scale_grad_by_freq,
                                                 bool need_weight_grad, bool need_pos_grad) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("pyembed::embedding_backward", "")
                       .typed<std::tuple<at::Tensor, at::Tensor>(
                           const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&, int64_t, int64_t,
                           int64_t, double, std::optional<int64_t>, bool, bool, bool)>();
  return op.call(grad_out, ids, position_ids, offset, num_embeddings, num_positions, scale, padding_idx,
                 scale_grad_by_freq, need_weight_grad, need_pos_grad);
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
  const at::Tensor grad = grad_out.reshape({-1, dim}).to(acc);
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
};

struct EmbeddingFunction : public torch::autograd::Function<EmbeddingFunction> {
  // The tables come first: autograd numbers the tensor inputs in this order, so
  // needs_input_grad(0) is the weight and (1) the positional table when there is one.
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& weight, const std::optional<at::Tensor>& pos_weight,
                            const Lookup& lookup) {
    ctx->save_for_backward({lookup.ids, lookup.position_ids.value_or(at::Tensor())});
    // One entry, not one per scalar: each insertion into saved_data (a hash map that grows
    // as it fills) cost the forward of a one-token lookup tens of nanoseconds.
    ctx->saved_data["lookup"] = c10::ivalue::Tuple::create(
        {weight.size(0), lookup.pos_encoding == "learned" && pos_weight.has_value(),
         pos_weight.has_value() ? pos_weight->size(0) : int64_t(0), lookup.scale, lookup.offset, lookup.padding_idx,
         lookup.scale_grad_by_freq});
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    return call_forward(lookup.ids, weight, pos_weight, lookup.position_ids, lookup.pos_encoding, lookup.scale,
                        lookup.offset, lookup.error_record);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor &ids = saved[0], &position_ids = saved[1];
    const auto& lookup = ctx->saved_data["lookup"].toTupleRef().elements();
    const int64_t num_embeddings = lookup[0].toInt();
    const bool learned = lookup[1].toBool();
    const int64_t num_positions = lookup[2].toInt();
    const double scale = lookup[3].toDouble();
    const int64_t offset = lookup[4].toInt();
    const auto padding_idx = lookup[5].toOptional<int64_t>();
    const bool by_freq = lookup[6].toBool();
    const bool need_weight_grad = ctx->needs_input_grad(0);
    const bool need_pos_grad = learned && ctx->needs_input_grad(1);
    const at::Tensor grad_out = grad_outputs[0].contiguous();

    at::Tensor grad_weight, grad_pos;
    if (need_weight_grad || need_pos_grad) {
      if (at::GradMode::is_enabled()) {  // create_graph=True: the backward is recorded too
        std::tie(grad_weight, grad_pos) =
            differentiable_backward(grad_out, ids, position_ids, offset, num_embeddings, num_positions, scale,
                                    padding_idx, by_freq, need_weight_grad, need_pos_grad);
      } else {
        at::AutoDispatchBelowADInplaceOrView below_autograd;
        const std::optional<at::Tensor> positions =
            position_ids.defined() ? std::optional<at::Tensor>(position_ids) : std::nullopt;
        std::tie(grad_weight, grad_pos) = call_backward(grad_out, ids, positions, offset, num_embeddings,
                                                        num_positions, scale, padding_idx, by_freq,
                                                        need_weight_grad, need_pos_grad);
      }
    }
    // One entry per forward argument: the weight, pos_weight, nothing for the lookup.
    return {need_weight_grad ? grad_weight : at::Tensor(), need_pos_grad ? grad_pos : at::Tensor(), at::Tensor()};
  }
};

// Below autograd (inference_mode, no_grad, or tables that need no gradient): the forward op alone.
at::Tensor embedding_no_autograd(const at::Tensor& ids, const at::Tensor& weight,
                                 const std::optional<at::Tensor>& pos_weight,
                                 const std::optional<at::Tensor>& position_ids, std::string_view pos_encoding,
                                 double scale, int64_t offset, std::optional<int64_t> padding_idx,
                                 bool /*scale_grad_by_freq*/, bool validate, int64_t error_record) {
  const LookupArgs args =
      check_lookup(ids, weight, pos_weight, position_ids, pos_encoding, offset, padding_idx, validate);
  return call_forward(ids, weight, pos_weight, args.position_ids, pos_encoding, scale, offset, error_record);
}

at::Tensor embedding_autograd(const at::Tensor& ids, const at::Tensor& weight,
                              const std::optional<at::Tensor>& pos_weight,
                              const std::optional<at::Tensor>& position_ids, std::string_view pos_encoding,
                              double scale, int64_t offset, std::optional<int64_t> padding_idx,
                              bool scale_grad_by_freq, bool validate, int64_t error_record) {
  const bool needs_grad = weight.requires_grad() || (pos_weight.has_value() && pos_weight->requires_grad());
  if (!at::GradMode::is_enabled() || !needs_grad) {  // no_grad decoding: no node to build (~1 us)
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    return embedding_no_autograd(ids, weight, pos_weight, position_ids, pos_encoding, scale, offset, padding_idx,
                                 scale_grad_by_freq, validate, error_record);
  }
  const LookupArgs args =
      check_lookup(ids, weight, pos_weight, position_ids, pos_encoding, offset, padding_idx, validate);
  return EmbeddingFunction::apply(weight, pos_weight,
                                  Lookup{ids, args.position_ids, pos_encoding, scale, offset, args.padding_idx,
                                         scale_grad_by_freq, error_record});
}

}  // namespace

TORCH_LIBRARY_IMPL(pyembed, Autograd, m) {
  m.impl("embedding", &embedding_autograd);
}

TORCH_LIBRARY_IMPL(pyembed, CompositeExplicitAutograd, m) {
  m.impl("embedding", &embedding_no_autograd);
}

}  // namespace pyembed
