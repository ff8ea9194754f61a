"""``torch.ops.kt_regroup``: schemas, fake kernels, autograd and the portable kernels.

The schemas are FBGEMM's, so each op is a drop-in replacement for its
``torch.ops.fbgemm`` namesake. They are defined here, in Python, so the ops and
their fake kernels exist even when no compiled code is loaded; compiled code
(``kernels/cpu.py``) only adds device kernels (and, when it has them, a C++ autograd
kernel that replaces the Python one registered here).

Ops:

* ``permute_multi_embedding(Tensor[] pooled_embs, Tensor permutes, Tensor in_shapes,
  Tensor out_shapes, SymInt[] out_lengths) -> Tensor[]``
* ``permute_multi_embedding_backward(Tensor?[] grad_outputs, Tensor permutes,
  Tensor in_shapes, Tensor out_shapes, SymInt[] in_lengths, SymInt batch_size,
  ScalarType dtype) -> Tensor[]`` (the backward, an op of its own so compile and
  export see it)
* ``kt_regroup_arguments(Tensor embs, str[][] keys, int[][] lengths, str[][] groups)
  -> (Tensor, Tensor, Tensor, int[])``
* ``regroup_keyed_tensor(Tensor[] pooled_embs, str[][] keys, int[][] lengths,
  str[][] groups) -> Tensor[]``
"""

from __future__ import annotations

import logging
import os
from typing import Dict, List, Sequence, Tuple

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode

from kt_regroup.kernels.reference import (
    permute_multi_embedding_backward_reference,
    permute_multi_embedding_reference,
)
from kt_regroup.kernels.validation import check_metadata, check_tensor_list
from kt_regroup.plan import PERMUTE_COLUMNS, RegroupPlan

logger = logging.getLogger(__name__)

NAMESPACE = "kt_regroup"
BACKEND_ENV = "KT_REGROUP_BACKEND"  # "auto" (default), "reference" or "cpp"

_lib = torch.library.Library(NAMESPACE, "DEF")
_lib.define(
    "permute_multi_embedding(Tensor[] pooled_embs, Tensor permutes, Tensor in_shapes, "
    "Tensor out_shapes, SymInt[] out_lengths) -> Tensor[]"
)
_lib.define(
    "permute_multi_embedding_backward(Tensor?[] grad_outputs, Tensor permutes, "
    "Tensor in_shapes, Tensor out_shapes, SymInt[] in_lengths, SymInt batch_size, "
    "ScalarType dtype) -> Tensor[]"
)
_lib.define(
    "kt_regroup_arguments(Tensor embs, str[][] keys, int[][] lengths, str[][] groups) "
    "-> (Tensor, Tensor, Tensor, int[])"
)
_lib.define(
    "regroup_keyed_tensor(Tensor[] pooled_embs, str[][] keys, int[][] lengths, "
    "str[][] groups) -> Tensor[]"
)

# --- portable kernels: every device; a device-specific kernel (CPU, CUDA) overrides them.
_lib.impl("permute_multi_embedding", permute_multi_embedding_reference, "CompositeExplicitAutograd")
_lib.impl(
    "permute_multi_embedding_backward",
    permute_multi_embedding_backward_reference,
    "CompositeExplicitAutograd",
)


# --- fake kernels: output sizes come from the SymInt arguments, never from data.
def _check_not_meta_only(op, metadata, name, data):
    # Metadata on "meta" next to real data would dispatch here, to the fake kernel, and
    # return uninitialised real tensors: refuse it.
    if data.device.type == "meta":
        return
    for meta_name, t in zip(("permutes", "in_shapes", "out_shapes"), metadata):
        if t.device.type == "meta":
            raise ValueError(
                f"kt_regroup.{op}: {meta_name} is on meta but {name} is on {data.device}; "
                "metadata and data must be on real devices together"
            )


