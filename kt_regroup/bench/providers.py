"""The providers compared by the benchmark: one callable per way of regrouping.

Every provider gets the same inputs and returns ``(outputs, input_gradients)``
(``input_gradients`` is ``None`` in forward cells and for the copy limits), so the
harness can time them alike and check each answer against the oracle: torchrec's
``_regroup_keyed_tensors`` (``torch.cat`` + ``split``) and its autograd.

Forward+backward cells run ``torch.autograd.grad(outputs, inputs, grad_outputs)``,
with the upstream gradients of the cell's ``grad`` mode (:data:`GRADS`):

* ``ones``: contiguous ones;
* ``expanded``: ``torch.ones(()).expand(B, n)``, the stride-0 tensor that
  ``loss = out.sum()`` hands back;
* ``randn``: contiguous random values.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence, Tuple

import torch

from kt_regroup.bench.layout import BenchLayout

__all__ = [
    "CLONE",
    "COPY",
    "Cell",
    "FORWARD",
    "FORWARD_BACKWARD",
    "GRADS",
    "KT_REGROUP_BASELINE",
    "Provider",
    "make_grad_outputs",
    "make_providers",
    "select",
]

FORWARD = "forward"
FORWARD_BACKWARD = "forward+backward"
GRADS = ("ones", "expanded", "randn")

KT_REGROUP_BASELINE = "kt_regroup.KTRegroupAsDict"  # the row other rows are compared with
CLONE = "limit: clone"
COPY = "limit: copy_"

Result = Tuple[List[torch.Tensor], Optional[Sequence[torch.Tensor]]]


def make_grad_outputs(
    grad: str, shapes: Sequence[Tuple[int, int]], dtype: torch.dtype, device: torch.device,
    seed: int = 0,
) -> List[torch.Tensor]:
    """Upstream gradients of one ``grad`` mode for outputs of the given shapes."""
    if grad == "ones":
        return [torch.ones(s, dtype=dtype, device=device) for s in shapes]
    if grad == "expanded":
        # what SumBackward hands back: one element, strides (0, 0)
        return [torch.ones((), dtype=dtype, device=device).expand(s) for s in shapes]
    if grad == "randn":
        gen = torch.Generator().manual_seed(seed + 1)
        return [torch.randn(s, generator=gen).to(device=device, dtype=dtype) for s in shapes]
    raise ValueError(f"grad must be one of {GRADS}, got {grad!r}")


class Cell:
    """The inputs, upstream gradients and oracle shared by every provider of a cell."""

    def __init__(
        self,
        layout: BenchLayout,
        device: torch.device,
        mode: str,
        grad: Optional[str] = None,
        seed: int = 0,
        requires_grad: Optional[bool] = None,
    ):
        from torchrec.sparse.jagged_tensor import _regroup_keyed_tensors

        self.layout = layout
        self.device = device
        self.mode = mode
        self.backward = mode == FORWARD_BACKWARD
        self.grad = (grad or "ones") if self.backward else None
        if requires_grad is None:
            requires_grad = self.backward
        self.kts = layout.make_inputs(device, requires_grad=requires_grad, seed=seed)
        self.values = [kt.values() for kt in self.kts]
        self.group_names = [f"group_{i}" for i in range(len(layout.groups))]
        with torch.no_grad():
            # torchrec's plain cat path is the oracle: independent of kt_regroup's code.
            self.expected = [
                t.contiguous() for t in _regroup_keyed_tensors(self.kts, layout.groups)
            ]
        self.grad_outputs: List[torch.Tensor] = []
        self.expected_grads: List[torch.Tensor] = []
        if self.backward:
            shapes = [tuple(t.shape) for t in self.expected]
            self.grad_outputs = make_grad_outputs(self.grad, shapes, layout.dtype, device, seed)
            if self.grad == "randn":
                outs = _regroup_keyed_tensors(self.kts, layout.groups)
                self.expected_grads = list(self.input_grads(outs))
            else:
                # All-ones gradients: each input column gets how often its key is used (no
                # second regroup to run; randn is the mode that also checks the routing).
                self.expected_grads = self._use_counts()

    def _use_counts(self) -> List[torch.Tensor]:
        uses: dict = {}
        for group in self.layout.groups:
            for key in group:
                uses[key] = uses.get(key, 0) + 1
        rows = []
        for keys, widths, v in zip(self.layout.keys, self.layout.lengths, self.values):
            counts = [float(uses.get(k, 0)) for k, w in zip(keys, widths) for _ in range(w)]
            row = torch.tensor(counts, dtype=v.dtype, device=self.device)
            rows.append(row.expand(v.shape))  # one row, as wide as the input, for every batch row
        return rows

    def input_grads(self, outs: Sequence[torch.Tensor]) -> Sequence[torch.Tensor]:
        """The backward every provider runs: gradients of the inputs, none accumulated."""
        return torch.autograd.grad(
            outs, self.values, self.grad_outputs, allow_unused=True, materialize_grads=True
        )

    def check(self, result: Result) -> str:
        """``ok``, or what differs from the oracle: outputs bit-exact, input gradients
        to the dtype's rounding (duplicated keys may be summed in another order)."""
        outs, grads = result
        if len(outs) != len(self.expected):
            return f"mismatch: {len(outs)} outputs, expected {len(self.expected)}"
        for i, (o, e) in enumerate(zip(outs, self.expected)):
            if o.shape != e.shape or o.dtype != e.dtype or not torch.equal(o.detach(), e):
                return f"mismatch in group {i}"
        if grads is not None:
            for i, (g, e) in enumerate(zip(grads, self.expected_grads)):
                if torch.equal(g, e):
                    continue
                try:
                    torch.testing.assert_close(g, e)
                except AssertionError:
                    return f"gradient mismatch in input {i}"
        return "ok"


