"""``KTRegroupAsDict``: drop-in for ``torchrec.modules.regroup.KTRegroupAsDict``.

The module keeps one :class:`Plan` of its inputs' layout, built on the first eager
forward. Every call runs :func:`regroup_with_plan` (an fx leaf), by one of three routes:

* eager: a call whose layout the plan does not serve (the first, or keys, widths or
  kind of input changed) builds a new plan and swaps it in with one assignment, so
  threads never see half a plan and the warm path takes no lock; then one fused op;
* eager, variable-batch inputs (:mod:`kt_regroup.vbe`): the same, and the op reads the
  pooled rows (``permute_multi_embedding_vbe``);
* a graph (fx, TorchScript, ``torch.compile``, ``torch.export``): the module's state
  stays as it is, and the call checks the layout itself (a different one is computed
  with an uncached plan).
"""

import logging
from typing import Dict, List, NamedTuple, Optional, Tuple

import torch
from torchrec.modules.embedding_configs import data_type_to_dtype, dtype_to_data_type
from torchrec.sparse.jagged_tensor import KeyedTensor
from torchrec.types import CacheMixin, DataType

from kt_regroup.functional import layout, permute
from kt_regroup.plan import get_plan
from kt_regroup.vbe import (
    has_pooled_rows,
    in_graph,
    permute_rows,
    reads_rows,
    rows_layout,
    some_data,
    waited,
)

# Host work, run outside Dynamo: a layout error stays the library's own under torch.compile
# (torch 2.11 wraps errors raised while tracing in TorchRuntimeError).
_get_plan = torch.compiler.disable(get_plan)

logger = logging.getLogger(__name__)

__all__ = ["KTRegroupAsDict", "Plan"]


class Plan(NamedTuple):
    """The plan a :class:`KTRegroupAsDict` keeps: a :class:`~kt_regroup.RegroupPlan`'s
    tensors on the module's device, and how the module's inputs map onto it.

    ``in_keys``, ``in_lengths``, ``key_dim``: the inputs' layout it serves. ``views``
    (``allow_views``): per group ``[input, offset, width]`` for a group returned as a view,
    ``[-1, 0, 0]`` for one the op copies (the permute tensors then cover those only);
    empty without views. ``rows`` (variable-batch inputs): per input, whether the op reads
    its pooled rows, one op input per key; empty without such inputs.
    """

    in_keys: List[List[str]]
    in_lengths: List[List[int]]
    key_dim: int
    permutes: torch.Tensor
    in_shapes: torch.Tensor
    out_shapes: torch.Tensor
    out_lengths: List[int]
    views: List[List[int]]
    rows: List[bool]


def _empty_tensors() -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    empty = torch.empty(0, dtype=torch.int32)
    return empty.new_empty(0, 6), empty, empty.clone()


def _build(keyed_tensors: List[KeyedTensor], groups: List[List[str]], allow_views: bool):
    """The :class:`Plan` of the inputs' layout, on their device, and its host tensors."""
    keys, lengths, key_dim = layout(keyed_tensors, "KTRegroupAsDict")
    in_keys, in_lengths = [list(k) for k in keys], [list(n) for n in lengths]
    rows: List[bool] = []
    if has_pooled_rows(keyed_tensors):
        rows, keys, lengths = rows_layout(keyed_tensors)
    plan = _get_plan(keys, lengths, groups)  # layout errors
    views: List[List[int]] = []
    if allow_views and key_dim == 1 and not rows:
        specs = plan.view_specs()
        if any(s is not None for s in specs):
            views = [[-1, 0, 0] if s is None else list(s) for s in specs]
            plan = plan.restricted([j for j, s in enumerate(specs) if s is None])
    host = plan.tensors()
    device = some_data(keyed_tensors[0]).device
    tensors = [t.to(device, copy=True) for t in host]
    return Plan(in_keys, in_lengths, key_dim, *tensors, list(plan.out_lengths), views, rows), host


def matches(
    keyed_tensors: List[KeyedTensor], in_keys: List[List[str]], in_lengths: List[List[int]],
    key_dim: int,
) -> bool:
    """Whether ``keyed_tensors`` have a plan's keys, widths and key_dim (the same list
    object every step compares by identity first; tuples compare as lists)."""
    if len(keyed_tensors) != len(in_keys) or len(in_keys) == 0:
        return False
    for i, kt in enumerate(keyed_tensors):
        if kt.key_dim() != key_dim:
            return False
        keys = kt.keys()
        if keys != in_keys[i] and (isinstance(keys, list) or list(keys) != in_keys[i]):
            return False
        lengths = kt.length_per_key()
        if lengths != in_lengths[i] and (
            isinstance(lengths, list) or list(lengths) != in_lengths[i]
        ):
            return False
    return True


