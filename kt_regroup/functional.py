"""Functional regroup of torchrec ``KeyedTensor``s.

Same results as ``KeyedTensor.regroup`` / ``KeyedTensor.regroup_as_dict``, computed by
the fused ops in one pass. These functions are ``torch.fx.wrap``-ed like torchrec's, so
fx tracing keeps them as single calls, and they are TorchScript-able. The helpers
``layout`` and ``permute`` are what :class:`kt_regroup.KTRegroupAsDict` runs too.
"""

import re
import sys
import threading
from typing import Dict, List, NamedTuple, Optional, Tuple

import torch
import torch.utils._pytree as pytree
from torchrec.sparse.jagged_tensor import KeyedTensor

from kt_regroup.plan import arguments

__all__ = ["VariableBatchKeyedTensor", "regroup", "regroup_as_dict"]


def layout(
    keyed_tensors: List[KeyedTensor], who: str
) -> Tuple[List[List[str]], List[List[int]], int]:
    """The keys, widths and key_dim of ``keyed_tensors``; ``ValueError`` naming ``who``
    for an empty list or mixed key_dims."""
    if len(keyed_tensors) == 0:
        raise ValueError(f"{who}: keyed_tensors is empty")
    key_dim = keyed_tensors[0].key_dim()
    for i, kt in enumerate(keyed_tensors):
        if kt.key_dim() != key_dim:
            raise ValueError(
                f"{who}: all inputs must have the same key_dim; input {i} has key_dim "
                f"{kt.key_dim()}, input 0 has {key_dim}"
            )
    lengths = [kt.length_per_key() for kt in keyed_tensors]
    if not torch.jit.is_scripting():  # scripted, length_per_key() is a List[int]
        lengths = _int_widths(keyed_tensors, lengths, who)
    return [kt.keys() for kt in keyed_tensors], lengths, key_dim


@torch.jit.unused
def _int_widths(
    keyed_tensors: List[KeyedTensor], lengths: List[List[int]], who: str
) -> List[List[int]]:
    """``lengths`` as ints. Whole-number floats become ints, as a warm plan's comparison
    (``3.0 == 3``) takes them; anything else is a TypeError naming the key."""
    out = []
    for i, widths in enumerate(lengths):
        if all(type(w) is int for w in widths):
            out.append(widths)
            continue
        for key, w in zip(keyed_tensors[i].keys(), widths):
            if not (isinstance(w, int) or (isinstance(w, float) and w.is_integer())):
                raise TypeError(
                    f"{who}: input {i} key {key!r} has width {w!r}; widths must be integers"
                )
        out.append([int(w) for w in widths])
    return out


def permute(
    values: List[torch.Tensor],
    permutes: torch.Tensor,
    in_shapes: torch.Tensor,
    out_shapes: torch.Tensor,
    out_lengths: List[int],
    key_dim: int,
    dtype: Optional[torch.dtype],
) -> List[torch.Tensor]:
    """The fused op (with the cast fused in, for ``dtype``); along ``key_dim != 1``, the
    plan's blocks gathered with one ``cat``."""
    if key_dim == 1:
        if dtype is None:
            return torch.ops.kt_regroup.permute_multi_embedding(
                values, permutes, in_shapes, out_shapes, out_lengths
            )
        return torch.ops.kt_regroup.permute_multi_embedding_to(
            values, permutes, in_shapes, out_shapes, out_lengths, dtype
        )
    rows = torch.jit.annotate(List[List[int]], permutes.long().tolist())
    blocks = [values[r[0]].narrow(key_dim, r[2], r[4]) for r in rows]
    if len(blocks) == 0:
        size = list(values[0].shape)
        size[key_dim] = 0
        outs = [values[0].new_zeros(size) for _ in out_lengths]
    else:
        outs = list(torch.cat(blocks, dim=key_dim).split(out_lengths, dim=key_dim))
    return outs if dtype is None else [o.to(dtype) for o in outs]