@dataclass
class Provider:
    """``make(cell)`` returns the zero-argument callable that is timed."""

    name: str
    family: str  # kt_regroup | torchrec | fbgemm | limit
    make: Callable[[Cell], Callable[[], Result]]
    # No autograd (writes into caller-owned buffers): forward cells and inference rows only.
    inference_only: bool = False


def _with_backward(cell: Cell, forward: Callable[[], List[torch.Tensor]]):
    if not cell.backward:
        return lambda: (forward(), None)

    def call() -> Result:
        outs = forward()
        return outs, cell.input_grads(outs)

    return call


# --- kt_regroup (public API only) ----------------------------------------------------------


def _kt_plan_tensors(cell: Cell):
    import kt_regroup

    plan = kt_regroup.get_plan(cell.layout.keys, cell.layout.lengths, cell.layout.groups)
    tensors = plan.tensors
    return plan, tensors(cell.device)


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
    plan, (permutes, in_shapes, out_shapes) = _kt_plan_tensors(cell)
    out_lengths = list(plan.out_lengths)
    op = torch.ops.kt_regroup.permute_multi_embedding
    values = cell.values
    return _with_backward(cell, lambda: op(values, permutes, in_shapes, out_shapes, out_lengths))


def _kt_into(cell: Cell):
    """Inference into preallocated outputs, which are reused by every call."""
    _, (permutes, in_shapes, out_shapes) = _kt_plan_tensors(cell)
    outs = [torch.zeros_like(t) for t in cell.expected]  # pages touched outside the timing
    op = torch.ops.kt_regroup.permute_multi_embedding_into
    values = [v.detach() for v in cell.values]

    def call() -> Result:
        op(values, permutes, in_shapes, out_shapes, outs)
        return outs, None

    return call


def _has_op(namespace: str, name: str) -> bool:
    try:
        return hasattr(getattr(torch.ops, namespace), name)
    except (AttributeError, RuntimeError):
        return False


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


def _tr_triton(cell: Cell):
    """torchrec's Triton port of FBGEMM's op (CUDA only), on torchrec's own plan."""
    from torchrec.sparse.jagged_tensor import _kt_regroup_arguments
    from torchrec.sparse.triton_permute_multi_embedding import triton_permute_multi_embedding

    lay = cell.layout
    permutes, in_shapes, out_shapes, out_lengths = _kt_regroup_arguments(
        cell.values[0], [list(k) for k in lay.keys], [list(w) for w in lay.lengths],
        [list(g) for g in lay.groups],
    )
    values = cell.values
    return _with_backward(
        cell, lambda: triton_permute_multi_embedding(values, permutes, in_shapes, out_shapes,
                                                     out_lengths)
    )


def _fbgemm_permute_multi_embedding(cell: Cell):
    from torchrec.sparse.jagged_tensor import permute_multi_embedding

    groups = cell.layout.groups
    return _with_backward(cell, lambda: permute_multi_embedding(cell.kts, groups))


def _fbgemm_regroup_keyed_tensor(cell: Cell):
    from torchrec.sparse.jagged_tensor import regroup_kts

    groups = cell.layout.groups
    return _with_backward(cell, lambda: regroup_kts(cell.kts, groups))