@torch.library.register_fake(f"{NAMESPACE}::permute_multi_embedding", lib=_lib)
def _permute_multi_embedding_fake(pooled_embs, permutes, in_shapes, out_shapes, out_lengths):
    op = "permute_multi_embedding"
    check_tensor_list(op, "pooled_embs", pooled_embs)
    check_metadata(op, permutes, in_shapes, out_shapes, len(pooled_embs), out_lengths)
    first = pooled_embs[0]
    _check_not_meta_only(op, (permutes, in_shapes, out_shapes), "pooled_embs[0]", first)
    return [first.new_empty(first.size(0), n) for n in out_lengths]


@torch.library.register_fake(f"{NAMESPACE}::permute_multi_embedding_backward", lib=_lib)
def _permute_multi_embedding_backward_fake(
    grad_outputs, permutes, in_shapes, out_shapes, in_lengths, batch_size, dtype
):
    op = "permute_multi_embedding_backward"
    check_metadata(op, permutes, in_shapes, out_shapes, len(in_lengths), [0] * len(grad_outputs))
    defined = [g for g in grad_outputs if g is not None]
    if defined:
        j = next(j for j, g in enumerate(grad_outputs) if g is not None)
        _check_not_meta_only(op, (permutes, in_shapes, out_shapes), f"grad_outputs[{j}]", defined[0])
    device = defined[0].device if defined else permutes.device
    return [torch.empty(batch_size, n, dtype=dtype, device=device) for n in in_lengths]


# --- autograd: the backward is itself an op.
# Shared by permute_multi_embedding and permute_multi_embedding_to (one extra argument,
# the output dtype; gradients still come back in the input dtype).
def _setup_context(ctx, inputs, output):
    pooled_embs, permutes, in_shapes, out_shapes = inputs[:4]
    # Index tensors, never modified in place: kept as attributes rather than saved, so
    # plan tensors cached under torch.inference_mode() still work with autograd.
    ctx.plan_tensors = (permutes, in_shapes, out_shapes)
    ctx.in_lengths = [t.size(1) for t in pooled_embs]
    ctx.batch_size = pooled_embs[0].size(0)
    ctx.dtype = pooled_embs[0].dtype
    ctx.n_inputs = len(inputs)


def _backward(ctx, grads):
    permutes, in_shapes, out_shapes = ctx.plan_tensors
    grad_inputs = torch.ops.kt_regroup.permute_multi_embedding_backward(
        list(grads), permutes, in_shapes, out_shapes, ctx.in_lengths, ctx.batch_size, ctx.dtype
    )
    return (grad_inputs,) + (None,) * (ctx.n_inputs - 1)


# --- plan ops -----------------------------------------------------------------------------


def _layout_key(keys, lengths, groups) -> Tuple:
    return (
        tuple(tuple(k) for k in keys),
        tuple(tuple(int(w) for w in t) for t in lengths),
        tuple(tuple(g) for g in groups),
    )


# A plain dict rather than functools.lru_cache: dynamo traces it without a warning.
_plans: Dict[Tuple, RegroupPlan] = {}
_MAX_PLANS = 64


def get_plan(
    keys: Sequence[Sequence[str]],
    lengths: Sequence[Sequence[int]],
    groups: Sequence[Sequence[str]],
) -> RegroupPlan:
    """The :class:`RegroupPlan` of a layout, memoised (the 64 newest layouts)."""
    try:
        layout = _layout_key(keys, lengths, groups)
        plan = _plans.get(layout)
    except TypeError:  # unhashable junk in the layout: let the plan explain what is wrong
        return RegroupPlan.build(keys, lengths, groups)
    if plan is None:
        plan = RegroupPlan.build(*layout)
        if len(_plans) >= _MAX_PLANS:
            del _plans[next(iter(_plans))]
        _plans[layout] = plan
    return plan


_plan_tensors: Dict[Tuple[int, str], Tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}


def _plan_tensors_on(plan: RegroupPlan, device: torch.device):
    # Cache real tensors only in plain eager mode; under fake/proxy modes (compile,
    # export) they are made afresh so the tracer owns them.
    if _get_current_dispatch_mode() is not None or torch.compiler.is_compiling():
        return plan.tensors(device)
    key = (id(plan), str(device))
    hit = _plan_tensors.get(key)
    if hit is None:
        if len(_plan_tensors) > 256:
            _plan_tensors.clear()
        hit = _plan_tensors[key] = plan.tensors(device)
    return hit


