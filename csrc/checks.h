// Argument checks shared by the CPU and CUDA ops (DESIGN §3).
//
// The backends' ops (embedding_forward / _backward / _sparse_backward) sit behind the
// Python wrapper (pyembed/functional.py), which checks all metadata (pyembed/checks.py), and the data checks
// (id / position ranges, a device->host sync on a GPU), an op of their own
// (pyembed/checks.py). For them what is here are cheap guards for anyone calling an op
// directly: the kernels never read out of bounds whatever the ids, but they need sane
// shapes and every tensor on one device. pyembed::embedding, which plain eager calls
// reach with no Python checks at all, checks everything itself (check_lookup).
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <string>
#include <string_view>
#include <vector>

#include "common.h"
#include "dropout.h"
#include "optim.h"

namespace pyembed {

// Python's spelling of a dtype and a shape (torch.float32, (2, 3), (5,)): the errors here
// read exactly as pyembed/checks.py's, which pyembed raises for the same input.
inline std::string py_dtype(at::ScalarType dtype) { return "torch." + std::string(c10::getDtypeNames(dtype).first); }

inline std::string py_shape(at::IntArrayRef sizes) {
  std::string out = "(";
  for (size_t i = 0; i < sizes.size(); ++i) out += (i ? ", " : "") + std::to_string(sizes[i]);
  return out + (sizes.size() == 1 ? ",)" : ")");
}

inline PosEncoding parse_pos_encoding(const std::string& name) {
  if (name == "none") return PosEncoding::kNone;
  if (name == "learned") return PosEncoding::kLearned;
  TORCH_CHECK_VALUE(name == "sinusoidal", "pyembed: pos_encoding must be None, 'learned' or 'sinusoidal', got '",
                    name, "'");
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
                   "pyembed: ids must be an int32 or int64 tensor, got ", py_dtype(ids.scalar_type()));
  TORCH_CHECK_VALUE(weight.dim() == 2, "pyembed: weight must be 2-D (V, d), got shape ", py_shape(weight.sizes()));
  if (mode == PosEncoding::kLearned) {
    TORCH_CHECK_VALUE(pos_weight.has_value(), "pyembed: pos_encoding='learned' needs pos_weight (max_seq_len, d)");
    TORCH_CHECK_VALUE(pos_weight->dim() == 2 && pos_weight->size(1) == weight.size(1),
                      "pyembed: embedding dimension mismatch: weight is ", py_shape(weight.sizes()),
                      " but pos_weight is ", py_shape(pos_weight->sizes()));
    TORCH_CHECK_TYPE(pos_weight->scalar_type() == weight.scalar_type(), "pyembed: pos_weight dtype ",
                     py_dtype(pos_weight->scalar_type()), " != weight dtype ", py_dtype(weight.scalar_type()));
  }
  if (mode == PosEncoding::kSinusoidal) {
    TORCH_CHECK_VALUE(weight.size(1) % 2 == 0,
                      "pyembed: sinusoidal encoding requires an even embedding dim, got d=", weight.size(1));
  }
  if (mode != PosEncoding::kNone) {
    TORCH_CHECK_VALUE(ids.dim() == 1 || ids.dim() == 2,
                      "pyembed: with a positional encoding ids must be (B, T) or (T,), got shape ",
                      py_shape(ids.sizes()));
  }
  if (position_ids.has_value()) {
    TORCH_CHECK_VALUE(position_ids->sizes() == ids.sizes(), "pyembed: position_ids shape ",
                      py_shape(position_ids->sizes()), " != ids shape ", py_shape(ids.sizes()),
                      " (nor (T,) / (1, T) for the batch)");
  }
}

// The record the CUDA forward kernel writes when it meets an out-of-range id or position
// (validate=True on a GPU: checked inside the kernel, no host sync). Host memory the GPU
// writes directly; layout and reasons in pyembed/checks.py, which reads the same record
// for the triton backend. Int64 slots: [0] an id was out of range, [1] one such id, [2] that
// table's V, [3] a position was, [4] one such position, [5] the learned max_seq_len (-1:
// only negative positions are wrong).
constexpr int kErrorRecordSlots = 8;

