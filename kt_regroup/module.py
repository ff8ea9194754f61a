"""``KTRegroupAsDict``: drop-in for ``torchrec.modules.regroup.KTRegroupAsDict``.

The module builds its permute plan on the first forward and then calls the fused
``torch.ops.kt_regroup.permute_multi_embedding`` every step.

One route: ``forward`` refreshes a stale plan (eager only), then calls :func:`_regroup`,
one ``torch.fx.wrap``-ed function that eager, fx, TorchScript and ``torch.compile`` all
run. Where the plan could not be refreshed (a graph captured by fx or TorchScript, a
cold module under ``torch.compile``), :func:`_regroup` checks the layout itself and
computes a call whose layout differs with an uncached plan: the same values, dtype
rules and errors in every mode (groups ``allow_views`` would return as views come back
as copies there).

The plan and everything derived from it form one immutable :class:`RegroupPlanModule`,
swapped in with one assignment: threads sharing the module never see half of an old
plan, and the warm path takes no lock.
"""

import logging
import sys
from typing import Dict, List, Optional

import torch
import torch.fx._symbolic_trace as _fx_trace
from torchrec.modules.embedding_configs import data_type_to_dtype, dtype_to_data_type
from torchrec.sparse.jagged_tensor import KeyedTensor
from torchrec.types import CacheMixin, DataType

from kt_regroup.functional import has_pooled_rows, layout, permute, regroup_rows
from kt_regroup.plan import get_plan

# Host work, run outside Dynamo: a layout error stays the library's own under torch.compile
# (torch 2.11 wraps errors raised while tracing in TorchRuntimeError). torchrec, imported
# above, has loaded Dynamo already, so this costs `import kt_regroup.module` nothing.
_get_plan = torch.compiler.disable(get_plan)

logger = logging.getLogger(__name__)

__all__ = ["KTRegroupAsDict", "RegroupPlanModule"]


def _matches(
    keyed_tensors: List[KeyedTensor], in_keys: List[List[str]], in_lengths: List[List[int]],
    key_dim: int,
) -> bool:
    """Whether ``keyed_tensors`` have the keys, widths and key_dim of a plan. The same
    key-list object every step (torchrec's EBC passes its own) compares by identity
    first, then in C; keys or widths given as tuples compare as lists."""
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


def _check_one_dtype(values: List[torch.Tensor]) -> None:
    for i, v in enumerate(values):
        if v.dtype != values[0].dtype:
            raise TypeError(
                f"KTRegroupAsDict: input {i} is {v.dtype} but input 0 is {values[0].dtype}; "
                "set emb_dtype to regroup them into one dtype (the cast is fused into the copy)"
            )


@torch.fx.wrap
def _regroup(
    keyed_tensors: List[KeyedTensor],
    groups: List[List[str]],
    names: List[str],
    dtype: Optional[torch.dtype],
    multi_device: bool,
    checked: bool,
    in_keys: List[List[str]],
    in_lengths: List[List[int]],
    key_dim: int,
    permutes: torch.Tensor,
    in_shapes: torch.Tensor,
    out_shapes: torch.Tensor,
    out_lengths: List[int],
    views: List[List[int]],
) -> Dict[str, torch.Tensor]:
    """The regroup with a plan (``checked``: known to match the inputs), or with an
    uncached one where the inputs' layout differs from it.

    ``views`` (``allow_views``) holds per group ``[input, offset, width]`` for a group
    returned as a view and ``[-1, 0, 0]`` for a group the op copies; the plan then covers
    the copied groups only. Without views it is empty.
    """
    values = [kt.values() for kt in keyed_tensors]
    if dtype is None:
        _check_one_dtype(values)
    if not checked and not _matches(keyed_tensors, in_keys, in_lengths, key_dim):
        keys, lengths, key_dim = layout(keyed_tensors, "KTRegroupAsDict")
        permutes, in_shapes, out_shapes, out_lengths = torch.ops.kt_regroup.kt_regroup_arguments(
            values[0], keys, lengths, groups
        )
        views = torch.jit.annotate(List[List[int]], [])
    elif multi_device:
        device = values[0].device
        permutes = permutes.to(device, non_blocking=True)
        in_shapes = in_shapes.to(device, non_blocking=True)
        out_shapes = out_shapes.to(device, non_blocking=True)
    copied = torch.jit.annotate(List[torch.Tensor], [])
    if len(out_lengths) > 0 or len(views) == 0:
        copied = permute(values, permutes, in_shapes, out_shapes, out_lengths, key_dim, dtype)
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