@torch.fx.wrap
def regroup(keyed_tensors: List[KeyedTensor], groups: List[List[str]]) -> List[torch.Tensor]:
    """Regroups ``keyed_tensors`` into one tensor per group of keys; mixed dtypes promote
    as torchrec's ``torch.cat`` does.

    Example::

        >>> kt = KeyedTensor.from_tensor_list(["a", "b"], [torch.ones(2, 1), torch.zeros(2, 3)])
        >>> [t.shape for t in regroup([kt], [["b"], ["a", "b"]])]
        [torch.Size([2, 3]), torch.Size([2, 4])]
    """
    if not torch.jit.is_scripting():
        if has_pooled_rows(keyed_tensors):
            return regroup_rows(keyed_tensors, groups, None)
    keys, lengths, key_dim = layout(keyed_tensors, "kt_regroup.regroup")
    values = [kt.values() for kt in keyed_tensors]
    dtype = values[0].dtype
    for v in values:
        dtype = torch.promote_types(dtype, v.dtype)
    cast: Optional[torch.dtype] = None
    for v in values:
        if v.dtype != dtype:
            cast = dtype
    if torch.jit.is_scripting():
        permutes, in_shapes, out_shapes, out_lengths = torch.ops.kt_regroup.kt_regroup_arguments(
            values[0], keys, lengths, groups
        )
    else:  # with the error naming a key the schema cannot take
        permutes, in_shapes, out_shapes, out_lengths = arguments(values[0], keys, lengths, groups)
    return permute(values, permutes, in_shapes, out_shapes, out_lengths, key_dim, cast)


@torch.fx.wrap
def regroup_as_dict(
    keyed_tensors: List[KeyedTensor], groups: List[List[str]], keys: List[str]
) -> Dict[str, torch.Tensor]:
    """Like :func:`regroup`, with the groups returned by name."""
    if len(groups) != len(keys):
        raise ValueError(f"kt_regroup.regroup_as_dict: {len(groups)} groups but {len(keys)} keys")
    values = regroup(keyed_tensors, groups)
    return {key: values[i] for i, key in enumerate(keys)}


# --- variable-batch (VBE) outputs: regrouped from the pooled rows, never expanded ----------


class VariableBatchKeyedTensor(KeyedTensor):
    """A ``KeyedTensor`` whose values are expanded only when something reads them.

    What ``patch_torchrec()``'s ``EmbeddingBagCollection`` returns for a variable-batch
    KJT: per key, the pooled rows ``[rows_k, D_k]`` and the row of each sample
    (``indices[k]``, ``[B]``; None: one row per sample). ``values()``, ``to_dict()`` and
    every other ``KeyedTensor`` method see torchrec's ``[B, sum(D)]`` values, expanded once
    by :func:`kt_regroup.ops.permute_multi_embedding_vbe` under the grad and inference
    modes the KeyedTensor was made in (torchrec computes them then), whatever mode the
    first read runs in. Until then kt_regroup's regroups read the rows directly; from
    then on every consumer reads the values, so in-place changes to them are seen.
    Pickling and pytree flattening give a plain ``KeyedTensor`` of the values.
    """

    def __init__(
        self,
        keys: List[str],
        length_per_key: List[int],
        pooled: List[torch.Tensor],
        indices: List[Optional[torch.Tensor]],
    ) -> None:
        self.pooled, self.indices, self._expanded = pooled, indices, None
        self._modes = (torch.is_grad_enabled(), torch.is_inference_mode_enabled())
        super().__init__(keys, length_per_key, None)  # type: ignore[arg-type]

    @property
    def _values(self) -> torch.Tensor:  # type: ignore[override]
        values = self._expanded
        if values is None:
            with _EXPAND_LOCK:  # one expansion: every reader gets the same tensor
                values = self._expanded
                if values is None:
                    values = self._expanded = self._expand()
        return values

    @_values.setter
    def _values(self, values: Optional[torch.Tensor]) -> None:
        self._expanded = values

    def _expand(self) -> torch.Tensor:
        grad, inference = self._modes
        if (grad, inference) == (torch.is_grad_enabled(), torch.is_inference_mode_enabled()):
            return regroup_rows([self], [self.keys()], None)[0]
        with torch.inference_mode(inference), torch.set_grad_enabled(grad):
            return regroup_rows([self], [self.keys()], None)[0]

    def __reduce__(self):  # a plain KeyedTensor: loads without kt_regroup
        return (
            KeyedTensor,
            (self._keys, self._length_per_key, self._values, self._key_dim,
             self._offset_per_key, self._index_per_key),
        )