// Raise (and clear) what the record holds: the next forward on the device reports an
// earlier call's bad ids. A host memory read, no device sync. The messages are
// pyembed.checks.deferred_error's.
inline void raise_recorded_error(int64_t address, const at::Device& device) {
  volatile int64_t* record = reinterpret_cast<volatile int64_t*>(address);
  if (record[0] == 0 && record[3] == 0) return;
  int64_t found[kErrorRecordSlots];
  for (int i = 0; i < kErrorRecordSlots; ++i) found[i] = record[i];
  for (int i = 0; i < kErrorRecordSlots; ++i) record[i] = 0;
  constexpr const char* hint =
      "; nothing was read out of bounds (such an id got a zero row, such a learned position no positional term). "
      "The check ran inside the kernel, so the host did not wait for it: validate='sync' raises in the call itself, "
      "pyembed.check_errors() after a synchronize";
  TORCH_CHECK_INDEX(found[0] == 0, "pyembed: ids out of range in an earlier call on ", device, ": id ", found[1],
                    ", but the embedding table has V=", found[2], " rows (valid ids are 0..", found[2] - 1, ")",
                    hint);
  TORCH_CHECK_VALUE(found[5] >= 0, "pyembed: position out of range in an earlier call on ", device, ": position ",
                    found[4], ", positions must be >= 0", hint);
  TORCH_CHECK_VALUE(false, "pyembed: position out of range in an earlier call on ", device, ": position ", found[4],
                    ", positions must be in 0..", found[5] - 1, " (the learned table's max_seq_len=", found[5], ")",
                    hint);
}

// The Dropout a kernel applies for a [seed, offset] key (inactive without one); `kept`
// holds the contiguous key the kernel reads. The forward's mask, and the backward's, which
// regenerates it from the same key.
inline Dropout dropout_of(const std::optional<at::Tensor>& key, double dropout_p, at::Tensor& kept) {
  Dropout dropout;
  if (!key.has_value()) return dropout;
  TORCH_CHECK_VALUE(key->scalar_type() == at::kLong && key->numel() == 2,
                    "pyembed: dropout_key must be a (2,) int64 tensor [seed, offset]");
  TORCH_CHECK_VALUE(dropout_p >= 0.0 && dropout_p <= 1.0, "pyembed: dropout_p must be in [0, 1], got ", dropout_p);
  kept = key->contiguous();
  dropout.key = kept.data_ptr<int64_t>();
  dropout.threshold = Dropout::threshold_for(dropout_p);
  dropout.scale = Dropout::scale_for(dropout_p);
  return dropout;
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
  int64_t* error_record = nullptr;  // the in-kernel range check's record (CUDA); nullptr: no check
  bool empty() const { return ids.numel() == 0 || weight.size(1) == 0; }
};

inline ForwardInputs prepare_forward(const at::Tensor& ids, const at::Tensor& weight,
                                     const std::optional<at::Tensor>& pos_weight,
                                     const std::optional<at::Tensor>& position_ids, std::string_view pos_encoding,
                                     const std::optional<at::Tensor>& dropout_key, double dropout_p,
                                     int64_t sinusoid_column_offset, int64_t sinusoid_dim,
                                     int64_t error_record = 0) {
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
  if (error_record != 0) {
    raise_recorded_error(error_record, weight.device());
    in.error_record = reinterpret_cast<int64_t*>(error_record);
  }
  in.dropout = dropout_of(dropout_key, dropout_p, in.dropout_key);
  in.ids = ids.contiguous();
  in.weight = weight.contiguous();
  if (in.mode == PosEncoding::kLearned) in.pos_weight = pos_weight->contiguous();
  if (in.mode != PosEncoding::kNone && position_ids) in.position_ids = position_ids->to(at::kLong).contiguous();
  auto sizes = in.ids.sizes().vec();
  sizes.push_back(in.weight.size(1));
  in.out = at::empty(sizes, in.weight.options());
  return in;
}

