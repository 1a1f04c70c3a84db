// The pyembed._C extension: op schemas and build facts.
//
// Each op is declared once here; its CPU kernel registers in csrc/cpu/ and its CUDA
// kernel in csrc/cuda/ (TORCH_LIBRARY_IMPL), so the dispatcher picks by device. The
// schemas match pyembed/reference.py, whose fake implementations serve these ops too.
#include <c10/core/DeviceGuard.h>
#include <torch/extension.h>
#include <torch/library.h>
#include <torch/version.h>

#include "autograd.h"
#include "checks.h"
#include "cpu/kernel_api.h"

#include <cstring>
#include <limits>

// Set by setup.py when the CUDA kernels are compiled in.
#ifndef PYEMBED_CUDA_ARCH_LIST
#define PYEMBED_CUDA_ARCH_LIST ""
#endif
#ifndef PYEMBED_CUDA_VERSION
#define PYEMBED_CUDA_VERSION ""
#endif
#ifndef PYEMBED_TORCH_VERSION
#define PYEMBED_TORCH_VERSION ""
#endif
// The digest of csrc/ this was built from, in a file setup.py writes (a define would change
// every object's flags, so any edit would recompile them all): pyembed/_sources.py.
extern const char pyembed_source_digest[];

// The sparse backward's output size depends on the data (a device->host sync on a GPU):
// the tag keeps it out of CUDA graphs (torch >= 2.8 knows the tag). The forward and the
// dense backward never sync; the range checks are an op of their own (pyembed/checks.py).
static std::vector<at::Tag> cudagraph_unsafe() {
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 8)
  return {at::Tag::cudagraph_unsafe};
#else
  return {};
#endif
}

TORCH_LIBRARY(pyembed, m) {
  m.def(
      "embedding_forward(Tensor ids, Tensor weight, Tensor? pos_weight, Tensor? position_ids, "
      "str pos_encoding, float scale, int offset, Tensor? dropout_key, float dropout_p, "
      "int sinusoid_column_offset=0, int sinusoid_dim=0, int error_record=0) -> Tensor");
  // dropout_key / dropout_p (here and in the sparse ops): the forward's dropout, applied to
  // grad_out by the backward (the cuda kernels as they read it; the cpu op by a mask pass first).
  m.def(
      "embedding_backward(Tensor grad_out, Tensor ids, Tensor? position_ids, int offset, "
      "int num_embeddings, int num_positions, float scale, int? padding_idx, bool scale_grad_by_freq, "
      "bool need_weight_grad, bool need_pos_grad, Tensor? dropout_key=None, float dropout_p=0.0) "
      "-> (Tensor, Tensor)");
  // The lookup with its autograd node in C++ (csrc/autograd.cpp), for eager calls on the
  // C++ backends; its forward and backward are the two ops above. It checks every argument
  // itself (csrc/checks.h: check_lookup), the id / position ranges when validate (before the
  // kernel) or, with an error_record, inside the CUDA kernel (no host sync; pyembed/checks.py).
  // With dropout_p it draws the dropout key from generator (else the device's default);
  // with sparse the table's gradient is a coalesced COO tensor.
  m.def(
      "embedding(Tensor ids, Tensor weight, Tensor? pos_weight, Tensor? position_ids, str pos_encoding, "
      "float scale, int offset, int? padding_idx, bool scale_grad_by_freq, bool validate=True, int error_record=0, "
      "float dropout_p=0.0, Generator? generator=None, bool sparse=False) -> Tensor");
  const std::vector<at::Tag> sparse_tags = cudagraph_unsafe();  // an lvalue: the overload taking tags
  m.def(
      "embedding_sparse_backward(Tensor grad_out, Tensor ids, int num_embeddings, float scale, int? padding_idx, "
      "bool scale_grad_by_freq, Tensor? dropout_key=None, float dropout_p=0.0) -> (Tensor, Tensor)",
      sparse_tags);
  // The optimizer inside the backward (pyembed/optim.py, csrc/optim.h). touched_rows: the
  // sparse backward's (rows, values) with no host sync -- on a GPU sized min(tokens, V),
  // unused slots marked row -1 (the CPU gives the exact rows). optimizer_update: table rows
  // `rows` (ascending, as those two give them) got the gradient rows `values` (rows outside
  // the table -- the -1 slots, last -- are skipped on a GPU, refused on the CPU, as
  // unsorted ones are); all_rows updates every row, the rest with g = 0.
  m.def(
      "embedding_touched_rows(Tensor grad_out, Tensor ids, int num_embeddings, float scale, int? padding_idx, "
      "bool scale_grad_by_freq, Tensor? dropout_key=None, float dropout_p=0.0) -> (Tensor, Tensor)");
  m.def(
      "optimizer_update(Tensor(a!) param, Tensor(b!) state1, Tensor(c!) state2, Tensor rows, Tensor values, "
      "int rule, float[] hyper, bool all_rows) -> ()");
  // optimizer_backward (CUDA only): the dense token table's backward as its update, the
  // gradient never in memory -- optimizer_update by the rows embedding_backward would give
  // (csrc/cuda/optim_kernels.cuh); not SparseAdam.
  m.def(
      "optimizer_backward(Tensor grad_out, Tensor ids, float scale, int? padding_idx, bool scale_grad_by_freq, "
      "Tensor? dropout_key, float dropout_p, Tensor(a!) param, Tensor(b!) state1, Tensor(c!) state2, int rule, "
      "float[] hyper, bool all_rows) -> ()");
  // position_update (CUDA only): the learned positions' backward (p = offset + t) as their
  // update, the gradient never in memory; not SparseAdam.
  m.def(
      "position_update(Tensor grad_out, Tensor ids, int offset, Tensor? dropout_key, float dropout_p, "
      "Tensor(a!) param, Tensor(b!) state1, Tensor(c!) state2, int rule, float[] hyper) -> ()");
}

