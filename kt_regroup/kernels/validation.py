"""Argument checks of the Python side of the op library.

:func:`check_structure` needs no tensor data: the fake kernels and the portable kernels
share it. :func:`check_rows` reads the metadata and bounds every permute row: each
portable kernel runs it before it touches data. (The compiled library checks its own
arguments in ``csrc/ops.cpp``; both raise the same exception types.)
"""

from __future__ import annotations

from typing import List, Optional, Sequence

import torch

from kt_regroup.plan import PERMUTE_COLUMNS

__all__ = ["check_backward_call", "check_forward_call", "check_into_outputs", "check_rows", "check_structure"]


def _check_tensor_list(
    op: str, name: str, tensors: Sequence[Optional[torch.Tensor]], same_dtype: bool = True
) -> None:
    defined = [(i, t) for i, t in enumerate(tensors) if t is not None]
    if not defined:
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
        if same_dtype and t.dtype != first.dtype:
            raise TypeError(
                f"kt_regroup.{op}: {name}[{i}] is {t.dtype} but {name}[{i0}] is "
                f"{first.dtype}; all must have one dtype (permute_multi_embedding_to with a "
                "dtype casts mixed inputs)"
            )
        if t.size(0) != first.size(0):
            raise ValueError(
                f"kt_regroup.{op}: {name}[{i}] has batch size {t.size(0)} but "
                f"{name}[{i0}] has {first.size(0)}; all must have the same batch size"
            )


def check_structure(
    op: str,
    name: str,
    tensors: Sequence[Optional[torch.Tensor]],
    permutes: torch.Tensor,
    in_shapes: torch.Tensor,
    out_shapes: torch.Tensor,
    n_in: int,
    sizes: Sequence,
    allow_none: bool = False,
    same_dtype: bool = True,
) -> None:
    """Shapes, dtypes and devices of a call. ``tensors`` are the data (inputs, or
    gradients where ``allow_none``: ``None`` entries, all of them even), ``sizes`` the
    output (or input) widths the call asks for: ints or SymInts. ``same_dtype=False``
    (the fused cast) lets inputs differ in dtype."""
    for j, n in enumerate(sizes):
        if isinstance(n, int) and n < 0:
            raise ValueError(f"kt_regroup.{op}: {'in' if allow_none else 'out'}_lengths[{j}] is negative ({n})")
    data = None
    if not allow_none or any(t is not None for t in tensors):
        _check_tensor_list(op, name, tensors, same_dtype)
        data = next(t for t in tensors if t is not None).device
    if permutes.dim() != 2 or permutes.size(1) != PERMUTE_COLUMNS:
        raise ValueError(
            f"kt_regroup.{op}: permutes must have shape [n, {PERMUTE_COLUMNS}] "
            f"(in_tensor, out_tensor, in_offset, out_offset, length, next), got "
            f"{tuple(permutes.shape)}"
        )
    for meta_name, t in (("permutes", permutes), ("in_shapes", in_shapes), ("out_shapes", out_shapes)):
        if t.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"kt_regroup.{op}: {meta_name} must be int32 or int64, got {t.dtype}")
        if t.device.type == "meta" and data is not None and data.type != "meta":
            # Meta metadata next to real data would dispatch to the fake kernel and return
            # uninitialised real tensors.
            raise ValueError(
                f"kt_regroup.{op}: {meta_name} is on meta but the data is on {data}; "
                "metadata and data must be on real devices"
            )
    if in_shapes.dim() != 1 or in_shapes.numel() != n_in:
        raise ValueError(
            f"kt_regroup.{op}: in_shapes must have one entry per input tensor ({n_in}), "
            f"got shape {tuple(in_shapes.shape)}"
        )
    n_out = len(tensors) if allow_none else len(sizes)
    if out_shapes.dim() != 1 or out_shapes.numel() != n_out:
        raise ValueError(
            f"kt_regroup.{op}: out_shapes must have one entry per output ({n_out}), "
            f"got shape {tuple(out_shapes.shape)}"
        )


def _check_declared(op, tensor_name, declared, actual_name, actual) -> None:
    for i, (d, a) in enumerate(zip(declared, actual)):
        if isinstance(a, int) and a < 0:
            raise ValueError(f"kt_regroup.{op}: {actual_name}[{i}] is negative ({a})")
        if d != a:
            raise ValueError(f"kt_regroup.{op}: {tensor_name}[{i}]={d} but {actual_name}[{i}]={a}")