@torch.jit.unused
def _serves(plan: Plan, keyed_tensors: List[KeyedTensor]) -> bool:
    """Whether ``plan`` serves ``keyed_tensors`` in eager: their keys and widths, the same
    inputs read as pooled rows, and tensors that hold values (not meta) wherever the data is."""
    if not (
        isinstance(keyed_tensors, (list, tuple))
        and matches(keyed_tensors, plan.in_keys, plan.in_lengths, plan.key_dim)
    ):
        return False
    if len(plan.rows) == 0:
        if has_pooled_rows(keyed_tensors):
            return False
    elif [reads_rows(waited(kt)) for kt in keyed_tensors] != plan.rows:
        return False
    return not plan.permutes.is_meta or some_data(keyed_tensors[0]).is_meta


def _check_one_dtype(values: List[torch.Tensor]) -> None:
    for i, v in enumerate(values):
        if v.dtype != values[0].dtype:
            raise TypeError(
                f"KTRegroupAsDict: input {i} is {v.dtype} but input 0 is {values[0].dtype}; "
                "set emb_dtype to regroup them into one dtype (the cast is fused into the copy)"
            )


def _to(tensors: List[torch.Tensor], device: torch.device) -> List[torch.Tensor]:
    return [t.to(device, non_blocking=True) for t in tensors]


@torch.fx.wrap
def regroup_with_plan(
    keyed_tensors: List[KeyedTensor],
    groups: List[List[str]],
    names: List[str],
    dtype: Optional[torch.dtype],
    multi_device: bool,
    plan: Plan,
    checked: bool,
) -> Dict[str, torch.Tensor]:
    """The regroup with ``plan`` (``checked``: known to serve the inputs), or with an
    uncached plan where the inputs' layout differs from it."""
    tensors = [plan.permutes, plan.in_shapes, plan.out_shapes]
    if not torch.jit.is_scripting() and checked and len(plan.rows) > 0:
        if multi_device:
            tensors = _to(tensors, some_data(keyed_tensors[0]).device)
        outs = permute_rows(keyed_tensors, plan.rows, tensors[0], tensors[1], tensors[2],
                            plan.out_lengths)
        return {name: o if dtype is None else o.to(dtype) for name, o in zip(names, outs)}
    values = [kt.values() for kt in keyed_tensors]
    if dtype is None:
        _check_one_dtype(values)
    out_lengths, views, key_dim = plan.out_lengths, plan.views, plan.key_dim
    if not checked and (
        len(plan.rows) > 0 or not matches(keyed_tensors, plan.in_keys, plan.in_lengths, key_dim)
    ):
        keys, lengths, key_dim = layout(keyed_tensors, "KTRegroupAsDict")
        permutes, in_shapes, out_shapes, out_lengths = torch.ops.kt_regroup.kt_regroup_arguments(
            values[0], keys, lengths, groups
        )
        tensors = [permutes, in_shapes, out_shapes]
        views = torch.jit.annotate(List[List[int]], [])
    elif multi_device:
        tensors = _to(tensors, values[0].device)
    copied = torch.jit.annotate(List[torch.Tensor], [])
    if len(out_lengths) > 0 or len(views) == 0:
        copied = permute(values, tensors[0], tensors[1], tensors[2], out_lengths, key_dim, dtype)
    if len(views) == 0:
        return {name: copied[j] for j, name in enumerate(names)}
    out: Dict[str, torch.Tensor] = {}
    k = 0
    for j, spec in enumerate(views):
        if spec[0] < 0:
            out[names[j]] = copied[k]
            k += 1
        else:
            view = values[spec[0]].narrow(1, spec[1], spec[2])
            out[names[j]] = view if dtype is None else view.to(dtype)
    return out


_BUFFERS = ("_permutes", "_in_shapes", "_out_shapes")