// pyembed::check_ranges is defined in pyembed/checks.py, with its fake, vmap rule and a
// Python body for every device (it runs without this extension). Its CPU and CUDA kernels
// here are what a compiled graph calls with validate on a CPU or validate="sync": the same
// checks as the eager op's, no Python (through torch.library.custom_op the op took ~16 us
// a call on the development VM). A copy of ids comes back, which the lookup then reads.
static at::Tensor check_ranges_kernel(const at::Tensor& ids, int64_t num_embeddings,
                                      const std::optional<at::Tensor>& position_ids, int64_t max_seq_len) {
  pyembed::check_ranges(ids, num_embeddings, position_ids.value_or(at::Tensor()), max_seq_len);
  return ids.clone();
}

TORCH_LIBRARY_IMPL(pyembed, CPU, m) {
  m.impl("check_ranges", &check_ranges_kernel);
}

TORCH_LIBRARY_IMPL(pyembed, CUDA, m) {
  m.impl("check_ranges", &check_ranges_kernel);
}

// pyembed::embedding through a typed dispatcher call, for the eager fast path of
// pyembed/functional.py: the dispatcher still runs every key the op's (autograd, a tracer,
// dispatch modes, the device's kernel), but a custom op's boxed call from Python
// (torch.ops.pyembed.embedding) costs more host time than the op itself: a one-token
// lookup with its autograd node took 3.9 us that way and 2.3 us this way on the
// development VM (F.embedding: 2.1 us).
using EmbeddingOp = at::Tensor(const at::Tensor& ids, const at::Tensor& weight,
                               const std::optional<at::Tensor>& pos_weight,
                               const std::optional<at::Tensor>& position_ids, std::string_view pos_encoding,
                               double scale, int64_t offset, std::optional<int64_t> padding_idx,
                               bool scale_grad_by_freq, bool validate, int64_t error_record, double dropout_p,
                               const std::optional<at::Generator>& generator, bool sparse);

