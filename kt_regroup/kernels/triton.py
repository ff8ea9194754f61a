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
``MAX_TENSORS`` inputs and as many outputs are kernel arguments, one each (slots ``r0``..
``r7``, ``w0``..``w7``, unused ones ``None``; Inductor's launcher takes no tuples), packed
into tuples inside the kernel and selected by a few scalar selects on the row's tensor
index (``N_READS``/``N_WRITES`` slots, compile-time constants). Kernel arguments travel with
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

*Compiled and exported graphs.* The launches go through ``torch.library.wrap_triton`` and
the two triton_ops at the end of this file run them; :func:`register_graph_rules` makes
``torch.compile`` and AOTInductor trace the public ops on CUDA into those, so Inductor
compiles these kernels into its code (an AOTInductor package carries them as cubins)
instead of calling the op. Kernel arguments are therefore flat (Inductor launches no
tuples), and every size may be a SymInt there.

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
from torch._library.triton import is_wrap_triton_enabled, set_wrap_triton_enabled
from torch.library import wrap_triton
from triton.runtime.jit import JITFunction

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
_SLOTS = 8  # tensor arguments of each side in the kernels' signatures (>= MAX_TENSORS)

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
def _pick(i, vals, N: tl.constexpr):
    """``vals[i]`` for ``i < N`` (``vals[0]`` when ``i`` is out of range); scalar or tensor
    ``i``. Only the first ``N`` entries are used (the others are ``None``)."""
    r = vals[0]
    for k in tl.static_range(1, N):
        r = tl.where(i == k, vals[k], r)
    return r


@triton.jit
def _pick_read(i, ptrs, row_strides, col_strides, widths, N: tl.constexpr):
    """Pointer, strides and width of read tensor ``i``; width 0 (nothing is read) for an
    index outside ``[0, N)``, so a bad row reads zeros."""
    inside = (i >= 0) & (i < N)
    return (
        _pick(i, ptrs, N),
        tl.cast(_pick(i, row_strides, N), tl.int64),
        tl.cast(_pick(i, col_strides, N), tl.int64),
        tl.where(inside, _pick(i, widths, N), 0).to(tl.int64),
    )


@triton.jit
def _pick_write(i, ptrs, row_strides, widths, N: tl.constexpr):
    """Pointer, row stride and width of written tensor ``i``, and its first column in
    the flat column space (``sum(widths[:i])``)."""
    first = tl.where(i > 0, widths[0], 0).to(tl.int64)
    for k in tl.static_range(1, N - 1):
        first += tl.where(i > k, widths[k], 0)
    stride = tl.cast(_pick(i, row_strides, N), tl.int64)
    return _pick(i, ptrs, N), stride, tl.cast(_pick(i, widths, N), tl.int64), first


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
    reads, r_rs, r_cs, r_w, N_READS: tl.constexpr,
    BACKWARD: tl.constexpr, ACC: tl.constexpr, BLOCK_C: tl.constexpr, VEC: tl.constexpr,
):  # fmt: skip
    """Writes columns ``wo + c``, ``c`` in ``[c_lo, c_hi)``, of ``rows`` of one tensor."""
    OUT: tl.constexpr = w_ptr.dtype.element_ty
    IN: tl.constexpr = reads[0].dtype.element_ty
    # PyTorch adds a gradient to its accumulator in their promoted type.
    COMPUTE: tl.constexpr = tl.float64 if (ACC == tl.float64 or IN == tl.float64) else tl.float32
    if not BACKWARD:
        r_ptr, rs, cs, rw = _pick_read(rt, reads, r_rs, r_cs, r_w, N_READS)
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
                g_ptr, g_rs, g_cs, g_w = _pick_read(cur_t, reads, r_rs, r_cs, r_w, N_READS)
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
    r0, r1, r2, r3, r4, r5, r6, r7,
    r_rs0, r_rs1, r_rs2, r_rs3, r_rs4, r_rs5, r_rs6, r_rs7,
    r_cs0, r_cs1, r_cs2, r_cs3, r_cs4, r_cs5, r_cs6, r_cs7,
    r_w0, r_w1, r_w2, r_w3, r_w4, r_w5, r_w6, r_w7,
    w0, w1, w2, w3, w4, w5, w6, w7,
    w_rs0, w_rs1, w_rs2, w_rs3, w_rs4, w_rs5, w_rs6, w_rs7,
    w_w0, w_w1, w_w2, w_w3, w_w4, w_w5, w_w6, w_w7,
    N_READS: tl.constexpr, N_WRITES: tl.constexpr, BACKWARD: tl.constexpr,
    ACC64: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_C: tl.constexpr, VEC: tl.constexpr,
):  # fmt: skip
    """Forward: row ``(in_t, out_t, in_off, out_off, length)`` copies input columns to
    output columns. Backward (``BACKWARD``): the same rows read the other way, only chain
    heads (``next >= 0``) work, summing the gradient blocks on their chain in float32
    (float64 with ``ACC64``). ``r_lo``/``w_lo``: index of ``r0``/``w0`` in the full tensor
    lists. The first ``N_READS``/``N_WRITES`` slots are used, the others are ``None``."""
    reads = (r0, r1, r2, r3, r4, r5, r6, r7)
    r_rs = (r_rs0, r_rs1, r_rs2, r_rs3, r_rs4, r_rs5, r_rs6, r_rs7)
    r_cs = (r_cs0, r_cs1, r_cs2, r_cs3, r_cs4, r_cs5, r_cs6, r_cs7)
    r_w = (r_w0, r_w1, r_w2, r_w3, r_w4, r_w5, r_w6, r_w7)
    writes = (w0, w1, w2, w3, w4, w5, w6, w7)
    w_rs = (w_rs0, w_rs1, w_rs2, w_rs3, w_rs4, w_rs5, w_rs6, w_rs7)
    w_w = (w_w0, w_w1, w_w2, w_w3, w_w4, w_w5, w_w6, w_w7)
    ACC: tl.constexpr = tl.float64 if ACC64 else tl.float32
    pid = tl.program_id(0).to(tl.int64)
    n_rows = tl.cast(n_rows, tl.int64)  # a constant 1 where Inductor launches it
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
        active = (wt >= 0) & (wt < N_WRITES) & (nxt >= 0)
    else:
        rt = in_t - r_lo
        ro = in_off
        wt = out_t - w_lo
        wo = out_off
        active = (wt >= 0) & (wt < N_WRITES) & (rt >= 0) & (rt < N_READS)
    if active:
        w_ptr, w_stride, w_width, first = _pick_write(wt, writes, w_rs, w_w, N_WRITES)
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
                rt, ro, length, nxt, r_lo, reads, r_rs, r_cs, r_w, N_READS,
                BACKWARD, ACC, BLOCK_C, VEC,
            )  # fmt: skip
        else:
            _segment(
                perm_ptr, perm_s0, perm_s1, n_rows, written_ptr, first, bblk, rows, rmask,
                w_ptr, w_stride, wo, c_lo, c_hi, rt, ro, length, nxt, r_lo,
                reads, r_rs, r_cs, r_w, N_READS, BACKWARD, ACC, BLOCK_C, VEC,
            )  # fmt: skip


