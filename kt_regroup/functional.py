"""Functional regroup of torchrec ``KeyedTensor``s.

Same results as ``KeyedTensor.regroup`` / ``KeyedTensor.regroup_as_dict``, computed by
the fused ops in one pass. These functions are ``torch.fx.wrap``-ed like torchrec's, so
fx tracing keeps them as single calls, and they are TorchScript-able. The helpers
``layout`` and ``permute`` are what :class:`kt_regroup.KTRegroupAsDict` runs too.
"""

from typing import Dict, List, Optional, Tuple

import torch
from torchrec.sparse.jagged_tensor import KeyedTensor

from kt_regroup.plan import arguments
from kt_regroup.vbe import has_pooled_rows, regroup_rows

__all__ = ["regroup", "regroup_as_dict"]


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
            return regroup_rows(keyed_tensors, groups)
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
