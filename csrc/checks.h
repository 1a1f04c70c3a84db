// Argument checks shared by the CPU and CUDA ops (DESIGN §3).
//
// The Python wrapper (pyembed/functional.py) already checks all metadata, and the data
// checks (id / position ranges, a device->host sync on a GPU) are an op of their own
// (pyembed/checks.py). What is here are cheap guards for anyone calling an op directly:
// the kernels never read out of bounds whatever the ids, but they need sane shapes and
// every tensor on one device.
#pragma once

#include <ATen/ATen.h>

#include <string>
#include <string_view>

#include "common.h"
#include "dropout.h"

namespace pyembed {

inline PosEncoding parse_pos_encoding(const std::string& name) {
  if (name == "none") return PosEncoding::kNone;
  if (name == "learned") return PosEncoding::kLearned;
  TORCH_CHECK_VALUE(name == "sinusoidal", "pyembed: unknown pos_encoding '", name, "'");
  return PosEncoding::kSinusoidal;
}

// Every tensor an op reads or writes must be on `device`: a foreign pointer handed to a
// kernel is an out-of-bounds access on another GPU (or on the host).
inline void check_same_device(const at::Device& device, std::initializer_list<const at::Tensor*> tensors) {
  for (const at::Tensor* t : tensors) {
    if (t != nullptr && t->defined()) {
      TORCH_CHECK_VALUE(t->device() == device, "pyembed: tensors on different devices: ", t->device(), " and ",
                        device);
    }
  }
}

inline const at::Tensor* opt(const std::optional<at::Tensor>& t) { return t.has_value() ? &*t : nullptr; }

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

// The shared start of every forward op: argument checks, contiguous inputs,
// position_ids as int64, and the output, allocated (uninitialised).
struct ForwardInputs {
  PosEncoding mode;
  at::Tensor ids, weight, pos_weight, position_ids, out;  // pos_weight / position_ids may be undefined
  at::Tensor dropout_key;  // undefined: no dropout
  Dropout dropout;
  // The sinusoid of column j is column sinusoid_column_offset + j of a sinusoid_dim-wide
  // encoding (a DTensor column shard; 0 and d for a whole table).
  int64_t sinusoid_column_offset = 0, sinusoid_dim = 0;
  bool empty() const { return ids.numel() == 0 || weight.size(1) == 0; }
};

inline ForwardInputs prepare_forward(const at::Tensor& ids, const at::Tensor& weight,
                                     const std::optional<at::Tensor>& pos_weight,
                                     const std::optional<at::Tensor>& position_ids, std::string_view pos_encoding,
                                     const std::optional<at::Tensor>& dropout_key, double dropout_p,
                                     int64_t sinusoid_column_offset, int64_t sinusoid_dim) {
  ForwardInputs in;
  in.mode = parse_pos_encoding(std::string(pos_encoding));
  check_forward_args(ids, weight, pos_weight, position_ids, in.mode);
  in.sinusoid_column_offset = sinusoid_column_offset;
  in.sinusoid_dim = sinusoid_dim != 0 ? sinusoid_dim : weight.size(1);
  const bool aligned_slice = sinusoid_column_offset >= 0 && sinusoid_column_offset % 2 == 0 &&
                             in.sinusoid_dim % 2 == 0 && sinusoid_column_offset + weight.size(1) <= in.sinusoid_dim;
  TORCH_CHECK_VALUE(in.mode != PosEncoding::kSinusoidal || aligned_slice,
                    "pyembed: sinusoid columns ", sinusoid_column_offset, "..",
                    sinusoid_column_offset + weight.size(1), " are not an even-aligned slice of an even ",
                    in.sinusoid_dim, "-wide encoding");
  check_same_device(weight.device(), {&ids, opt(pos_weight), opt(position_ids), opt(dropout_key)});
  if (dropout_key.has_value()) {
    TORCH_CHECK_VALUE(dropout_key->scalar_type() == at::kLong && dropout_key->numel() == 2,
                      "pyembed: dropout_key must be a (2,) int64 tensor [seed, offset]");
    TORCH_CHECK_VALUE(dropout_p >= 0.0 && dropout_p <= 1.0, "pyembed: dropout_p must be in [0, 1], got ", dropout_p);
    in.dropout_key = dropout_key->contiguous();
    in.dropout.key = in.dropout_key.data_ptr<int64_t>();
    in.dropout.threshold = Dropout::threshold_for(dropout_p);
    in.dropout.scale = Dropout::scale_for(dropout_p);
  }
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