// Launch replays of `triton` calls by metadata, which pyembed::embedding's node (PythonKernels
// below) calls itself, without the Python body it would call: pyembed._triton's node_forward
// binds a lookup's launch (kernels/launch.py's bind) and backward a dense backward's
// allocations and launches whole (LaunchPlan.replay_whole), and each gives its replay here too
// (set_forward_replay, set_backward_replay). Skipped: the body's 13 arguments made Python
// objects, its key over them, its plan's lookup, its device guard. Read and written with the
// GIL held; never freed (as the kernels: a node may run one at exit). A key holds what the
// body's key holds, in integers.
using Replays = std::vector<std::pair<std::vector<int64_t>, py::object>>;
static auto* const forward_replays = new Replays();
static auto* const backward_replays = new Replays();
constexpr size_t kMaxReplays = 64;  // per direction: a server's stream of new shapes starts them afresh

static int64_t bits_of(double value) {
  int64_t bits;
  std::memcpy(&bits, &value, sizeof bits);
  return bits;
}

static void append_sizes(std::vector<int64_t>& key, const at::Tensor& t) {
  key.push_back(t.dim());
  key.insert(key.end(), t.sizes().begin(), t.sizes().end());
  key.push_back(static_cast<int64_t>(t.scalar_type()));
}

// A lookup's: shapes, dtypes, device, positional mode, scale, the offset's class as Triton
// specialises an int (kernels/launch.py's int_class), the error record, the position ids'
// shape (read where there is an encoding), the dropout's p. Empty: never planned.
static std::vector<int64_t> forward_replay_key(const at::Tensor& ids, const at::Tensor& weight,
                                               const std::optional<at::Tensor>& pos_weight,
                                               const std::optional<at::Tensor>& position_ids,
                                               std::string_view pos_encoding, double scale, int64_t offset,
                                               const std::optional<at::Tensor>& dropout_key, double dropout_p,
                                               int64_t error_record) {
  const int64_t mode = pos_encoding == "none"         ? 0
                       : pos_encoding == "learned"    ? 1
                       : pos_encoding == "sinusoidal" ? 2
                                                      : -1;
  if (mode < 0 || (pos_weight.has_value() != (mode == 1))) return {};
  std::vector<int64_t> key;
  append_sizes(key, ids);
  append_sizes(key, weight);
  const bool int32 = offset >= std::numeric_limits<int32_t>::min() && offset <= std::numeric_limits<int32_t>::max();
  const bool positions = position_ids.has_value() && mode != 0;
  key.insert(key.end(), {static_cast<int64_t>(weight.device().type()), weight.device().index(), mode, bits_of(scale),
                         offset == 1 ? 0 : (int32 ? 1 : 3) + (offset % 16 == 0), error_record,
                         dropout_key.has_value(), dropout_key ? bits_of(dropout_p) : 0, positions,
                         pos_weight.has_value()});
  if (positions) key.insert(key.end(), position_ids->sizes().begin(), position_ids->sizes().end());
  if (pos_weight) append_sizes(key, *pos_weight);
  return key;
}

// A dense backward's: shapes, dtypes, device, every scalar, the dropout's p.
static std::vector<int64_t> backward_replay_key(const at::Tensor& grad_out, const at::Tensor& ids,
                                                const std::optional<at::Tensor>& position_ids, int64_t offset,
                                                int64_t num_embeddings, int64_t num_positions, double scale,
                                                std::optional<int64_t> padding_idx, bool scale_grad_by_freq,
                                                bool need_weight_grad, bool need_pos_grad,
                                                const std::optional<at::Tensor>& dropout_key, double dropout_p) {
  std::vector<int64_t> key;
  append_sizes(key, grad_out);
  append_sizes(key, ids);
  key.insert(key.end(), {static_cast<int64_t>(grad_out.device().type()), grad_out.device().index(), offset,
                         num_embeddings, num_positions, bits_of(scale), padding_idx.has_value(),
                         padding_idx.value_or(0), scale_grad_by_freq, need_weight_grad, need_pos_grad,
                         dropout_key.has_value(), dropout_key ? bits_of(dropout_p) : 0, position_ids.has_value()});
  if (position_ids) append_sizes(key, *position_ids);
  return key;
}

