// Test-only module: the CUDA backend's kernels and host code (embedding_kernels.cuh),
// compiled by g++ with the host emulation header and run on CPU tensors.
#include <torch/extension.h>

#include <vector>

#include "cuda/host_emulation.h"
#include "cuda/embedding_kernels.cuh"
#include "cuda/optim_kernels.cuh"

using pyembed::emulation::EmulatedLaunch;

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  namespace py = pybind11;
  m.def("embedding_forward", &pyembed::cuda::forward_op<EmulatedLaunch>,
        "the CUDA forward, emulated on CPU tensors (same arguments as torch.ops.pyembed.embedding_forward)",
        py::arg("ids"), py::arg("weight"), py::arg("pos_weight"), py::arg("position_ids"), py::arg("pos_encoding"),
        py::arg("scale"), py::arg("offset"), py::arg("dropout_key"), py::arg("dropout_p"),
        py::arg("sinusoid_column_offset") = 0, py::arg("sinusoid_dim") = 0, py::arg("error_record") = 0);
  m.def("embedding_backward", &pyembed::cuda::backward_op<EmulatedLaunch>,
        "the CUDA dense backward, emulated on CPU tensors (same arguments as torch.ops.pyembed.embedding_backward)",
        py::arg("grad_out"), py::arg("ids"), py::arg("position_ids"), py::arg("offset"), py::arg("num_embeddings"),
        py::arg("num_positions"), py::arg("scale"), py::arg("padding_idx"), py::arg("scale_grad_by_freq"),
        py::arg("need_weight_grad"), py::arg("need_pos_grad"), py::arg("dropout_key") = std::nullopt,
        py::arg("dropout_p") = 0.0);
  m.def("embedding_sparse_backward", &pyembed::cuda::sparse_backward_op<EmulatedLaunch>,
        "the CUDA sparse backward, emulated on CPU tensors (same arguments as "
        "torch.ops.pyembed.embedding_sparse_backward)",
        py::arg("grad_out"), py::arg("ids"), py::arg("num_embeddings"), py::arg("scale"), py::arg("padding_idx"),
        py::arg("scale_grad_by_freq"), py::arg("dropout_key") = std::nullopt, py::arg("dropout_p") = 0.0);
  m.def("embedding_touched_rows", &pyembed::cuda::touched_rows_op<EmulatedLaunch>,
        "the CUDA sparse backward without its host sync, emulated on CPU tensors (same arguments as "
        "torch.ops.pyembed.embedding_touched_rows)",
        py::arg("grad_out"), py::arg("ids"), py::arg("num_embeddings"), py::arg("scale"), py::arg("padding_idx"),
        py::arg("scale_grad_by_freq"), py::arg("dropout_key") = std::nullopt, py::arg("dropout_p") = 0.0);
  m.def("optimizer_update",
        [](const at::Tensor& param, const at::Tensor& state1, const at::Tensor& state2, const at::Tensor& rows,
           const at::Tensor& values, int64_t rule, const std::vector<double>& hyper, bool all_rows) {
          pyembed::cuda::optimizer_update_op<EmulatedLaunch>(param, state1, state2, rows, values, rule, hyper,
                                                             all_rows);
        },
        "the CUDA optimizer update, emulated on CPU tensors (same arguments as torch.ops.pyembed.optimizer_update)");
  m.def("optimizer_backward",
        [](const at::Tensor& grad_out, const at::Tensor& ids, double scale, std::optional<int64_t> padding_idx,
           bool scale_grad_by_freq, const std::optional<at::Tensor>& dropout_key, double dropout_p,
           const at::Tensor& param, const at::Tensor& state1, const at::Tensor& state2, int64_t rule,
           const std::vector<double>& hyper, bool all_rows) {
          pyembed::cuda::optimizer_backward_op<EmulatedLaunch>(grad_out, ids, scale, padding_idx, scale_grad_by_freq,
                                                               dropout_key, dropout_p, param, state1, state2, rule,
                                                               hyper, all_rows);
        },
        "the CUDA token table's backward as its optimizer update, emulated on CPU tensors (same arguments as "
        "torch.ops.pyembed.optimizer_backward)");
  m.def("position_update",
        [](const at::Tensor& grad_out, const at::Tensor& ids, int64_t offset,
           const std::optional<at::Tensor>& dropout_key, double dropout_p, const at::Tensor& param,
           const at::Tensor& state1, const at::Tensor& state2, int64_t rule, const std::vector<double>& hyper) {
          pyembed::cuda::position_update_op<EmulatedLaunch>(grad_out, ids, offset, dropout_key, dropout_p, param,
                                                            state1, state2, rule, hyper);
        },
        "the CUDA learned positions' backward as their optimizer update, emulated on CPU tensors (same arguments "
        "as torch.ops.pyembed.position_update)");
  m.def("row_grid",
        [](int64_t rows, int64_t dim, int64_t vec, int64_t min_rows_per_block) {
          const auto g = pyembed::cuda::row_grid(rows, dim, static_cast<int>(vec), min_rows_per_block);
          return std::make_tuple(g.grid.x, g.block.x, g.block.y);
        },
        "(blocks, threads a row, rows a block) of a launch over `rows` rows of `dim` elements, `vec` a thread "
        "access, at least `min_rows_per_block` rows a block where that fits");
  m.def("forward_token_order",
        [](int64_t num_tokens, int64_t seq_len, int64_t pos_mode, bool has_position_ids) {
          auto order = at::empty({num_tokens}, at::kLong);
          auto run = [&](auto pos) {
            for (int64_t slot = 0; slot < num_tokens; ++slot) {
              order[slot] =
                  pyembed::cuda::token_of_slot<decltype(pos)::value>(slot, num_tokens, seq_len, has_position_ids)
                      .token;
            }
          };
          using pyembed::PosEncoding;
          if (pos_mode == static_cast<int>(PosEncoding::kLearned)) {
            run(std::integral_constant<int, static_cast<int>(PosEncoding::kLearned)>{});
          } else if (pos_mode == static_cast<int>(PosEncoding::kSinusoidal)) {
            run(std::integral_constant<int, static_cast<int>(PosEncoding::kSinusoidal)>{});
          } else {
            run(std::integral_constant<int, static_cast<int>(PosEncoding::kNone)>{});
          }
          return order;
        },
        "the token each slot (thread row, in launch order) of the forward kernel handles, per positional mode "
        "and whether position_ids are given");
  m.def("take_launch_counts",
        [] {
          const auto counts = std::make_pair(EmulatedLaunch::kernel_launches, EmulatedLaunch::sorts);
          EmulatedLaunch::kernel_launches = EmulatedLaunch::sorts = 0;
          return counts;
        },
        "(kernel launches, sorts) since the last call");
}