class KTRegroupAsDict(torch.nn.Module, CacheMixin):
    """Regroups a list of ``KeyedTensor``s into named groups, with a cached plan.

    Same constructor, output and methods as torchrec's ``KTRegroupAsDict``. The plan's
    tensors are non-persistent buffers: they follow ``.to()`` and DMP's device moves and
    stay out of ``state_dict``.

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

    # _emb_dtype: torchrec's form, for its tools (the IR serializer); the forward uses _dtype.
    # _host: the plan's tensors on the host, the truth _apply restores the buffers from.
    __jit_ignored_attributes__ = ["_emb_dtype", "_host"]
    __jit_unused_properties__ = ["_is_inited"]

    _groups: List[List[str]]
    _keys: List[str]
    _dtype: Optional[torch.dtype]
    _multi_device: bool
    _allow_views: bool
    _plan: Plan

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
        self.clear_cache()

    @torch.jit.ignore
    def _install(self, plan: Plan, host: Tuple[torch.Tensor, ...]) -> Plan:
        self._host = host
        for name, t in zip(_BUFFERS, (plan.permutes, plan.in_shapes, plan.out_shapes)):
            self.register_buffer(name, t, persistent=False)
        self._plan = plan  # last, in one assignment: what eager readers take
        return plan

    def _buffered_plan(self) -> Plan:
        """The plan with the buffers' tensors (which ``.to()`` and ``set_device`` move)."""
        p = self._plan
        return Plan(p.in_keys, p.in_lengths, p.key_dim, self._permutes, self._in_shapes,
                    self._out_shapes, p.out_lengths, p.views, p.rows)

    @torch.jit.ignore
    def _refresh(self, keyed_tensors: List[KeyedTensor]) -> Plan:
        """Builds the plan of the inputs' layout and swaps it in."""
        if not isinstance(keyed_tensors, (list, tuple)):
            raise TypeError(
                f"KTRegroupAsDict expects a list of KeyedTensors, got {type(keyed_tensors).__name__}"
            )
        for i, kt in enumerate(keyed_tensors):
            if not isinstance(waited(kt), KeyedTensor):
                raise TypeError(
                    f"KTRegroupAsDict: keyed_tensors[{i}] is a {type(kt).__name__}, not a KeyedTensor"
                )
        plan, host = _build(keyed_tensors, self._groups, self._allow_views)
        if self._is_inited and not self._stale_warned:
            logger.warning(
                "KTRegroupAsDict(keys=%s): the inputs' keys, widths or kind (variable-batch rows) "
                "changed since the plan was built; rebuilding it (shown once per module)", self._keys,
            )
            self._stale_warned = True
        return self._install(plan, host)

    def forward(self, keyed_tensors: List[KeyedTensor]) -> Dict[str, torch.Tensor]:
        """One tensor per group of ``keyed_tensors``, keyed by the group's name."""
        if not torch.jit.is_scripting() and not in_graph():
            return self._eager(keyed_tensors)
        # a graph: the module's state stays; a differing layout is computed uncached
        return regroup_with_plan(
            keyed_tensors, self._groups, self._keys, self._dtype, self._multi_device,
            self._buffered_plan(), False,
        )

    @torch.jit.unused
    def _eager(self, keyed_tensors: List[KeyedTensor]) -> Dict[str, torch.Tensor]:
        plan = self._plan  # read once: other threads may swap in their own plans
        if not _serves(plan, keyed_tensors):
            plan = self._refresh(keyed_tensors)
        return regroup_with_plan(
            keyed_tensors, self._groups, self._keys, self._dtype, self._multi_device, plan, True
        )

    def _apply(self, fn, recurse=True):
        # to_empty() and .type() would spoil the plan: buffers are rebuilt from the host copy
        super()._apply(fn, recurse)
        for name, host in zip(_BUFFERS, self._host):
            buf = self._buffers[name]
            if not buf.is_meta and (buf.dtype != host.dtype or not torch.equal(buf.cpu(), host)):
                self._buffers[name] = host.to(buf.device, copy=True)
        self._plan = self._buffered_plan()
        return self

    @torch.jit.export
    def set_device(self, device: str) -> None:
        self._permutes = self._permutes.to(device)
        self._in_shapes = self._in_shapes.to(device)
        self._out_shapes = self._out_shapes.to(device)
        if not torch.jit.is_scripting():
            self._plan = self._buffered_plan()

    def clear_cache(self) -> None:
        host = _empty_tensors()
        self._install(Plan([], [], 1, *(t.clone() for t in host), [], [], []), host)

    @property
    def _is_inited(self) -> bool:
        """torchrec's name for "the plan is built" (read by torchrec's tools and tests)."""
        return len(self._plan.in_keys) > 0