def _kt_regroup_arguments_impl(embs, keys, lengths, groups):
    plan = get_plan(keys, lengths, groups)
    permutes, in_shapes, out_shapes = plan.tensors(embs.device, coalesced=False)
    return permutes, in_shapes, out_shapes, list(plan.out_lengths)


_lib.impl("kt_regroup_arguments", _kt_regroup_arguments_impl, "CompositeExplicitAutograd")


@torch.library.register_fake(f"{NAMESPACE}::kt_regroup_arguments", lib=_lib)
def _kt_regroup_arguments_fake(embs, keys, lengths, groups):
    plan = get_plan(keys, lengths, groups)
    dev = embs.device
    return (
        torch.empty(len(plan.rows), PERMUTE_COLUMNS, dtype=torch.int32, device=dev),
        torch.empty(len(plan.in_lengths), dtype=torch.int32, device=dev),
        torch.empty(len(plan.out_lengths), dtype=torch.int32, device=dev),
        list(plan.out_lengths),
    )


def _regroup_keyed_tensor_impl(pooled_embs, keys, lengths, groups):
    if len(pooled_embs) != len(keys):
        raise ValueError(
            f"kt_regroup.regroup_keyed_tensor: {len(pooled_embs)} tensors but keys for "
            f"{len(keys)}"
        )
    plan = get_plan(keys, lengths, groups)
    permutes, in_shapes, out_shapes = _plan_tensors_on(plan, pooled_embs[0].device)
    return torch.ops.kt_regroup.permute_multi_embedding(
        pooled_embs, permutes, in_shapes, out_shapes, plan.out_lengths
    )


# Composite: decomposes into permute_multi_embedding, whose autograd and kernels apply.
_lib.impl("regroup_keyed_tensor", _regroup_keyed_tensor_impl, "CompositeImplicitAutograd")


# --- compiled kernels -------------------------------------------------------------------------


def requested_backend() -> str:
    """The backend asked for by ``KT_REGROUP_BACKEND`` (``auto`` when unset)."""
    value = os.environ.get(BACKEND_ENV, "auto").strip().lower() or "auto"
    if value not in ("auto", "reference", "cpp"):
        raise ValueError(f"{BACKEND_ENV}={value!r}: expected one of auto, reference, cpp")
    return value


def _load_compiled_kernels() -> bool:
    if requested_backend() == "reference":
        return False
    try:
        from kt_regroup.kernels import cpu
    except ImportError:  # the module is not there yet in this build
        return False
    return cpu.load(required=requested_backend() == "cpp")


NATIVE_CPU = _load_compiled_kernels()


def _has_kernel(op: str, key: str) -> bool:
    return torch._C._dispatch_has_kernel_for_dispatch_key(f"{NAMESPACE}::{op}", key)


if not _has_kernel("permute_multi_embedding", "Autograd"):
    torch.library.register_autograd(
        f"{NAMESPACE}::permute_multi_embedding", _backward, setup_context=_setup_context, lib=_lib
    )


def backend(device: torch.device | str = "cpu") -> str:
    """Which kernel serves ``permute_multi_embedding`` on ``device``: ``cpp`` or ``reference``."""
    key = {"cpu": "CPU", "cuda": "CUDA"}.get(torch.device(device).type)
    if key is not None and _has_kernel("permute_multi_embedding", key):
        return "cpp"
    return "reference"


def permute_multi_embedding(
    pooled_embs: List[torch.Tensor],
    permutes: torch.Tensor,
    in_shapes: torch.Tensor,
    out_shapes: torch.Tensor,
    out_lengths: List[int],
) -> List[torch.Tensor]:
    """Copies column segments of ``pooled_embs`` into fresh outputs (see module docs)."""
    return torch.ops.kt_regroup.permute_multi_embedding(
        pooled_embs, permutes, in_shapes, out_shapes, out_lengths
    )


def kt_regroup_arguments(
    embs: torch.Tensor,
    keys: List[List[str]],
    lengths: List[List[int]],
    groups: List[List[str]],
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, List[int]]:
    """``(permutes, in_shapes, out_shapes, out_lengths)`` for a layout, torchrec's format."""
    return torch.ops.kt_regroup.kt_regroup_arguments(embs, keys, lengths, groups)


