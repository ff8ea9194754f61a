// Autograd kernels: the only autograd of the ops when this library is loaded.
//
// The regroup is linear, so each direction is the other's gradient:
//   permute_multi_embedding{,_to}   --backward-->  permute_multi_embedding_backward
//   permute_multi_embedding_backward --backward--> permute_multi_embedding_to
// Every step calls an op through the dispatcher, so torch.compile / AOTAutograd /
// export trace it, and sizes are SymInts (sym_size), so the kernels also run on fake
// tensors with a symbolic batch. The metadata tensors are index tensors that nothing
// modifies in place: they are kept in saved_data rather than save_for_backward, so plans
// made under torch.inference_mode() work with autograd too.
//
// Forward-mode AD is the same linearity: each op applied to the tangents. The _into op
// records nothing: it refuses what it cannot differentiate and bumps version counters.

#include "kt_regroup.h"

#include <torch/autograd.h>
#include <torch/csrc/autograd/VariableTypeUtils.h>
#include <torch/library.h>

#include <algorithm>

namespace kt_regroup {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;
using OptionalTensors = c10::List<std::optional<at::Tensor>>;

std::vector<at::Tensor> call_backward(
    const OptionalTensors& grad_outputs,
    const at::Tensor& permutes,
    const at::Tensor& in_shapes,
    const at::Tensor& out_shapes,
    c10::SymIntArrayRef in_lengths,
    c10::SymInt batch_size,
    c10::ScalarType dtype) {
  static const auto op = op_handle<std::vector<at::Tensor>(
      const OptionalTensors&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
      c10::SymIntArrayRef, c10::SymInt, c10::ScalarType)>(
      "kt_regroup::permute_multi_embedding_backward");
  return op.call(
      grad_outputs, permutes, in_shapes, out_shapes, in_lengths, std::move(batch_size), dtype);
}

void call_into(
    at::TensorList pooled_embs,
    const at::Tensor& permutes,
    const at::Tensor& in_shapes,
    const at::Tensor& out_shapes,
    at::TensorList outs) {
  static const auto op = op_handle<void(
      at::TensorList, const at::Tensor&, const at::Tensor&, const at::Tensor&, at::TensorList)>(
      "kt_regroup::permute_multi_embedding_into");
  op.call(pooled_embs, permutes, in_shapes, out_shapes, outs);
}

// permute_multi_embedding, or permute_multi_embedding_to (`cast`).
std::vector<at::Tensor> call_permute(
    at::TensorList pooled_embs,
    const at::Tensor& permutes,
    const at::Tensor& in_shapes,
    const at::Tensor& out_shapes,
    c10::SymIntArrayRef out_lengths,
    std::optional<c10::ScalarType> dtype,
    bool cast) {
  static const auto forward = op_handle<std::vector<at::Tensor>(
      at::TensorList, const at::Tensor&, const at::Tensor&, const at::Tensor&,
      c10::SymIntArrayRef)>("kt_regroup::permute_multi_embedding");
  static const auto to = op_handle<std::vector<at::Tensor>(
      at::TensorList, const at::Tensor&, const at::Tensor&, const at::Tensor&, c10::SymIntArrayRef,
      std::optional<c10::ScalarType>)>("kt_regroup::permute_multi_embedding_to");
  return cast ? to.call(pooled_embs, permutes, in_shapes, out_shapes, out_lengths, dtype)
              : forward.call(pooled_embs, permutes, in_shapes, out_shapes, out_lengths);
}

// Autograd's undefined gradients are the op's None.
OptionalTensors optionals(at::TensorList tensors) {
  OptionalTensors out;
  out.reserve(tensors.size());
  for (const at::Tensor& t : tensors) {
    out.push_back(t.defined() ? std::optional<at::Tensor>(t) : std::nullopt);
  }
  return out;
}

void save_metadata(
    AutogradContext* ctx,
    const at::Tensor& permutes,
    const at::Tensor& in_shapes,
    const at::Tensor& out_shapes) {
  ctx->saved_data["permutes"] = permutes;
  ctx->saved_data["in_shapes"] = in_shapes;
  ctx->saved_data["out_shapes"] = out_shapes;
}

// Gradients of the non-tensor arguments and metadata: none.
variable_list with_no_grads_for_rest(variable_list grads, size_t n_rest) {
  grads.resize(grads.size() + n_rest);
  return grads;
}

// permute_multi_embedding and permute_multi_embedding_to (`cast`: the latter).
class PermuteFunction : public torch::autograd::Function<PermuteFunction> {
 public:
  static variable_list forward(
      AutogradContext* ctx,
      at::TensorList pooled_embs,
      const at::Tensor& permutes,
      const at::Tensor& in_shapes,
      const at::Tensor& out_shapes,
      c10::SymIntArrayRef out_lengths,
      std::optional<c10::ScalarType> dtype,
      bool cast) {
    if (!pooled_embs.empty()) {  // else the kernel below reports the empty list
      std::vector<c10::SymInt> in_lengths;
      for (const at::Tensor& t : pooled_embs) {
        in_lengths.push_back(t.dim() == 2 ? t.sym_size(1) : c10::SymInt(0));
      }
      const at::Tensor& first = pooled_embs[0];
      ctx->saved_data["in_lengths"] = c10::IValue(c10::SymIntArrayRef(in_lengths));
      ctx->saved_data["batch_size"] = first.dim() > 0 ? first.sym_size(0) : c10::SymInt(0);
      // Gradients in the widest input dtype; autograd casts each to its input's dtype
      // (inputs differ in dtype only for the fused cast).
      c10::ScalarType grad_dtype = first.scalar_type();
      for (const at::Tensor& t : pooled_embs)
        grad_dtype = c10::promoteTypes(grad_dtype, t.scalar_type());
      // A complex output has complex gradients: they are accumulated as such, and a real
      // input gets their real part, as torch's cast (.to) and torch.cat backward give it.
      if (cast && dtype.has_value() && c10::isComplexType(*dtype)) {
        grad_dtype = c10::promoteTypes(grad_dtype, *dtype);
      }
      ctx->saved_data["dtype"] = grad_dtype;
      if (c10::isComplexType(grad_dtype)) {
        std::vector<int64_t> real_inputs;
        for (size_t i = 0; i < pooled_embs.size(); ++i) {
          if (!pooled_embs[i].is_complex()) real_inputs.push_back(static_cast<int64_t>(i));
        }
        ctx->saved_data["real_inputs"] = real_inputs;
      }
      save_metadata(ctx, permutes, in_shapes, out_shapes);
    }
    at::AutoDispatchBelowADInplaceOrView guard;
    return call_permute(pooled_embs, permutes, in_shapes, out_shapes, out_lengths, dtype, cast);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    const auto& saved = ctx->saved_data;
    variable_list grads = call_backward(
        optionals(grad_outputs), saved.at("permutes").toTensor(), saved.at("in_shapes").toTensor(),
        saved.at("out_shapes").toTensor(), saved.at("in_lengths").toSymIntVector(),
        saved.at("batch_size").toSymInt(), saved.at("dtype").toScalarType());
    if (const auto it = saved.find("real_inputs"); it != saved.end()) {
      for (const c10::IValue& i : it->second.toListRef()) {
        at::Tensor& g = grads[i.toInt()];
        if (g.defined()) g = at::real(g);
      }
    }
    // permutes, in_shapes, out_shapes, out_lengths, dtype, cast
    return with_no_grads_for_rest(std::move(grads), 6);
  }
};

// permute_multi_embedding_backward: its gradient is the forward permute of the incoming
// gradients, cast back to the dtype the output gradients had. A C++ Function takes no
// undefined tensors: it gets the defined output gradients and their positions.
class PermuteBackwardFunction : public torch::autograd::Function<PermuteBackwardFunction> {
 public:
  static variable_list forward(
      AutogradContext* ctx,
      at::TensorList defined_grads,
      const std::vector<int64_t>& positions,  // of defined_grads among the n_out outputs
      int64_t n_out,
      const at::Tensor& permutes,
      const at::Tensor& in_shapes,
      const at::Tensor& out_shapes,
      c10::SymIntArrayRef in_lengths,
      c10::SymInt batch_size,
      c10::ScalarType dtype) {
    OptionalTensors grads;
    std::vector<c10::SymInt> widths(n_out, c10::SymInt(-1));  // -1: None
    for (int64_t j = 0; j < n_out; ++j) grads.push_back(std::nullopt);
    for (size_t k = 0; k < positions.size(); ++k) {
      grads.set(positions[k], defined_grads[k]);
      if (defined_grads[k].dim() == 2) widths[positions[k]] = defined_grads[k].sym_size(1);
    }
    ctx->saved_data["out_lengths"] = c10::IValue(c10::SymIntArrayRef(widths));
    ctx->saved_data["positions"] = positions;
    ctx->saved_data["grad_dtype"] = defined_grads.empty() ? dtype : defined_grads[0].scalar_type();
    ctx->saved_data["batch_size"] = batch_size;
    ctx->saved_data["in_lengths"] = c10::IValue(in_lengths);
    save_metadata(ctx, permutes, in_shapes, out_shapes);
    at::AutoDispatchBelowADInplaceOrView guard;
    return call_backward(
        grads, permutes, in_shapes, out_shapes, in_lengths, std::move(batch_size), dtype);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_grads) {
    const auto& saved = ctx->saved_data;
    const at::Tensor out_shapes = saved.at("out_shapes").toTensor();
    std::vector<c10::SymInt> out_lengths = saved.at("out_lengths").toSymIntVector();
    std::vector<int64_t> declared;
    for (size_t j = 0; j < out_lengths.size(); ++j) {
      if (out_lengths[j].maybe_as_int() == -1) {  // a None gradient: its width is in out_shapes
        if (declared.empty()) {
          const at::Tensor host = out_shapes.to(at::kCPU, at::kLong).contiguous();
          declared.assign(
              host.const_data_ptr<int64_t>(), host.const_data_ptr<int64_t>() + host.numel());
        }
        out_lengths[j] = declared[j];
      }
    }
    const std::vector<c10::SymInt> in_lengths = saved.at("in_lengths").toSymIntVector();
    const c10::SymInt batch = saved.at("batch_size").toSymInt();
    at::TensorOptions options;  // of a defined one: autograd calls this only if there is one
    for (const at::Tensor& g : grad_grads) {
      if (g.defined()) options = g.options();
    }
    std::vector<at::Tensor> inputs;
    for (size_t i = 0; i < grad_grads.size(); ++i) {
      const at::Tensor& g = grad_grads[i];
      inputs.push_back(g.defined() ? g : at::zeros_symint({batch, in_lengths[i]}, options));
    }
    const variable_list all = call_permute(
        inputs, saved.at("permutes").toTensor(), saved.at("in_shapes").toTensor(), out_shapes,
        out_lengths, saved.at("grad_dtype").toScalarType(), /*cast=*/true);
    variable_list grads;
    for (const c10::IValue& j : saved.at("positions").toListRef()) grads.push_back(all[j.toInt()]);
    // positions, n_out, permutes, in_shapes, out_shapes, in_lengths, batch_size, dtype
    return with_no_grads_for_rest(std::move(grads), 8);
  }
};

// ---- forward-mode AD (torch.autograd.forward_ad, torch.func.jvp) --------------------------
// The regroup is linear: the outputs' tangents are the same op applied to the inputs'
// tangents (zeros for an input without one). The primals and the tangents each go
// through the dispatcher, autograd included, so both can be differentiated further.

bool has_tangent(const at::Tensor& t) {
  return t.defined() && t._fw_grad(/*level=*/0).defined();
}

// The inputs without their tangents (a view that keeps their autograd history), and the
// tangents, zeros where an input has none.
std::pair<std::vector<at::Tensor>, std::vector<at::Tensor>> split_duals(at::TensorList duals) {
  std::vector<at::Tensor> primals, tangents;
  for (const at::Tensor& t : duals) {
    at::Tensor tangent = t._fw_grad(/*level=*/0);
    primals.push_back(tangent.defined() ? t._fw_primal(/*level=*/0) : t);
    tangents.push_back(tangent.defined() ? std::move(tangent) : at::zeros_like(t));
  }
  return {std::move(primals), std::move(tangents)};
}

std::vector<at::Tensor> with_tangents(
    std::vector<at::Tensor> outs, const std::vector<at::Tensor>& tangents) {
  for (size_t j = 0; j < outs.size(); ++j) {
    outs[j]._set_fw_grad(tangents[j], /*level=*/0, /*is_inplace_op=*/false);
  }
  return outs;
}

// Whether a call must be recorded for autograd. When not (torch.no_grad(), a backward
// pass without create_graph, inputs that need no gradient) the kernels below autograd
// run directly: building and dropping a graph node costs more than the copy of a
// small serving batch. Tangents are looked for first: that path never drops one.
bool records_grad(at::TensorList tensors) {
  return at::GradMode::is_enabled() &&
         std::any_of(tensors.begin(), tensors.end(), [](const at::Tensor& t) {
           return t.defined() && t.requires_grad();
         });
}

std::vector<at::Tensor> permute_autograd(
    at::TensorList pooled_embs,
    const at::Tensor& permutes,
    const at::Tensor& in_shapes,
    const at::Tensor& out_shapes,
    c10::SymIntArrayRef out_lengths,
    std::optional<c10::ScalarType> dtype,
    bool cast) {
  if (std::any_of(pooled_embs.begin(), pooled_embs.end(), has_tangent)) {
    const auto [primals, tangents] = split_duals(pooled_embs);
    std::vector<at::Tensor> outs =
        call_permute(primals, permutes, in_shapes, out_shapes, out_lengths, dtype, cast);
    return with_tangents(
        std::move(outs),
        call_permute(tangents, permutes, in_shapes, out_shapes, out_lengths, dtype, cast));
  }
  if (!records_grad(pooled_embs)) {
    at::AutoDispatchBelowADInplaceOrView guard;
    return call_permute(pooled_embs, permutes, in_shapes, out_shapes, out_lengths, dtype, cast);
  }
  return PermuteFunction::apply(
      pooled_embs, permutes, in_shapes, out_shapes, out_lengths, dtype, cast);
}

std::vector<at::Tensor> permute_multi_embedding_autograd(
    at::TensorList pooled_embs,
    const at::Tensor& permutes,
    const at::Tensor& in_shapes,
    const at::Tensor& out_shapes,
    c10::SymIntArrayRef out_lengths) {
  return permute_autograd(
      pooled_embs, permutes, in_shapes, out_shapes, out_lengths, std::nullopt, false);
}

std::vector<at::Tensor> permute_multi_embedding_to_autograd(
    at::TensorList pooled_embs,
    const at::Tensor& permutes,
    const at::Tensor& in_shapes,
    const at::Tensor& out_shapes,
    c10::SymIntArrayRef out_lengths,
    std::optional<c10::ScalarType> dtype) {
  return permute_autograd(pooled_embs, permutes, in_shapes, out_shapes, out_lengths, dtype, true);
}

std::vector<at::Tensor> permute_multi_embedding_backward_autograd(
    const OptionalTensors& grad_outputs,
    const at::Tensor& permutes,
    const at::Tensor& in_shapes,
    const at::Tensor& out_shapes,
    c10::SymIntArrayRef in_lengths,
    c10::SymInt batch_size,
    c10::ScalarType dtype) {
  if (std::any_of(grad_outputs.begin(), grad_outputs.end(), [](const std::optional<at::Tensor>& g) {
        return g.has_value() && has_tangent(*g);
      })) {
    // A gradient without a tangent has a zero one: None.
    OptionalTensors primals, tangents;
    for (size_t j = 0; j < grad_outputs.size(); ++j) {
      const std::optional<at::Tensor> g = grad_outputs[j];
      if (g.has_value() && has_tangent(*g)) {
        primals.push_back(g->_fw_primal(/*level=*/0));
        tangents.push_back(g->_fw_grad(/*level=*/0));
      } else {
        primals.push_back(g);
        tangents.push_back(std::nullopt);
      }
    }
    std::vector<at::Tensor> outs =
        call_backward(primals, permutes, in_shapes, out_shapes, in_lengths, batch_size, dtype);
    return with_tangents(
        std::move(outs),
        call_backward(
            tangents, permutes, in_shapes, out_shapes, in_lengths, std::move(batch_size), dtype));
  }
  const bool record =
      at::GradMode::is_enabled() &&
      std::any_of(grad_outputs.begin(), grad_outputs.end(), [](const std::optional<at::Tensor>& g) {
        return g.has_value() && g->defined() && g->requires_grad();
      });
  if (!record) {
    at::AutoDispatchBelowADInplaceOrView guard;
    return call_backward(
        grad_outputs, permutes, in_shapes, out_shapes, in_lengths, std::move(batch_size), dtype);
  }
  std::vector<at::Tensor> defined;
  std::vector<int64_t> positions;
  for (size_t j = 0; j < grad_outputs.size(); ++j) {
    const std::optional<at::Tensor> g = grad_outputs[j];
    if (g.has_value() && g->defined()) {
      defined.push_back(*g);
      positions.push_back(static_cast<int64_t>(j));
    }
  }
  return PermuteBackwardFunction::apply(
      at::TensorList(defined), positions, static_cast<int64_t>(grad_outputs.size()), permutes,
      in_shapes, out_shapes, in_lengths, std::move(batch_size), dtype);
}

// permute_multi_embedding_into records no gradients and propagates no tangents: under
// grad mode it refuses tensors that require grad (a leaf as torch refuses it; otherwise
// the outs would keep a history that no longer computes them), and it refuses tangents.
void permute_multi_embedding_into_autograd(
    at::TensorList pooled_embs,
    const at::Tensor& permutes,
    const at::Tensor& in_shapes,
    const at::Tensor& out_shapes,
    at::TensorList outs) {
  constexpr const char* op = "kt_regroup.permute_multi_embedding_into";
  constexpr const char* use =
      "call it under torch.no_grad() or torch.inference_mode(), or use "
      "permute_multi_embedding";
  const std::pair<const char*, at::TensorList> lists[] = {
      {"outs", outs}, {"pooled_embs", pooled_embs}};
  for (const auto& [name, tensors] : lists) {
    for (size_t i = 0; i < tensors.size(); ++i) {
      TORCH_CHECK(
          !has_tangent(tensors[i]), op, ": ", name, "[", i,
          "] has a forward-mode AD tangent, which this op does not propagate; use "
          "permute_multi_embedding");
    }
  }
  if (at::GradMode::is_enabled()) {
    const auto requires_grad = [](const at::Tensor& t) { return t.requires_grad(); };
    const bool any_requires_grad =
        std::any_of(outs.begin(), outs.end(), requires_grad) ||
        std::any_of(pooled_embs.begin(), pooled_embs.end(), requires_grad);
    using torch::autograd::can_mutate_inplace_result;
    for (size_t j = 0; j < outs.size(); ++j) {
      switch (torch::autograd::can_mutate_inplace(outs[j], any_requires_grad)) {
        case can_mutate_inplace_result::success:
          break;
        case can_mutate_inplace_result::non_default_backward_view:  // torch's own error
          torch::autograd::handle_view_on_rebase(
              torch::autograd::impl::get_view_autograd_meta(outs[j]));
          break;
        case can_mutate_inplace_result::view_of_leaf:
          TORCH_CHECK(
              false, op, ": outs[", j,
              "]: a view of a leaf Variable that requires grad is "
              "being used in an in-place operation.");
        case can_mutate_inplace_result::is_leaf:
          TORCH_CHECK(
              false, op, ": outs[", j,
              "]: a leaf Variable that requires grad is being used "
              "in an in-place operation.");
      }
    }
    for (const auto& [name, tensors] : lists) {
      for (size_t i = 0; i < tensors.size(); ++i) {
        TORCH_CHECK(
            !tensors[i].requires_grad(), op, ": ", name, "[", i,
            "] requires grad, but this op records no gradients; ", use);
      }
    }
  }
  at::AutoDispatchBelowAutograd guard;
  call_into(pooled_embs, permutes, in_shapes, out_shapes, outs);
}

// The writes bump each output's version counter, as every in-place op does: a tensor
// that autograd saved and that is then overwritten makes its backward raise.
void permute_multi_embedding_into_ad_inplace_or_view(
    at::TensorList pooled_embs,
    const at::Tensor& permutes,
    const at::Tensor& in_shapes,
    const at::Tensor& out_shapes,
    at::TensorList outs) {
  {
    at::AutoDispatchBelowADInplaceOrView guard;
    call_into(pooled_embs, permutes, in_shapes, out_shapes, outs);
  }
  for (const at::Tensor& t : outs) torch::autograd::increment_version(t);
}

}  // namespace
}  // namespace kt_regroup

TORCH_LIBRARY_IMPL(kt_regroup, ADInplaceOrView, m) {
  m.impl(
      "permute_multi_embedding_into",
      TORCH_FN(kt_regroup::permute_multi_embedding_into_ad_inplace_or_view));
}

TORCH_LIBRARY_IMPL(kt_regroup, Autograd, m) {
  m.impl(
      "permute_multi_embedding_into", TORCH_FN(kt_regroup::permute_multi_embedding_into_autograd));
  m.impl("permute_multi_embedding", TORCH_FN(kt_regroup::permute_multi_embedding_autograd));
  m.impl("permute_multi_embedding_to", TORCH_FN(kt_regroup::permute_multi_embedding_to_autograd));
  m.impl(
      "permute_multi_embedding_backward",
      TORCH_FN(kt_regroup::permute_multi_embedding_backward_autograd));
}
