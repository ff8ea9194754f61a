"""Argument checks shared by the Python kernels and the fake (meta) kernels.

Every message starts with ``kt_regroup.<op>:`` and names the culprit (the input,
the permute row and column), so a bad plan is found without a debugger. The C++
kernel performs the same checks with the same wording.
"""

from __future__ import annotations

from typing import List, Optional, Sequence

import torch

from kt_regroup.plan import PERMUTE_COLUMNS


def check_tensor_list(op: str, name: str, tensors: Sequence[Optional[torch.Tensor]]) -> None:
    """Non-empty list of 2-D tensors on one device, one dtype, one batch size."""
    defined = [(i, t) for i, t in enumerate(tensors) if t is not None]
    if len(tensors) == 0 or not defined:
        raise ValueError(f"kt_regroup.{op}: {name} is empty")
    i0, first = defined[0]
    for i, t in defined:
        if t.dim() != 2:
            raise ValueError(
                f"kt_regroup.{op}: {name}[{i}] must be 2-D [batch, width], got shape "
                f"{tuple(t.shape)}"
            )
        if t.device != first.device:
            raise ValueError(
                f"kt_regroup.{op}: {name}[{i}] is on {t.device} but {name}[{i0}] is on "
                f"{first.device}; all must be on one device"
            )
        if t.dtype != first.dtype:
            raise TypeError(
                f"kt_regroup.{op}: {name}[{i}] is {t.dtype} but {name}[{i0}] is "
                f"{first.dtype}; all must have one dtype"
            )
        if t.size(0) != first.size(0):
            raise ValueError(
                f"kt_regroup.{op}: {name}[{i}] has batch size {t.size(0)} but "
                f"{name}[{i0}] has {first.size(0)}; all must have the same batch size"
            )


def check_metadata(
    op: str,
    permutes: torch.Tensor,
    in_shapes: torch.Tensor,
    out_shapes: torch.Tensor,
    n_in: int,
    out_lengths: Sequence[int],
) -> None:
    """Checks that need no tensor data (usable on fake tensors)."""
    if permutes.dim() != 2 or permutes.size(1) != PERMUTE_COLUMNS:
        raise ValueError(
            f"kt_regroup.{op}: permutes must have shape [n, {PERMUTE_COLUMNS}] "
            f"(in_tensor, out_tensor, in_offset, out_offset, length, next), got "
            f"{tuple(permutes.shape)}"
        )
    for name, t in (("permutes", permutes), ("in_shapes", in_shapes), ("out_shapes", out_shapes)):
        if t.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"kt_regroup.{op}: {name} must be int32 or int64, got {t.dtype}")
    if in_shapes.dim() != 1 or in_shapes.numel() != n_in:
        raise ValueError(
            f"kt_regroup.{op}: in_shapes must have one entry per input tensor ({n_in}), "
            f"got shape {tuple(in_shapes.shape)}"
        )
    if out_shapes.dim() != 1 or out_shapes.numel() != len(out_lengths):
        raise ValueError(
            f"kt_regroup.{op}: out_shapes must have one entry per output "
            f"({len(out_lengths)} out_lengths), got shape {tuple(out_shapes.shape)}"
        )
    for j, n in enumerate(out_lengths):
        if isinstance(n, int) and n < 0:
            raise ValueError(f"kt_regroup.{op}: out_lengths[{j}] is negative ({n})")


def check_rows(
    op: str,
    rows: Sequence[Sequence[int]],
    in_widths: Sequence[int],
    out_widths: Sequence[int],
) -> None:
    """Every row stays inside its input and output; lengths are non-negative."""
    n_in, n_out = len(in_widths), len(out_widths)
    for r, (in_t, out_t, in_off, out_off, length, _) in enumerate(rows):
        if not 0 <= in_t < n_in:
            raise ValueError(
                f"kt_regroup.{op}: permutes[{r}] in_tensor={in_t} is out of range "
                f"[0, {n_in})"
            )
        if not 0 <= out_t < n_out:
            raise ValueError(
                f"kt_regroup.{op}: permutes[{r}] out_tensor={out_t} is out of range "
                f"[0, {n_out})"
            )
        if length < 0:
            raise ValueError(f"kt_regroup.{op}: permutes[{r}] has negative length {length}")
        if in_off < 0 or in_off + length > in_widths[in_t]:
            raise ValueError(
                f"kt_regroup.{op}: permutes[{r}] reads columns [{in_off}, {in_off + length}) "
                f"of input {in_t}, which has {in_widths[in_t]} columns"
            )
        if out_off < 0 or out_off + length > out_widths[out_t]:
            raise ValueError(
                f"kt_regroup.{op}: permutes[{r}] writes columns [{out_off}, "
                f"{out_off + length}) of output {out_t}, which has {out_widths[out_t]} columns"
            )


def check_permute_rows(
    op: str,
    pooled_embs: Sequence[torch.Tensor],
    permutes: torch.Tensor,
    in_shapes: torch.Tensor,
    out_shapes: torch.Tensor,
    out_lengths: Sequence[int],
) -> List[List[int]]:
    """Full check of a forward call (reads the metadata tensors); returns the rows."""
    check_tensor_list(op, "pooled_embs", pooled_embs)
    check_metadata(op, permutes, in_shapes, out_shapes, len(pooled_embs), out_lengths)
    in_widths = [int(t.size(1)) for t in pooled_embs]
    for i, (w, d) in enumerate(zip(in_widths, in_shapes.tolist())):
        if w != d:
            raise ValueError(
                f"kt_regroup.{op}: in_shapes[{i}]={d} but pooled_embs[{i}] has {w} columns"
            )
    out_widths = [int(n) for n in out_lengths]
    for j, (w, d) in enumerate(zip(out_widths, out_shapes.tolist())):
        if w != d:
            raise ValueError(f"kt_regroup.{op}: out_shapes[{j}]={d} but out_lengths[{j}]={w}")
    rows = permutes.tolist()
    check_rows(op, rows, in_widths, out_widths)
    return rows


def check_backward_rows(
    op: str,
    grad_outputs: Sequence[Optional[torch.Tensor]],
    permutes: torch.Tensor,
    in_shapes: torch.Tensor,
    out_shapes: torch.Tensor,
    in_lengths: Sequence[int],
    batch_size: int,
) -> List[List[int]]:
    """Full check of a backward call; returns the rows. ``None`` gradients mean zeros."""
    if any(g is not None for g in grad_outputs):
        check_tensor_list(op, "grad_outputs", grad_outputs)
    check_metadata(op, permutes, in_shapes, out_shapes, len(in_lengths), [0] * len(grad_outputs))
    out_widths = [int(v) for v in out_shapes.tolist()]
    for j, g in enumerate(grad_outputs):
        if g is None:
            continue
        if g.size(0) != batch_size or g.size(1) != out_widths[j]:
            raise ValueError(
                f"kt_regroup.{op}: grad_outputs[{j}] has shape {tuple(g.shape)}, expected "
                f"({batch_size}, {out_widths[j]})"
            )
    in_widths = [int(n) for n in in_lengths]
    for i, (w, d) in enumerate(zip(in_widths, in_shapes.tolist())):
        if w != d:
            raise ValueError(f"kt_regroup.{op}: in_shapes[{i}]={d} but in_lengths[{i}]={w}")
    rows = permutes.tolist()
    check_rows(op, rows, in_widths, out_widths)
    return rows
