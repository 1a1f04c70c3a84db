// CUDA backend registration: the kernels and their orchestration are in
// embedding_kernels.cuh (shared with the host emulation the tests run); this file
// launches them on the current stream of the tensors' device.
#include <ATen/cuda/cub.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAException.h>
#include <torch/library.h>

#include <string_view>

#include "embedding_kernels.cuh"
#include "optim_kernels.cuh"

namespace pyembed::cuda {
namespace {

struct CudaLaunch {
  template <typename Kernel, typename... Args>
  static void run(dim3 grid, dim3 block, Kernel kernel, Args... args) {
    kernel<<<grid, block, 0, c10::cuda::getCurrentCUDAStream()>>>(args...);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }

  // A stable sort of (keys, values) on the keys' low `bits` bits (keys in [0, 2^bits)):
  // CUB's radix sort, as PyTorch's own embedding backward calls it, on the current stream.
  static std::pair<at::Tensor, at::Tensor> sort_pairs(const at::Tensor& keys, const at::Tensor& values,
                                                      int64_t bits) {
    at::Tensor sorted = at::empty_like(keys), order = at::empty_like(values);
    AT_DISPATCH_INDEX_TYPES(keys.scalar_type(), "pyembed_sort_pairs", [&] {
      at::cuda::cub::radix_sort_pairs<index_t, int64_t>(keys.data_ptr<index_t>(), sorted.data_ptr<index_t>(),
                                                        values.data_ptr<int64_t>(), order.data_ptr<int64_t>(),
                                                        keys.numel(), /*descending=*/false, 0, bits);
    });
    return {sorted, order};
  }
};

// Every op runs on the device of its tensors (the current device may be another GPU).
at::Tensor embedding_forward_cuda(const at::Tensor& ids, const at::Tensor& weight,
                                  const std::optional<at::Tensor>& pos_weight,
                                  const std::optional<at::Tensor>& position_ids, std::string_view pos_encoding,
                                  double scale, int64_t offset, const std::optional<at::Tensor>& dropout_key,
                                  double dropout_p, int64_t sinusoid_column_offset, int64_t sinusoid_dim,
                                  int64_t error_record) {
  const c10::cuda::CUDAGuard guard(weight.device());
  return forward_op<CudaLaunch>(ids, weight, pos_weight, position_ids, pos_encoding, scale, offset, dropout_key,
                                dropout_p, sinusoid_column_offset, sinusoid_dim, error_record);
}

std::tuple<at::Tensor, at::Tensor> embedding_backward_cuda(
    const at::Tensor& grad_out, const at::Tensor& ids, const std::optional<at::Tensor>& position_ids, int64_t offset,
    int64_t num_embeddings, int64_t num_positions, double scale, std::optional<int64_t> padding_idx,
    bool scale_grad_by_freq, bool need_weight_grad, bool need_pos_grad, const std::optional<at::Tensor>& dropout_key,
    double dropout_p) {
  const c10::cuda::CUDAGuard guard(grad_out.device());
  return backward_op<CudaLaunch>(grad_out, ids, position_ids, offset, num_embeddings, num_positions, scale, padding_idx,
                                 scale_grad_by_freq, need_weight_grad, need_pos_grad, dropout_key, dropout_p);
}

std::tuple<at::Tensor, at::Tensor> embedding_sparse_backward_cuda(
    const at::Tensor& grad_out, const at::Tensor& ids, int64_t num_embeddings, double scale,
    std::optional<int64_t> padding_idx, bool scale_grad_by_freq, const std::optional<at::Tensor>& dropout_key,
    double dropout_p) {
  const c10::cuda::CUDAGuard guard(grad_out.device());
  return sparse_backward_op<CudaLaunch>(grad_out, ids, num_embeddings, scale, padding_idx, scale_grad_by_freq,
                                        dropout_key, dropout_p);
}

std::tuple<at::Tensor, at::Tensor> embedding_touched_rows_cuda(
    const at::Tensor& grad_out, const at::Tensor& ids, int64_t num_embeddings, double scale,
    std::optional<int64_t> padding_idx, bool scale_grad_by_freq, const std::optional<at::Tensor>& dropout_key,
    double dropout_p) {
  const c10::cuda::CUDAGuard guard(grad_out.device());
  return touched_rows_op<CudaLaunch>(grad_out, ids, num_embeddings, scale, padding_idx, scale_grad_by_freq,
                                     dropout_key, dropout_p);
}

void optimizer_update_cuda(const at::Tensor& param, const at::Tensor& state1, const at::Tensor& state2,
                           const at::Tensor& rows, const at::Tensor& values, int64_t rule, c10::ArrayRef<double> hyper,
                           bool all_rows) {
  const c10::cuda::CUDAGuard guard(param.device());
  optimizer_update_op<CudaLaunch>(param, state1, state2, rows, values, rule, hyper, all_rows);
}

void optimizer_backward_cuda(const at::Tensor& grad_out, const at::Tensor& ids, double scale,
                             std::optional<int64_t> padding_idx, bool scale_grad_by_freq,
                             const std::optional<at::Tensor>& dropout_key, double dropout_p, const at::Tensor& param,
                             const at::Tensor& state1, const at::Tensor& state2, int64_t rule,
                             c10::ArrayRef<double> hyper, bool all_rows) {
  const c10::cuda::CUDAGuard guard(param.device());
  optimizer_backward_op<CudaLaunch>(grad_out, ids, scale, padding_idx, scale_grad_by_freq, dropout_key, dropout_p,
                                    param, state1, state2, rule, hyper, all_rows);
}

void position_update_cuda(const at::Tensor& grad_out, const at::Tensor& ids, int64_t offset,
                          const std::optional<at::Tensor>& dropout_key, double dropout_p, const at::Tensor& param,
                          const at::Tensor& state1, const at::Tensor& state2, int64_t rule,
                          c10::ArrayRef<double> hyper) {
  const c10::cuda::CUDAGuard guard(param.device());
  position_update_op<CudaLaunch>(grad_out, ids, offset, dropout_key, dropout_p, param, state1, state2, rule, hyper);
}

}  // namespace

TORCH_LIBRARY_IMPL(pyembed, CUDA, m) {
  m.impl("optimizer_update", &optimizer_update_cuda);
  m.impl("optimizer_backward", &optimizer_backward_cuda);
  m.impl("position_update", &position_update_cuda);
  m.impl("embedding_touched_rows", &embedding_touched_rows_cuda);
  m.impl("embedding_forward", &embedding_forward_cuda);
  m.impl("embedding_backward", &embedding_backward_cuda);
  m.impl("embedding_sparse_backward", &embedding_sparse_backward_cuda);
}

}  // namespace pyembed::cuda
