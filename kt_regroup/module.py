"""``KTRegroupAsDict``: drop-in for ``torchrec.modules.regroup.KTRegroupAsDict``.

The module builds its permute plan on the first forward and then calls the fused
``torch.ops.kt_regroup.permute_multi_embedding`` every step.

Staleness: the plan is tied to the layout (keys and widths of every input) it was
built for. Every eager call compares the layout with the cached one (list
comparisons, a few microseconds) and **rebuilds** the plan when it differs, logging
one warning per module. A graph captured by ``torch.fx`` or TorchScript cannot
rebuild its constants: there the check runs too, and a call whose layout differs
from the captured one is computed by the uncached fused path
(``regroup_keyed_tensor``), so the answer is right either way. A graph traced before
the first forward has no plan and always uses that uncached path.
"""


import logging
from typing import Dict, List, Optional, Union

import torch
import torch.fx._symbolic_trace as _fx_trace
import torchrec.fx.tracer as _torchrec_tracer
from torchrec.modules.embedding_configs import data_type_to_dtype
from torchrec.sparse.jagged_tensor import KeyedTensor
from torchrec.types import CacheMixin, DataType

import kt_regroup.ops  # noqa: F401  (registers torch.ops.kt_regroup)
from kt_regroup.functional import _regroup_by_cat
from kt_regroup.ops import get_plan

logger = logging.getLogger(__name__)

__all__ = ["KTRegroupAsDict"]


def _layout_matches(
    keyed_tensors: List[KeyedTensor],
    in_keys: List[List[str]],
    in_lengths: List[List[int]],
    key_dim: int,
) -> bool:
    if len(keyed_tensors) != len(in_keys):
        return False
    for i, kt in enumerate(keyed_tensors):
        if kt.key_dim() != key_dim or kt.keys() != in_keys[i] or kt.length_per_key() != in_lengths[i]:
            return False
    return True


def _is_fx_tracing() -> bool:
    """True under torchrec's tracer and under plain ``torch.fx.symbolic_trace``."""
    # Flag reads first: this runs on every eager call.
    if _torchrec_tracer._is_fx_tracing_flag:
        return True
    return _fx_trace._is_fx_tracing_flag and not torch.compiler.is_compiling()


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

    With ``allow_views``, ``views[j]`` is ``[input, offset, width]`` for a group returned
    as a view and ``[-1, 0, 0]`` for a group the op copies (not ``[]``: TorchScript types
    a literal like ``[[0, 0, 5], []]`` as a union); the plan then covers the copied
    groups only. Without, ``views`` is empty.
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


def _cast(values: List[torch.Tensor], dtype: Optional[torch.dtype]) -> List[torch.Tensor]:
    if dtype is None:
        return values
    return [v.to(dtype) for v in values]


@torch.fx.wrap
def _regroup_with_plan(
    keyed_tensors: List[KeyedTensor],
    groups: List[List[str]],
    in_keys: List[List[str]],
    in_lengths: List[List[int]],
    permutes: torch.Tensor,
    in_shapes: torch.Tensor,
    out_shapes: torch.Tensor,
    out_lengths: List[int],
    multi_device: bool,
    dtype: Optional[torch.dtype],
    views: List[List[int]],
) -> List[torch.Tensor]:
    """Graph-mode regroup: the captured plan when the layout matches it, else uncached."""
    values = [kt.values() for kt in keyed_tensors]
    if _layout_matches(keyed_tensors, in_keys, in_lengths, 1):
        return _permute(
            values, permutes, in_shapes, out_shapes, out_lengths, multi_device, dtype, views
        )
    for kt in keyed_tensors:
        if kt.key_dim() != 1:
            return _cast(_regroup_by_cat(keyed_tensors, groups), dtype)
    regrouped = torch.ops.kt_regroup.regroup_keyed_tensor(
        values,
        [kt.keys() for kt in keyed_tensors],
        [kt.length_per_key() for kt in keyed_tensors],
        groups,
    )
    return _cast(regrouped, dtype)