// Ids in [0, V); positions >= 0 and, for a learned table (max_seq_len >= 0), < max_seq_len.
// One pass over the values on the host. On a GPU the host must wait for them (the sync
// validate=False skips), so the fewest launches win: a few values (a decoding step) are
// copied as they are, more are reduced to their extremes on the device first; one
// transfer either way.
inline void check_ranges(const at::Tensor& ids, int64_t num_embeddings, const at::Tensor& position_ids,
                         int64_t max_seq_len) {
  constexpr int64_t kCopiedAsIs = 64;  // values per tensor copied to the host without a reduction
  const at::Tensor* tensors[2] = {&ids, &position_ids};
  at::Tensor values[2];  // per tensor, what the host scans: the values or their [min, max] (undefined: none)
  const bool on_host = ids.device().is_cpu();
  std::vector<at::Tensor> to_copy;
  for (int k = 0; k < 2; ++k) {
    const at::Tensor& t = *tensors[k];
    if (!t.defined() || t.numel() == 0) continue;
    if (on_host) {
      values[k] = t;
      continue;
    }
    if (t.numel() <= kCopiedAsIs) {
      values[k] = t.reshape(-1).to(at::kLong);
    } else {
      auto [lo, hi] = at::aminmax(t);
      values[k] = at::stack({lo, hi}).to(at::kLong);
    }
    to_copy.push_back(values[k]);
  }
  if (!to_copy.empty()) {  // a GPU: one transfer, then the slices of each tensor
    const at::Tensor host = (to_copy.size() == 1 ? to_copy[0] : at::cat(to_copy)).cpu();
    int64_t start = 0;
    for (at::Tensor& v : values) {
      if (!v.defined()) continue;
      const int64_t n = v.numel();
      v = host.slice(0, start, start + n);
      start += n;
    }
  }
  int64_t extremes[4] = {0, -1, 0, -1};  // min id, max id, min position, max position (max < min: none)
  for (int k = 0; k < 2; ++k) {
    if (!values[k].defined()) continue;
    const at::Tensor t = values[k].contiguous();
    AT_DISPATCH_INDEX_TYPES(t.scalar_type(), "pyembed_check_ranges", [&] {
      const index_t* data = t.const_data_ptr<index_t>();
      const auto [lo, hi] = std::minmax_element(data, data + t.numel());
      extremes[2 * k] = *lo, extremes[2 * k + 1] = *hi;
    });
  }
  const auto [min_id, max_id, min_pos, max_pos] = extremes;
  if (max_id >= min_id) {
    TORCH_CHECK_INDEX(min_id >= 0 && max_id < num_embeddings, "pyembed: ids out of range: min id ", min_id,
                      ", max id ", max_id, ", but the embedding table has V=", num_embeddings,
                      " rows (valid ids are 0..", num_embeddings - 1, ")");
  }
  if (max_pos >= min_pos) {
    TORCH_CHECK_VALUE(min_pos >= 0, "pyembed: position_ids must be >= 0, got min position ", min_pos);
    TORCH_CHECK_VALUE(max_seq_len < 0 || max_pos < max_seq_len, "pyembed: position ", max_pos,
                      " is out of range for the learned positional table with max_seq_len=", max_seq_len);
  }
}

// The arguments of pyembed::embedding after every check of DESIGN §3.
struct LookupArgs {
  std::optional<at::Tensor> position_ids;  // broadcast to ids' shape
  std::optional<int64_t> padding_idx;      // in [0, V)
};

// pyembed::embedding's dropout_p, in pyembed/checks.py's words (check_dropout_p).
inline void check_dropout_p(double dropout_p) {
  TORCH_CHECK_VALUE(dropout_p >= 0.0 && dropout_p <= 1.0,
                    "pyembed: dropout probability has to be between 0 and 1, but got ", dropout_p);
}

// pyembed::embedding is the op plain eager calls reach straight from Python (the fast
// path of pyembed/functional.py), so it checks everything the Python wrapper does --
// metadata, and with validate the data -- before anything runs, with the same messages.
// Its errors are c10's (TypeError / ValueError / IndexError); the wrapper raises them as
// pyembed's typed exceptions (also RuntimeError, DESIGN §3: checks.from_cpp).
inline LookupArgs check_lookup(const at::Tensor& ids, const at::Tensor& weight,
                               const std::optional<at::Tensor>& pos_weight,
                               const std::optional<at::Tensor>& position_ids, std::string_view pos_encoding,
                               int64_t offset, std::optional<int64_t> padding_idx, bool validate) {
  const PosEncoding mode = parse_pos_encoding(std::string(pos_encoding));
  if (ids.unsafeGetTensorImpl()->is_python_dispatch() || weight.unsafeGetTensorImpl()->is_python_dispatch()) {
    // Fake tensors (opcheck, torch.export tracing) have no data and may have symbolic
    // shapes; they get what shapes the computation -- positions broadcast over the batch --
    // and the checks are the tracing caller's (pyembed's Python path does them all).
    if (!position_ids.has_value()) return {std::nullopt, padding_idx};
    return {position_ids->expand_symint(ids.sym_sizes()), padding_idx};
  }
  const auto dtype = weight.scalar_type();
  TORCH_CHECK_TYPE(dtype == at::kFloat || dtype == at::kHalf || dtype == at::kBFloat16 || dtype == at::kDouble,
                   "pyembed: weight must be a float32/float16/bfloat16/float64 tensor, got ", py_dtype(dtype));
  TORCH_CHECK_VALUE(mode == PosEncoding::kLearned || !pos_weight.has_value(),
                    "pyembed: pos_weight was given but pos_encoding='", pos_encoding, "'");
  TORCH_CHECK_VALUE(offset >= 0, "pyembed: offset must be an int >= 0, got ", offset);
  LookupArgs args{position_ids, padding_idx};
  if (position_ids.has_value()) {
    TORCH_CHECK_VALUE(mode != PosEncoding::kNone, "pyembed: position_ids given but there is no positional encoding");
    TORCH_CHECK_TYPE(position_ids->scalar_type() == at::kInt || position_ids->scalar_type() == at::kLong,
                     "pyembed: position_ids must be an int32 or int64 tensor, got ",
                     py_dtype(position_ids->scalar_type()));
    TORCH_CHECK_VALUE(offset == 0, "pyembed: pass position_ids or offset, not both");
    const auto sizes = position_ids->sizes();
    const bool broadcasts = ids.dim() == 2 && (sizes.equals({ids.size(1)}) || sizes.equals({1, ids.size(1)}));
    if (broadcasts) args.position_ids = position_ids->expand(ids.sizes());
  }
  check_forward_args(ids, weight, pos_weight, args.position_ids, mode);
  check_same_device(weight.device(), {&ids, opt(pos_weight), opt(position_ids)});
  const int64_t num_embeddings = weight.size(0);
  if (padding_idx.has_value()) {
    TORCH_CHECK_VALUE(-num_embeddings <= *padding_idx && *padding_idx < num_embeddings, "pyembed: padding_idx=",
                      *padding_idx, " is out of range for V=", num_embeddings);
    args.padding_idx = (*padding_idx + num_embeddings) % num_embeddings;
  }
  const int64_t max_seq_len = mode == PosEncoding::kLearned ? pos_weight->size(0) : -1;
  if (mode == PosEncoding::kLearned && !position_ids.has_value() && ids.numel() > 0) {
    TORCH_CHECK_VALUE(offset + ids.size(-1) <= max_seq_len, "pyembed: positions ", offset, "..",
                      offset + ids.size(-1) - 1, " (sequence length ", ids.size(-1), ", offset ", offset,
                      ") exceed the learned table's max_seq_len=", max_seq_len);
  }
  if (validate) {
    check_ranges(ids, num_embeddings, position_ids.value_or(at::Tensor()), max_seq_len);  // not the expanded one
  }
  return args;
}

