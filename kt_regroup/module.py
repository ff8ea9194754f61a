"""``KTRegroupAsDict``: drop-in for ``torchrec.modules.regroup.KTRegroupAsDict``.

The module builds its permute plan on the first forward and then calls the fused
``torch.ops.kt_regroup.permute_multi_embedding`` every step.

The plan and everything derived from it (buffers, layout, output widths) form one
immutable :class:`RegroupPlanModule`, swapped in with one assignment: a forward reads
it once, so threads sharing the module never see half of an old plan and half of a
new one, and the warm path takes no lock.

Staleness: each eager call compares the inputs' keys and widths with the plan's and
builds a new plan when they differ (one warning per module). A graph captured by
``torch.fx`` or TorchScript cannot rebuild its constants: there the same check runs and
a call whose layout differs is computed by the uncached fused op, so the result is
right either way.
"""

import logging
import sys
from typing import Dict, List, Optional, Tuple, Union

import torch
import torch.fx._symbolic_trace as _fx_trace
import torchrec.fx.tracer as _torchrec_tracer
from torchrec.modules.embedding_configs import data_type_to_dtype, dtype_to_data_type
from torchrec.sparse.jagged_tensor import KeyedTensor
from torchrec.types import CacheMixin, DataType

from kt_regroup.functional import regroup
from kt_regroup.plan import RegroupPlan, get_plan

logger = logging.getLogger(__name__)

_PERMUTE = torch.ops.kt_regroup.permute_multi_embedding.default

__all__ = ["KTRegroupAsDict", "RegroupPlanModule"]


def _layout_matches(
    keyed_tensors: List[KeyedTensor],
    in_keys: List[List[str]],
    in_lengths: List[List[int]],
    key_dim: int,
) -> bool:
    if len(keyed_tensors) != len(in_keys):
        return False
    for i, kt in enumerate(keyed_tensors):
        if kt.key_dim() != key_dim:
            return False
        # A list compares in C; keys or lengths given as tuples compare as lists.
        keys = kt.keys()
        if keys != in_keys[i] and (isinstance(keys, list) or list(keys) != in_keys[i]):
            return False
        lengths = kt.length_per_key()
        if lengths != in_lengths[i] and (
            isinstance(lengths, list) or list(lengths) != in_lengths[i]
        ):
            return False
    return True


def _is_fx_tracing() -> bool:
    """True under torchrec's tracer and under plain ``torch.fx.symbolic_trace``."""
    if _torchrec_tracer._is_fx_tracing_flag:  # flag reads first: this runs every call
        return True
    return _fx_trace._is_fx_tracing_flag and not torch.compiler.is_compiling()


def _cast(values: List[torch.Tensor], dtype: Optional[torch.dtype]) -> List[torch.Tensor]:
    if dtype is None:
        return values
    return [v.to(dtype) for v in values]


def _permute(
    values: List[torch.Tensor],
    permutes: torch.Tensor,
    in_shapes: torch.Tensor,
    out_shapes: torch.Tensor,
    out_lengths: List[int],
    multi_device: bool,
    dtype: Optional[torch.dtype],
    views: List[List[int]],
) -> List[torch.Tensor]:
    """The fused op with a plan that matches ``values``; the cast is fused into the copy.

    ``views`` (``allow_views``) holds per group ``[input, offset, width]`` for a group
    returned as a view and ``[-1, 0, 0]`` for a group the op copies; the plan then covers
    the copied groups only. Without views it is empty.
    """
    copied: List[torch.Tensor] = []
    if len(out_lengths) > 0 or len(views) == 0:
        if multi_device:
            device = values[0].device
            permutes = permutes.to(device, non_blocking=True)
            in_shapes = in_shapes.to(device, non_blocking=True)
            out_shapes = out_shapes.to(device, non_blocking=True)
        if dtype is None:
            copied = torch.ops.kt_regroup.permute_multi_embedding(
                values, permutes, in_shapes, out_shapes, out_lengths
            )
        else:
            copied = torch.ops.kt_regroup.permute_multi_embedding_to(
                values, permutes, in_shapes, out_shapes, out_lengths, dtype
            )
    if len(views) == 0:
        return copied
    out: List[torch.Tensor] = []
    k = 0
    for spec in views:
        if spec[0] < 0:
            out.append(copied[k])
            k += 1
        else:
            view = values[spec[0]].narrow(1, spec[1], spec[2])
            out.append(view if dtype is None else view.to(dtype))
    return out