def check_rows(
    op: str,
    permutes: torch.Tensor,
    in_shapes: torch.Tensor,
    out_shapes: torch.Tensor,
    in_widths: Sequence[int],
    out_widths: Sequence[int],
    in_name: str,
    out_name: str,
) -> List[List[int]]:
    """The metadata agrees with the widths and every row stays inside its input and
    output; returns the rows. ``in_name``/``out_name`` say where the widths came from."""
    _check_declared(op, "out_shapes", out_shapes.tolist(), out_name, out_widths)
    _check_declared(op, "in_shapes", in_shapes.tolist(), in_name, in_widths)
    rows = permutes.tolist()
    n_in, n_out = len(in_widths), len(out_widths)
    for r, (in_t, out_t, in_off, out_off, length, _) in enumerate(rows):
        if not 0 <= in_t < n_in:
            raise IndexError(
                f"kt_regroup.{op}: permutes[{r}] in_tensor={in_t} is out of range [0, {n_in})"
            )
        if not 0 <= out_t < n_out:
            raise IndexError(
                f"kt_regroup.{op}: permutes[{r}] out_tensor={out_t} is out of range [0, {n_out})"
            )
        if length < 0:
            raise ValueError(f"kt_regroup.{op}: permutes[{r}] has negative length {length}")
        if in_off < 0 or in_off + length > in_widths[in_t]:
            raise IndexError(
                f"kt_regroup.{op}: permutes[{r}] reads columns [{in_off}, {in_off + length}) "
                f"of input {in_t}, which has {in_widths[in_t]} columns"
            )
        if out_off < 0 or out_off + length > out_widths[out_t]:
            raise IndexError(
                f"kt_regroup.{op}: permutes[{r}] writes columns [{out_off}, "
                f"{out_off + length}) of output {out_t}, which has {out_widths[out_t]} columns"
            )
    return rows


def _span(t: torch.Tensor):
    lo = t.storage_offset() * t.element_size()
    return lo, lo + t.element_size() * (1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride())))


def check_into_outputs(op: str, pooled_embs, outs, overlap: bool = True) -> List[int]:
    """Caller-owned outputs: shape, dtype, device, unit column stride and (``overlap``,
    where tensors have data) no overlap with the inputs or each other. Returns their
    widths."""
    first = pooled_embs[0]
    for j, o in enumerate(outs):
        if o.dim() != 2 or o.size(0) != first.size(0):
            raise ValueError(
                f"kt_regroup.{op}: outs[{j}] must have shape ({first.size(0)}, width), got "
                f"shape {tuple(o.shape)}"
            )
        if o.dtype != first.dtype:
            raise TypeError(f"kt_regroup.{op}: outs[{j}] is {o.dtype} but pooled_embs[0] is {first.dtype}")
        if o.device != first.device:
            raise ValueError(
                f"kt_regroup.{op}: outs[{j}] is on {o.device} but pooled_embs[0] is on {first.device}"
            )
        if o.size(1) > 1 and o.stride(1) != 1:
            raise ValueError(
                f"kt_regroup.{op}: outs[{j}] must have unit column stride, got strides "
                f"{tuple(o.stride())}"
            )

    def overlaps(a, b) -> bool:
        if a.numel() == 0 or b.numel() == 0:
            return False
        if a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr():
            return False
        (alo, ahi), (blo, bhi) = _span(a), _span(b)
        return alo < bhi and blo < ahi

    for j, o in enumerate(outs if overlap else []):
        for i, t in enumerate(pooled_embs):
            if overlaps(o, t):
                raise ValueError(
                    f"kt_regroup.{op}: outs[{j}] overlaps pooled_embs[{i}] in memory; outputs "
                    "must not alias the inputs"
                )
        for k in range(j):
            if overlaps(o, outs[k]):
                raise ValueError(
                    f"kt_regroup.{op}: outs[{j}] overlaps outs[{k}] in memory; outputs must "
                    "not alias each other"
                )
    return [int(o.size(1)) for o in outs]


# The checks of the device backends (Triton, FBGEMM): the plan's rows are bounds-checked
# where it is on the host; on a device they are not read back (that would be a sync).


def check_forward_call(op, pooled_embs, permutes, in_shapes, out_shapes, out_widths,
                       same_dtype: bool = True, out_name: str = "out_lengths") -> None:
    check_structure(op, "pooled_embs", pooled_embs, permutes, in_shapes, out_shapes,
                    len(pooled_embs), out_widths, same_dtype=same_dtype)
    if permutes.device.type == "cpu":
        check_rows(op, permutes, in_shapes, out_shapes, [t.size(1) for t in pooled_embs],
                   [int(n) for n in out_widths], "pooled_embs widths", out_name)


def check_backward_call(op, grad_outputs, permutes, in_shapes, out_shapes, in_lengths,
                        batch_size) -> None:
    check_structure(op, "grad_outputs", grad_outputs, permutes, in_shapes, out_shapes,
                    len(in_lengths), in_lengths, allow_none=True)
    if batch_size < 0:
        raise ValueError(f"kt_regroup.{op}: batch_size is negative ({batch_size})")
    for j, g in enumerate(grad_outputs):
        if g is not None and g.size(0) != batch_size:
            raise ValueError(
                f"kt_regroup.{op}: grad_outputs[{j}] has {g.size(0)} rows, expected {batch_size}"
            )
    if permutes.device.type == "cpu":
        out_widths = [int(n) for n in out_shapes.tolist()]
        for j, g in enumerate(grad_outputs):
            if g is not None and g.size(1) != out_widths[j]:
                raise ValueError(
                    f"kt_regroup.{op}: grad_outputs[{j}] has shape {tuple(g.shape)}, expected "
                    f"({batch_size}, {out_widths[j]})"
                )
        check_rows(op, permutes, in_shapes, out_shapes, [int(n) for n in in_lengths],
                   out_widths, "in_lengths", "out_shapes")
