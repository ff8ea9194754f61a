"""FBGEMM's ``permute_multi_embedding`` behind ``torch.ops.kt_regroup.*``: the
``fbgemm`` backend, for comparison with kt_regroup's own kernels.

Importing this module imports ``fbgemm_gpu`` (``kt_regroup.ops`` does so only when the
backend is asked for). The plan is passed in torchrec's format, which is FBGEMM's:
``permutes`` rows ``(in_tensor, out_tensor, in_offset, out_offset, length, next)`` with
the duplicate chain in column 5, ``in_shapes``/``out_shapes`` the widths.

What FBGEMM does, and what this backend adds:

* forward: ``fbgemm::permute_multi_embedding_function(..., reverse=False)``, on the device
  FBGEMM has a kernel for (``CUDA`` in the CUDA build of fbgemm_gpu; ``CPU`` in both,
  where it reads each plan row with ``.item()``). Its outputs are ``at::empty``: columns
  no row writes (none in plans kt_regroup or torchrec build; the ops define them as 0)
  are zeroed here, with the mask below.
* backward: the same function with ``reverse=True`` copies the first occurrence of a key
  and adds the later ones in the gradient dtype (kt_regroup's kernels accumulate
  float16/bfloat16 in float32). Its outputs are ``at::empty`` on CPU and CUDA alike, so
  the gradients of keys no group uses are whatever memory held: this backend zeroes
  them. Both fills are device ops without a host sync: a coverage mask from the plan and
  one masked fill over the results, an extra pass FBGEMM's own op does not make.
* what FBGEMM has no op for (float64 and integer dtypes, int64 metadata, the fused cast
  to another dtype, mixed input dtypes, caller-owned outputs) returns ``NotImplemented``: ``kt_regroup.ops`` then calls the
  kernel that served the device before.
"""

from __future__ import annotations

from typing import List, Optional, Sequence

import fbgemm_gpu  # noqa: F401  (registers torch.ops.fbgemm)
import torch

from kt_regroup.kernels.validation import check_backward_call, check_forward_call

__all__ = [
    "has_kernel",
    "permute_multi_embedding_backward_fbgemm",
    "permute_multi_embedding_fbgemm",
    "permute_multi_embedding_to_fbgemm",
]

_OP = "fbgemm::permute_multi_embedding_function"
_DTYPES = (torch.float32, torch.float16, torch.bfloat16)  # FBGEMM's kernels (no float64)


def _int32(*tensors: torch.Tensor) -> bool:
    return all(t.dtype == torch.int32 for t in tensors)  # FBGEMM's metadata type


def has_kernel(dispatch_key: str) -> bool:
    """Whether the installed fbgemm_gpu has a kernel for ``dispatch_key`` (``CPU``, ``CUDA``)."""
    return torch._C._dispatch_has_kernel_for_dispatch_key(_OP, dispatch_key)


def permute_multi_embedding_to_fbgemm(
    pooled_embs: Sequence[torch.Tensor],
    permutes: torch.Tensor,
    in_shapes: torch.Tensor,
    out_shapes: torch.Tensor,
    out_lengths: Sequence[int],
    dtype: Optional[torch.dtype] = None,
    op: str = "permute_multi_embedding_to",
) -> List[torch.Tensor]:
    """The op ``permute_multi_embedding_to`` (and, without ``dtype``,
    ``permute_multi_embedding``)."""
    check_forward_call(op, pooled_embs, permutes, in_shapes, out_shapes, out_lengths,
                       same_dtype=dtype is None)
    dtypes = {t.dtype for t in pooled_embs}
    if (len(dtypes) != 1 or not dtypes <= set(_DTYPES) or (dtype is not None and dtypes != {dtype})
            or not _int32(permutes, in_shapes, out_shapes)):
        return NotImplemented  # FBGEMM has no fused cast; it allocates like pooled_embs[0]
    # .contiguous(): not relying on FBGEMM's CUDA kernel taking strided rows (unchecked
    # without a GPU); a no-op for contiguous tensors.
    outs = list(torch.ops.fbgemm.permute_multi_embedding_function(
        [t.contiguous() for t in pooled_embs], permutes, in_shapes, out_shapes,
        list(out_lengths), False,
    ))
    return _zero_uncovered(outs, permutes, out_shapes, side=1)


def permute_multi_embedding_fbgemm(
    pooled_embs: Sequence[torch.Tensor],
    permutes: torch.Tensor,
    in_shapes: torch.Tensor,
    out_shapes: torch.Tensor,
    out_lengths: Sequence[int],
) -> List[torch.Tensor]:
    """The op ``permute_multi_embedding``."""
    return permute_multi_embedding_to_fbgemm(pooled_embs, permutes, in_shapes, out_shapes,
                                             out_lengths, op="permute_multi_embedding")


def _covered(permutes: torch.Tensor, shapes: torch.Tensor, total: int, side: int) -> torch.Tensor:
    """A bool mask over the columns of the inputs (``side`` 0) or outputs (1), side by
    side: True where some row reads or writes. Device ops only, nothing uploaded (a
    +1/-1 difference array and its cumulative sum), so it can be captured in a CUDA graph."""
    rows = permutes.to(torch.int64)
    widths = shapes.to(permutes.device, torch.int64)
    starts = widths.cumsum(0) - widths
    lo = starts[rows[:, side].clamp(0, max(widths.numel() - 1, 0))] + rows[:, 2 + side]
    hi = lo + rows[:, 4]
    steps = torch.zeros(total + 1, dtype=torch.int64, device=permutes.device)
    steps.index_add_(0, lo.clamp(0, total), torch.ones_like(lo))
    steps.index_add_(0, hi.clamp(0, total), -torch.ones_like(hi))
    return steps.cumsum(0)[:total] > 0


def _zero_uncovered(tensors: List[torch.Tensor], permutes, shapes, side: int) -> List[torch.Tensor]:
    widths = [int(t.size(1)) for t in tensors]
    if tensors and sum(widths) and permutes.size(0):
        for t, covered in zip(tensors, _covered(permutes, shapes, sum(widths), side).split(widths)):
            t.masked_fill_(~covered, 0)
    elif tensors:
        for t in tensors:
            t.zero_()
    return tensors


def permute_multi_embedding_backward_fbgemm(
    grad_outputs: Sequence[Optional[torch.Tensor]],
    permutes: torch.Tensor,
    in_shapes: torch.Tensor,
    out_shapes: torch.Tensor,
    in_lengths: Sequence[int],
    batch_size: int,
    dtype: torch.dtype,
) -> List[torch.Tensor]:
    check_backward_call("permute_multi_embedding_backward", grad_outputs, permutes, in_shapes,
                        out_shapes, in_lengths, batch_size)
    defined = [g for g in grad_outputs if g is not None]
    if (not defined or dtype not in _DTYPES or any(g.dtype != dtype for g in defined)
            or not _int32(permutes, in_shapes, out_shapes)):
        return NotImplemented
    like = defined[0]
    # FBGEMM takes no None gradient: a zero block reads as one (out_shapes has its width;
    # reading it is a host sync on CUDA, only where a gradient is None).
    widths = out_shapes.tolist() if len(defined) < len(grad_outputs) else None
    grads = [
        like.new_zeros(batch_size, int(widths[j])) if g is None else g.contiguous()
        for j, g in enumerate(grad_outputs)
    ]
    in_lengths = [int(n) for n in in_lengths]
    outs = list(torch.ops.fbgemm.permute_multi_embedding_function(
        grads, permutes, out_shapes, in_shapes, in_lengths, True
    ))
    return _zero_uncovered(outs, permutes, in_shapes, side=0)
