"""The providers compared by the benchmark: one callable per way of regrouping.

Every provider gets the same inputs and returns the same list of group tensors, so
the harness can time them round-robin and check each one's answer. In
forward+backward mode a provider also runs the backward of its own outputs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, List, Optional

import torch

from kt_regroup.bench.layout import BenchLayout

__all__ = ["Cell", "Provider", "make_providers", "FORWARD", "FORWARD_BACKWARD"]

FORWARD = "forward"
FORWARD_BACKWARD = "forward+backward"


class Cell:
    """The inputs shared by every provider of one (layout, mode) cell."""

    def __init__(
        self,
        layout: BenchLayout,
        device: torch.device,
        mode: str,
        seed: int = 0,
        requires_grad: Optional[bool] = None,
    ):
        from torchrec.sparse.jagged_tensor import _regroup_keyed_tensors

        self.layout = layout
        self.device = device
        self.mode = mode
        self.backward = mode == FORWARD_BACKWARD
        if requires_grad is None:
            requires_grad = self.backward
        self.kts = layout.make_inputs(device, requires_grad=requires_grad, seed=seed)
        self.values = [kt.values() for kt in self.kts]
        self.group_names = [f"group_{i}" for i in range(len(layout.groups))]
        with torch.no_grad():
            # torchrec's plain cat path is the oracle: independent of kt_regroup's code.
            self.expected = [t.contiguous() for t in _regroup_keyed_tensors(self.kts, layout.groups)]
        # Backward seeds: the expected outputs double as (random) output gradients.
        self.grad_outputs = self.expected

    def reset_grads(self) -> None:
        for v in self.values:
            v.grad = None

    def run_backward(self, outs: List[torch.Tensor]) -> None:
        torch.autograd.backward(outs, self.grad_outputs)


@dataclass
class Provider:
    """``make(cell)`` returns the zero-argument callable that is timed."""

    name: str
    family: str  # kt_regroup | torchrec | fbgemm | limit
    make: Callable[[Cell], Callable[[], List[torch.Tensor]]]
    note: str = ""
    # Limits emulate the backward themselves; other providers get cell.run_backward.
    does_own_backward: bool = False
    # No autograd (writes into caller-owned buffers): forward cells and inference rows only.
    inference_only: bool = False


def _with_backward(cell: Cell, forward: Callable[[], List[torch.Tensor]]):
    if not cell.backward:
        return forward

    def call() -> List[torch.Tensor]:
        outs = forward()
        cell.run_backward(outs)
        return outs

    return call


# --- kt_regroup ------------------------------------------------------------------------------


def _kt_module(cell: Cell):
    import kt_regroup

    module = kt_regroup.KTRegroupAsDict(cell.layout.groups, cell.group_names)
    names = cell.group_names

    def forward() -> List[torch.Tensor]:
        out = module(cell.kts)
        return [out[n] for n in names]

    return _with_backward(cell, forward)


def _kt_functional(cell: Cell):
    import kt_regroup

    groups = cell.layout.groups
    return _with_backward(cell, lambda: kt_regroup.regroup(cell.kts, groups))


def _kt_op(cell: Cell):
    import kt_regroup

    plan = kt_regroup.get_plan(cell.layout.keys, cell.layout.lengths, cell.layout.groups)
    permutes, in_shapes, out_shapes = plan.tensors(cell.device)
    out_lengths = list(plan.out_lengths)
    op = torch.ops.kt_regroup.permute_multi_embedding
    values = cell.values
    return _with_backward(cell, lambda: op(values, permutes, in_shapes, out_shapes, out_lengths))


def _kt_into(cell: Cell):
    """Inference into preallocated outputs, which are reused by every call."""
    import kt_regroup

    plan = kt_regroup.get_plan(cell.layout.keys, cell.layout.lengths, cell.layout.groups)
    permutes, in_shapes, out_shapes = plan.tensors(cell.device)
    outs = [torch.zeros_like(t) for t in cell.expected]  # pages touched outside the timing
    op = torch.ops.kt_regroup.permute_multi_embedding_into
    values = [v.detach() for v in cell.values]

    def call() -> List[torch.Tensor]:
        op(values, permutes, in_shapes, out_shapes, outs)
        return outs

    return call


def _kt_into_available() -> bool:
    try:
        return hasattr(torch.ops.kt_regroup, "permute_multi_embedding_into")
    except (AttributeError, RuntimeError):
        return False


def _kt_reference(cell: Cell):
    """The portable kernel called directly (it has no autograd of its own)."""
    import kt_regroup
    from kt_regroup.kernels.reference import (
        permute_multi_embedding_backward_reference,
        permute_multi_embedding_reference,
    )

    plan = kt_regroup.get_plan(cell.layout.keys, cell.layout.lengths, cell.layout.groups)
    permutes, in_shapes, out_shapes = plan.tensors(cell.device)
    out_lengths = list(plan.out_lengths)
    in_lengths = [v.size(1) for v in cell.values]
    values = [v.detach() for v in cell.values]
    batch, dtype = cell.layout.batch_size, cell.layout.dtype

    def call() -> List[torch.Tensor]:
        with torch.no_grad():
            outs = permute_multi_embedding_reference(
                values, permutes, in_shapes, out_shapes, out_lengths
            )
            if cell.backward:
                permute_multi_embedding_backward_reference(
                    cell.grad_outputs, permutes, in_shapes, out_shapes, in_lengths, batch, dtype
                )
        return outs

    return call


# --- torchrec / FBGEMM -----------------------------------------------------------------------


def _tr_regroup_keyed_tensors(cell: Cell):
    from torchrec.sparse.jagged_tensor import _regroup_keyed_tensors

    groups = cell.layout.groups
    return _with_backward(cell, lambda: _regroup_keyed_tensors(cell.kts, groups))


def _tr_keyed_tensor_regroup(cell: Cell):
    from torchrec.sparse.jagged_tensor import KeyedTensor

    groups = cell.layout.groups
    return _with_backward(cell, lambda: KeyedTensor.regroup(cell.kts, groups))


def _tr_module(cell: Cell):
    from torchrec.modules.regroup import KTRegroupAsDict

    module = KTRegroupAsDict(cell.layout.groups, cell.group_names)
    names = cell.group_names

    def forward() -> List[torch.Tensor]:
        out = module(cell.kts)
        return [out[n] for n in names]

    return _with_backward(cell, forward)


def _fbgemm_permute_multi_embedding(cell: Cell):
    from torchrec.sparse.jagged_tensor import permute_multi_embedding

    groups = cell.layout.groups
    return _with_backward(cell, lambda: permute_multi_embedding(cell.kts, groups))


def _fbgemm_regroup_keyed_tensor(cell: Cell):
    from torchrec.sparse.jagged_tensor import regroup_kts

    groups = cell.layout.groups
    return _with_backward(cell, lambda: regroup_kts(cell.kts, groups))


# --- the copy limit ----------------------------------------------------------------------------


def _limit_clone(cell: Cell):
    """A fresh copy of the output bytes (+ of the input bytes: the input gradient)."""
    src_out = cell.expected
    src_in = [v.detach() for v in cell.values]

    def call() -> List[torch.Tensor]:
        outs = [t.clone() for t in src_out]
        if cell.backward:
            [t.clone() for t in src_in]
        return outs

    return call


def _limit_copy(cell: Cell):
    """The same bytes copied into buffers that already exist (no allocation)."""
    src_out = cell.expected
    dst_out = [torch.empty_like(t) for t in src_out]
    for t in dst_out:
        t.fill_(0)  # touch the pages once, outside the timing
    src_in = [v.detach() for v in cell.values]
    dst_in = [torch.zeros_like(t) for t in src_in] if cell.backward else []

    def call() -> List[torch.Tensor]:
        for d, s in zip(dst_out, src_out):
            d.copy_(s)
        for d, s in zip(dst_in, src_in):
            d.copy_(s)
        return dst_out

    return call


def _fbgemm_available() -> bool:
    try:
        import torchrec.sparse.jagged_tensor  # noqa: F401  (loads fbgemm_gpu's ops)
    except ImportError:
        return False
    return hasattr(torch.ops.fbgemm, "permute_multi_embedding") and hasattr(
        torch.ops.fbgemm, "regroup_keyed_tensor"
    )


def make_providers(device: torch.device, include_reference: Optional[bool] = None) -> List[Provider]:
    """Every provider available on ``device``.

    kt_regroup appears once per surface (module, functional, op) on the backend the
    dispatcher picks for ``device``; the portable reference kernel gets a row of its own
    when that backend is a compiled one (``include_reference=None``: automatic).
    """
    import kt_regroup

    backend = kt_regroup.backend(device)
    providers = [
        Provider(f"kt_regroup.KTRegroupAsDict [{backend}]", "kt_regroup", _kt_module),
        Provider(f"kt_regroup.regroup [{backend}]", "kt_regroup", _kt_functional),
        Provider(f"kt_regroup.permute_multi_embedding [{backend}]", "kt_regroup", _kt_op),
    ]
    if _kt_into_available():
        providers.append(
            Provider(f"kt_regroup.permute_multi_embedding_into [{backend}, preallocated]",
                     "kt_regroup", _kt_into, does_own_backward=True, inference_only=True)
        )
    if include_reference is None:
        include_reference = backend != "reference"
    if include_reference:
        providers.append(
            Provider("kt_regroup reference kernel", "kt_regroup", _kt_reference, does_own_backward=True)
        )
    providers += [
        Provider("torchrec._regroup_keyed_tensors", "torchrec", _tr_regroup_keyed_tensors),
        Provider("torchrec.KeyedTensor.regroup", "torchrec", _tr_keyed_tensor_regroup),
    ]
    if _fbgemm_available():
        providers += [
            Provider("torchrec.KTRegroupAsDict [fbgemm]", "fbgemm", _tr_module),
            Provider("fbgemm.permute_multi_embedding", "fbgemm", _fbgemm_permute_multi_embedding),
            Provider("fbgemm.regroup_keyed_tensor", "fbgemm", _fbgemm_regroup_keyed_tensor),
        ]
    providers += [
        Provider("limit: clone", "limit", _limit_clone, does_own_backward=True),
        Provider("limit: copy_", "limit", _limit_copy, does_own_backward=True),
    ]
    return providers


KT_REGROUP_BASELINE = "kt_regroup.KTRegroupAsDict"  # the row other rows are compared with
KT_REGROUP_INTO = "kt_regroup.permute_multi_embedding_into"
CLONE = "limit: clone"
COPY = "limit: copy_"


def select(providers: List[Provider], only: Optional[List[str]], skip: Optional[List[str]]) -> List[Provider]:
    """Filters by case-insensitive substrings of the name or family."""

    def hit(p: Provider, pats: List[str]) -> bool:
        return any(s.lower() in p.name.lower() or s.lower() == p.family for s in pats)

    out = [p for p in providers if not only or hit(p, only)]
    return [p for p in out if not skip or not hit(p, skip)]


def describe(providers: List[Provider]) -> Dict[str, str]:
    return {p.name: p.family for p in providers}