# --- the zero-fill kernel -----------------------------------------------------------------


@triton.jit(do_not_specialize=["batch", "n_cols", "rows_per_program"])
def _zero_unwritten_kernel(
    written_ptr, batch, n_cols, rows_per_program,
    w0, w1, w2, w3, w4, w5, w6, w7,
    w_rs0, w_rs1, w_rs2, w_rs3, w_rs4, w_rs5, w_rs6, w_rs7,
    w_w0, w_w1, w_w2, w_w3, w_w4, w_w5, w_w6, w_w7,
    N_WRITES: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_C: tl.constexpr,
):  # fmt: skip
    """Stores 0 in the columns the copy kernel did not mark; a block of flat columns
    (the written tensors side by side) and of rows per program."""
    writes = (w0, w1, w2, w3, w4, w5, w6, w7)
    w_rs = (w_rs0, w_rs1, w_rs2, w_rs3, w_rs4, w_rs5, w_rs6, w_rs7)
    w_w = (w_w0, w_w1, w_w2, w_w3, w_w4, w_w5, w_w6, w_w7)
    col = tl.program_id(0).to(tl.int64) * BLOCK_C + tl.arange(0, BLOCK_C).to(tl.int64)
    unwritten = tl.load(written_ptr + col, mask=col < n_cols, other=1) == 0
    if tl.reduce(unwritten.to(tl.int32), 0, _add) > 0:
        # Each column's tensor: the last one starting at or before it (a zero-width
        # tensor starts where the next one does and loses to it).
        t = col * 0
        start = col * 0
        end = col * 0 + w_w[0]
        for k in tl.static_range(1, N_WRITES):
            t = tl.where(col >= end, k, t)
            start = tl.where(col >= end, end, start)
            end += w_w[k]
        base = _pick(t, writes, N_WRITES) + (col - start)
        rs = tl.cast(_pick(t, w_rs, N_WRITES), tl.int64) + col * 0  # a vector even for one tensor
        zeros = tl.full([BLOCK_B, BLOCK_C], 0, dtype=writes[0].dtype.element_ty)
        first_row = tl.program_id(1).to(tl.int64) * rows_per_program
        end_row = tl.minimum(first_row + rows_per_program, batch)
        for r in range(first_row, end_row, BLOCK_B):
            rows = r + tl.arange(0, BLOCK_B).to(tl.int64)
            m = (rows < end_row)[:, None] & unwritten[None, :]
            tl.store(base[None, :] + rows[:, None] * rs[None, :], zeros, mask=m)