def regroup_keyed_tensor(
    pooled_embs: List[torch.Tensor],
    keys: List[List[str]],
    lengths: List[List[int]],
    groups: List[List[str]],
) -> List[torch.Tensor]:
    """Regroups the column blocks of ``pooled_embs`` into one tensor per group.

    Example::

        >>> a, b = torch.randn(2, 5), torch.randn(2, 4)
        >>> outs = regroup_keyed_tensor([a, b], [["x", "y"], ["z"]], [[2, 3], [4]],
        ...                             [["z", "x"], ["y"]])
        >>> [o.shape[1] for o in outs]
        [6, 3]
    """
    return torch.ops.kt_regroup.regroup_keyed_tensor(pooled_embs, keys, lengths, groups)


__all__ = [
    "BACKEND_ENV",
    "NATIVE_CPU",
    "backend",
    "get_plan",
    "kt_regroup_arguments",
    "permute_multi_embedding",
    "regroup_keyed_tensor",
    "requested_backend",
]


# --- fused cast and preallocated outputs (owner: native CPU kernel) -----------------------
# Two ops the C++ CPU kernel serves natively (kt_regroup/csrc); the Python kernels below
# are their portable fallback and test oracle.
#
# * permute_multi_embedding_to: the regroup with the outputs cast to ``dtype`` in the same
#   pass (read fp32, write bf16), where casting every input first would read and write
#   everything twice. ``dtype=None`` keeps the input dtype. Gradients come back in the
#   input dtype.
# * permute_multi_embedding_into: writes into caller-owned outputs (inference only, no
#   autograd). ``outs[j]`` must be ``[batch, out_shapes[j]]`` with unit column stride, in
#   the inputs' dtype, and must not overlap the inputs; its contents are overwritten
#   (columns no row writes become zeros).

_lib.define(
    "permute_multi_embedding_to(Tensor[] pooled_embs, Tensor permutes, Tensor in_shapes, "
    "Tensor out_shapes, SymInt[] out_lengths, ScalarType? dtype=None) -> Tensor[]"
)
_lib.define(
    "permute_multi_embedding_into(Tensor[] pooled_embs, Tensor permutes, Tensor in_shapes, "
    "Tensor out_shapes, Tensor(a!)[] outs) -> ()"
)


def _permute_multi_embedding_to_reference(
    pooled_embs, permutes, in_shapes, out_shapes, out_lengths, dtype=None
):
    from kt_regroup.kernels.validation import check_permute_rows

    check_permute_rows(
        "permute_multi_embedding_to", pooled_embs, permutes, in_shapes, out_shapes, out_lengths
    )
    outs = permute_multi_embedding_reference(
        pooled_embs, permutes, in_shapes, out_shapes, out_lengths
    )
    return outs if dtype is None else [o.to(dtype) for o in outs]


def _check_into_outs(pooled_embs, permutes, in_shapes, out_shapes, outs) -> List[int]:
    from kt_regroup.kernels.validation import check_permute_rows

    op = "permute_multi_embedding_into"
    for j, o in enumerate(outs):
        if o.dim() != 2:
            raise ValueError(
                f"kt_regroup.{op}: outs[{j}] must be 2-D [batch, width], got shape "
                f"{tuple(o.shape)}"
            )
    out_lengths = [int(o.size(1)) for o in outs]
    check_permute_rows(op, pooled_embs, permutes, in_shapes, out_shapes, out_lengths)
    first = pooled_embs[0]
    for j, o in enumerate(outs):
        if o.size(0) != first.size(0):
            raise ValueError(
                f"kt_regroup.{op}: outs[{j}] must have shape ({first.size(0)}, "
                f"{out_lengths[j]}), got shape {tuple(o.shape)}"
            )
        if o.dtype != first.dtype:
            raise TypeError(
                f"kt_regroup.{op}: outs[{j}] is {o.dtype} but pooled_embs[0] is {first.dtype}"
            )
        if o.device != first.device:
            raise ValueError(
                f"kt_regroup.{op}: outs[{j}] is on {o.device} but pooled_embs[0] is on "
                f"{first.device}"
            )
        if o.size(1) > 1 and o.stride(1) != 1:
            raise ValueError(
                f"kt_regroup.{op}: outs[{j}] must have unit column stride, got strides "
                f"({o.stride(0)}, {o.stride(1)})"
            )
    return out_lengths


