// Portable kernels: ATen copies, one per segment, registered for every device
// (CompositeExplicitAutograd). The native kernels override them: cpu.cpp for CPU, and
// cuda/permute.cu for CUDA where the library was built with CUDA. Here they serve every
// other device, and CUDA in a library built without its CUDA kernels (with a warning,
// once per process, that says how to build them).
//
// The metadata is read on the host (a device sync where it lives on an accelerator).

#include "kt_regroup.h"

#include <ATen/ATen.h>
#include <torch/library.h>

namespace kt_regroup {
namespace {

// A CUDA tensor here means the library has no CUDA kernels (permute.cu registers every op
// for CUDA): C++, so that TorchScript and AOTInductor runs warn too.
void warn_if_cuda(const at::Tensor& t) {
  if (t.defined() && t.is_cuda()) {
    TORCH_WARN_ONCE(
        "kt_regroup: this op library was built without its CUDA kernels, so CUDA tensors take "
        "the portable kernel (one ATen copy per segment, the plan read on the host: a host "
        "sync per call, no CUDA graphs). To build them, reinstall kt_regroup with a CUDA "
        "build of torch and an nvcc of the same CUDA major (CUDA_HOME, nvcc on PATH, or "
        "`pip install nvidia-cuda-nvcc==<torch.version.cuda>.*` for CUDA 13+): "
        "`pip install --no-build-isolation .`; it prints why it skips them");
  }
}

std::vector<at::Tensor> new_outputs(
    const std::vector<Segment>& segments,
    c10::IntArrayRef out_lengths,
    int64_t batch,
    const at::TensorOptions& options) {
  const bool tiled = segments_tile_outputs(segments, out_lengths);
  std::vector<at::Tensor> outs;
  for (int64_t n : out_lengths) {
    outs.push_back(tiled ? at::empty({batch, n}, options) : at::zeros({batch, n}, options));
  }
  return outs;
}

void copy_segments(
    at::TensorList inputs, const std::vector<Segment>& segments, at::TensorList outs) {
  for (const Segment& s : segments) {
    outs[s.out_t]
        .narrow(1, s.out_off, s.length)
        .copy_(inputs[s.in_t].narrow(1, s.in_off, s.length));
  }
}

std::vector<at::Tensor> permute_multi_embedding_to(
    at::TensorList pooled_embs,
    const at::Tensor& permutes,
    const at::Tensor& in_shapes,
    const at::Tensor& out_shapes,
    c10::IntArrayRef out_lengths,
    std::optional<c10::ScalarType> dtype) {
  warn_if_cuda(permutes);
  if (!pooled_embs.empty()) warn_if_cuda(pooled_embs[0]);
  const std::vector<Segment> segments = check_forward(
      "permute_multi_embedding_to", pooled_embs, permutes, in_shapes, out_shapes, out_lengths,
      /*same_dtype=*/!dtype.has_value());
  const at::Tensor& first = pooled_embs[0];
  std::vector<at::Tensor> outs = new_outputs(
      segments, out_lengths, first.size(0),
      first.options().dtype(dtype.value_or(first.scalar_type())));
  copy_segments(pooled_embs, segments, outs);  // copy_ casts
  return outs;
}

std::vector<at::Tensor> permute_multi_embedding(
    at::TensorList pooled_embs,
    const at::Tensor& permutes,
    const at::Tensor& in_shapes,
    const at::Tensor& out_shapes,
    c10::IntArrayRef out_lengths) {
  warn_if_cuda(permutes);
  if (!pooled_embs.empty()) warn_if_cuda(pooled_embs[0]);
  const std::vector<Segment> segments = check_forward(
      "permute_multi_embedding", pooled_embs, permutes, in_shapes, out_shapes, out_lengths);
  std::vector<at::Tensor> outs =
      new_outputs(segments, out_lengths, pooled_embs[0].size(0), pooled_embs[0].options());
  copy_segments(pooled_embs, segments, outs);
  return outs;
}

void permute_multi_embedding_into(
    at::TensorList pooled_embs,
    const at::Tensor& permutes,
    const at::Tensor& in_shapes,
    const at::Tensor& out_shapes,
    at::TensorList outs) {
  warn_if_cuda(permutes);
  if (!pooled_embs.empty()) warn_if_cuda(pooled_embs[0]);
  const std::vector<Segment> segments =
      prepare_into(pooled_embs, permutes, in_shapes, out_shapes, outs);
  copy_segments(pooled_embs, segments, outs);
}

std::vector<at::Tensor> permute_multi_embedding_backward(
    const c10::List<std::optional<at::Tensor>>& grad_outputs,
    const at::Tensor& permutes,
    const at::Tensor& in_shapes,
    const at::Tensor& out_shapes,
    c10::IntArrayRef in_lengths,
    int64_t batch_size,
    c10::ScalarType dtype) {
  std::vector<std::optional<at::Tensor>> held;
  const TensorPtrs grads = grad_pointers(grad_outputs, held);
  warn_if_cuda(permutes);
  for (const at::Tensor* g : grads) {
    if (g) warn_if_cuda(*g);
  }
  const std::vector<Segment> segments = check_backward(
      "permute_multi_embedding_backward", grads, permutes, in_shapes, out_shapes, in_lengths,
      batch_size);
  return backward_by_segments(
      grads, segments, in_lengths, batch_size, dtype, gradients_device(grads, permutes));
}

}  // namespace

std::vector<at::Tensor> backward_by_segments(
    const TensorPtrs& grads,
    const std::vector<Segment>& segments,
    c10::IntArrayRef in_lengths,
    int64_t batch_size,
    c10::ScalarType dtype,
    c10::Device device) {
  for (size_t j = 0; j < grads.size(); ++j) {
    // Checked for every call, not only where a segment adds: float gradients never
    // become an integer or bool gradient, with or without rows.
    TORCH_CHECK_TYPE(
        !grads[j] || c10::canCast(grads[j]->scalar_type(), dtype),
        "kt_regroup.permute_multi_embedding_backward: grad_outputs[", j, "] is ",
        grads[j]->scalar_type(), ", which cannot be accumulated into dtype ", dtype);
  }
  const bool reduced = dtype == at::kHalf || dtype == at::kBFloat16;
  const auto options = at::TensorOptions().dtype(reduced ? at::kFloat : dtype).device(device);
  std::vector<at::Tensor> out;
  for (int64_t n : in_lengths) out.push_back(at::zeros({batch_size, n}, options));
  for (const Segment& s : segments) {
    if (const at::Tensor* g = grads[s.out_t]) {
      out[s.in_t].narrow(1, s.in_off, s.length).add_(g->narrow(1, s.out_off, s.length));
    }
  }
  if (reduced) {
    for (at::Tensor& t : out) t = t.to(dtype);
  }
  return out;
}

}  // namespace kt_regroup

TORCH_LIBRARY_IMPL(kt_regroup, CompositeExplicitAutograd, m) {
  m.impl("permute_multi_embedding", TORCH_FN(kt_regroup::permute_multi_embedding));
  m.impl("permute_multi_embedding_to", TORCH_FN(kt_regroup::permute_multi_embedding_to));
  m.impl("permute_multi_embedding_into", TORCH_FN(kt_regroup::permute_multi_embedding_into));
  m.impl(
      "permute_multi_embedding_backward", TORCH_FN(kt_regroup::permute_multi_embedding_backward));
}