@torch.fx.wrap
def _to_tensor_dict(keys: List[str], values: List[torch.Tensor]) -> Dict[str, torch.Tensor]:
    return {key: values[i] for i, key in enumerate(keys)}


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
            outputs alias the input: writing to one changes the other, and they are
            not contiguous. Other groups are copied as usual. Off by default (torchrec's
            module always returns fresh tensors).

    Example::

        >>> m = KTRegroupAsDict(groups=[["f1", "f2"], ["f3"]], keys=["user", "item"])
        >>> kt = KeyedTensor.from_tensor_list(["f1", "f2", "f3"], [torch.randn(2, 4)] * 3)
        >>> {k: v.shape for k, v in m([kt]).items()}
        {'user': torch.Size([2, 8]), 'item': torch.Size([2, 4])}
    """

    _groups: List[List[str]]
    _keys: List[str]
    _emb_dtype: Optional[torch.dtype]
    _multi_device: bool
    _in_keys: List[List[str]]
    _in_lengths: List[List[int]]
    _out_lengths: List[int]
    _is_inited: bool
    _dim: int
    _allow_views: bool
    _views: List[List[int]]

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
            emb_dtype = data_type_to_dtype(emb_dtype)
        self._emb_dtype = emb_dtype
        self._multi_device = multi_device
        self._is_inited = False
        self._dim = 1
        self._stale_warned = False
        self._in_keys = []
        self._in_lengths = []
        self._out_lengths = []
        self._allow_views = allow_views
        self._views = []  # per group: [input, offset, width] = a view, [-1, 0, 0] = copied
        self.register_buffer("_permutes", torch.empty(0, 6, dtype=torch.int32), persistent=False)
        self.register_buffer("_in_shapes", torch.empty(0, dtype=torch.int32), persistent=False)
        self.register_buffer("_out_shapes", torch.empty(0, dtype=torch.int32), persistent=False)

    def _build_plan(self, keyed_tensors: List[KeyedTensor]) -> None:
        if len(keyed_tensors) == 0:
            raise ValueError("KTRegroupAsDict: keyed_tensors is empty")
        device = keyed_tensors[0].values().device
        for i, kt in enumerate(keyed_tensors):
            if kt.values().device != device:
                raise ValueError(
                    f"KTRegroupAsDict: input {i} is on {kt.values().device}, input 0 on {device}"
                )
        in_keys = [list(kt.keys()) for kt in keyed_tensors]
        in_lengths = [list(kt.length_per_key()) for kt in keyed_tensors]
        plan = get_plan(in_keys, in_lengths, self._groups)  # validates the layout
        self._dim = keyed_tensors[0].key_dim()
        views: List[List[int]] = []
        if self._allow_views:
            specs = plan.view_specs()
            if any(spec is not None for spec in specs):
                views = [[-1, 0, 0] if spec is None else list(spec) for spec in specs]
                plan = plan.restricted([j for j, spec in enumerate(specs) if spec is None])
        self._permutes, self._in_shapes, self._out_shapes = plan.tensors(device)
        self._in_keys = in_keys
        self._in_lengths = in_lengths
        self._out_lengths = list(plan.out_lengths)
        self._views = views
        self._is_inited = True

    @torch.jit.ignore
    def _refresh_plan(self, keyed_tensors: List[KeyedTensor]) -> None:
        """Builds the plan on the first call, rebuilds it when the layout changed."""
        if self._is_inited:
            # dynamo cannot trace a logger call (fullgraph compile would fail): the
            # warning is an eager-mode courtesy, the rebuild below happens either way.
            if not self._stale_warned and not torch.compiler.is_compiling():
                logger.warning(
                    "KTRegroupAsDict(keys=%s): the inputs' keys or widths changed since the "
                    "plan was built; rebuilding it (this warning is shown once per module)",
                    self._keys,
                )
                self._stale_warned = True
        self._build_plan(keyed_tensors)

    def forward(self, keyed_tensors: List[KeyedTensor]) -> Dict[str, torch.Tensor]:
        """
        Args:
            keyed_tensors: the KeyedTensors to regroup.

        Returns:
            One tensor per group, keyed by the group's name.
        """
        if not torch.jit.is_scripting():
            if not _is_fx_tracing():
                # Eager and torch.compile: the cached plan is always the current one.
                if not (
                    self._is_inited
                    and _layout_matches(keyed_tensors, self._in_keys, self._in_lengths, self._dim)
                ):
                    self._refresh_plan(keyed_tensors)
                if self._dim != 1:
                    values = _cast(_regroup_by_cat(keyed_tensors, self._groups), self._emb_dtype)
                else:
                    # Buffers read from the dict: nn.Module.__getattr__ costs ~1 us per
                    # buffer, a third of a small regroup's budget.
                    buffers = self._buffers
                    values = _permute(
                        [kt.values() for kt in keyed_tensors],
                        buffers["_permutes"],
                        buffers["_in_shapes"],
                        buffers["_out_shapes"],
                        self._out_lengths,
                        self._multi_device,
                        self._emb_dtype,
                        self._views,
                    )
                return _to_tensor_dict(self._keys, values)
        # fx tracing and TorchScript: the captured plan, checked on every call.
        values = _regroup_with_plan(
            keyed_tensors,
            self._groups,
            self._in_keys,
            self._in_lengths,
            self._permutes,
            self._in_shapes,
            self._out_shapes,
            self._out_lengths,
            self._multi_device,
            self._emb_dtype,
            self._views,
        )
        return _to_tensor_dict(self._keys, values)

    @torch.jit.export
    def set_device(self, device: str) -> None:
        self._permutes = self._permutes.to(device)
        self._in_shapes = self._in_shapes.to(device)
        self._out_shapes = self._out_shapes.to(device)

    def clear_cache(self) -> None:
        self._is_inited = False