// The replay kept under `key`, or None.
static py::object find_replay(const Replays& replays, const std::vector<int64_t>& key) {
  for (const auto& [bound, replay] : replays) {
    if (bound == key) return replay;
  }
  return py::none();
}

// `replay` kept under `key`, in place of one there; all of them forgotten first at kMaxReplays.
static void keep_replay(Replays& replays, std::vector<int64_t> key, py::object replay) {
  if (key.empty()) return;
  for (auto& [bound, held] : replays) {
    if (bound == key) {
      held = std::move(replay);
      return;
    }
  }
  if (replays.size() >= kMaxReplays) replays.clear();
  replays.emplace_back(std::move(key), std::move(replay));
}

// A replay's calls run on the tensors' device, as the Python bodies' (Triton launches on the current one).
static c10::OptionalDeviceGuard on_device_of(const at::Tensor& t) {
  return c10::OptionalDeviceGuard(t.is_cuda() ? std::optional<c10::Device>(t.device()) : std::nullopt);
}

// The kernels of a backend whose launches are Python (triton), for pyembed::embedding's node
// (csrc/autograd.cpp): its Python autograd.Function and argument checks cost a one-token
// lookup with a gradient more host time than the launch itself; through the C++ node only
// the forward and backward bodies are Python. The backward runs on autograd's thread,
// which holds no GIL; a Python exception propagates as it was raised.
struct PythonKernels final : pyembed::LookupKernels {
  py::object forward_fn, backward_fn, sparse_backward_fn;
  // The two backwards' ops (torch.library; None: the functions above), for an output gradient
  // without storage: a batched one (torch.autograd.grad's is_grads_batched=True, torch.func.vmap
  // over a backward), whose elements the kernels, called directly or replayed, cannot read.
  // Through the dispatcher, vmap's fallback runs them once per sample, as it runs the C++
  // backends' ops.
  py::object backward_op, sparse_backward_op;

  PythonKernels(py::object forward, py::object backward, py::object sparse_backward, py::object backward_op,
                py::object sparse_backward_op)
      : forward_fn(std::move(forward)), backward_fn(std::move(backward)),
        sparse_backward_fn(std::move(sparse_backward)), backward_op(std::move(backward_op)),
        sparse_backward_op(std::move(sparse_backward_op)) {}

  at::Tensor forward(const at::Tensor& ids, const at::Tensor& weight, const std::optional<at::Tensor>& pos_weight,
                     const std::optional<at::Tensor>& position_ids, std::string_view pos_encoding, double scale,
                     int64_t offset, const std::optional<at::Tensor>& dropout_key, double dropout_p,
                     int64_t error_record) const override {
    // An earlier call's finding raised and the output allocated here, not in the Python
    // body (pyembed._triton.node_forward), where the two cost a one-token lookup ~1.3 us.
    if (error_record != 0) pyembed::raise_recorded_error(error_record, weight.device());
    std::vector<int64_t> sizes = ids.sizes().vec();
    sizes.push_back(weight.size(1));
    at::Tensor out = at::empty(sizes, weight.options());
    py::gil_scoped_acquire gil;
    if (!forward_replays->empty() && ids.is_contiguous() && weight.is_contiguous() &&
        (!pos_weight || pos_weight->is_contiguous())) {
      const py::object replay =
          find_replay(*forward_replays, forward_replay_key(ids, weight, pos_weight, position_ids, pos_encoding, scale,
                                                           offset, dropout_key, dropout_p, error_record));
      if (!replay.is_none()) {
        const auto on_device = on_device_of(weight);
        const at::Tensor& table = pos_weight ? *pos_weight : weight;
        // As node_forward calls it: with position ids or a dropout key, both (the ids for one not given).
        const bool positions = position_ids && pos_encoding != "none";
        const py::object done =
            positions || dropout_key
                ? replay(ids, positions ? position_ids->to(at::kLong).contiguous() : ids,
                         dropout_key ? *dropout_key : ids, weight, table, out, offset)
                : replay(ids, weight, table, out, offset);
        // False: it launched nothing (a profiler hook, a misaligned tensor, ...); node_forward decides.
        if (done.cast<bool>()) return out;
      }
    }
    return forward_fn(out, ids, weight, pos_weight, position_ids, pos_encoding, scale, offset, dropout_key, dropout_p,
                      0, 0, error_record)
        .cast<at::Tensor>();
  }

