"""Functional regroup of torchrec ``KeyedTensor``s.

Same results as ``KeyedTensor.regroup`` / ``KeyedTensor.regroup_as_dict``, computed by
``torch.ops.kt_regroup.regroup_keyed_tensor`` in one fused pass (the permute plan of
each layout is memoised). These functions are ``torch.fx.wrap``-ed like torchrec's, so
fx tracing keeps them as single calls, and they are TorchScript-able.
"""


from typing import Dict, List

import torch
from torchrec.sparse.jagged_tensor import KeyedTensor

import kt_regroup.ops  # noqa: F401  (registers torch.ops.kt_regroup)

__all__ = ["regroup", "regroup_as_dict"]


def _regroup_by_cat(keyed_tensors: List[KeyedTensor], groups: List[List[str]]) -> List[torch.Tensor]:
    """Fallback for ``key_dim != 1``: gather the key blocks with one cat per call."""
    key_dim = keyed_tensors[0].key_dim()
    where: Dict[str, int] = {}
    for i, kt in enumerate(keyed_tensors):
        for key in kt.keys():
            if key in where:
                raise ValueError(f"kt_regroup: key '{key}' appears in input {where[key]} and input {i}")
            where[key] = i
    blocks: List[torch.Tensor] = []
    splits: List[int] = []
    for g, group in enumerate(groups):
        width = 0
        for key in group:
            if key not in where:
                raise KeyError(f"kt_regroup: group {g} asks for key '{key}', which is in none of the inputs")
            kt = keyed_tensors[where[key]]
            offsets = kt.offset_per_key()
            k = kt._key_indices()[key]
            length = offsets[k + 1] - offsets[k]
            blocks.append(kt.values().narrow(key_dim, offsets[k], length))
            width += length
        splits.append(width)
    return list(torch.cat(blocks, dim=key_dim).split(splits, dim=key_dim))


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
    for kt in keyed_tensors:
        if kt.key_dim() != 1:
            return _regroup_by_cat(keyed_tensors, groups)
    return torch.ops.kt_regroup.regroup_keyed_tensor(
        [kt.values() for kt in keyed_tensors],
        [kt.keys() for kt in keyed_tensors],
        [kt.length_per_key() for kt in keyed_tensors],
        groups,
    )


@torch.fx.wrap
def regroup_as_dict(
    keyed_tensors: List[KeyedTensor], groups: List[List[str]], keys: List[str]
) -> Dict[str, torch.Tensor]:
    """Like :func:`regroup`, with the groups returned by name."""
    if len(groups) != len(keys):
        raise ValueError(
            f"kt_regroup.regroup_as_dict: {len(groups)} groups but {len(keys)} keys"
        )
    values = regroup(keyed_tensors, groups)
    return {key: values[i] for i, key in enumerate(keys)}
