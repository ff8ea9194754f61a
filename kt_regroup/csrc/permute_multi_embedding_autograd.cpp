// Autograd kernel of torch.ops.kt_regroup.permute_multi_embedding, in C++ so that an
// eager call makes no trip through Python (a Python autograd.Function costs tens of
// microseconds, more than the whole copy at serving batch sizes).
//
// The backward calls permute_multi_embedding_backward through the dispatcher, so
// torch.compile / AOTAutograd / export trace it as an op. Sizes are SymInts
// (sym_size), so the kernel also runs on fake tensors with a symbolic batch.

#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/autograd.h>
#include <torch/library.h>

namespace kt_regroup {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

std::vector<at::Tensor> call_forward(
    at::TensorList pooled_embs,
    const at::Tensor& permutes,
    const at::Tensor& in_shapes,
    const at::Tensor& out_shapes,
    c10::SymIntArrayRef out_lengths) {
  static auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("kt_regroup::permute_multi_embedding", "")
          .typed<std::vector<at::Tensor>(
              at::TensorList, const at::Tensor&, const at::Tensor&, const at::Tensor&,
              c10::SymIntArrayRef)>();
  return op.call(pooled_embs, permutes, in_shapes, out_shapes, out_lengths);
}

std::vector<at::Tensor> call_backward(
    const c10::List<std::optional<at::Tensor>>& grad_outputs,
    const at::Tensor& permutes,
    const at::Tensor& in_shapes,
    const at::Tensor& out_shapes,
    c10::SymIntArrayRef in_lengths,
    c10::SymInt batch_size,
    c10::ScalarType dtype) {
  static auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("kt_regroup::permute_multi_embedding_backward", "")
          .typed<std::vector<at::Tensor>(
              const c10::List<std::optional<at::Tensor>>&, const at::Tensor&,
              const at::Tensor&, const at::Tensor&, c10::SymIntArrayRef, c10::SymInt,
              c10::ScalarType)>();
  return op.call(
      grad_outputs, permutes, in_shapes, out_shapes, in_lengths, std::move(batch_size), dtype);
}

class PermuteMultiEmbeddingFunction
    : public torch::autograd::Function<PermuteMultiEmbeddingFunction> {
 public:
  static variable_list forward(
      AutogradContext* ctx,
      at::TensorList pooled_embs,
      const at::Tensor& permutes,
      const at::Tensor& in_shapes,
      const at::Tensor& out_shapes,
      c10::SymIntArrayRef out_lengths) {
    if (!pooled_embs.empty()) {  // else the kernel below reports the empty list
      std::vector<c10::SymInt> in_lengths;
      in_lengths.reserve(pooled_embs.size());
      for (const at::Tensor& t : pooled_embs) {
        in_lengths.push_back(t.dim() == 2 ? t.sym_size(1) : c10::SymInt(0));
      }
      const at::Tensor& first = pooled_embs[0];
      ctx->saved_data["in_lengths"] = c10::IValue(c10::SymIntArrayRef(in_lengths));
      ctx->saved_data["batch_size"] = first.dim() > 0 ? first.sym_size(0) : c10::SymInt(0);
      ctx->saved_data["dtype"] = first.scalar_type();
      // Index tensors, never modified in place: kept in saved_data rather than
      // save_for_backward so plans cached under torch.inference_mode() still work.
      ctx->saved_data["permutes"] = permutes;
      ctx->saved_data["in_shapes"] = in_shapes;
      ctx->saved_data["out_shapes"] = out_shapes;
    }
    at::AutoDispatchBelowADInplaceOrView guard;
    return call_forward(pooled_embs, permutes, in_shapes, out_shapes, out_lengths);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    c10::List<std::optional<at::Tensor>> grads;
    grads.reserve(grad_outputs.size());
    for (const at::Tensor& g : grad_outputs) {
      grads.push_back(g.defined() ? std::optional<at::Tensor>(g) : std::nullopt);
    }
    const std::vector<c10::SymInt> in_lengths = ctx->saved_data["in_lengths"].toSymIntVector();
    variable_list result = call_backward(
        grads, ctx->saved_data["permutes"].toTensor(), ctx->saved_data["in_shapes"].toTensor(),
        ctx->saved_data["out_shapes"].toTensor(), in_lengths,
        ctx->saved_data["batch_size"].toSymInt(), ctx->saved_data["dtype"].toScalarType());
    // No gradient for permutes, in_shapes, out_shapes, out_lengths.
    result.resize(result.size() + 4);
    return result;
  }
};

std::vector<at::Tensor> permute_multi_embedding_autograd(
    at::TensorList pooled_embs,
    const at::Tensor& permutes,
    const at::Tensor& in_shapes,
    const at::Tensor& out_shapes,
    c10::SymIntArrayRef out_lengths) {
  return PermuteMultiEmbeddingFunction::apply(
      pooled_embs, permutes, in_shapes, out_shapes, out_lengths);
}

}  // namespace
}  // namespace kt_regroup

TORCH_LIBRARY_IMPL(kt_regroup, Autograd, m) {
  m.impl("permute_multi_embedding", TORCH_FN(kt_regroup::permute_multi_embedding_autograd));
}
