"""``KTRegroupAsDict``: drop-in for ``torchrec.modules.regroup.KTRegroupAsDict``.

The first eager forward builds a :class:`RegroupPlanModule` (the plan of the inputs'
layout); every call runs ``regroup_with_plan`` (kt_regroup/functional.py, an fx leaf).
Three routes: eager with a matching plan (variable-batch inputs included: such a plan
reads them as pooled rows); eager with a cold or stale one (rebuilt and
swapped in with one assignment, so threads never see half a plan and the warm path takes
no lock); a graph (fx, TorchScript, ``torch.compile``, ``torch.export``), where the
module's state stays as it is and the call checks the layout itself.
"""

import logging
from typing import Dict, List, Optional

import torch
import torch.fx._symbolic_trace as _fx_trace
from torchrec.modules.embedding_configs import data_type_to_dtype, dtype_to_data_type
from torchrec.sparse.jagged_tensor import KeyedTensor
from torchrec.types import CacheMixin, DataType

from kt_regroup.functional import (
    Plan,
    _rows_of,
    _waited,
    has_pooled_rows,
    layout,
    matches,
    regroup_with_plan,
    rows_layout,
)
from kt_regroup.plan import get_plan

# Host work, run outside Dynamo: a layout error stays the library's own under torch.compile
# (torch 2.11 wraps errors raised while tracing in TorchRuntimeError). torchrec, imported
# above, has loaded Dynamo already, so this costs `import kt_regroup.module` nothing.
_get_plan = torch.compiler.disable(get_plan)
torch.fx.wrap("regroup_with_plan")  # a leaf of fx graphs here too (fx patches by module)

logger = logging.getLogger(__name__)

__all__ = ["KTRegroupAsDict", "RegroupPlanModule"]


class RegroupPlanModule(torch.nn.Module):
    """The plan of one input layout, its tensors as non-persistent buffers (they follow
    ``.to()`` and DMP's device moves, and stay out of ``state_dict``)."""

    __jit_ignored_attributes__ = ["_host", "_warm"]

    in_keys: List[List[str]]
    in_lengths: List[List[int]]
    key_dim: int
    out_lengths: List[int]
    views: List[List[int]]
    rows: List[bool]

    def __init__(
        self,
        keyed_tensors: Optional[List[KeyedTensor]] = None,
        groups: Optional[List[List[str]]] = None,
        allow_views: bool = False,
    ) -> None:
        super().__init__()
        self.in_keys, self.in_lengths, self.key_dim = [], [], 1
        self.out_lengths, self.views, self.rows = [], [], []
        tensors = (torch.empty(0, 6, dtype=torch.int32),) + (torch.empty(0, dtype=torch.int32),) * 2
        device = torch.device("cpu")
        if keyed_tensors is not None and groups is not None:
            keys, lengths, self.key_dim = layout(keyed_tensors, "KTRegroupAsDict")
            self.in_keys = [list(k) for k in keys]
            self.in_lengths = [list(n) for n in lengths]
            if has_pooled_rows(keyed_tensors):  # variable-batch: the op takes rows per key
                self.rows, keys, lengths = rows_layout(keyed_tensors)
            plan = _get_plan(keys, lengths, groups)  # layout errors
            if allow_views and self.key_dim == 1 and len(self.rows) == 0:
                specs = plan.view_specs()
                if any(s is not None for s in specs):
                    self.views = [[-1, 0, 0] if s is None else list(s) for s in specs]
                    plan = plan.restricted([j for j, s in enumerate(specs) if s is None])
            self.out_lengths = list(plan.out_lengths)
            tensors = plan.tensors()
            device = _some_data(keyed_tensors[0]).device
        # The truth on the host, for _apply; the buffers follow the module's device.
        self._host = tensors
        for name, t in zip(_BUFFERS, tensors):
            self.register_buffer(name, t.to(device, copy=True), persistent=False)
        self._warm = self.plan()  # what the eager route reads

    def plan(self) -> Plan:
        return Plan(
            self.in_keys, self.in_lengths, self.key_dim, self._permutes, self._in_shapes,
            self._out_shapes, self.out_lengths, self.views, self.rows,
        )

    def matches(self, keyed_tensors: List[KeyedTensor]) -> bool:
        """Whether this plan serves ``keyed_tensors``: the keys and widths it was built
        for, the same inputs read as pooled rows, and buffers that hold values (not meta)
        wherever the data is."""
        if not (
            isinstance(keyed_tensors, (list, tuple))
            and matches(keyed_tensors, self.in_keys, self.in_lengths, self.key_dim)
        ):
            return False
        rows = self.rows
        if len(rows) == 0:
            if has_pooled_rows(keyed_tensors):
                return False
        elif [_rows_of(_waited(kt)) for kt in keyed_tensors] != rows:
            return False
        return not self._warm.permutes.is_meta or _some_data(keyed_tensors[0]).is_meta

    def _apply(self, fn, recurse=True):
        # to_empty() and .type() would spoil the plan: buffers are rebuilt from the host copy
        super()._apply(fn, recurse)
        for name, host in zip(_BUFFERS, self._host):
            buf = self._buffers[name]
            if not buf.is_meta and (buf.dtype != host.dtype or not torch.equal(buf.cpu(), host)):
                self._buffers[name] = host.to(buf.device, copy=True)
        self._warm = self.plan()
        return self

    @torch.jit.export
    def set_device(self, device: str) -> None:
        self._permutes = self._permutes.to(device)
        self._in_shapes = self._in_shapes.to(device)
        self._out_shapes = self._out_shapes.to(device)
        if not torch.jit.is_scripting():
            self._warm = self.plan()