# --- host side ----------------------------------------------------------------------------
# The launches go through torch.library.wrap_triton: where wrapping is enabled (a trace:
# torch.compile, AOTInductor, fake tensors) they are recorded as Triton kernel calls that
# Inductor compiles into its own code; where it is disabled (every eager entry below
# disables it) they are plain launches. So the same code serves eager calls and the
# triton_ops at the end of this file. Sizes may be SymInts there: no int() of the batch.


def _device_guard(device: torch.device):
    # Triton launches on the current device's current stream: make it the tensors' device.
    # In a trace the compiler emits its own guards (and fake tensors have no device to set).
    if device.type != "cuda" or is_wrap_triton_enabled():
        return contextlib.nullcontext()
    return torch.cuda.device(device)


def _check_args(op, tensors, permutes, in_shapes, out_shapes, lengths, batch_size=None,
                same_dtype=True) -> None:  # fmt: skip
    """The library's own checks (``kt_regroup::_check_permute_args``, C++): everything the
    other kernels check before reading data, with their messages. Then what only these
    kernels need: a dtype they take, and the plan on the data's device (they read it there)."""
    torch.ops.kt_regroup._check_permute_args(
        op, tensors, permutes, in_shapes, out_shapes, [int(n) for n in lengths], batch_size,
        same_dtype,
    )  # fmt: skip
    data = next((t for t in tensors if t is not None), None)
    device = permutes.device if data is None else data.device
    if data is not None and data.dtype not in _TL_DTYPE:
        raise TypeError(
            f"kt_regroup.{op}: the Triton kernels take {', '.join(map(str, _TL_DTYPE))}, "
            f"got {data.dtype}"
        )
    if permutes.device != device:
        raise ValueError(
            f"kt_regroup.{op}: permutes is on {permutes.device} but the tensors are on {device}"
        )


def _kernels() -> tuple:
    """The two kernels as this call launches them: wrapped by wrap_triton where a trace
    records them, as they are in eager calls and under Triton's interpreter (which
    torch 2.11's wrap_triton refuses; nothing traces there)."""
    if is_wrap_triton_enabled() and isinstance(_permute_kernel, JITFunction):
        return wrap_triton(_permute_kernel), wrap_triton(_zero_unwritten_kernel)
    return _permute_kernel, _zero_unwritten_kernel


def _next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def _slots(prefix: str, values: Sequence) -> dict:
    """Kernel arguments ``prefix0 .. prefix7``: ``values``, then ``None``."""
    return {f"{prefix}{k}": values[k] if k < len(values) else None for k in range(_SLOTS)}


