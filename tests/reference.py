"""The test oracle: the ops written as plain slices, with no checks.

One slice copy per permute row. Columns no row covers are zeros, duplicated keys
accumulate their gradients (in float32 for float16/bfloat16, rounded once), keys used by
no row get zero gradients.
"""

from __future__ import annotations

from typing import List, Optional, Sequence

import torch

_ACCUMULATE_IN_FLOAT = (torch.float16, torch.bfloat16)


def _rows(permutes: torch.Tensor) -> List[List[int]]:
    return permutes.long().tolist()


def permute_multi_embedding_to_reference(
    pooled_embs: Sequence[torch.Tensor],
    permutes: torch.Tensor,
    in_shapes: torch.Tensor,
    out_shapes: torch.Tensor,
    out_lengths: Sequence[int],
    dtype: Optional[torch.dtype] = None,
) -> List[torch.Tensor]:
    first = pooled_embs[0]
    outs = [first.new_zeros(first.size(0), int(n), dtype=dtype) for n in out_lengths]
    for in_t, out_t, in_off, out_off, length, _ in _rows(permutes):
        outs[out_t][:, out_off : out_off + length] = pooled_embs[in_t][:, in_off : in_off + length]
    return outs


def permute_multi_embedding_reference(pooled_embs, permutes, in_shapes, out_shapes, out_lengths):
    return permute_multi_embedding_to_reference(
        pooled_embs, permutes, in_shapes, out_shapes, out_lengths
    )


def permute_multi_embedding_into_reference(pooled_embs, permutes, in_shapes, out_shapes, outs):
    got = permute_multi_embedding_to_reference(
        pooled_embs, permutes, in_shapes, out_shapes, [o.size(1) for o in outs]
    )
    for o, g in zip(outs, got):
        o.copy_(g)


def permute_multi_embedding_backward_reference(
    grad_outputs: Sequence[Optional[torch.Tensor]],
    permutes: torch.Tensor,
    in_shapes: torch.Tensor,
    out_shapes: torch.Tensor,
    in_lengths: Sequence[int],
    batch_size: int,
    dtype: torch.dtype,
) -> List[torch.Tensor]:
    defined = [g for g in grad_outputs if g is not None]
    device = defined[0].device if defined else permutes.device
    acc_dtype = torch.float32 if dtype in _ACCUMULATE_IN_FLOAT else dtype
    grads = [torch.zeros(batch_size, int(n), dtype=acc_dtype, device=device) for n in in_lengths]
    for in_t, out_t, in_off, out_off, length, _ in _rows(permutes):
        g = grad_outputs[out_t]
        if g is not None:
            grads[in_t][:, in_off : in_off + length] += g[:, out_off : out_off + length]
    return [g.to(dtype) for g in grads]


def permute_multi_embedding_vbe_reference(pooled_embs, indices, permutes, in_shapes, out_shapes, out_lengths):
    """The variable-batch forward: each input's rows picked by its index (None: as it is)."""
    expanded = [p if ix is None else p.index_select(0, ix) for p, ix in zip(pooled_embs, indices)]
    return permute_multi_embedding_reference(expanded, permutes, in_shapes, out_shapes, out_lengths)