_BUFFERS = ("_permutes", "_in_shapes", "_out_shapes")


def _some_data(kt: KeyedTensor) -> torch.Tensor:
    """A tensor of ``kt``'s data, on its device (pooled rows are not expanded for it)."""
    kt = _waited(kt)
    return kt.pooled[0] if _rows_of(kt) and len(kt.pooled) > 0 else kt.values()


def _in_graph() -> bool:
    """True under fx tracing (torchrec's tracer, ``torch.fx.symbolic_trace``) and
    ``torch.compile`` / ``torch.export``."""
    return _fx_trace._is_fx_tracing_flag or torch.compiler.is_compiling()


class KTRegroupAsDict(torch.nn.Module, CacheMixin):
    """Regroups a list of ``KeyedTensor``s into named groups, with a cached plan.

    Same constructor, output and methods as torchrec's ``KTRegroupAsDict``.

    Args:
        groups: the keys of each output group (a key may appear in several groups).
        keys: the name of each output group.
        emb_dtype: optional dtype (torchrec ``DataType`` or ``torch.dtype``) of the outputs.
            Without it, inputs of mixed dtypes are a ``TypeError``.
        multi_device: move the cached plan to the inputs' device on every call.
        allow_views: opt-in zero-copy: a group that is one contiguous run of columns of
            one input comes back as a view of it (``values.narrow(1, offset, width)``),
            aliasing the input. Off by default (torchrec's module returns fresh tensors).

    Example::

        >>> m = KTRegroupAsDict(groups=[["f1", "f2"], ["f3"]], keys=["user", "item"])
        >>> kt = KeyedTensor.from_tensor_list(["f1", "f2", "f3"], [torch.randn(2, 4)] * 3)
        >>> {k: v.shape for k, v in m([kt]).items()}
        {'user': torch.Size([2, 8]), 'item': torch.Size([2, 4])}
    """

    # _emb_dtype: torchrec's form, for its tools (the IR serializer); the forward uses _dtype
    __jit_ignored_attributes__ = ["_emb_dtype"]
    __jit_unused_properties__ = ["_is_inited"]

    _groups: List[List[str]]
    _keys: List[str]
    _dtype: Optional[torch.dtype]
    _multi_device: bool
    _allow_views: bool

    def __init__(
        self,
        groups: List[List[str]],
        keys: List[str],
        # torchrec's annotation, kept exactly (its API-compatibility check compares it);
        # a torch.dtype is taken too.
        emb_dtype: Optional[DataType] = None,
        multi_device: bool = False,
        allow_views: bool = False,
    ) -> None:
        super().__init__()
        if len(groups) != len(keys):
            raise ValueError(
                f"KTRegroupAsDict: {len(groups)} groups but {len(keys)} keys; need one key "
                "per group"
            )
        self._groups = [list(g) for g in groups]
        self._keys = list(keys)
        if isinstance(emb_dtype, DataType):
            self._dtype = data_type_to_dtype(emb_dtype)
        else:
            self._dtype = emb_dtype
            try:  # torchrec's DataType where it has one (not for float64)
                emb_dtype = None if emb_dtype is None else dtype_to_data_type(emb_dtype)
            except Exception:
                pass
        self._emb_dtype = emb_dtype
        self._multi_device = multi_device
        self._allow_views = allow_views
        self._stale_warned = False
        self._plan = RegroupPlanModule()

    @torch.jit.ignore
    def _refresh(self, keyed_tensors: List[KeyedTensor]) -> RegroupPlanModule:
        """Builds the plan of the inputs' layout and swaps it in (one assignment)."""
        if not isinstance(keyed_tensors, (list, tuple)):
            raise TypeError(
                f"KTRegroupAsDict expects a list of KeyedTensors, got {type(keyed_tensors).__name__}"
            )
        for i, kt in enumerate(keyed_tensors):
            if not isinstance(_waited(kt), KeyedTensor):
                raise TypeError(
                    f"KTRegroupAsDict: keyed_tensors[{i}] is a {type(kt).__name__}, not a KeyedTensor"
                )
        plan = RegroupPlanModule(keyed_tensors, self._groups, self._allow_views)
        if len(self._plan.in_keys) > 0 and not self._stale_warned:
            logger.warning(
                "KTRegroupAsDict(keys=%s): the inputs' keys, widths or kind (variable-batch rows) "
                "changed since the plan was built; rebuilding it (shown once per module)", self._keys,
            )
            self._stale_warned = True
        self._plan = plan
        return plan

    def forward(self, keyed_tensors: List[KeyedTensor]) -> Dict[str, torch.Tensor]:
        """One tensor per group of ``keyed_tensors``, keyed by the group's name."""
        if not torch.jit.is_scripting() and not _in_graph():
            return self._eager(keyed_tensors)
        # a graph: the module's state stays; a differing layout is computed uncached
        return regroup_with_plan(
            keyed_tensors, self._groups, self._keys, self._dtype, self._multi_device,
            self._plan.plan(), False,
        )

    @torch.jit.unused
    def _eager(self, keyed_tensors: List[KeyedTensor]) -> Dict[str, torch.Tensor]:
        # read once: other threads may swap in their own plans (_modules: the submodule
        # without nn.Module.__getattr__, a microsecond a call)
        plan = self._modules["_plan"]
        if not plan.matches(keyed_tensors):  # cold or stale: a new plan, swapped in
            plan = self._refresh(keyed_tensors)
        return regroup_with_plan(
            keyed_tensors, self._groups, self._keys, self._dtype, self._multi_device,
            plan._warm, True,
        )

    @torch.jit.export
    def set_device(self, device: str) -> None:
        self._plan.set_device(device)

    def clear_cache(self) -> None:
        self._plan = RegroupPlanModule()

    @property
    def _is_inited(self) -> bool:
        """torchrec's name for "the plan is built" (read by torchrec's tools and tests)."""
        return len(self._plan.in_keys) > 0