def _waited(obj):
    """What a torchrec LazyAwaitable (a sharded EBC's output under DistributedModelParallel)
    stands for; anything else unchanged."""
    if "torchrec.distributed.types" in sys.modules:
        from torchrec.distributed.types import LazyAwaitable

        if isinstance(obj, LazyAwaitable):
            return LazyAwaitable._wait_async(obj)
    return obj


class RegroupPlanModule(torch.nn.Module):
    """The cached plan of one input layout: what :class:`KTRegroupAsDict` swaps in.

    Owns the plan's tensors as non-persistent buffers (they follow ``.to()`` and
    DistributedModelParallel's device moves, and stay out of ``state_dict``). Nothing
    changes it after construction except :meth:`set_device`.
    """

    __jit_ignored_attributes__ = ["_host"]

    in_keys: List[List[str]]
    in_lengths: List[List[int]]
    key_dim: int
    out_lengths: List[int]
    views: List[List[int]]

    def __init__(
        self,
        keyed_tensors: Optional[List[KeyedTensor]] = None,
        groups: Optional[List[List[str]]] = None,
        allow_views: bool = False,
    ) -> None:
        super().__init__()
        self.in_keys, self.in_lengths, self.key_dim = [], [], 1
        self.out_lengths, self.views = [], []
        permutes = torch.empty(0, 6, dtype=torch.int32)
        in_shapes = out_shapes = torch.empty(0, dtype=torch.int32)
        device = torch.device("cpu")
        if keyed_tensors is not None and groups is not None:
            keys, lengths, self.key_dim = layout(keyed_tensors, "KTRegroupAsDict")
            self.in_keys = [list(k) for k in keys]
            self.in_lengths = [list(n) for n in lengths]
            plan = _get_plan(keys, lengths, groups)  # layout errors
            if allow_views and self.key_dim == 1:
                specs = plan.view_specs()
                if any(s is not None for s in specs):
                    self.views = [[-1, 0, 0] if s is None else list(s) for s in specs]
                    plan = plan.restricted([j for j, s in enumerate(specs) if s is None])
            self.out_lengths = list(plan.out_lengths)
            permutes, in_shapes, out_shapes = plan.tensors()
            device = keyed_tensors[0].values().device
        # The truth on the host, for _apply; the buffers follow the module's device.
        self._host = (permutes, in_shapes, out_shapes)
        self.register_buffer("_permutes", permutes.to(device, copy=True), persistent=False)
        self.register_buffer("_in_shapes", in_shapes.to(device, copy=True), persistent=False)
        self.register_buffer("_out_shapes", out_shapes.to(device, copy=True), persistent=False)

    def matches(self, keyed_tensors: List[KeyedTensor]) -> bool:
        """Whether this plan serves ``keyed_tensors``: the keys and widths it was built
        for, and buffers that hold values (not meta) wherever the data is."""
        return (
            isinstance(keyed_tensors, (list, tuple))
            and _matches(keyed_tensors, self.in_keys, self.in_lengths, self.key_dim)
            and (not self._buffers["_permutes"].is_meta or keyed_tensors[0].values().is_meta)
        )

    def _apply(self, fn, recurse=True):
        # Device moves keep the plan; to_empty() would leave garbage in its buffers, and
        # .type() would cast them: the moved buffers are rebuilt from the host copy wherever
        # their values or dtypes differ.
        super()._apply(fn, recurse)
        for name, host in zip(("_permutes", "_in_shapes", "_out_shapes"), self._host):
            buf = self._buffers[name]
            if not buf.is_meta and (buf.dtype != host.dtype or not torch.equal(buf.cpu(), host)):
                self._buffers[name] = host.to(buf.device, copy=True)
        return self

    @torch.jit.export
    def set_device(self, device: str) -> None:
        self._permutes = self._permutes.to(device)
        self._in_shapes = self._in_shapes.to(device)
        self._out_shapes = self._out_shapes.to(device)