  std::tuple<at::Tensor, at::Tensor> backward(const at::Tensor& grad_out, const at::Tensor& ids,
                                              const std::optional<at::Tensor>& position_ids, int64_t offset,
                                              int64_t num_embeddings, int64_t num_positions, double scale,
                                              std::optional<int64_t> padding_idx, bool scale_grad_by_freq,
                                              bool need_weight_grad, bool need_pos_grad,
                                              const std::optional<at::Tensor>& dropout_key,
                                              double dropout_p) const override {
    py::gil_scoped_acquire gil;
    const bool stored = grad_out.has_storage();  // a batched one has none: backward_op
    if (stored && !backward_replays->empty()) {
      const py::object replay = find_replay(
          *backward_replays, backward_replay_key(grad_out, ids, position_ids, offset, num_embeddings, num_positions,
                                                 scale, padding_idx, scale_grad_by_freq, need_weight_grad,
                                                 need_pos_grad, dropout_key, dropout_p));
      if (!replay.is_none()) {
        const auto on_device = on_device_of(grad_out);
        // Its inputs as the body planned it with them: contiguous (then None where it refuses).
        const py::object grads =
            replay(grad_out.contiguous(), ids.contiguous(),
                   position_ids ? py::cast(position_ids->contiguous()) : py::none(), dropout_key);
        if (!grads.is_none()) return grads.cast<std::tuple<at::Tensor, at::Tensor>>();
      }
    }
    return (stored || backward_op.is_none() ? backward_fn : backward_op)(
               grad_out, ids, position_ids, offset, num_embeddings, num_positions, scale, padding_idx,
               scale_grad_by_freq, need_weight_grad, need_pos_grad, dropout_key, dropout_p)
        .cast<std::tuple<at::Tensor, at::Tensor>>();
  }

  std::tuple<at::Tensor, at::Tensor> sparse_backward(const at::Tensor& grad_out, const at::Tensor& ids,
                                                     int64_t num_embeddings, double scale,
                                                     std::optional<int64_t> padding_idx, bool scale_grad_by_freq,
                                                     const std::optional<at::Tensor>& dropout_key,
                                                     double dropout_p) const override {
    py::gil_scoped_acquire gil;
    return (grad_out.has_storage() || sparse_backward_op.is_none() ? sparse_backward_fn : sparse_backward_op)(
               grad_out, ids, num_embeddings, scale, padding_idx, scale_grad_by_freq, dropout_key, dropout_p)
        .cast<std::tuple<at::Tensor, at::Tensor>>();
  }
};

// The update of tables whose optimizer runs in the backward, for the node of
// embedding_fused: pyembed/_autograd.py's fused_step (pyembed/optim.py's step_tables), on
// autograd's thread with the GIL taken, as PythonKernels' backward.
struct PythonFusedStep final : pyembed::FusedStep {
  py::object step;

  explicit PythonFusedStep(py::object step) : step(std::move(step)) {}

  std::tuple<bool, bool> operator()(bool python, const at::Tensor& grad_out, const at::Tensor& ids,
                                    const std::optional<at::Tensor>& position_ids,
                                    const std::optional<at::Tensor>& dropout_key,
                                    const std::optional<at::Tensor>& weight,
                                    const std::optional<at::Tensor>& pos_weight, bool need_weight_grad,
                                    bool need_pos_grad, double scale, int64_t offset,
                                    std::optional<int64_t> padding_idx, bool scale_grad_by_freq, double dropout_p,
                                    bool sparse) const override {
    py::gil_scoped_acquire gil;
    return step(python, grad_out, ids, position_ids, dropout_key, weight, pos_weight, need_weight_grad,
                need_pos_grad, scale, offset, padding_idx, scale_grad_by_freq, dropout_p, sparse)
        .cast<std::tuple<bool, bool>>();
  }
};

