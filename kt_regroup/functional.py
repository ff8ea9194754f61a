"""Functional regroup of torchrec ``KeyedTensor``s.

Same results as ``KeyedTensor.regroup`` / ``KeyedTensor.regroup_as_dict``, computed by
``torch.ops.kt_regroup.regroup_keyed_tensor`` in one fused pass. These functions are
``torch.fx.wrap``-ed like torchrec's, so fx tracing keeps them as single calls, and they
are TorchScript-able.
"""

from typing import Dict, List

import torch
from torchrec.sparse.jagged_tensor import KeyedTensor

import kt_regroup.keyed_tensor_pytree  # noqa: F401  (KeyedTensor as a torch.export input)
import kt_regroup.ops  # noqa: F401  (registers torch.ops.kt_regroup)

__all__ = ["regroup", "regroup_as_dict"]


def _regroup_along(
    values: List[torch.Tensor],
    keys: List[List[str]],
    lengths: List[List[int]],
    groups: List[List[str]],
    dim: int,
) -> List[torch.Tensor]:
    """``key_dim != 1``: the op's plan, gathered with one ``cat`` along ``dim``."""
    permutes, in_shapes, out_shapes, out_lengths = torch.ops.kt_regroup.kt_regroup_arguments(
        torch.empty(0), keys, lengths, groups
    )
    rows = torch.jit.annotate(List[List[int]], permutes.long().tolist())
    blocks = [values[r[0]].narrow(dim, r[2], r[4]) for r in rows]
    if len(blocks) == 0:
        size = list(values[0].shape)
        size[dim] = 0
        return [values[0].new_zeros(size) for g in groups]
    return list(torch.cat(blocks, dim=dim).split(out_lengths, dim=dim))


@torch.fx.wrap
def regroup(keyed_tensors: List[KeyedTensor], groups: List[List[str]]) -> List[torch.Tensor]:
    """Regroups ``keyed_tensors`` into one tensor per group of keys.

    Example::

        >>> kt = KeyedTensor.from_tensor_list(["a", "b"], [torch.ones(2, 1), torch.zeros(2, 3)])
        >>> [t.shape for t in regroup([kt], [["b"], ["a", "b"]])]
        [torch.Size([2, 3]), torch.Size([2, 4])]
    """
    if len(keyed_tensors) == 0:
        raise ValueError("kt_regroup.regroup: keyed_tensors is empty")
    key_dim = keyed_tensors[0].key_dim()
    for i, kt in enumerate(keyed_tensors):
        if kt.key_dim() != key_dim:
            raise ValueError(
                f"kt_regroup.regroup: all inputs must have the same key_dim; input {i} has "
                f"key_dim {kt.key_dim()}, input 0 has {key_dim}"
            )
    values = [kt.values() for kt in keyed_tensors]
    keys = [kt.keys() for kt in keyed_tensors]
    lengths = [kt.length_per_key() for kt in keyed_tensors]
    if key_dim != 1:
        return _regroup_along(values, keys, lengths, groups, key_dim)
    dtype = values[0].dtype
    for v in values:
        dtype = torch.promote_types(dtype, v.dtype)
    for v in values:
        if v.dtype != dtype:
            # Mixed dtypes promote, as torchrec's torch.cat does; the cast is in the copy.
            permutes, in_shapes, out_shapes, out_lengths = (
                torch.ops.kt_regroup.kt_regroup_arguments(values[0], keys, lengths, groups)
            )
            return torch.ops.kt_regroup.permute_multi_embedding_to(
                values, permutes, in_shapes, out_shapes, out_lengths, dtype
            )
    return torch.ops.kt_regroup.regroup_keyed_tensor(values, keys, lengths, groups)


@torch.fx.wrap
def regroup_as_dict(
    keyed_tensors: List[KeyedTensor], groups: List[List[str]], keys: List[str]
) -> Dict[str, torch.Tensor]:
    """Like :func:`regroup`, with the groups returned by name."""
    if len(groups) != len(keys):
        raise ValueError(f"kt_regroup.regroup_as_dict: {len(groups)} groups but {len(keys)} keys")
    values = regroup(keyed_tensors, groups)
    return {key: values[i] for i, key in enumerate(keys)}
