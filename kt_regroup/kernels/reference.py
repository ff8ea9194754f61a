"""Portable PyTorch kernels: the fallback where the compiled library is absent, and the
test oracle.

One slice copy per permute row. Every output column is written exactly once (columns no
row covers are zeros), duplicated keys accumulate their gradients (in float32 for
float16/bfloat16, rounded once), keys used by no row get zero gradients.
"""

from __future__ import annotations

from typing import List, Optional, Sequence

import torch

from kt_regroup.kernels.validation import check_into_outputs, check_rows, check_structure

__all__ = [
    "permute_multi_embedding_backward_reference",
    "permute_multi_embedding_into_reference",
    "permute_multi_embedding_reference",
    "permute_multi_embedding_to_reference",
]

_ACCUMULATE_IN_FLOAT = (torch.float16, torch.bfloat16)


def _forward_rows(op, pooled_embs, permutes, in_shapes, out_shapes, out_lengths,
                  same_dtype=True):
    check_structure(op, "pooled_embs", pooled_embs, permutes, in_shapes, out_shapes,
                    len(pooled_embs), out_lengths, same_dtype=same_dtype)
    return check_rows(
        op, permutes, in_shapes, out_shapes, [t.size(1) for t in pooled_embs],
        [int(n) for n in out_lengths], "pooled_embs widths", "out_lengths",
    )


def _copy(pooled_embs, rows, outs) -> None:
    for in_t, out_t, in_off, out_off, length, _ in rows:
        outs[out_t][:, out_off : out_off + length] = pooled_embs[in_t][:, in_off : in_off + length]


def permute_multi_embedding_to_reference(
    pooled_embs: Sequence[torch.Tensor],
    permutes: torch.Tensor,
    in_shapes: torch.Tensor,
    out_shapes: torch.Tensor,
    out_lengths: Sequence[int],
    dtype: Optional[torch.dtype] = None,
) -> List[torch.Tensor]:
    rows = _forward_rows(
        "permute_multi_embedding_to", pooled_embs, permutes, in_shapes, out_shapes, out_lengths,
        same_dtype=dtype is None,
    )
    first = pooled_embs[0]
    outs = [first.new_zeros(first.size(0), int(n), dtype=dtype) for n in out_lengths]
    _copy(pooled_embs, rows, outs)
    return outs


def permute_multi_embedding_reference(
    pooled_embs: Sequence[torch.Tensor],
    permutes: torch.Tensor,
    in_shapes: torch.Tensor,
    out_shapes: torch.Tensor,
    out_lengths: Sequence[int],
) -> List[torch.Tensor]:
    rows = _forward_rows(
        "permute_multi_embedding", pooled_embs, permutes, in_shapes, out_shapes, out_lengths
    )
    first = pooled_embs[0]
    outs = [first.new_zeros(first.size(0), int(n)) for n in out_lengths]
    _copy(pooled_embs, rows, outs)
    return outs


def permute_multi_embedding_into_reference(
    pooled_embs: Sequence[torch.Tensor],
    permutes: torch.Tensor,
    in_shapes: torch.Tensor,
    out_shapes: torch.Tensor,
    outs: Sequence[torch.Tensor],
) -> None:
    op = "permute_multi_embedding_into"
    check_structure(op, "pooled_embs", pooled_embs, permutes, in_shapes, out_shapes,
                    len(pooled_embs), [o.size(-1) for o in outs])
    widths = check_into_outputs(op, pooled_embs, outs)
    rows = check_rows(op, permutes, in_shapes, out_shapes, [t.size(1) for t in pooled_embs],
                      widths, "pooled_embs widths", "outs widths")
    for o in outs:
        o.zero_()
    _copy(pooled_embs, rows, outs)


def permute_multi_embedding_backward_reference(
    grad_outputs: Sequence[Optional[torch.Tensor]],
    permutes: torch.Tensor,
    in_shapes: torch.Tensor,
    out_shapes: torch.Tensor,
    in_lengths: Sequence[int],
    batch_size: int,
    dtype: torch.dtype,
) -> List[torch.Tensor]:
    op = "permute_multi_embedding_backward"
    check_structure(op, "grad_outputs", grad_outputs, permutes, in_shapes, out_shapes,
                    len(in_lengths), in_lengths, allow_none=True)
    if batch_size < 0:
        raise ValueError(f"kt_regroup.{op}: batch_size is negative ({batch_size})")
    out_widths = [int(n) for n in out_shapes.tolist()]
    for j, g in enumerate(grad_outputs):
        if g is not None and (g.size(0) != batch_size or g.size(1) != out_widths[j]):
            raise ValueError(
                f"kt_regroup.{op}: grad_outputs[{j}] has shape {tuple(g.shape)}, expected "
                f"({batch_size}, {out_widths[j]})"
            )
    rows = check_rows(op, permutes, in_shapes, out_shapes, [int(n) for n in in_lengths],
                      out_widths, "in_lengths", "out_shapes")
    defined = [g for g in grad_outputs if g is not None]
    device = defined[0].device if defined else permutes.device
    acc_dtype = torch.float32 if dtype in _ACCUMULATE_IN_FLOAT else dtype
    grads = [torch.zeros(batch_size, int(n), dtype=acc_dtype, device=device) for n in in_lengths]
    for in_t, out_t, in_off, out_off, length, _ in rows:
        g = grad_outputs[out_t]
        if g is not None:
            grads[in_t][:, in_off : in_off + length] += g[:, out_off : out_off + length]
    return [g.to(dtype) for g in grads]