_EXPAND_LOCK = threading.RLock()


_Context = Tuple[List[str], List[int]]


def _flatten_vbkt(kt: VariableBatchKeyedTensor) -> Tuple[List[torch.Tensor], _Context]:
    return [kt._values], (kt._keys, kt._length_per_key)


def _flatten_vbkt_with_keys(kt: VariableBatchKeyedTensor):
    return [(pytree.GetAttrKey("_values"), kt._values)], (kt._keys, kt._length_per_key)


def _unflatten_vbkt(values: List[torch.Tensor], context: _Context) -> KeyedTensor:
    return KeyedTensor(list(context[0]), list(context[1]), values[0])


# As torchrec's KeyedTensor: one leaf, the values (pytree finds nodes by exact type).
pytree.register_pytree_node(
    VariableBatchKeyedTensor,
    _flatten_vbkt,
    _unflatten_vbkt,
    serialized_type_name="kt_regroup.VariableBatchKeyedTensor",
    flatten_with_keys_fn=_flatten_vbkt_with_keys,
)


# --- what KTRegroupAsDict runs (kt_regroup.module) ------------------------------------


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


def _check_one_dtype(values: List[torch.Tensor]) -> None:
    for i, v in enumerate(values):
        if v.dtype != values[0].dtype:
            raise TypeError(
                f"KTRegroupAsDict: input {i} is {v.dtype} but input 0 is {values[0].dtype}; "
                "set emb_dtype to regroup them into one dtype (the cast is fused into the copy)"
            )


class Plan(NamedTuple):
    """What one regroup call reads of a plan (the fields of a :class:`RegroupPlanModule`).

    ``views`` (``allow_views``) holds per group ``[input, offset, width]`` for a group
    returned as a view and ``[-1, 0, 0]`` for one the op copies; the permute tensors then
    cover the copied groups only. Without views it is empty. ``rows`` (variable-batch
    inputs) holds per input whether it is regrouped from its pooled rows; the permute
    tensors then take such an input as one tensor per key. Without such inputs it is empty.
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
    """The regroup with ``plan`` (``checked``: known to match the inputs), or with an
    uncached plan where the inputs' layout differs from it."""
    if not torch.jit.is_scripting() and checked and len(plan.rows) > 0:
        return dict(zip(names, regroup_rows(keyed_tensors, groups, dtype, plan, multi_device)))
    values = [kt.values() for kt in keyed_tensors]
    if dtype is None:
        _check_one_dtype(values)
    permutes, in_shapes, out_shapes = plan.permutes, plan.in_shapes, plan.out_shapes
    out_lengths, views, key_dim = plan.out_lengths, plan.views, plan.key_dim
    if not checked and (
        len(plan.rows) > 0 or not matches(keyed_tensors, plan.in_keys, plan.in_lengths, key_dim)
    ):
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


@torch.jit.unused
def _waited(kt: KeyedTensor) -> KeyedTensor:
    """What a torchrec LazyAwaitable (a sharded EBC's output under DMP) stands for."""
    types = sys.modules.get("torchrec.distributed.types")
    if types is not None and isinstance(kt, types.LazyAwaitable):
        return types.LazyAwaitable._wait_async(kt)
    return kt


@torch.jit.unused
def has_pooled_rows(keyed_tensors: List[KeyedTensor]) -> bool:
    if not isinstance(keyed_tensors, (list, tuple)):
        return False
    for kt in keyed_tensors:  # a plain KeyedTensor first: neither kind, and the usual one
        if type(kt) is not KeyedTensor and _rows_of(_waited(kt)):
            return True
    return False


@torch.jit.unused
def _rows_of(kt: KeyedTensor) -> bool:
    """Whether ``kt`` is regrouped from its pooled rows: a variable-batch KeyedTensor whose
    values nobody has read (once they exist, they are what every consumer reads)."""
    return isinstance(kt, VariableBatchKeyedTensor) and kt._expanded is None