// The table, its optimizer state and the rule's scalars, as every optimizer op takes them:
// the table and its state are updated in place, so every shape is checked.
inline void check_optimizer_state(const at::Tensor& param, const at::Tensor& state1, const at::Tensor& state2,
                                  int64_t rule, c10::ArrayRef<double> hyper) {
  TORCH_CHECK_VALUE(rule >= optim::kSGD && rule <= optim::kSparseAdam, "pyembed: unknown optimizer rule ", rule);
  TORCH_CHECK_VALUE(static_cast<int64_t>(hyper.size()) >= optim::Scalars<float>::count(static_cast<int>(rule)),
                    "pyembed: optimizer rule ", rule, " needs ", optim::Scalars<float>::count(static_cast<int>(rule)),
                    " scalars, got ", hyper.size());
  TORCH_CHECK_VALUE(param.dim() == 2 && param.is_contiguous(), "pyembed: the table must be 2-D and contiguous");
  for (const at::Tensor* s : {&state1, &state2}) {
    TORCH_CHECK_VALUE(s->numel() == 0 || (s->sizes() == param.sizes() && s->scalar_type() == param.scalar_type() &&
                                          s->is_contiguous()),
                      "pyembed: optimizer state must be like the table (contiguous, same shape and dtype)");
  }
  const bool needs1 = rule != optim::kSGD, needs2 = rule == optim::kAdam || rule == optim::kSparseAdam;
  TORCH_CHECK_VALUE((!needs1 || state1.numel() == param.numel()) && (!needs2 || state2.numel() == param.numel()),
                    "pyembed: optimizer rule ", rule, " needs its state tensors");
  check_same_device(param.device(), {&state1, &state2});
}

// optimizer_update (pyembed/optim.py): also its gradient rows; the rows are checked to be
// ascending and inside the table on the CPU (a CUDA caller passes the rows its own
// backward made; the kernel masks them).
inline void check_optimizer_update(const at::Tensor& param, const at::Tensor& state1, const at::Tensor& state2,
                                   const at::Tensor& rows, const at::Tensor& values, int64_t rule,
                                   c10::ArrayRef<double> hyper) {
  check_optimizer_state(param, state1, state2, rule, hyper);
  TORCH_CHECK_TYPE(rows.scalar_type() == at::kLong && rows.dim() == 1, "pyembed: rows must be 1-D int64");
  TORCH_CHECK_VALUE(values.dim() == 2 && values.size(0) == rows.numel() && values.size(1) == param.size(1) &&
                        values.scalar_type() == param.scalar_type(),
                    "pyembed: values must be (rows, d) of the table's dtype");
  check_same_device(param.device(), {&rows, &values});
}

}  // namespace pyembed