@torch.fx.wrap
def _regroup_with_plan(
    keyed_tensors: List[KeyedTensor],
    groups: List[List[str]],
    in_keys: List[List[str]],
    in_lengths: List[List[int]],
    key_dim: int,
    permutes: torch.Tensor,
    in_shapes: torch.Tensor,
    out_shapes: torch.Tensor,
    out_lengths: List[int],
    multi_device: bool,
    dtype: Optional[torch.dtype],
    views: List[List[int]],
) -> List[torch.Tensor]:
    """Graph-mode regroup: the captured plan when the layout matches it, else uncached."""
    if key_dim == 1 and _layout_matches(keyed_tensors, in_keys, in_lengths, key_dim):
        values = [kt.values() for kt in keyed_tensors]
        return _permute(
            values, permutes, in_shapes, out_shapes, out_lengths, multi_device, dtype, views
        )
    return _cast(regroup(keyed_tensors, groups), dtype)


@torch.fx.wrap
def _to_tensor_dict(keys: List[str], values: List[torch.Tensor]) -> Dict[str, torch.Tensor]:
    return {key: values[i] for i, key in enumerate(keys)}


def _waited(obj):
    """What a torchrec LazyAwaitable (a sharded EBC's output under DistributedModelParallel)
    stands for; anything else unchanged. Its attribute reads wait on it the same way."""
    if "torchrec.distributed.types" in sys.modules:
        from torchrec.distributed.types import LazyAwaitable

        if isinstance(obj, LazyAwaitable):
            return LazyAwaitable._wait_async(obj)
    return obj


def _check_inputs(keyed_tensors, casts: bool) -> None:
    """Clear errors for what is not a list of KeyedTensors of one key_dim, and for mixed
    dtypes the module is not asked to cast (checked when a plan is built)."""
    if not isinstance(keyed_tensors, (list, tuple)):
        raise TypeError(
            "KTRegroupAsDict expects a list of KeyedTensors, got "
            f"{type(keyed_tensors).__name__}"
        )
    if len(keyed_tensors) == 0:
        raise ValueError("KTRegroupAsDict: keyed_tensors is empty")
    for i, kt in enumerate(keyed_tensors):
        if not isinstance(kt, KeyedTensor) and not isinstance(_waited(kt), KeyedTensor):
            raise TypeError(
                f"KTRegroupAsDict: keyed_tensors[{i}] is a {type(kt).__name__}, not a KeyedTensor"
            )
    key_dim = keyed_tensors[0].key_dim()
    for i, kt in enumerate(keyed_tensors):
        if kt.key_dim() != key_dim:
            raise ValueError(
                f"KTRegroupAsDict: all inputs must have the same key_dim; input {i} has "
                f"key_dim {kt.key_dim()}, input 0 has {key_dim}"
            )
    dtypes = {kt.values().dtype for kt in keyed_tensors}
    if len(dtypes) > 1 and not casts:
        raise TypeError(
            f"KTRegroupAsDict: the inputs have dtypes {sorted(str(d) for d in dtypes)}; "
            "set emb_dtype to regroup them into one dtype (the cast is fused into the copy)"
        )