// Typed dispatcher calls of the backends' ops, for eager Python callers (the Backend record's
// eager_forward / eager_backward and the optimizer's ops, pyembed/_extension.py): the same
// dispatch (by device, through any dispatch mode), without the boxed call's parsing of
// every argument against the schema -- a one-token forward op 4.3 us through
// torch.ops.pyembed.embedding_forward.default, 1.6 us typed, on the development VM. The
// kernels' own C++ signatures (c10 checks them when the handle is made); the schemas'
// argument names and defaults (def_typed_ops), so a call written for the op runs as it is.
using OptionalTensor = std::optional<at::Tensor>;
using OptimizerUpdateOp = void(const at::Tensor& param, const at::Tensor& state1, const at::Tensor& state2,
                               const at::Tensor& rows, const at::Tensor& values, int64_t rule,
                               c10::ArrayRef<double> hyper, bool all_rows);
using OptimizerBackwardOp = void(const at::Tensor& grad_out, const at::Tensor& ids, double scale,
                                 std::optional<int64_t> padding_idx, bool scale_grad_by_freq,
                                 const OptionalTensor& dropout_key, double dropout_p, const at::Tensor& param,
                                 const at::Tensor& state1, const at::Tensor& state2, int64_t rule,
                                 c10::ArrayRef<double> hyper, bool all_rows);
using PositionUpdateOp = void(const at::Tensor& grad_out, const at::Tensor& ids, int64_t offset,
                              const OptionalTensor& dropout_key, double dropout_p, const at::Tensor& param,
                              const at::Tensor& state1, const at::Tensor& state2, int64_t rule,
                              c10::ArrayRef<double> hyper);

// An argument as Python passes it: pybind11 makes a std::vector of a list, not an ArrayRef.
template <class T>
struct FromPython {
  using type = T;
};
template <>
struct FromPython<c10::ArrayRef<double>> {
  using type = std::vector<double>;
};

// A function calling op `name` (of C++ signature Result(Args...)) through its typed handle.
template <class Signature>
struct TypedCall;
template <class Result, class... Args>
struct TypedCall<Result(Args...)> {
  static auto of(const char* name) {
    return [op = pyembed::typed_op<Result(Args...)>(name)](typename FromPython<Args>::type... args) -> Result {
      return op.call(args...);
    };
  }
};

template <class Signature>
static auto typed_call(const char* name) {
  return TypedCall<Signature>::of(name);
}

// A call with pyembed::embedding's arguments (EmbeddingOp), named and defaulted as its schema does.
template <class Function, class... Extra>
static void def_embedding_call(py::module_& m, const char* name, Function&& function, const char* doc,
                               const Extra&... extra) {
  m.def(name, std::forward<Function>(function), doc, py::arg("ids"), py::arg("weight"), py::arg("pos_weight"),
        py::arg("position_ids"), py::arg("pos_encoding"), py::arg("scale"), py::arg("offset"), py::arg("padding_idx"),
        py::arg("scale_grad_by_freq"), py::arg("validate"), py::arg("error_record"), py::arg("dropout_p") = 0.0,
        py::arg("generator") = py::none(), py::arg("sparse") = false, extra...);
}