def _run(
    reads: Sequence[Optional[torch.Tensor]],
    writes: Sequence[torch.Tensor],
    permutes: torch.Tensor,
    batch,
    backward: bool,
    avg_length: int,
    acc_dtype: Optional[torch.dtype] = None,
) -> None:
    """Fills ``writes`` (every element once) from ``reads`` as ``permutes`` says."""
    write_widths = [w.size(1) for w in writes]
    n_cols = sum(write_widths)
    if n_cols == 0 or batch == 0:
        return
    device = writes[0].device
    n_rows = int(permutes.size(0))
    defined = next(t for t in reads if t is not None)
    itemsize = max(defined.element_size(), writes[0].element_size())
    block_c = min(128, max(4, _next_pow2(avg_length)))
    block_b = _BLOCK_ELEMENTS // block_c
    if isinstance(batch, int):  # a symbolic batch (a trace) keeps the full tile
        block_b = max(1, min(block_b, _next_pow2(batch)))
    # Reads of undefined (None) gradients: any pointer of the right type, width 0.
    r_ptr = [defined if t is None else t for t in reads]
    r_rs = [0 if t is None else t.stride(0) for t in reads]
    r_cs = [0 if t is None else t.stride(1) for t in reads]
    r_w = [0 if t is None else t.size(1) for t in reads]
    read_chunks = [0] if backward else range(0, len(reads), MAX_TENSORS)
    rows_per_program = torch.sym_max(_ZERO_ROWS_PER_PROGRAM, triton.cdiv(batch, _MAX_GRID_Y))
    acc64 = (acc_dtype or writes[0].dtype) == torch.float64
    permute_kernel, zero_kernel = _kernels()
    with _device_guard(device):
        for w_lo in range(0, len(writes), MAX_TENSORS):
            w = slice(w_lo, w_lo + MAX_TENSORS)
            n_here = sum(write_widths[w])
            if n_here == 0:
                continue
            w_args = {
                **_slots("w", writes[w]),
                **_slots("w_rs", [t.stride(0) for t in writes[w]]),
                **_slots("w_w", write_widths[w]),
                "N_WRITES": len(writes[w]),
            }
            # One byte per written column: 1 where the copy kernel wrote it.
            written = writes[0].new_zeros(n_here, dtype=torch.int8)
            if n_rows > 0:
                for r_lo in read_chunks:
                    r = slice(r_lo, r_lo + MAX_TENSORS)
                    permute_kernel[(n_rows * triton.cdiv(batch, block_b),)](
                        perm_ptr=permutes, perm_s0=permutes.stride(0),
                        perm_s1=permutes.stride(1), n_rows=n_rows, batch=batch,
                        written_ptr=written, r_lo=r_lo, w_lo=w_lo,
                        **_slots("r", r_ptr[r]), **_slots("r_rs", r_rs[r]),
                        **_slots("r_cs", r_cs[r]), **_slots("r_w", r_w[r]),
                        N_READS=len(r_ptr[r]), **w_args,
                        BACKWARD=backward, ACC64=acc64, BLOCK_B=block_b, BLOCK_C=block_c,
                        VEC=max(1, 16 // itemsize),
                    )  # fmt: skip
            grid = (triton.cdiv(n_here, _ZERO_COLS), triton.cdiv(batch, rows_per_program))
            zero_kernel[grid](
                written_ptr=written, batch=batch, n_cols=n_here,
                rows_per_program=rows_per_program, **w_args,
                BLOCK_B=_ZERO_ROWS, BLOCK_C=_ZERO_COLS,
            )  # fmt: skip


def _forward(pooled_embs, permutes, out_lengths, dtype=None, out=None) -> List[torch.Tensor]:
    """The regroup of inputs of one dtype, without checks (they come before)."""
    first = pooled_embs[0]
    batch = first.size(0)
    if out is None:
        out_dtype = first.dtype if dtype is None else dtype
        outs = [first.new_empty((batch, n), dtype=out_dtype) for n in out_lengths]
    else:
        outs = list(out)
    if outs:
        n_rows = max(1, int(permutes.size(0)))
        avg = sum(int(o.size(1)) for o in outs) // n_rows
        _run(pooled_embs, outs, permutes, batch, backward=False, avg_length=avg)
    return outs


def _backward(grad_outputs, permutes, out_shapes, in_lengths, batch_size, dtype):
    """The gradients, without checks (they come before)."""
    # Factories on a tensor of the device: no device lookup (fake tensors have none).
    defined = [g for g in grad_outputs if g is not None]
    if not defined:
        return [permutes.new_zeros((batch_size, n), dtype=dtype) for n in in_lengths]
    grads = [defined[0].new_empty((batch_size, n), dtype=dtype) for n in in_lengths]
    reads: List[Optional[torch.Tensor]] = list(grad_outputs)
    if len(reads) > MAX_TENSORS:
        reads, permutes = _concatenated(reads, permutes, out_shapes)
    n_rows = max(1, int(permutes.size(0)))
    avg = sum(int(g.size(1)) for g in defined) // n_rows
    acc = torch.float32 if dtype in _HALF else dtype
    _run(reads, grads, permutes, batch_size, backward=True, avg_length=avg, acc_dtype=acc)
    return grads


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
    _check_args(op, pooled_embs, permutes, in_shapes, out_shapes, out_lengths)
    first = pooled_embs[0]
    if out is None:
        if dtype is not None and dtype not in _TL_DTYPE:
            raise TypeError(f"kt_regroup.{op}: cannot write {dtype}")
    else:
        for j, o in enumerate(out):
            if (o.dim() != 2 or o.size(0) != first.size(0) or o.device != first.device
                    or (o.size(1) > 1 and o.stride(1) != 1)):  # fmt: skip
                raise ValueError(
                    f"kt_regroup.{op}: out[{j}] must be [{first.size(0)}, width] on "
                    f"{first.device} with unit column stride, got {tuple(o.shape)} with "
                    f"strides {o.stride()} on {o.device}"
                )
    with set_wrap_triton_enabled(False):
        return _forward(pooled_embs, permutes, out_lengths, dtype, out)


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
    _check_args(op, grad_outputs, permutes, in_shapes, out_shapes, in_lengths, batch_size)
    with set_wrap_triton_enabled(False):
        return _backward(grad_outputs, permutes, out_shapes, in_lengths, batch_size, dtype)


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
# They check what the library's kernels check (``_check_args``), except the plan's values:
# on a device they are not read back (no sync): the kernels clip bad rows instead (see the
# module docstring). A dtype Triton does not take, or a plan on another device than the
# data, returns NotImplemented: the op then runs the kernel that served the device before.


def _takes(tensors, permutes, dtype=None) -> bool:
    """Whether these kernels serve the call (else the library's kernel does)."""
    defined = [t for t in tensors if t is not None]
    dtypes = {t.dtype for t in defined}
    devices = {t.device for t in defined}
    return (
        dtypes <= set(_TL_DTYPE)
        and (dtype is None or dtype in _TL_DTYPE)
        and devices <= {permutes.device}
    )


def _widened(pooled_embs: List[torch.Tensor]) -> List[torch.Tensor]:
    # Inputs of different dtypes (the fused cast) are first widened to their promoted
    # dtype, exactly, in one extra copy of the narrower ones: a launch reads one dtype.
    dtypes = {t.dtype for t in pooled_embs}
    if len(dtypes) < 2:
        return pooled_embs
    wide = functools.reduce(torch.promote_types, dtypes)
    return [t.to(wide) for t in pooled_embs]


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
    ``permute_multi_embedding``). Inputs of one dtype take one pass."""
    if not _takes(pooled_embs, permutes, dtype):
        return NotImplemented
    _check_args(op, pooled_embs, permutes, in_shapes, out_shapes, out_lengths,
                same_dtype=dtype is None)
    with set_wrap_triton_enabled(False):
        return _forward(_widened(pooled_embs), permutes, out_lengths, dtype)


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
    """The op ``permute_multi_embedding_backward``: checks, then the kernels."""
    if not _takes(grad_outputs, permutes, dtype) or len(
        {g.dtype for g in grad_outputs if g is not None}
    ) > 1:
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


# --- inside compiled and exported graphs ----------------------------------------------------
# Inductor treats the library's ops as opaque extern calls: a compiled or AOTInductor graph
# calls them through the dispatcher, and an AOTInductor package loaded without this module
# (a C++ predictor) gets the portable kernel. The triton_ops below run the same launches
# through wrap_triton, so a trace records the Triton kernels themselves and Inductor
# compiles them into its code (cubins in an AOTInductor package). The public ops are
# rewritten into them where AOTAutograd functionalizes the graph (a FunctionalTensorMode
# rule, the mechanism triton_op itself uses): by then autograd has split the step into
# the forward and backward ops, so a training step gets Triton kernels both ways.
# torch.export keeps the library's ops (its graph stays portable and serializable; its
# AOTInductor compile is what decomposes them); so do CPU tensors and what these kernels
# do not take (a dtype, a plan on another device): the library's kernels serve those.


@torch.library.triton_op("kt_regroup::_permute_multi_embedding_triton", mutates_args=())
def _permute_op(
    pooled_embs: List[torch.Tensor],
    permutes: torch.Tensor,
    out_lengths: List[int],
    dtype: Optional[torch.dtype],
) -> List[torch.Tensor]:
    """``permute_multi_embedding_to`` (``dtype=None``: ``permute_multi_embedding``) by the
    Triton kernels; arguments as checked by the op's fake kernel."""
    return _forward(_widened(pooled_embs), permutes, out_lengths, dtype)


