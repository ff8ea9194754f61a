"""Triton kernels for ``permute_multi_embedding``: forward, fused cast, backward.

They compute exactly what :mod:`tests/reference.py` (the test oracle) computes, bit for bit, in
a fixed number of launches and without reading tensor data on the host: no ``.tolist()``,
``.item()`` or data-dependent size, so a training step that uses them can be captured in
a CUDA graph. Widths come from the tensors' shapes and ``out_lengths``/``in_lengths``;
``in_shapes``/``out_shapes`` are not read. With ``TRITON_INTERPRET=1`` (set before this
module is imported) they run on CPU tensors in Triton's interpreter, which is how they
are tested without a GPU.

Design
------
*Work split.* The grid is 1-D: one program per (permute row, block of ``BLOCK_B`` batch
rows); the row index varies fastest, so neighbouring programs touch neighbouring columns
of the same rows. A program copies its row's segment in ``BLOCK_C``-wide chunks, int64
addressing throughout. Segments whose offsets, length and row strides are multiples of
16 bytes (and lie inside their tensors) take a branch where the compiler can prove it, so
loads and stores are 128-bit vector accesses; other segments take a masked scalar branch.

*Several tensors without a pointer table.* The pointers, strides and widths of up to
``MAX_TENSORS`` inputs and as many outputs are kernel arguments (tuples), selected in the
kernel by a few scalar selects on the row's tensor index. Kernel arguments travel with
the launch (and are baked into a CUDA graph): nothing is copied to the device per call,
and every result is an independent allocation. One flat buffer sliced into the outputs
was rejected: a custom op's outputs may not share storage (``torch.library``'s aliasing
check), one kept group would pin the whole buffer, and ``permute_multi_embedding_into``
writes into caller-owned tensors anyway. With more tensors the launch is repeated per
chunk of ``MAX_TENSORS`` (rows of other chunks exit at once); the backward needs every
gradient output in one launch, so beyond ``MAX_TENSORS`` outputs it concatenates them
once and rebases the rows on the device.

*Columns no row writes* (gaps in an output, gradients of unused keys) are zeros written
exactly once: the copy kernel marks the columns it writes in a byte mask (zeroed by one
memset), then a second kernel stores zeros only where the mask is clear; where all is
covered its programs exit after one mask load. Nothing is zero-filled and overwritten.

*Duplicates* (the backward). Rows carry torchrec's duplicate chain (column 5): the first
occurrence of a key points to its second (positive), later occurrences hold minus the
index of the next one (or ``-len(permutes)`` at the end), keys used once hold 0. Only
rows with ``next >= 0`` do work: such a program sums its own gradient block and those of
the rows on its chain in registers, tile by tile, in row order, in float32 for
float16/bfloat16 (float64 when either side is float64, PyTorch's promotion), and stores
the input gradient once. No atomics, no read-modify-write of global memory.

*Launches per call* (batch > 0, at most ``MAX_TENSORS`` inputs and outputs): forward 3
(mask memset, copy, zero fill), backward 3, whatever the number of rows. Batch 0 launches
nothing.

*Bad rows* never make an access leave its tensor: writes are clipped to the written
tensor's real width, reads outside the read tensor's width load 0, a tensor index outside
the list makes the row a no-op (its columns are zero-filled), and a chain walk stops after
``len(permutes)`` steps. What a bad plan computes is then defined but not meaningful:
overlapping output segments race, duplicates without a chain (``next == 0`` twice) race,
a chain linking different keys sums their blocks. Plans are validated where their
metadata is on the host; these kernels do not re-check them.
"""

from __future__ import annotations

import contextlib
import functools
from typing import List, Optional, Sequence

import torch
import triton
import triton.language as tl

__all__ = [
    "MAX_TENSORS",
    "permute_multi_embedding_backward_op_triton",
    "permute_multi_embedding_backward_triton",
    "permute_multi_embedding_into_triton",
    "permute_multi_embedding_to_triton",
    "permute_multi_embedding_triton",
]

# Tensors addressed by one launch on each side (read, write). Their pointers, strides and
# widths are tuple kernel arguments; Triton compiles one kernel per tuple length, so this
# bounds the variants and the argument count. More tensors are handled in chunks.
MAX_TENSORS = 8

