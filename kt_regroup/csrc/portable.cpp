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

// The plan of a call, checked, after a warning where the library has no CUDA kernels.
std::shared_ptr<const CheckedPlan> checked(const Call& call, const PlanArgs& plan) {
  warn_if_cuda(plan.permutes);
  for (const at::Tensor* t : call.tensors) {
    if (t) warn_if_cuda(*t);
    if (call.kind != Kind::kBackward) break;  // the inputs are on one device, if any
  }
  return check(call, plan);
}

// The forward's copies into `outs`, zeroed first unless the segments write every column.
void copy_segments(at::TensorList inputs, const CheckedPlan& plan, at::TensorList outs) {
  if (!plan.tiled) {
    for (const at::Tensor& t : outs) t.zero_();
  }
  for (const Segment& s : plan.segments) {
    outs[s.out_t]
        .narrow(1, s.out_off, s.length)
        .copy_(inputs[s.in_t].narrow(1, s.in_off, s.length));  // copy_ casts
  }
}

std::vector<at::Tensor> forward(
    const char* op,
    at::TensorList pooled_embs,
    const PlanArgs& args,
    std::optional<c10::ScalarType> dtype) {
  const auto plan =
      checked({op, dtype ? Kind::kCast : Kind::kForward, pointers(pooled_embs)}, args);
  const at::Tensor& first = pooled_embs[0];
  const auto options = first.options().dtype(dtype.value_or(first.scalar_type()));
  std::vector<at::Tensor> outs;
  for (int64_t n : args.lengths) outs.push_back(at::empty({first.size(0), n}, options));
  copy_segments(pooled_embs, *plan, outs);
  return outs;
}

std::vector<at::Tensor> permute_multi_embedding_to(
    at::TensorList pooled_embs,
    const at::Tensor& permutes,
    const at::Tensor& in_shapes,
    const at::Tensor& out_shapes,
    c10::IntArrayRef out_lengths,
    std::optional<c10::ScalarType> dtype) {
  return forward(
      "permute_multi_embedding_to", pooled_embs, {permutes, in_shapes, out_shapes, out_lengths},
      dtype);
}

std::vector<at::Tensor> permute_multi_embedding(
    at::TensorList pooled_embs,
    const at::Tensor& permutes,
    const at::Tensor& in_shapes,
    const at::Tensor& out_shapes,
    c10::IntArrayRef out_lengths) {
  return forward(
      "permute_multi_embedding", pooled_embs, {permutes, in_shapes, out_shapes, out_lengths},
      std::nullopt);
}

void permute_multi_embedding_into(
    at::TensorList pooled_embs,
    const at::Tensor& permutes,
    const at::Tensor& in_shapes,
    const at::Tensor& out_shapes,
    at::TensorList outs) {
  const auto plan = checked(
      {"permute_multi_embedding_into", Kind::kInto, pointers(pooled_embs), 0, outs},
      {permutes, in_shapes, out_shapes});
  copy_segments(pooled_embs, *plan, outs);
}

std::vector<at::Tensor> permute_multi_embedding_backward(
    const c10::List<std::optional<at::Tensor>>& grad_outputs,
    const at::Tensor& permutes,
    const at::Tensor& in_shapes,
    const at::Tensor& out_shapes,
    c10::IntArrayRef in_lengths,
    int64_t batch_size,
    c10::ScalarType dtype) {
  HeldTensors held;
  const Call call{
      "permute_multi_embedding_backward", Kind::kBackward, grad_pointers(grad_outputs, held),
      batch_size};
  const auto plan = checked(call, {permutes, in_shapes, out_shapes, in_lengths});
  return backward_by_segments(
      call.tensors, plan->segments, in_lengths, batch_size, dtype,
      gradients_device(call.tensors, permutes));
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