def _fbgemm_serves(device: torch.device) -> bool:
    """FBGEMM's permute_multi_embedding ops are loaded, with a kernel for ``device``."""
    try:
        import torchrec.sparse.jagged_tensor  # noqa: F401  (loads fbgemm_gpu's ops)
    except ImportError:
        return False
    if not (_has_op("fbgemm", "permute_multi_embedding") and _has_op("fbgemm", "regroup_keyed_tensor")):
        return False
    # FBGEMM registers its device kernels on the inner op (the outer one has CPU, Meta and
    # Autograd kernels only): a CUDA build has permute_multi_embedding_function on CUDA.
    key = {"cpu": "CPU", "cuda": "CUDA"}.get(device.type)
    return key is not None and torch._C._dispatch_has_kernel_for_dispatch_key(
        "fbgemm::permute_multi_embedding_function", key
    )


def _torchrec_triton_serves(device: torch.device) -> bool:
    if device.type != "cuda":
        return False  # its kernels take CUDA tensors only
    try:
        import torchrec.sparse.triton_permute_multi_embedding  # noqa: F401  (needs triton)
    except ImportError:
        return False
    return True


# --- the copy limit ----------------------------------------------------------------------------


def _limit_clone(cell: Cell):
    """A fresh copy of the output bytes (+ of the input bytes: the input gradient)."""
    src_out = cell.expected
    src_in = [v.detach() for v in cell.values] if cell.backward else []

    def call() -> Result:
        outs = [t.clone() for t in src_out]
        [t.clone() for t in src_in]
        return outs, None

    return call


def _limit_copy(cell: Cell):
    """The same bytes copied into buffers that already exist (no allocation)."""
    src_out = cell.expected
    dst_out = [torch.zeros_like(t) for t in src_out]  # pages touched outside the timing
    src_in = [v.detach() for v in cell.values] if cell.backward else []
    dst_in = [torch.zeros_like(t) for t in src_in]

    def call() -> Result:
        for d, s in zip(dst_out + dst_in, src_out + src_in):
            d.copy_(s)
        return dst_out, None

    return call


def make_providers(device: torch.device) -> List[Provider]:
    """Every provider available on ``device``.

    kt_regroup appears once per surface (module, functional, op) on the backend that
    serves ``device`` (``KT_REGROUP_BACKEND`` forces one).
    """

    backend = serving_kernel(device)
    providers = [
        Provider(f"kt_regroup.KTRegroupAsDict [{backend}]", "kt_regroup", _kt_module),
        Provider(f"kt_regroup.regroup [{backend}]", "kt_regroup", _kt_functional),
        Provider(f"kt_regroup.permute_multi_embedding [{backend}]", "kt_regroup", _kt_op),
    ]
    if _has_op("kt_regroup", "permute_multi_embedding_into"):
        providers.append(
            Provider(f"kt_regroup.permute_multi_embedding_into [{backend}, preallocated]",
                     "kt_regroup", _kt_into, inference_only=True)
        )
    providers += [
        Provider("torchrec._regroup_keyed_tensors", "torchrec", _tr_regroup_keyed_tensors),
        Provider("torchrec.KeyedTensor.regroup", "torchrec", _tr_keyed_tensor_regroup),
    ]
    if _torchrec_triton_serves(device):
        providers.append(
            Provider("torchrec.triton_permute_multi_embedding", "torchrec", _tr_triton)
        )
    if _fbgemm_serves(device):
        providers += [
            Provider("torchrec.KTRegroupAsDict [fbgemm]", "fbgemm", _tr_module),
            Provider("fbgemm.permute_multi_embedding", "fbgemm", _fbgemm_permute_multi_embedding),
            Provider("fbgemm.regroup_keyed_tensor", "fbgemm", _fbgemm_regroup_keyed_tensor),
        ]
    providers += [
        Provider(CLONE, "limit", _limit_clone),
        Provider(COPY, "limit", _limit_copy),
    ]
    return providers


def select(providers: List[Provider], only: Optional[List[str]], skip: Optional[List[str]]) -> List[Provider]:
    """Filters by case-insensitive substrings of the name or family."""

    def hit(p: Provider, pats: List[str]) -> bool:
        return any(s.lower() in p.name.lower() or s.lower() == p.family for s in pats)

    out = [p for p in providers if not only or hit(p, only)]
    return [p for p in out if not skip or not hit(p, skip)]


def serving_kernel(device) -> str:
    """What serves torch.ops.kt_regroup on ``device``: Triton on CUDA where it imports
    (kt_regroup.ops registers it), else the library's native CPU or portable kernel."""
    import importlib.util

    kind = torch.device(device).type
    if kind == "cuda":
        return "triton" if importlib.util.find_spec("triton") else "portable"
    return "cpp" if kind == "cpu" else "portable"