_BLOCK_ELEMENTS = 4096  # elements per (BLOCK_B x BLOCK_C) tile of the copy kernel
_ZERO_COLS = 128  # columns per program of the zero-fill kernel
_ZERO_ROWS = 32  # rows per store of the zero-fill kernel
_ZERO_ROWS_PER_PROGRAM = 256
_MAX_GRID_Y = 65535

_HALF = (torch.float16, torch.bfloat16)
_TL_DTYPE = {
    torch.float32: tl.float32,
    torch.float64: tl.float64,
    torch.float16: tl.float16,
    torch.bfloat16: tl.bfloat16,
}


# --- device helpers -----------------------------------------------------------------------
# Tensors are passed as tuples (pointers, strides, widths): Triton specialises a kernel on
# the tuple lengths and turns ``vals[k]`` in a static loop into plain arguments. Tuple
# elements equal to 1 arrive as compile-time constants, hence ``tl.cast`` over ``.to``.
# Only builtins of triton.language are used, none of its @triton.jit library functions
# (cdiv, zeros, max, ...): those are interpreted only if Triton itself was imported after
# TRITON_INTERPRET=1 was set, these kernels whenever this module was.


@triton.jit
def _add(a, b):
    return a + b


@triton.jit
def _pick(i, vals):
    """``vals[i]`` (``vals[0]`` when ``i`` is out of range); scalar or tensor ``i``."""
    r = vals[0]
    for k in tl.static_range(1, len(vals)):
        r = tl.where(i == k, vals[k], r)
    return r


@triton.jit
def _pick_read(i, ptrs, row_strides, col_strides, widths):
    """Pointer, strides and width of read tensor ``i``; width 0 (nothing is read) for an
    index outside the tuple, so a bad row reads zeros."""
    inside = (i >= 0) & (i < len(ptrs))
    return (
        _pick(i, ptrs),
        tl.cast(_pick(i, row_strides), tl.int64),
        tl.cast(_pick(i, col_strides), tl.int64),
        tl.where(inside, _pick(i, widths), 0).to(tl.int64),
    )


@triton.jit
def _pick_write(i, ptrs, row_strides, widths):
    """Pointer, row stride and width of written tensor ``i``, and its first column in
    the flat column space (``sum(widths[:i])``)."""
    first = tl.where(i > 0, widths[0], 0).to(tl.int64)
    for k in tl.static_range(1, len(widths) - 1):
        first += tl.where(i > k, widths[k], 0)
    stride = tl.cast(_pick(i, row_strides), tl.int64)
    return _pick(i, ptrs), stride, tl.cast(_pick(i, widths), tl.int64), first


@triton.jit
def _convert(x, dst: tl.constexpr):
    """``x.to(dst)`` rounded exactly as PyTorch rounds.

    PyTorch builds float16/bfloat16 from a float, so other sources go through float32
    first. float32 -> bfloat16 is rounded to nearest even with integer ops (PyTorch's
    ``round_to_nearest_even``, NaN -> 0x7FC0): the GPU's conversion rounds the same way,
    but Triton's interpreter truncates, and the kernels must be checkable there.
    """
    if dst == tl.bfloat16:
        f = x.to(tl.float32)
        bits = f.to(tl.int32, bitcast=True)
        r = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        r = tl.where(f != f, 0x7FC0, r)
        y = r.to(tl.int16).to(tl.bfloat16, bitcast=True)
    elif dst == tl.float16 and x.dtype != tl.float32:
        y = x.to(tl.float32).to(dst)
    else:
        y = x.to(dst)
    return y