def _permute_multi_embedding_into_reference(pooled_embs, permutes, in_shapes, out_shapes, outs):
    out_lengths = _check_into_outs(pooled_embs, permutes, in_shapes, out_shapes, outs)
    results = permute_multi_embedding_reference(
        pooled_embs, permutes, in_shapes, out_shapes, out_lengths
    )
    for o, r in zip(outs, results):
        o.copy_(r)


_lib.impl(
    "permute_multi_embedding_to", _permute_multi_embedding_to_reference, "CompositeExplicitAutograd"
)
_lib.impl(
    "permute_multi_embedding_into",
    _permute_multi_embedding_into_reference,
    "CompositeExplicitAutograd",
)


@torch.library.register_fake(f"{NAMESPACE}::permute_multi_embedding_to", lib=_lib)
def _permute_multi_embedding_to_fake(
    pooled_embs, permutes, in_shapes, out_shapes, out_lengths, dtype=None
):
    op = "permute_multi_embedding_to"
    check_tensor_list(op, "pooled_embs", pooled_embs)
    check_metadata(op, permutes, in_shapes, out_shapes, len(pooled_embs), out_lengths)
    first = pooled_embs[0]
    _check_not_meta_only(op, (permutes, in_shapes, out_shapes), "pooled_embs[0]", first)
    return [first.new_empty(first.size(0), n, dtype=dtype or first.dtype) for n in out_lengths]


@torch.library.register_fake(f"{NAMESPACE}::permute_multi_embedding_into", lib=_lib)
def _permute_multi_embedding_into_fake(pooled_embs, permutes, in_shapes, out_shapes, outs):
    op = "permute_multi_embedding_into"
    check_tensor_list(op, "pooled_embs", pooled_embs)
    check_metadata(
        op, permutes, in_shapes, out_shapes, len(pooled_embs), [o.size(-1) for o in outs]
    )
    _check_not_meta_only(op, (permutes, in_shapes, out_shapes), "pooled_embs[0]", pooled_embs[0])


torch.library.register_autograd(
    f"{NAMESPACE}::permute_multi_embedding_to",
    _backward,
    setup_context=_setup_context,
    lib=_lib,
)


def permute_multi_embedding_to(
    pooled_embs: List[torch.Tensor],
    permutes: torch.Tensor,
    in_shapes: torch.Tensor,
    out_shapes: torch.Tensor,
    out_lengths: List[int],
    dtype: torch.dtype | None = None,
) -> List[torch.Tensor]:
    """:func:`permute_multi_embedding` with the outputs cast to ``dtype`` in the same pass.

    Example::

        >>> x = torch.randn(2, 4)
        >>> p, i, o = RegroupPlan.build([["a", "b"]], [[1, 3]], [["b"]]).tensors()
        >>> permute_multi_embedding_to([x], p, i, o, [3], torch.bfloat16)[0].dtype
        torch.bfloat16
    """
    return torch.ops.kt_regroup.permute_multi_embedding_to(
        pooled_embs, permutes, in_shapes, out_shapes, out_lengths, dtype
    )


def permute_multi_embedding_into(
    pooled_embs: List[torch.Tensor],
    permutes: torch.Tensor,
    in_shapes: torch.Tensor,
    out_shapes: torch.Tensor,
    outs: List[torch.Tensor],
) -> None:
    """Writes the regroup into caller-owned ``outs`` (inference; no autograd).

    ``outs`` alias nothing the caller still reads: each is overwritten in full, and must
    not overlap ``pooled_embs``.
    """
    torch.ops.kt_regroup.permute_multi_embedding_into(
        pooled_embs, permutes, in_shapes, out_shapes, outs
    )


__all__ += ["permute_multi_embedding_into", "permute_multi_embedding_to"]
