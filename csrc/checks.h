// Argument and data checks shared by the CPU and CUDA ops (DESIGN §3).
//
// The Python wrapper (pyembed/functional.py) already checks all metadata; the checks
// here are the data-dependent ones (they read the ids, a device->host sync on a GPU,
// skipped with validate=false) plus cheap guards for anyone calling the op directly.
// Messages match pyembed/reference.py word for word.
#pragma once

#include <ATen/ATen.h>

#include <string>
#include <string_view>

#include "common.h"

namespace pyembed {

inline PosEncoding parse_pos_encoding(const std::string& name) {
  if (name == "none") return PosEncoding::kNone;
  if (name == "learned") return PosEncoding::kLearned;
  TORCH_CHECK_VALUE(name == "sinusoidal", "pyembed: unknown pos_encoding '", name, "'");
  return PosEncoding::kSinusoidal;
}

inline void check_ids_in_range(const at::Tensor& ids, int64_t num_embeddings) {
  if (ids.numel() == 0) return;
  auto [lo_t, hi_t] = at::aminmax(ids);
  const int64_t lo = lo_t.item<int64_t>(), hi = hi_t.item<int64_t>();
  TORCH_CHECK_INDEX(lo >= 0 && hi < num_embeddings, "pyembed: ids out of range: min id ", lo, ", max id ", hi,
                    ", but the embedding table has V=", num_embeddings, " rows (valid ids are 0..",
                    num_embeddings - 1, ")");
}

// max_seq_len < 0: no upper bound (sinusoidal positions may be anything >= 0).
inline void check_position_ids(const at::Tensor& position_ids, int64_t max_seq_len) {
  if (position_ids.numel() == 0) return;
  auto [lo_t, hi_t] = at::aminmax(position_ids);
  const int64_t lo = lo_t.item<int64_t>(), hi = hi_t.item<int64_t>();
  TORCH_CHECK_VALUE(lo >= 0, "pyembed: position_ids must be >= 0, got min position ", lo);
  TORCH_CHECK_VALUE(max_seq_len < 0 || hi < max_seq_len, "pyembed: position ", hi,
                    " is out of range for the learned positional table with max_seq_len=", max_seq_len);
}

// Guards for direct callers of torch.ops.pyembed.*; the Python API reports these better.
inline void check_forward_args(const at::Tensor& ids, const at::Tensor& weight,
                               const std::optional<at::Tensor>& pos_weight,
                               const std::optional<at::Tensor>& position_ids, PosEncoding mode) {
  TORCH_CHECK_TYPE(ids.scalar_type() == at::kInt || ids.scalar_type() == at::kLong,
                   "pyembed: ids must be an int32 or int64 tensor, got ", ids.scalar_type());
  TORCH_CHECK_VALUE(weight.dim() == 2, "pyembed: weight must be 2-D (V, d)");
  if (mode != PosEncoding::kNone) {
    TORCH_CHECK_VALUE(ids.dim() == 1 || ids.dim() == 2,
                      "pyembed: with a positional encoding ids must be (B, T) or (T,), got shape ", ids.sizes());
  }
  if (mode == PosEncoding::kLearned) {
    TORCH_CHECK_VALUE(pos_weight.has_value() && pos_weight->dim() == 2 && pos_weight->size(1) == weight.size(1),
                      "pyembed: embedding dimension mismatch between weight and pos_weight");
    TORCH_CHECK_TYPE(pos_weight->scalar_type() == weight.scalar_type(), "pyembed: pos_weight dtype != weight dtype");
  }
  if (mode == PosEncoding::kSinusoidal) {
    TORCH_CHECK_VALUE(weight.size(1) % 2 == 0,
                      "pyembed: sinusoidal encoding requires an even embedding dim, got d=", weight.size(1));
  }
  if (position_ids.has_value()) {
    TORCH_CHECK_VALUE(position_ids->sizes() == ids.sizes(), "pyembed: position_ids shape ", position_ids->sizes(),
                      " != ids shape ", ids.sizes());
  }
}

inline void validate_forward(const at::Tensor& ids, int64_t num_embeddings,
                             const std::optional<at::Tensor>& position_ids, PosEncoding mode,
                             int64_t num_positions) {
  check_ids_in_range(ids, num_embeddings);
  if (position_ids.has_value()) {
    check_position_ids(*position_ids, mode == PosEncoding::kLearned ? num_positions : -1);
  }
}

// The shared start of every forward op: checks (data checks when validate), contiguous
// inputs, position_ids as int64, and the output, allocated (uninitialised).
struct ForwardInputs {
  PosEncoding mode;
  at::Tensor ids, weight, pos_weight, position_ids, out;  // pos_weight / position_ids may be undefined
  bool empty() const { return ids.numel() == 0 || weight.size(1) == 0; }
};

inline ForwardInputs prepare_forward(const at::Tensor& ids, const at::Tensor& weight,
                                     const std::optional<at::Tensor>& pos_weight,
                                     const std::optional<at::Tensor>& position_ids, std::string_view pos_encoding,
                                     bool validate) {
  ForwardInputs in;
  in.mode = parse_pos_encoding(std::string(pos_encoding));
  check_forward_args(ids, weight, pos_weight, position_ids, in.mode);
  const int64_t num_positions = in.mode == PosEncoding::kLearned ? pos_weight->size(0) : 0;
  if (validate) validate_forward(ids, weight.size(0), position_ids, in.mode, num_positions);
  in.ids = ids.contiguous();
  in.weight = weight.contiguous();
  if (in.mode == PosEncoding::kLearned) in.pos_weight = pos_weight->contiguous();
  if (in.mode != PosEncoding::kNone && position_ids) in.position_ids = position_ids->to(at::kLong).contiguous();
  auto sizes = in.ids.sizes().vec();
  sizes.push_back(in.weight.size(1));
  in.out = at::empty(sizes, in.weight.options());
  return in;
}

}  // namespace pyembed