@triton.jit
def _load_block(ptr, rs, cs, width, off, length, rows, rmask, c, c_end, VEC: tl.constexpr):
    """Columns ``off + c`` (``c < min(c_end, length)``) of ``rows``; 0 outside the tensor.

    Takes the vectorisable branch when the segment is inside the tensor and its offset,
    length and row stride are multiples of ``VEC`` with unit column stride: there,
    ``(x // VEC) * VEC`` (equal to ``x``) lets the compiler prove the alignment.
    """
    inside = (off >= 0) & (length >= 0) & (off + length <= width)
    if inside & (cs == 1) & (off % VEC == 0) & (length % VEC == 0) & (rs % VEC == 0):
        off_a = (off // VEC) * VEC
        rs_a = (rs // VEC) * VEC
        mask = rmask[:, None] & ((c < (length // VEC) * VEC) & (c < c_end))[None, :]
        x = tl.load(ptr + rows[:, None] * rs_a + (off_a + c)[None, :], mask=mask, other=0)
    else:
        col = off + c
        cmask = (c < length) & (c < c_end) & (col >= 0) & (col < width)
        mask = rmask[:, None] & cmask[None, :]
        x = tl.load(ptr + rows[:, None] * rs + (col * cs)[None, :], mask=mask, other=0)
    return x


# --- the copy kernel (forward: every row; backward: chain heads) ---------------------------


@triton.jit
def _segment(
    perm_ptr, perm_s0, perm_s1, n_rows, written_ptr, first, bblk, rows, rmask,
    w_ptr, w_rs, wo, c_lo, c_hi, rt, ro, length, nxt, r_lo,
    reads, r_rs, r_cs, r_w,
    BACKWARD: tl.constexpr, ACC: tl.constexpr, BLOCK_C: tl.constexpr, VEC: tl.constexpr,
):  # fmt: skip
    """Writes columns ``wo + c``, ``c`` in ``[c_lo, c_hi)``, of ``rows`` of one tensor."""
    OUT: tl.constexpr = w_ptr.dtype.element_ty
    IN: tl.constexpr = reads[0].dtype.element_ty
    # PyTorch adds a gradient to its accumulator in their promoted type.
    COMPUTE: tl.constexpr = tl.float64 if (ACC == tl.float64 or IN == tl.float64) else tl.float32
    if not BACKWARD:
        r_ptr, rs, cs, rw = _pick_read(rt, reads, r_rs, r_cs, r_w)
    for ci in range(0, (c_hi - c_lo + BLOCK_C - 1) // BLOCK_C):
        c = c_lo + ci * BLOCK_C + tl.arange(0, BLOCK_C).to(tl.int64)
        if bblk == 0:  # one program per row marks the columns it writes
            one = tl.full([BLOCK_C], 1, tl.int8)
            tl.store(written_ptr + first + wo + c, one, mask=c < c_hi)
        if BACKWARD:
            acc = tl.full([rows.shape[0], BLOCK_C], 0, dtype=ACC)
            cur_t = rt
            cur_off = ro
            cur_len = length
            cur_nxt = nxt
            steps = n_rows * 0
            more = steps == 0
            while more:
                g_ptr, g_rs, g_cs, g_w = _pick_read(cur_t, reads, r_rs, r_cs, r_w)
                g = _load_block(g_ptr, g_rs, g_cs, g_w, cur_off, cur_len, rows, rmask, c, c_hi, VEC)
                acc = (acc.to(COMPUTE) + g.to(COMPUTE)).to(ACC)
                # Follow the chain: a positive link is the next row of the same key; that
                # row's column 5 holds minus the one after it (or -len(permutes)).
                steps += 1
                more = (cur_nxt > 0) & (cur_nxt < n_rows) & (steps < n_rows)
                link = perm_ptr + tl.minimum(tl.maximum(cur_nxt, 0), n_rows - 1) * perm_s0
                cur_t = tl.load(link + perm_s1).to(tl.int64) - r_lo
                cur_off = tl.load(link + 3 * perm_s1).to(tl.int64)
                cur_len = tl.load(link + 4 * perm_s1).to(tl.int64)
                cur_nxt = -tl.load(link + 5 * perm_s1).to(tl.int64)
            x = acc
        else:
            x = _load_block(r_ptr, rs, cs, rw, ro, length, rows, rmask, c, c_hi, VEC)
        if x.dtype != OUT:
            x = _convert(x, OUT)
        wmask = rmask[:, None] & (c < c_hi)[None, :]
        tl.store(w_ptr + rows[:, None] * w_rs + (wo + c)[None, :], x, mask=wmask)


@triton.jit(do_not_specialize=["perm_s0", "perm_s1", "n_rows", "batch", "r_lo", "w_lo"])
def _permute_kernel(
    perm_ptr, perm_s0, perm_s1, n_rows, batch, written_ptr, r_lo, w_lo,
    reads, r_rs, r_cs, r_w, writes, w_rs, w_w,
    BACKWARD: tl.constexpr, ACC: tl.constexpr,
    BLOCK_B: tl.constexpr, BLOCK_C: tl.constexpr, VEC: tl.constexpr,
):  # fmt: skip
    """Forward: row ``(in_t, out_t, in_off, out_off, length)`` copies input columns to
    output columns. Backward (``BACKWARD``): the same rows read the other way, only chain
    heads (``next >= 0``) work, summing the gradient blocks on their chain in ``ACC``.
    ``r_lo``/``w_lo``: index of ``reads[0]``/``writes[0]`` in the full tensor lists."""
    pid = tl.program_id(0).to(tl.int64)
    n_rows = n_rows.to(tl.int64)
    seg = pid % n_rows
    bblk = pid // n_rows
    row = perm_ptr + seg * perm_s0
    in_t = tl.load(row).to(tl.int64)
    out_t = tl.load(row + perm_s1).to(tl.int64)
    in_off = tl.load(row + 2 * perm_s1).to(tl.int64)
    out_off = tl.load(row + 3 * perm_s1).to(tl.int64)
    length = tl.load(row + 4 * perm_s1).to(tl.int64)
    nxt = tl.load(row + 5 * perm_s1).to(tl.int64)
    if BACKWARD:
        rt = out_t - r_lo
        ro = out_off
        wt = in_t - w_lo
        wo = in_off
        active = (wt >= 0) & (wt < len(writes)) & (nxt >= 0)
    else:
        rt = in_t - r_lo
        ro = in_off
        wt = out_t - w_lo
        wo = out_off
        active = (wt >= 0) & (wt < len(writes)) & (rt >= 0) & (rt < len(reads))
    if active:
        w_ptr, w_stride, w_width, first = _pick_write(wt, writes, w_rs, w_w)
        rows = bblk * BLOCK_B + tl.arange(0, BLOCK_B).to(tl.int64)
        rmask = rows < batch
        # The row clipped to the written tensor: columns wo + c, c in [c_lo, c_hi).
        c_lo = tl.maximum(-wo, 0)
        c_hi = tl.minimum(length, w_width - wo)
        inside = (c_lo == 0) & (c_hi == length)
        if inside & (wo % VEC == 0) & (length % VEC == 0) & (w_stride % VEC == 0):
            # (x // VEC) * VEC equals x here; that form proves the alignment to the compiler,
            # in this branch only, so its stores (and aligned reads) are vector accesses.
            _segment(
                perm_ptr, perm_s0, perm_s1, n_rows, written_ptr, first, bblk, rows, rmask,
                w_ptr, (w_stride // VEC) * VEC, (wo // VEC) * VEC, 0, (length // VEC) * VEC,
                rt, ro, length, nxt, r_lo, reads, r_rs, r_cs, r_w,
                BACKWARD, ACC, BLOCK_C, VEC,
            )  # fmt: skip
        else:
            _segment(
                perm_ptr, perm_s0, perm_s1, n_rows, written_ptr, first, bblk, rows, rmask,
                w_ptr, w_stride, wo, c_lo, c_hi, rt, ro, length, nxt, r_lo,
                reads, r_rs, r_cs, r_w, BACKWARD, ACC, BLOCK_C, VEC,
            )  # fmt: skip


# --- the zero-fill kernel -----------------------------------------------------------------


@triton.jit(do_not_specialize=["batch", "n_cols", "rows_per_program"])
def _zero_unwritten_kernel(
    written_ptr, batch, n_cols, rows_per_program, writes, w_rs, w_w,
    BLOCK_B: tl.constexpr, BLOCK_C: tl.constexpr,
):  # fmt: skip
    """Stores 0 in the columns the copy kernel did not mark; a block of flat columns
    (the written tensors side by side) and of rows per program."""
    col = tl.program_id(0).to(tl.int64) * BLOCK_C + tl.arange(0, BLOCK_C).to(tl.int64)
    unwritten = tl.load(written_ptr + col, mask=col < n_cols, other=1) == 0
    if tl.reduce(unwritten.to(tl.int32), 0, _add) > 0:
        # Each column's tensor: the last one starting at or before it (a zero-width
        # tensor starts where the next one does and loses to it).
        t = col * 0
        start = col * 0
        end = col * 0 + w_w[0]
        for k in tl.static_range(1, len(writes)):
            t = tl.where(col >= end, k, t)
            start = tl.where(col >= end, end, start)
            end += w_w[k]
        base = _pick(t, writes) + (col - start)
        rs = tl.cast(_pick(t, w_rs), tl.int64) + col * 0  # a vector even for one tensor
        zeros = tl.full([BLOCK_B, BLOCK_C], 0, dtype=writes[0].dtype.element_ty)
        first_row = tl.program_id(1).to(tl.int64) * rows_per_program
        end_row = tl.minimum(first_row + rows_per_program, batch)
        for r in range(first_row, end_row, BLOCK_B):
            rows = r + tl.arange(0, BLOCK_B).to(tl.int64)
            m = (rows < end_row)[:, None] & unwritten[None, :]
            tl.store(base[None, :] + rows[:, None] * rs[None, :], zeros, mask=m)


# --- host side ----------------------------------------------------------------------------


def _device_guard(device: torch.device):
    # Triton launches on the current device's current stream: make it the tensors' device.
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def _check_2d(op: str, name: str, tensors: Sequence[Optional[torch.Tensor]]) -> None:
    """Host-side structure checks only (shapes, dtypes, devices): no tensor data is read."""
    first = next((t for t in tensors if t is not None), None)
    for i, t in enumerate(tensors):
        if t is None:
            continue
        if t.dim() != 2:
            raise ValueError(
                f"kt_regroup.{op}: {name}[{i}] must be 2-D [batch, width], got shape "
                f"{tuple(t.shape)}"
            )
        if t.dtype != first.dtype or t.device != first.device or t.size(0) != first.size(0):
            raise ValueError(
                f"kt_regroup.{op}: {name}[{i}] is {t.dtype} {tuple(t.shape)} on {t.device}, "
                f"but {name} must share one dtype, device and batch size "
                f"({first.dtype}, {first.size(0)} rows, {first.device})"
            )
        if t.dtype not in _TL_DTYPE:
            raise TypeError(
                f"kt_regroup.{op}: {name}[{i}] is {t.dtype}; Triton kernels take "
                f"{', '.join(str(d) for d in _TL_DTYPE)}"
            )


def _check_permutes(op: str, permutes: torch.Tensor, device: torch.device) -> None:
    if permutes.dim() != 2 or permutes.size(1) != 6:
        raise ValueError(
            f"kt_regroup.{op}: permutes must have shape [n, 6] (in_tensor, out_tensor, "
            f"in_offset, out_offset, length, next), got {tuple(permutes.shape)}"
        )
    if permutes.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"kt_regroup.{op}: permutes must be int32 or int64, got {permutes.dtype}")
    if permutes.device != device:
        raise ValueError(
            f"kt_regroup.{op}: permutes is on {permutes.device} but the tensors are on {device}"
        )


def _next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def _run(
    reads: Sequence[Optional[torch.Tensor]],
    writes: Sequence[torch.Tensor],
    permutes: torch.Tensor,
    batch: int,
    backward: bool,
    avg_length: int,
    acc_dtype: Optional[torch.dtype] = None,
) -> None:
    """Fills ``writes`` (every element once) from ``reads`` as ``permutes`` says."""
    write_widths = [int(w.size(1)) for w in writes]
    n_cols = sum(write_widths)
    if batch == 0 or n_cols == 0:
        return
    device = writes[0].device
    n_rows = int(permutes.size(0))
    written = torch.zeros(n_cols, dtype=torch.int8, device=device)
    defined = next(t for t in reads if t is not None)
    itemsize = max(defined.element_size(), writes[0].element_size())
    block_c = min(128, max(4, _next_pow2(avg_length)))
    block_b = max(1, min(_BLOCK_ELEMENTS // block_c, _next_pow2(batch)))
    # Reads of undefined (None) gradients: any pointer of the right type, width 0.
    r_ptr = [defined if t is None else t for t in reads]
    r_rs = [0 if t is None else t.stride(0) for t in reads]
    r_cs = [0 if t is None else t.stride(1) for t in reads]
    r_w = [0 if t is None else t.size(1) for t in reads]
    read_chunks = [0] if backward else range(0, len(reads), MAX_TENSORS)
    rows_per_program = max(_ZERO_ROWS_PER_PROGRAM, triton.cdiv(batch, _MAX_GRID_Y))
    with _device_guard(device):
        for w_lo in range(0, len(writes), MAX_TENSORS):
            w = slice(w_lo, w_lo + MAX_TENSORS)
            w_args = (
                tuple(writes[w]),
                tuple(t.stride(0) for t in writes[w]),
                tuple(write_widths[w]),
            )
            written_here = written[sum(write_widths[:w_lo]) :]
            if n_rows > 0:
                for r_lo in read_chunks:
                    r = slice(r_lo, r_lo + MAX_TENSORS)
                    _permute_kernel[(n_rows * triton.cdiv(batch, block_b),)](
                        permutes, permutes.stride(0), permutes.stride(1), n_rows, batch,
                        written_here, r_lo, w_lo,
                        tuple(r_ptr[r]), tuple(r_rs[r]), tuple(r_cs[r]), tuple(r_w[r]), *w_args,
                        BACKWARD=backward, ACC=_TL_DTYPE[acc_dtype or writes[0].dtype],
                        BLOCK_B=block_b, BLOCK_C=block_c, VEC=max(1, 16 // itemsize),
                    )  # fmt: skip
            n_here = sum(w_args[2])
            if n_here:
                grid = (triton.cdiv(n_here, _ZERO_COLS), triton.cdiv(batch, rows_per_program))
                _zero_unwritten_kernel[grid](
                    written_here,
                    batch,
                    n_here,
                    rows_per_program,
                    *w_args,
                    BLOCK_B=_ZERO_ROWS,
                    BLOCK_C=_ZERO_COLS,
                )


def permute_multi_embedding_triton(
    pooled_embs: List[torch.Tensor],
    permutes: torch.Tensor,
    in_shapes: torch.Tensor,
    out_shapes: torch.Tensor,
    out_lengths: List[int],
    dtype: Optional[torch.dtype] = None,
    out: Optional[List[torch.Tensor]] = None,
) -> List[torch.Tensor]:
    """Regroups ``pooled_embs`` into ``[batch, out_lengths[j]]`` tensors (one pass).

    ``dtype`` casts inside the copy (``permute_multi_embedding_to``); ``out`` writes into
    caller-owned tensors instead (``permute_multi_embedding_into``: unit column stride,
    any row stride). ``in_shapes``/``out_shapes`` are not read: widths come from the
    tensors' shapes and ``out_lengths``. Example::

        >>> x = torch.arange(6.0).view(2, 3)
        >>> p = torch.tensor([[0, 0, 1, 0, 2, 0]], dtype=torch.int32)
        >>> permute_multi_embedding_triton([x], p, torch.tensor([3]), torch.tensor([2]), [2])
        [tensor([[1., 2.],
                [4., 5.]])]
    """
    op = "permute_multi_embedding"
    if len(pooled_embs) == 0:
        raise ValueError(f"kt_regroup.{op}: pooled_embs is empty")
    _check_2d(op, "pooled_embs", pooled_embs)
    first = pooled_embs[0]
    _check_permutes(op, permutes, first.device)
    batch = first.size(0)
    if out is None:
        out_dtype = first.dtype if dtype is None else dtype
        if out_dtype not in _TL_DTYPE:
            raise TypeError(f"kt_regroup.{op}: cannot write {out_dtype}")
        outs = [
            torch.empty(batch, int(n), dtype=out_dtype, device=first.device) for n in out_lengths
        ]
    else:
        outs = list(out)
        _check_2d(op, "out", outs)
        for j, o in enumerate(outs):
            if (
                o.size(0) != batch
                or o.device != first.device
                or (o.size(1) > 1 and o.stride(1) != 1)
            ):
                raise ValueError(
                    f"kt_regroup.{op}: out[{j}] must be [{batch}, width] on {first.device} "
                    f"with unit column stride, got {tuple(o.shape)} with strides {o.stride()} "
                    f"on {o.device}"
                )
    if outs:
        n_rows = max(1, int(permutes.size(0)))
        avg = sum(int(o.size(1)) for o in outs) // n_rows
        _run(pooled_embs, outs, permutes, batch, backward=False, avg_length=avg)
    return outs


def permute_multi_embedding_backward_triton(
    grad_outputs: List[Optional[torch.Tensor]],
    permutes: torch.Tensor,
    in_shapes: torch.Tensor,
    out_shapes: torch.Tensor,
    in_lengths: List[int],
    batch_size: int,
    dtype: torch.dtype,
) -> List[torch.Tensor]:
    """Gradients of the inputs: ``[batch_size, in_lengths[i]]`` tensors in ``dtype``.

    ``None`` gradients count as zeros. Rows must carry torchrec's duplicate chain in
    column 5 (see the module docstring); a key used by no row gets exact zeros.
    ``out_shapes`` is read on the device only when there are more than ``MAX_TENSORS``
    gradient outputs (to rebase rows onto their concatenation).
    """
    op = "permute_multi_embedding_backward"
    if dtype not in _TL_DTYPE:
        raise TypeError(f"kt_regroup.{op}: cannot produce {dtype} gradients")
    _check_2d(op, "grad_outputs", grad_outputs)
    defined = [g for g in grad_outputs if g is not None]
    device = defined[0].device if defined else permutes.device
    _check_permutes(op, permutes, device)
    for j, g in enumerate(grad_outputs):
        if g is not None and g.size(0) != batch_size:
            raise ValueError(
                f"kt_regroup.{op}: grad_outputs[{j}] has {g.size(0)} rows, expected {batch_size}"
            )
    if not defined:
        return [torch.zeros(batch_size, int(n), dtype=dtype, device=device) for n in in_lengths]
    grads = [torch.empty(batch_size, int(n), dtype=dtype, device=device) for n in in_lengths]
    reads: List[Optional[torch.Tensor]] = list(grad_outputs)
    if len(reads) > MAX_TENSORS:
        reads, permutes = _concatenated(reads, permutes, out_shapes)
    n_rows = max(1, int(permutes.size(0)))
    avg = sum(int(g.size(1)) for g in defined) // n_rows
    acc = torch.float32 if dtype in _HALF else dtype
    _run(reads, grads, permutes, batch_size, backward=True, avg_length=avg, acc_dtype=acc)
    return grads


def _concatenated(
    grad_outputs: Sequence[Optional[torch.Tensor]],
    permutes: torch.Tensor,
    out_shapes: torch.Tensor,
) -> tuple:
    """One gradient, ``torch.cat`` of the defined ones, and rows rebased onto it.

    Computed on the device from ``out_shapes`` (no copy from the host): output ``j``
    starts at the sum of the widths of the defined outputs before it; rows of an
    undefined or out-of-range output get output index -1 (they contribute zeros).
    """
    n_out = len(grad_outputs)
    widths = out_shapes.to(permutes.device, torch.int64, copy=True)
    defined = torch.ones(n_out, dtype=torch.bool, device=permutes.device)
    for j, g in enumerate(grad_outputs):
        if g is None:  # scalar fills on the device: no host list is uploaded
            widths[j] = 0
            defined[j] = False
    starts = torch.cumsum(widths, 0) - widths
    rows = permutes.to(torch.int64, copy=True)  # the caller's permutes stay untouched
    out_t = rows[:, 1]
    idx = out_t.clamp(0, n_out - 1)
    valid = (out_t >= 0) & (out_t < n_out) & defined[idx]
    rows[:, 3] += torch.where(valid, starts[idx], 0)
    rows[:, 1] = torch.where(valid, 0, -1)
    cat = torch.cat([g for g in grad_outputs if g is not None], dim=1)
    return [cat], rows


# --- the ops' kernels (kt_regroup.ops registers them for CUDA, and CPU under the interpreter)
# They check what the other kernels check. The plan's rows are bounds-checked where it is on
# the host (CPU tensors); on a device they are not read back (no sync): the kernels clip
# bad rows instead (see the module docstring). A dtype Triton does not take, or a plan on
# another device than the data, returns NotImplemented: the op then runs the kernel that
# served the device before.


def permute_multi_embedding_to_triton(
    pooled_embs: List[torch.Tensor],
    permutes: torch.Tensor,
    in_shapes: torch.Tensor,
    out_shapes: torch.Tensor,
    out_lengths: List[int],
    dtype: Optional[torch.dtype] = None,
    op: str = "permute_multi_embedding_to",
) -> List[torch.Tensor]:
    """The op ``permute_multi_embedding_to`` (and, without ``dtype``,
    ``permute_multi_embedding``). Inputs of different dtypes (the fused cast) are first
    widened to their promoted dtype, exactly, in one extra copy of the narrower ones:
    a launch reads one dtype. Inputs of one dtype take one pass."""
    if len(pooled_embs) == 0:
        raise ValueError(f"kt_regroup.{op}: pooled_embs is empty")
    dtypes = {t.dtype for t in pooled_embs}
    if dtype is None and len(dtypes) > 1:
        raise TypeError(
            f"kt_regroup.{op}: pooled_embs have dtypes {sorted(map(str, dtypes))}; all must "
            "have one dtype (permute_multi_embedding_to with a dtype casts mixed inputs)"
        )
    if (not dtypes <= set(_TL_DTYPE) or (dtype is not None and dtype not in _TL_DTYPE)
            or permutes.device != pooled_embs[0].device):
        return NotImplemented
    if len(dtypes) > 1:
        wide = functools.reduce(torch.promote_types, dtypes)
        pooled_embs = [t.to(wide) for t in pooled_embs]
    return permute_multi_embedding_triton(
        pooled_embs, permutes, in_shapes, out_shapes, out_lengths, dtype=dtype
    )


def permute_multi_embedding_into_triton(
    pooled_embs: List[torch.Tensor],
    permutes: torch.Tensor,
    in_shapes: torch.Tensor,
    out_shapes: torch.Tensor,
    outs: List[torch.Tensor],
) -> None:
    """The op ``permute_multi_embedding_into``: every element of ``outs`` written once."""
    # The library's kernel serves it: its checks (overlap by address, version counter,
    # leaves) are the library's, and callers of _into keep buffers, not launch counts.
    return NotImplemented


def permute_multi_embedding_backward_op_triton(
    grad_outputs: List[Optional[torch.Tensor]],
    permutes: torch.Tensor,
    in_shapes: torch.Tensor,
    out_shapes: torch.Tensor,
    in_lengths: List[int],
    batch_size: int,
    dtype: torch.dtype,
) -> List[torch.Tensor]:
    """The op ``permute_multi_embedding_backward``: checks, then
    :func:`permute_multi_embedding_backward_triton`."""
    dtypes = {g.dtype for g in grad_outputs if g is not None}
    devices = {g.device for g in grad_outputs if g is not None}
    if (dtype not in _TL_DTYPE or not dtypes <= set(_TL_DTYPE) or len(dtypes) > 1
            or devices - {permutes.device}):
        return NotImplemented
    return permute_multi_embedding_backward_triton(
        grad_outputs, permutes, in_shapes, out_shapes, in_lengths, batch_size, dtype
    )


_OPS = {
    "permute_multi_embedding": lambda *a: permute_multi_embedding_to_triton(
        *a, None, "permute_multi_embedding"),
    "permute_multi_embedding_to": permute_multi_embedding_to_triton,
    "permute_multi_embedding_into": permute_multi_embedding_into_triton,
    "permute_multi_embedding_backward": permute_multi_embedding_backward_op_triton,
}


def register(lib: torch.library.Library, dispatch_key: str) -> None:
    """Registers the Triton kernels of the four regroup ops on ``lib`` for ``dispatch_key``.

    Each op gets one entry. Where a kernel returns ``NotImplemented`` (a dtype Triton does
    not take, a plan on another device), the kernel that served ``dispatch_key`` before
    this registration runs instead (fetched with :func:`torch.library.get_kernel`).
    Destroying ``lib`` (``lib._destroy()``) restores the previous kernels.
    """
    import warnings

    for name, kernel in _OPS.items():
        before = torch.library.get_kernel(f"kt_regroup::{name}", dispatch_key)

        def entry(keyset, *args, _kernel=kernel, _before=before):
            result = _kernel(*args)
            if result is NotImplemented:
                return _before.call_boxed(keyset, *args)
            return result

        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*[Oo]verrid.*")
            lib.impl(name, entry, dispatch_key, with_keyset=True)
