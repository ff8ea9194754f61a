// The CUDA kernels of torch.ops.kt_regroup.permute_multi_embedding{,_to,_into,_backward}
// (one launch per call, no host sync) and permute_multi_embedding_vbe{,_backward}.
//
// The design is described in kernels.cuh, with the kernels. Only per-operator ATen
// headers here (not ATen/ATen.h): nvcc compiles this file's host code too.

#include "kernels.cuh"

#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGraphsC10Utils.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <cstring>
#include <mutex>
#include <optional>
#include <vector>

namespace kt_regroup {
namespace cuda {
namespace {

// The plan where the kernel reads it: the data's device.
at::Tensor plan_on(const at::Tensor& permutes, c10::Device device) {
  return permutes.device() == device ? permutes : permutes.to(device);
}

// The checks of a forward (check: in full where the plan is on the CPU, else those that
// read no data; the plan stays on the device). Then the data must be on CUDA.
void check_forward_call(const Call& call, const PlanArgs& plan) {
  check(call, plan);
  const at::Tensor& first = *call.tensors[0];
  TORCH_CHECK_VALUE(
      first.is_cuda(), "kt_regroup.", call.op, ": pooled_embs[0] is on ", first.device(),
      " but other arguments are on cuda; all must be on one device");
}

// The forward's launches into `outs` (fresh, or the caller's for _into), every column
// written: copies, and zeros where no row writes (forward_host plans them).
void launch_forward(
    at::TensorList pooled_embs,
    const at::Tensor& permutes,
    at::TensorList outs,
    c10::ScalarType out_dtype) {
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  forward_host(
      pooled_embs, outs, out_dtype, [&](c10::Device device) { return plan_on(permutes, device); },
      [&](auto kernel, int64_t blocks, const Launch& L, const auto& r, const auto& w) {
        kernel<<<blocks, kThreads, 0, stream>>>(L, r, w);
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      });
}

std::vector<at::Tensor> forward(
    const char* op,
    at::TensorList pooled_embs,
    const at::Tensor& permutes,
    const at::Tensor& in_shapes,
    const at::Tensor& out_shapes,
    c10::IntArrayRef out_lengths,
    std::optional<c10::ScalarType> dtype) {
  check_forward_call(
      {op,
       dtype ? Kind::kCast : Kind::kForward,
       pointers(pooled_embs),
       0,
       {},
       /*device_kernel=*/true},
      {permutes, in_shapes, out_shapes, out_lengths});
  const at::Tensor& first = pooled_embs[0];
  const c10::cuda::CUDAGuard guard(first.device());
  const c10::ScalarType out_dtype = dtype.value_or(first.scalar_type());
  std::vector<at::Tensor> outs;
  for (int64_t n : out_lengths) {
    outs.push_back(at::empty({first.size(0), n}, first.options().dtype(out_dtype)));
  }
  launch_forward(pooled_embs, permutes, outs, out_dtype);
  return outs;
}

std::vector<at::Tensor> permute_multi_embedding_cuda(
    at::TensorList pooled_embs,
    const at::Tensor& permutes,
    const at::Tensor& in_shapes,
    const at::Tensor& out_shapes,
    c10::IntArrayRef out_lengths) {
  return forward(
      "permute_multi_embedding", pooled_embs, permutes, in_shapes, out_shapes, out_lengths,
      std::nullopt);
}

std::vector<at::Tensor> permute_multi_embedding_to_cuda(
    at::TensorList pooled_embs,
    const at::Tensor& permutes,
    const at::Tensor& in_shapes,
    const at::Tensor& out_shapes,
    c10::IntArrayRef out_lengths,
    std::optional<c10::ScalarType> dtype) {
  return forward(
      "permute_multi_embedding_to", pooled_embs, permutes, in_shapes, out_shapes, out_lengths,
      dtype);
}

// Into caller-owned outputs: their checks read no data, the plan's are the forward's;
// then the forward's launches write every column of every output.
void permute_multi_embedding_into_cuda(
    at::TensorList pooled_embs,
    const at::Tensor& permutes,
    const at::Tensor& in_shapes,
    const at::Tensor& out_shapes,
    at::TensorList outs) {
  check_forward_call(
      {"permute_multi_embedding_into", Kind::kInto, pointers(pooled_embs), 0, outs,
       /*device_kernel=*/true},
      {permutes, in_shapes, out_shapes});
  const c10::cuda::CUDAGuard guard(pooled_embs[0].device());
  launch_forward(pooled_embs, permutes, outs, pooled_embs[0].scalar_type());
}

std::vector<at::Tensor> permute_multi_embedding_backward_cuda(
    const c10::List<std::optional<at::Tensor>>& grad_outputs,
    const at::Tensor& permutes,
    const at::Tensor& in_shapes,
    const at::Tensor& out_shapes,
    c10::IntArrayRef in_lengths,
    int64_t batch_size,
    c10::ScalarType dtype) {
  constexpr const char* op = "permute_multi_embedding_backward";
  HeldTensors held;
  const TensorPtrs grads = grad_pointers(grad_outputs, held);
  const at::Tensor* defined = nullptr;
  for (const at::Tensor* g : grads) {
    if (g && !defined) defined = g;
  }
  const c10::Device device = gradients_device(grads, permutes);
  const bool kernel_dtypes = is_float(dtype) && (!defined || is_float(defined->scalar_type()));
  const bool portable = !kernel_dtypes || grads.size() > kMaxReads;
  // The portable path reads the plan on the host (a sync where it is on the device).
  const auto checked = check(
      {op, Kind::kBackward, grads, batch_size, {}, /*device_kernel=*/!portable},
      {permutes, in_shapes, out_shapes, in_lengths});
  if (portable) {
    return backward_by_segments(grads, checked->segments, in_lengths, batch_size, dtype, device);
  }
  TORCH_CHECK_VALUE(
      device.is_cuda(), "kt_regroup.", op, ": the gradients are on ", device,
      " but other arguments are on cuda; all must be on one device");
  const c10::cuda::CUDAGuard guard(device);
  const auto options = at::TensorOptions().dtype(dtype).device(device);
  std::vector<at::Tensor> outs;
  int64_t total_cols = 0;
  for (int64_t n : in_lengths) {
    outs.push_back(
        defined ? at::empty({batch_size, n}, options) : at::zeros({batch_size, n}, options));
    total_cols += n;
  }
  if (!defined || batch_size == 0 || total_cols == 0) return outs;
  const at::Tensor plan = plan_on(permutes, device);
  TensorPtrs out_ptrs;
  for (const at::Tensor& t : outs) out_ptrs.push_back(&t);
  const int64_t es = outs[0].element_size();
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const c10::ScalarType grad_dtype = defined->scalar_type();
  backward_launches(
      plan, grads, out_ptrs, batch_size, es,
      [&](const Launch& L, const auto& g, const auto& w, int64_t blocks) {
        with_backward_kernel(grad_dtype, dtype, [&](auto kernel) {
          kernel<<<blocks, kThreads, 0, stream>>>(L, g, w);
          C10_CUDA_KERNEL_LAUNCH_CHECK();
        });
      });
  return outs;
}

// The variable-batch ops: checked as the others (the plan in full where it is on the
// CPU, else without reading data); the indices' values by the kernels (a device-side
// assert, as index_select's: reading them here would wait for the device).
template <typename Kernel, typename... Args>
void launch(Kernel kernel, int64_t blocks, const Args&... args) {
  kernel<<<blocks, kThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(args...);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// Their table of tensors on `device`: staged in pinned memory and copied on the current
// stream without a sync (the caching host allocator keeps the staging block until the
// copy is done). Under CUDA graph capture the staging block is kept for good: each
// replay copies from it again.
at::Tensor upload(const std::vector<int64_t>& fields, c10::Device device) {
  const int64_t n = static_cast<int64_t>(fields.size());
  at::Tensor host = at::empty({n}, at::TensorOptions().dtype(at::kLong).pinned_memory(true));
  std::memcpy(host.mutable_data_ptr<int64_t>(), fields.data(), n * sizeof(int64_t));
  at::Tensor table = at::empty({n}, at::TensorOptions().dtype(at::kLong).device(device));
  table.copy_(host, /*non_blocking=*/true);
  if (c10::cuda::currentStreamCaptureStatusMayInitCtx() != c10::cuda::CaptureStatus::None) {
    static std::mutex mutex;
    static std::vector<at::Tensor> captured;
    const std::lock_guard<std::mutex> lock(mutex);
    captured.push_back(host);
  }
  return table;
}

std::vector<at::Tensor> permute_multi_embedding_vbe_cuda(
    at::TensorList pooled_embs,
    const c10::List<std::optional<at::Tensor>>& indices,
    const at::Tensor& permutes,
    const at::Tensor& in_shapes,
    const at::Tensor& out_shapes,
    c10::IntArrayRef out_lengths) {
  const int64_t batch =
      check(
          {false, pointers(pooled_embs), indices, {}, at::kFloat, /*device_kernel=*/true},
          {permutes, in_shapes, out_shapes, out_lengths})
          .batch;
  const at::Tensor& first = pooled_embs[0];
  TORCH_CHECK_VALUE(
      first.is_cuda(), "kt_regroup.permute_multi_embedding_vbe: pooled_embs[0] is on ",
      first.device(), " but other arguments are on cuda; all must be on one device");
  const c10::cuda::CUDAGuard guard(first.device());
  std::vector<at::Tensor> outs;
  int64_t total_cols = 0;
  for (int64_t n : out_lengths) {
    outs.push_back(at::empty({batch, n}, first.options()));
    total_cols += n;
  }
  if (batch == 0 || total_cols == 0) return outs;
  std::vector<at::Tensor> inputs;
  for (const at::Tensor& t : pooled_embs) inputs.push_back(t.resolve_conj().resolve_neg());
  const std::vector<std::optional<at::Tensor>> index(indices.begin(), indices.end());
  vbe_forward_launches(
      plan_on(permutes, first.device()), inputs, index, outs, batch,
      [&](const std::vector<int64_t>& fields) { return upload(fields, first.device()); },
      [](auto kernel, int64_t blocks, const auto&... args) { launch(kernel, blocks, args...); });
  return outs;
}

at::Tensor permute_multi_embedding_vbe_backward_cuda(
    const c10::List<std::optional<at::Tensor>>& grad_outputs,
    const c10::List<std::optional<at::Tensor>>& indices,
    const at::Tensor& permutes,
    const at::Tensor& in_shapes,
    const at::Tensor& out_shapes,
    c10::IntArrayRef in_lengths,
    c10::IntArrayRef in_rows,
    c10::ScalarType dtype) {
  if (!is_float(dtype) || grad_outputs.size() > size_t(kMaxReads)) {
    return vbe_backward_portable(
        grad_outputs, indices, permutes, in_shapes, out_shapes, in_lengths, in_rows, dtype);
  }
  HeldTensors held;
  const TensorPtrs grads = grad_pointers(grad_outputs, held);
  const int64_t batch = check(
                            {true, grads, indices, in_rows, dtype, /*device_kernel=*/true},
                            {permutes, in_shapes, out_shapes, in_lengths})
                            .batch;
  const bool defined =
      std::any_of(grads.begin(), grads.end(), [](const at::Tensor* g) { return g; });
  const c10::Device device = gradients_device(grads, permutes);
  TORCH_CHECK_VALUE(
      device.is_cuda(), "kt_regroup.permute_multi_embedding_vbe_backward: the gradients are on ",
      device, " but other arguments are on cuda; all must be on one device");
  const c10::cuda::CUDAGuard guard(device);
  int64_t total = 0;
  for (size_t i = 0; i < in_rows.size(); ++i) total += in_rows[i] * in_lengths[i];
  const auto options = at::TensorOptions().dtype(dtype).device(device);
  if (!defined || total == 0) return at::zeros({total}, options);
  at::Tensor flat = at::empty({total}, options);
  const std::vector<std::optional<at::Tensor>> index(indices.begin(), indices.end());
  vbe_backward_launches(
      plan_on(permutes, device), grads, index, in_rows, in_lengths, batch, flat,
      [&](const std::vector<int64_t>& fields) { return upload(fields, device); },
      [](auto kernel, int64_t blocks, const auto&... args) { launch(kernel, blocks, args...); });
  return flat;
}

}  // namespace
}  // namespace cuda
}  // namespace kt_regroup

// Present only in a library built with CUDA (kt_regroup/ops.py, tests).
extern "C" int kt_regroup_built_with_cuda() {
  return 1;
}

TORCH_LIBRARY_IMPL(kt_regroup, CUDA, m) {
  m.impl("permute_multi_embedding", TORCH_FN(kt_regroup::cuda::permute_multi_embedding_cuda));
  m.impl("permute_multi_embedding_to", TORCH_FN(kt_regroup::cuda::permute_multi_embedding_to_cuda));
  m.impl(
      "permute_multi_embedding_into",
      TORCH_FN(kt_regroup::cuda::permute_multi_embedding_into_cuda));
  m.impl(
      "permute_multi_embedding_backward",
      TORCH_FN(kt_regroup::cuda::permute_multi_embedding_backward_cuda));
  m.impl(
      "permute_multi_embedding_vbe", TORCH_FN(kt_regroup::cuda::permute_multi_embedding_vbe_cuda));
  m.impl(
      "permute_multi_embedding_vbe_backward",
      TORCH_FN(kt_regroup::cuda::permute_multi_embedding_vbe_backward_cuda));
}