@torch.library.triton_op("kt_regroup::_permute_multi_embedding_backward_triton", mutates_args=())
def _backward_op(
    grad_outputs: List[Optional[torch.Tensor]],
    permutes: torch.Tensor,
    out_shapes: torch.Tensor,
    in_lengths: List[int],
    batch_size: int,
    dtype: torch.dtype,
) -> List[torch.Tensor]:
    """``permute_multi_embedding_backward`` by the Triton kernels."""
    return _backward(grad_outputs, permutes, out_shapes, in_lengths, batch_size, dtype)


def _export_keeps_ops() -> bool:
    """True while torch.export traces (it keeps triton_ops undecomposed, and so do we)."""
    try:
        from torch.export._trace import custom_triton_ops_decomposition_disabled
    except ImportError:  # a torch without the switch decomposes triton_ops everywhere
        return False
    return custom_triton_ops_decomposition_disabled()


def _in_graph(types, tensors, permutes, dtype, one_dtype: bool) -> bool:
    """Whether a functionalized call is rewritten into the triton_ops."""
    from torch._subclasses.fake_tensor import FakeTensor
    from torch._subclasses.functional_tensor import FunctionalTensor

    defined = [t for t in tensors if t is not None]
    return (
        not _export_keeps_ops()  # torch.export: keep the library's op
        and all(issubclass(t, (FakeTensor, FunctionalTensor)) or t is torch.Tensor for t in types)
        and permutes.device.type == "cuda"
        and _takes(tensors, permutes, dtype)
        and (not one_dtype or len({t.dtype for t in defined}) <= 1)
    )


