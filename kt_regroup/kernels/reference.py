"""Portable PyTorch kernels: the always-available fallback and the test oracle.

They run on any device PyTorch supports. Every output column is written exactly
once, columns no segment covers are zeros, and duplicate keys accumulate their
gradients (in float32 for float16/bfloat16, rounded once at the end, like the C++
kernel).
"""

from __future__ import annotations

from typing import List, Optional, Sequence

import torch

from kt_regroup.kernels.validation import check_backward_rows, check_permute_rows

__all__ = ["permute_multi_embedding_reference", "permute_multi_embedding_backward_reference"]

_ACCUMULATE_IN_FLOAT = (torch.float16, torch.bfloat16)


def permute_multi_embedding_reference(
    pooled_embs: Sequence[torch.Tensor],
    permutes: torch.Tensor,
    in_shapes: torch.Tensor,
    out_shapes: torch.Tensor,
    out_lengths: Sequence[int],
) -> List[torch.Tensor]:
    rows = check_permute_rows(
        "permute_multi_embedding", pooled_embs, permutes, in_shapes, out_shapes, out_lengths
    )
    first = pooled_embs[0]
    batch = first.size(0)
    outs = [first.new_zeros(batch, int(n)) for n in out_lengths]
    for in_t, out_t, in_off, out_off, length, _ in rows:
        outs[out_t][:, out_off : out_off + length] = pooled_embs[in_t][:, in_off : in_off + length]
    return outs


def permute_multi_embedding_backward_reference(
    grad_outputs: Sequence[Optional[torch.Tensor]],
    permutes: torch.Tensor,
    in_shapes: torch.Tensor,
    out_shapes: torch.Tensor,
    in_lengths: Sequence[int],
    batch_size: int,
    dtype: torch.dtype,
) -> List[torch.Tensor]:
    rows = check_backward_rows(
        "permute_multi_embedding_backward",
        grad_outputs, permutes, in_shapes, out_shapes, in_lengths, batch_size,
    )
    defined = [g for g in grad_outputs if g is not None]
    device = defined[0].device if defined else permutes.device
    acc_dtype = torch.float32 if dtype in _ACCUMULATE_IN_FLOAT else dtype
    grads = [
        torch.zeros(int(batch_size), int(n), dtype=acc_dtype, device=device) for n in in_lengths
    ]
    for in_t, out_t, in_off, out_off, length, _ in rows:
        g = grad_outputs[out_t]
        if g is None:
            continue
        grads[in_t][:, in_off : in_off + length] += g[:, out_off : out_off + length]
    return [g if g.dtype == dtype else g.to(dtype) for g in grads]