@torch.jit.unused
def rows_layout(
    keyed_tensors: List[KeyedTensor],
) -> Tuple[List[bool], List[List[str]], List[List[int]]]:
    """Per input, whether it is regrouped from its pooled rows, and the op's inputs' keys
    and widths: one tensor per key of such an input, the values of any other."""
    rows: List[bool] = []
    keys: List[List[str]] = []
    lengths: List[List[int]] = []
    for kt in map(_waited, keyed_tensors):
        if kt.key_dim() != 1:
            raise ValueError("kt_regroup: variable-batch inputs regroup along key_dim 1 only")
        rows.append(_rows_of(kt))
        if rows[-1]:
            keys += [[k] for k in kt.keys()]
            lengths += [[int(n)] for n in kt.length_per_key()]
        else:
            keys.append(list(kt.keys()))
            lengths.append([int(n) for n in kt.length_per_key()])
    return rows, keys, lengths


@torch.jit.unused
def regroup_rows(
    keyed_tensors: List[KeyedTensor],
    groups: List[List[str]],
    dtype: Optional[torch.dtype],
    plan: Optional[Plan] = None,
    multi_device: bool = False,
) -> List[torch.Tensor]:
    """The regroup of inputs some of which are :class:`VariableBatchKeyedTensor`: one
    ``permute_multi_embedding_vbe`` call on their pooled rows (one input per key) and the
    other inputs' values. Mixed dtypes promote as :func:`regroup` does. ``plan``: a
    :class:`Plan` known to match the inputs (its ``rows`` say which are read as rows)."""
    pooled: List[torch.Tensor] = []
    indices: List[Optional[torch.Tensor]] = []
    if plan is None:
        rows, keys, lengths = rows_layout(keyed_tensors)
    else:
        rows = plan.rows
    for kt, from_rows in zip(map(_waited, keyed_tensors), rows):
        if from_rows:
            pooled += kt.pooled
            indices += kt.indices
        else:
            pooled.append(kt.values())
            indices.append(None)
    if plan is None:
        permutes, in_shapes, out_shapes, out_lengths = torch.ops.kt_regroup.kt_regroup_arguments(
            pooled[0], keys, lengths, groups
        )
    else:
        permutes, in_shapes, out_shapes = plan.permutes, plan.in_shapes, plan.out_shapes
        out_lengths = plan.out_lengths
        if multi_device:
            device = pooled[0].device
            permutes = permutes.to(device, non_blocking=True)
            in_shapes = in_shapes.to(device, non_blocking=True)
            out_shapes = out_shapes.to(device, non_blocking=True)
    try:
        outs = torch.ops.kt_regroup.permute_multi_embedding_vbe(
            pooled, indices, permutes, in_shapes, out_shapes, out_lengths
        )
    except (IndexError, TypeError) as exc:
        outs = _rows_error(
            exc, keyed_tensors, pooled, indices, permutes, in_shapes, out_shapes, out_lengths
        )
    return outs if dtype is None else [o.to(dtype) for o in outs]


@torch.jit.unused
def _rows_error(
    exc: Exception, keyed_tensors: List[KeyedTensor], pooled: List[torch.Tensor],
    indices: List[Optional[torch.Tensor]], permutes: torch.Tensor, in_shapes: torch.Tensor,
    out_shapes: torch.Tensor, out_lengths: List[int],
) -> List[torch.Tensor]:
    """After the op's error: mixed dtypes are promoted and the call made again; a bad
    index is re-raised naming its key."""
    if isinstance(exc, TypeError):
        promoted = pooled[0].dtype
        for p in pooled:
            promoted = torch.promote_types(promoted, p.dtype)
        if all(p.dtype == promoted for p in pooled):
            raise exc
        return torch.ops.kt_regroup.permute_multi_embedding_vbe(
            [p.to(promoted) for p in pooled], indices, permutes, in_shapes, out_shapes, out_lengths
        )
    found = re.search(r"indices\[(\d+)\]\[(\d+)\]", str(exc))
    if found is None:
        raise exc
    keys = rows_layout(keyed_tensors)[1]
    key, sample = keys[int(found[1])][0], found[2]
    raise IndexError(f"kt_regroup: key {key!r}, sample {sample}: {exc}") from exc