def _forward_rule(mode, func, types, args, kwargs):
    pooled_embs, permutes, _in_shapes, _out_shapes, out_lengths, *rest = args
    dtype = rest[0] if rest else (kwargs or {}).get("dtype")
    if pooled_embs and _in_graph(types, pooled_embs, permutes, dtype, dtype is None):
        with mode:
            return _permute_op(pooled_embs, permutes, out_lengths, dtype)
    return mode.__torch_dispatch__(func, types, args, kwargs)


def _backward_rule(mode, func, types, args, kwargs):
    grad_outputs, permutes, _in_shapes, out_shapes, in_lengths, batch_size, dtype = args
    if _in_graph(types, grad_outputs, permutes, dtype, True):
        with mode:
            return _backward_op(grad_outputs, permutes, out_shapes, in_lengths, batch_size, dtype)
    return mode.__torch_dispatch__(func, types, args, kwargs)


def register_graph_rules(lib: torch.library.Library) -> None:
    """Makes traces that functionalize (``torch.compile``, AOTInductor) rewrite the public
    regroup ops on CUDA tensors into the triton_ops above (rules on ``lib``: destroying it
    removes them). Eager calls are untouched (:func:`register` serves those)."""
    from torch._subclasses.functional_tensor import FunctionalTensorMode

    rules = {
        "permute_multi_embedding": _forward_rule,
        "permute_multi_embedding_to": _forward_rule,
        "permute_multi_embedding_backward": _backward_rule,
    }
    for name, rule in rules.items():
        torch.library.register_torch_dispatch(
            f"kt_regroup::{name}", FunctionalTensorMode, rule, lib=lib
        )