static void def_typed_ops(py::module_& m) {
  const auto no_gil = py::call_guard<py::gil_scoped_release>();
  m.def("embedding_forward", typed_call<pyembed::ForwardOp>("pyembed::embedding_forward"),
        "torch.ops.pyembed.embedding_forward, typed", py::arg("ids"), py::arg("weight"), py::arg("pos_weight"),
        py::arg("position_ids"), py::arg("pos_encoding"), py::arg("scale"), py::arg("offset"), py::arg("dropout_key"),
        py::arg("dropout_p"), py::arg("sinusoid_column_offset") = 0, py::arg("sinusoid_dim") = 0,
        py::arg("error_record") = 0, no_gil);
  m.def("embedding_backward", typed_call<pyembed::BackwardOp>("pyembed::embedding_backward"),
        "torch.ops.pyembed.embedding_backward, typed", py::arg("grad_out"), py::arg("ids"), py::arg("position_ids"),
        py::arg("offset"), py::arg("num_embeddings"), py::arg("num_positions"), py::arg("scale"),
        py::arg("padding_idx"), py::arg("scale_grad_by_freq"), py::arg("need_weight_grad"), py::arg("need_pos_grad"),
        py::arg("dropout_key") = py::none(), py::arg("dropout_p") = 0.0, no_gil);
  m.def("embedding_touched_rows", typed_call<pyembed::RowSumsOp>("pyembed::embedding_touched_rows"),
        "torch.ops.pyembed.embedding_touched_rows, typed", py::arg("grad_out"), py::arg("ids"),
        py::arg("num_embeddings"), py::arg("scale"), py::arg("padding_idx"), py::arg("scale_grad_by_freq"),
        py::arg("dropout_key") = py::none(), py::arg("dropout_p") = 0.0, no_gil);
  m.def("optimizer_update", typed_call<OptimizerUpdateOp>("pyembed::optimizer_update"),
        "torch.ops.pyembed.optimizer_update, typed", no_gil);
  m.def("optimizer_backward", typed_call<OptimizerBackwardOp>("pyembed::optimizer_backward"),
        "torch.ops.pyembed.optimizer_backward, typed", no_gil);
  m.def("position_update", typed_call<PositionUpdateOp>("pyembed::position_update"),
        "torch.ops.pyembed.position_update, typed", no_gil);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "pyembed's compiled kernels; the ops live in torch.ops.pyembed";
#ifdef PYEMBED_WITH_CUDA
  m.attr("cuda_built") = true;
#else
  m.attr("cuda_built") = false;
#endif
  m.attr("cuda_version") = PYEMBED_CUDA_VERSION;
  m.attr("torch_version") = PYEMBED_TORCH_VERSION;  // the torch whose headers and ABI this was built against
  m.attr("cuda_arch_list") = PYEMBED_CUDA_ARCH_LIST;
  m.attr("source_digest") = py::str(pyembed_source_digest);  // compared with a checkout's csrc/ at import
  m.def("cpu_isa", [] { return pyembed::cpu::row_kernels().isa; },
        "the instruction set of the CPU row kernels in use: 'avx512', 'avx2' or 'base'");
  def_embedding_call(m, "embedding", typed_call<EmbeddingOp>("pyembed::embedding"),
                     "torch.ops.pyembed.embedding's call, for eager calls on plain tensors",
                     py::call_guard<py::gil_scoped_release>());
  m.def(
      "set_python_kernels",
      [](py::object forward, py::object backward, py::object sparse_backward, py::object backward_op,
         py::object sparse_backward_op) {
        pyembed::set_python_kernels(std::make_unique<PythonKernels>(std::move(forward), std::move(backward),
                                                                    std::move(sparse_backward), std::move(backward_op),
                                                                    std::move(sparse_backward_op)));
      },
      "the forward (into the output the node allocates, then pyembed/reference.py's schema: "
      "pyembed._triton.node_forward), dense and sparse backward (reference.py's schemas) embedding_python_kernels "
      "runs, and the two backwards' ops, for batched output gradients",
      py::arg("forward"), py::arg("backward"), py::arg("sparse_backward"), py::arg("backward_op") = py::none(),
      py::arg("sparse_backward_op") = py::none());
  m.def(
      "set_forward_replay",
      [](const at::Tensor& ids, const at::Tensor& weight, const std::optional<at::Tensor>& pos_weight,
         const std::optional<at::Tensor>& position_ids, std::string_view pos_encoding, double scale, int64_t offset,
         const std::optional<at::Tensor>& dropout_key, double dropout_p, int64_t error_record, py::object replay) {
        keep_replay(*forward_replays,
                    forward_replay_key(ids, weight, pos_weight, position_ids, pos_encoding, scale, offset,
                                       dropout_key, dropout_p, error_record),
                    std::move(replay));
      },
      "keep the launch replay pyembed._triton.node_forward bound for a lookup of this metadata (its arguments), "
      "which embedding_python_kernels' node then calls itself: replay(ids, weight, pos_weight or weight, out, "
      "offset) -> bool, or with position ids or dropout replay(ids, position_ids or ids, dropout_key or ids, "
      "weight, pos_weight or weight, out, offset)",
      py::arg("ids"), py::arg("weight"), py::arg("pos_weight"), py::arg("position_ids"), py::arg("pos_encoding"),
      py::arg("scale"), py::arg("offset"), py::arg("dropout_key"), py::arg("dropout_p"), py::arg("error_record"),
      py::arg("replay"));
  m.def(
      "set_backward_replay",
      [](const at::Tensor& grad_out, const at::Tensor& ids, const std::optional<at::Tensor>& position_ids,
         int64_t offset, int64_t num_embeddings, int64_t num_positions, double scale,
         std::optional<int64_t> padding_idx, bool scale_grad_by_freq, bool need_weight_grad, bool need_pos_grad,
         const std::optional<at::Tensor>& dropout_key, double dropout_p, py::object replay) {
        keep_replay(*backward_replays,
                    backward_replay_key(grad_out, ids, position_ids, offset, num_embeddings, num_positions, scale,
                                        padding_idx, scale_grad_by_freq, need_weight_grad, need_pos_grad,
                                        dropout_key, dropout_p),
                    std::move(replay));
      },
      "keep the whole replay pyembed._triton.backward planned for a dense backward of this metadata (its "
      "arguments), which embedding_python_kernels' node then calls itself: replay(grad_out, ids, position_ids, "
      "dropout_key) -> (weight_grad, pos_grad) or None");
  m.def(
      "clear_replays",
      [](bool forward, bool backward) {
        if (forward) forward_replays->clear();
        if (backward) backward_replays->clear();
      },
      "forget every set_forward_replay, set_backward_replay or both", py::arg("forward") = true,
      py::arg("backward") = true);
  // The GIL stays held: the forward is Python.
  def_embedding_call(m, "embedding_python_kernels", &pyembed::embedding_python_kernels,
                     "pyembed::embedding's call (its checks and C++ autograd node) with the kernels "
                     "set_python_kernels gave");
  m.def(
      "set_fused_step",
      [](py::object step) { pyembed::set_fused_step(std::make_unique<PythonFusedStep>(std::move(step))); },
      "the update embedding_fused's node runs in its backward (csrc/autograd.h, FusedStep)", py::arg("step"));
  // Positional (python, fused_weight, fused_pos, then pyembed::embedding's arguments). The
  // GIL is released around the C++ kernels (python=false), as embedding's call releases it,
  // and held for the Python ones, as for embedding_python_kernels.
  m.def(
      "embedding_fused",
      [](bool python, bool fused_weight, bool fused_pos, const at::Tensor& ids, const at::Tensor& weight,
         const std::optional<at::Tensor>& pos_weight, const std::optional<at::Tensor>& position_ids,
         std::string_view pos_encoding, double scale, int64_t offset, std::optional<int64_t> padding_idx,
         bool scale_grad_by_freq, bool validate, int64_t error_record, double dropout_p,
         const std::optional<at::Generator>& generator, bool sparse) {
        std::optional<py::gil_scoped_release> no_gil;
        if (!python) no_gil.emplace();
        return pyembed::embedding_fused(python, fused_weight, fused_pos, ids, weight, pos_weight, position_ids,
                                        pos_encoding, scale, offset, padding_idx, scale_grad_by_freq, validate,
                                        error_record, dropout_p, generator, sparse);
      },
      "pyembed::embedding's call (its checks and C++ autograd node) on tables of which some have their optimizer "
      "in the backward, which the node updates");
  def_typed_ops(m);
}