def _layout_plan(
    keyed_tensors: List[KeyedTensor], groups: List[List[str]], allow_views: bool
) -> Tuple[RegroupPlan, List[List[int]]]:
    """The plan of the inputs' layout and, with ``allow_views``, the groups returned as
    views (``[input, offset, width]``, ``[-1, 0, 0]`` for copied ones; the plan then
    covers the copied groups only)."""
    plan = get_plan(  # layout errors
        [kt.keys() for kt in keyed_tensors], [kt.length_per_key() for kt in keyed_tensors], groups
    )
    views: List[List[int]] = []
    if allow_views and keyed_tensors[0].key_dim() == 1:
        specs = plan.view_specs()
        if any(spec is not None for spec in specs):
            views = [[-1, 0, 0] if s is None else list(s) for s in specs]
            plan = plan.restricted([j for j, s in enumerate(specs) if s is None])
    return plan, views


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
        casts: bool = False,
    ) -> None:
        super().__init__()
        self.in_keys = []
        self.in_lengths = []
        self.key_dim = 1
        self.out_lengths = []
        self.views = []  # per group: [input, offset, width] = a view, [-1, 0, 0] = copied
        permutes = torch.empty(0, 6, dtype=torch.int32)
        in_shapes = out_shapes = torch.empty(0, dtype=torch.int32)
        if keyed_tensors is not None and groups is not None:
            _check_inputs(keyed_tensors, casts)
            self.key_dim = keyed_tensors[0].key_dim()
            self.in_keys = [list(kt.keys()) for kt in keyed_tensors]
            self.in_lengths = [list(kt.length_per_key()) for kt in keyed_tensors]
            plan, self.views = _layout_plan(keyed_tensors, groups, allow_views)
            self.out_lengths = list(plan.out_lengths)
            permutes, in_shapes, out_shapes = plan.coalesced_tensors()
        # The truth on the host, for _apply; the buffers follow the module's device.
        self._host = (permutes, in_shapes, out_shapes)
        device = torch.device("cpu") if keyed_tensors is None else keyed_tensors[0].values().device
        self.register_buffer("_permutes", permutes.to(device, copy=True), persistent=False)
        self.register_buffer("_in_shapes", in_shapes.to(device, copy=True), persistent=False)
        self.register_buffer("_out_shapes", out_shapes.to(device, copy=True), persistent=False)

    def matches(self, keyed_tensors: List[KeyedTensor]) -> bool:
        """Whether this plan serves ``keyed_tensors``: the keys and widths it was built
        for, and buffers that hold values (not meta) wherever the data is.

        Runs on every eager call, so it is written for speed: the same key-list object
        every step (torchrec's EBC passes its own) compares by identity first, then in C.
        """
        in_keys = self.in_keys
        if not isinstance(keyed_tensors, (list, tuple)) or len(keyed_tensors) != len(in_keys):
            return False
        if len(in_keys) == 0:
            return False
        key_dim = self.key_dim
        for kt, keys, lengths in zip(keyed_tensors, in_keys, self.in_lengths):
            if kt.key_dim() != key_dim:
                return False
            got = kt.keys()
            if got != keys and (isinstance(got, list) or list(got) != keys):
                return False
            got = kt.length_per_key()
            if got != lengths and (isinstance(got, list) or list(got) != lengths):
                return False
        return not self._buffers["_permutes"].is_meta or keyed_tensors[0].values().is_meta

    def _apply(self, fn, recurse=True):
        # Device moves keep the plan; to_empty() would leave garbage in its buffers: the
        # moved buffers are rebuilt from the host copy wherever their values differ.
        super()._apply(fn, recurse)
        for name, host in zip(("_permutes", "_in_shapes", "_out_shapes"), self._host):
            buf = self._buffers[name]
            if not buf.is_meta and not torch.equal(buf.cpu(), host):
                self._buffers[name] = host.to(buf.device, copy=True)
        return self

    @torch.jit.export
    def set_device(self, device: str) -> None:
        self._permutes = self._permutes.to(device)
        self._in_shapes = self._in_shapes.to(device)
        self._out_shapes = self._out_shapes.to(device)