def _is_fx_tracing() -> bool:
    """True under torchrec's tracer and plain ``torch.fx.symbolic_trace``."""
    return _fx_trace._is_fx_tracing_flag and not torch.compiler.is_compiling()


class KTRegroupAsDict(torch.nn.Module, CacheMixin):
    """Regroups a list of ``KeyedTensor``s into named groups, with a cached plan.

    Same constructor, output and methods as torchrec's ``KTRegroupAsDict``.

    Args:
        groups: the keys of each output group (a key may appear in several groups).
        keys: the name of each output group.
        emb_dtype: optional dtype (torchrec ``DataType`` or ``torch.dtype``) of the outputs.
            Without it, inputs of mixed dtypes are a ``TypeError``.
        multi_device: move the cached plan to the inputs' device on every call.
        allow_views: opt-in zero-copy. A group that is one contiguous run of columns of
            one input (e.g. all keys of one KeyedTensor, in order) comes back as a view
            of that input (``values.narrow(1, offset, width)``) instead of a copy. Such
            outputs alias the input and are not contiguous. Off by default (torchrec's
            module always returns fresh tensors).

    Example::

        >>> m = KTRegroupAsDict(groups=[["f1", "f2"], ["f3"]], keys=["user", "item"])
        >>> kt = KeyedTensor.from_tensor_list(["f1", "f2", "f3"], [torch.randn(2, 4)] * 3)
        >>> {k: v.shape for k, v in m([kt]).items()}
        {'user': torch.Size([2, 8]), 'item': torch.Size([2, 4])}
    """

    # torchrec's form of emb_dtype, for torchrec's tools (its IR serializer); the forward
    # uses the torch dtype, _dtype.
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
                "KTRegroupAsDict(keys=%s): the inputs' keys or widths changed since the plan "
                "was built; rebuilding it (shown once per module)", self._keys,
            )
            self._stale_warned = True
        self._plan = plan
        return plan

    def forward(self, keyed_tensors: List[KeyedTensor]) -> Dict[str, torch.Tensor]:
        """
        Args:
            keyed_tensors: the KeyedTensors to regroup.

        Returns:
            One tensor per group, keyed by the group's name.
        """
        plan = self._plan  # read once: other threads may swap in their own plans
        if not torch.jit.is_scripting():
            if not _is_fx_tracing():
                if has_pooled_rows(keyed_tensors):  # variable-batch: from the pooled rows
                    return dict(zip(self._keys, regroup_rows(keyed_tensors, self._groups, self._dtype)))
                checked = plan.matches(keyed_tensors)
                # Under torch.compile the module stays as it is (its state is guarded):
                # _regroup computes a cold call in the graph.
                if not checked and not torch.compiler.is_compiling():
                    plan = self._refresh(keyed_tensors)
                    checked = True
                # The same call as below; buffers read from the dict (a serving call
                # saves ~2 us over three nn.Module attribute lookups).
                buffers = plan._buffers
                return _regroup(
                    keyed_tensors, self._groups, self._keys, self._dtype, self._multi_device,
                    checked, plan.in_keys, plan.in_lengths, plan.key_dim, buffers["_permutes"],
                    buffers["_in_shapes"], buffers["_out_shapes"], plan.out_lengths, plan.views,
                )
        # fx tracing (the buffers become get_attr nodes) and TorchScript: the layout is
        # checked on every call.
        return _regroup(
            keyed_tensors, self._groups, self._keys, self._dtype, self._multi_device, False,
            plan.in_keys, plan.in_lengths, plan.key_dim, plan._permutes, plan._in_shapes,
            plan._out_shapes, plan.out_lengths, plan.views,
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