class KTRegroupAsDict(torch.nn.Module, CacheMixin):
    """Regroups a list of ``KeyedTensor``s into named groups, with a cached plan.

    Same constructor, output and methods as torchrec's ``KTRegroupAsDict``.

    Args:
        groups: the keys of each output group (a key may appear in several groups).
        keys: the name of each output group.
        emb_dtype: optional dtype (torchrec ``DataType`` or ``torch.dtype``) of the outputs.
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
    _plain: bool

    def __init__(
        self,
        groups: List[List[str]],
        keys: List[str],
        emb_dtype: Optional[Union[DataType, torch.dtype]] = None,
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
        self._plain = self._dtype is None and not multi_device  # the op as is, no extras
        self._stale_warned = False
        self._plan = RegroupPlanModule()

    @torch.jit.ignore
    def _build_plan(self, keyed_tensors: List[KeyedTensor]) -> RegroupPlanModule:
        """Builds the plan for this layout and swaps it in (one assignment)."""
        plan = RegroupPlanModule(
            keyed_tensors, self._groups, self._allow_views, casts=self._dtype is not None
        )
        old = self._modules["_plan"]
        changed = len(old.in_keys) > 0 and (
            old.in_keys != plan.in_keys or old.in_lengths != plan.in_lengths
        )
        # dynamo cannot trace a logger call; the rebuild happens either way.
        if changed and not self._stale_warned and not torch.compiler.is_compiling():
            logger.warning(
                "KTRegroupAsDict(keys=%s): the inputs' keys or widths changed since the plan "
                "was built; rebuilding it (shown once per module)",
                self._keys,
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
        if not torch.jit.is_scripting():
            if not _is_fx_tracing():
                # Eager and torch.compile: one read of the plan, rebuilt if it is stale.
                plan = self._modules["_plan"]
                if not plan.matches(keyed_tensors):
                    if torch.compiler.is_compiling():
                        # A plan of the graph's own (constants), the module untouched: its
                        # state is guarded, changing it would recompile on the next call.
                        return _to_tensor_dict(self._keys, self._regroup_in_graph(keyed_tensors))
                    plan = self._build_plan(keyed_tensors)
                if plan.key_dim != 1:
                    values = _cast(regroup(keyed_tensors, self._groups), self._dtype)
                else:
                    buffers = plan._buffers  # ~1 us cheaper per buffer than attribute access
                    args = (
                        [kt.values() for kt in keyed_tensors],
                        buffers["_permutes"],
                        buffers["_in_shapes"],
                        buffers["_out_shapes"],
                        plan.out_lengths,
                    )
                    if self._plain and len(plan.views) == 0:
                        # The common case, kept short: it runs on every serving call.
                        return dict(zip(self._keys, _PERMUTE(*args)))
                    values = _permute(*args, self._multi_device, self._dtype, plan.views)
                return _to_tensor_dict(self._keys, values)
        # fx tracing and TorchScript: the captured plan, checked on every call.
        values = _regroup_with_plan(
            keyed_tensors,
            self._groups,
            self._plan.in_keys,
            self._plan.in_lengths,
            self._plan.key_dim,
            self._plan._permutes,
            self._plan._in_shapes,
            self._plan._out_shapes,
            self._plan.out_lengths,
            self._multi_device,
            self._dtype,
            self._plan.views,
        )
        return _to_tensor_dict(self._keys, values)

    @torch.jit.ignore
    def _regroup_in_graph(self, keyed_tensors: List[KeyedTensor]) -> List[torch.Tensor]:
        _check_inputs(keyed_tensors, self._dtype is not None)
        if keyed_tensors[0].key_dim() != 1:
            return _cast(regroup(keyed_tensors, self._groups), self._dtype)
        plan, views = _layout_plan(keyed_tensors, self._groups, self._allow_views)
        values = [kt.values() for kt in keyed_tensors]
        return _permute(
            values, *plan.coalesced_tensors(values[0].device), list(plan.out_lengths),
            self._multi_device, self._dtype, views,
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


# torchrec's IR serializer learns this class where torchrec.ir exists.
from kt_regroup.torchrec_ir import register_ir_serializer  # noqa: E402

register_ir_serializer()
