"""The op library's CUDA kernels (``kt_regroup/csrc/cuda``): one set of checks, run two ways.

* ``emulated``: the kernels' device code on the CPU (``tests/cuda_emulation.cpp``: blocks
  one at a time and their threads between barriers, each in a seeded random order; shared
  memory poisoned before each block,
  misaligned 16-byte accesses trapped, launches checked against the device's limits; the
  launches planned and the kernels chosen by the same host code as ``permute.cu``).
  Outputs start filled with a marker (NaN or -77), so an element no kernel writes fails
  the comparison. Runs where no GPU is present.
* ``cuda``: the compiled kernels through the ops, the plan on the device, on a GPU with a
  library built with CUDA.

Both are compared bit for bit with ``tests/reference.py``. Then the checks only a GPU can
make (named ``*cuda*``, skipped with their reason elsewhere): plans on the CPU, the
errors, autograd, no host sync, one launch per call, CUDA graphs, ``torch.compile``,
``torch.library.opcheck``, AOTInductor and TorchScript in a fresh process that loads only
torch and the library, the C++ predictor, and the one-time warning of a library built
without its CUDA kernels. None imports torchrec at module load.
"""

from __future__ import annotations

import ctypes
import json
import os
import pathlib
import random
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch
from conftest import DTYPES, random_layout
from hypothesis import given, settings
from hypothesis import strategies as st
from reference import (
    permute_multi_embedding_backward_reference,
    permute_multi_embedding_reference,
    permute_multi_embedding_to_reference,
    permute_multi_embedding_vbe_reference,
)

import kt_regroup

ROOT = pathlib.Path(__file__).resolve().parent.parent
ops = torch.ops.kt_regroup


def _library_has_cuda() -> bool:
    return hasattr(ctypes.CDLL(kt_regroup.library_path()), "kt_regroup_built_with_cuda")


HAS_GPU = torch.cuda.is_available()
CUDA_KERNELS = HAS_GPU and _library_has_cuda()
needs_cuda_kernels = pytest.mark.skipif(
    not CUDA_KERNELS,
    reason="needs a GPU and a library built with its CUDA kernels (torch with CUDA, nvcc)",
)

# --- the two ways ---------------------------------------------------------------------------


class Emulated:
    """The device code on the CPU: plans and data on the CPU, outputs marked."""

    def __init__(self, ext):
        self.ext = ext

    def forward(self, xs, p, i, o, n, dtype=None):
        return self.ext.forward(xs, p, n, dtype)

    def into(self, xs, p, i, o, outs):
        self.ext.into(xs, p, outs)

    def backward(self, grads, p, i, o, in_lengths, batch, dtype):
        return self.ext.backward(grads, p, in_lengths, batch, dtype)

    def vbe_forward(self, xs, indices, p, i, o, n, batch):
        return self.ext.vbe_forward(xs, indices, p, n, batch)

    def vbe_backward(self, grads, indices, p, i, o, in_lengths, in_rows, batch, dtype):
        return self.ext.vbe_backward(grads, indices, p, in_lengths, in_rows, batch, dtype)


class Cuda:
    """The ops on CUDA, the plan on the device (read there only); results back on the CPU."""

    @staticmethod
    def _on(*tensors):
        """The tensors on CUDA with their strides (slices, transposes, stride-0 expands)."""
        moved = []
        for t in tensors:
            if t is not None:
                root = t if t._base is None else t._base  # contiguous in these tests
                t = root.cuda().as_strided(t.shape, t.stride(), t.storage_offset())
            moved.append(t)
        return moved

    def forward(self, xs, p, i, o, n, dtype=None):
        xs, (p, i, o) = self._on(*xs), self._on(p, i, o)
        if dtype is None:
            outs = ops.permute_multi_embedding(xs, p, i, o, n)
        else:
            outs = ops.permute_multi_embedding_to(xs, p, i, o, n, dtype)
        return [t.cpu() for t in outs]

    def into(self, xs, p, i, o, outs):
        # Each out is a view of a CPU buffer: the same view of a CUDA copy, copied back.
        on = self._on(*outs)
        ops.permute_multi_embedding_into(self._on(*xs), *self._on(p, i, o), on)
        for t, c in zip(outs, on):
            t._base.copy_(c._base.cpu())

    def backward(self, grads, p, i, o, in_lengths, batch, dtype):
        got = ops.permute_multi_embedding_backward(
            self._on(*grads), *self._on(p, i, o), in_lengths, batch, dtype
        )
        return [t.cpu() for t in got]

    def vbe_forward(self, xs, indices, p, i, o, n, batch):
        outs = ops.permute_multi_embedding_vbe(self._on(*xs), self._on(*indices), *self._on(p, i, o), n)
        return [t.cpu() for t in outs]

    def vbe_backward(self, grads, indices, p, i, o, in_lengths, in_rows, batch, dtype):
        return ops.permute_multi_embedding_vbe_backward(
            self._on(*grads), self._on(*indices), *self._on(p, i, o), in_lengths, in_rows, dtype
        ).cpu()


# Every test of this fixture is a kernel check (-m kernel_check: the GPU check's smoke).
@pytest.fixture(scope="module", params=[pytest.param(p, marks=pytest.mark.kernel_check)
                                        for p in ("emulated", "cuda")])
def kernel(request):
    if request.param == "cuda":
        if not CUDA_KERNELS:
            pytest.skip("needs a GPU and a library built with its CUDA kernels")
        return Cuda()
    if HAS_GPU:
        pytest.skip("a GPU is present: the compiled kernels run these checks (cuda)")
    if shutil.which("c++") is None:
        pytest.skip("no C++ compiler to build the emulation")
    # One build for the suite and the cost model, kept in build/ and rebuilt when its
    # sources change; torch's build lock makes concurrent workers wait for it.
    from benchmarks import cuda_model

    ext = cuda_model.emulation()
    return Emulated(ext)


# --- inputs ---------------------------------------------------------------------------------


def _plan(layout, index_dtype=torch.int32):
    p, i, o, n = kt_regroup.kt_regroup_arguments(torch.empty(0), *layout)
    return p.to(index_dtype), i, o, list(n)


def _values(batch, width, dtype, memory="contiguous", seed=0):
    """``[batch, width]``: contiguous, a column slice of a wider tensor (row stride >
    width, unaligned start) or a transposed view (column stride > 1)."""
    g = torch.Generator().manual_seed(seed)
    shape = {"contiguous": (batch, width), "sliced": (batch, width + 5), "transposed": (width, batch)}[memory]
    if dtype.is_floating_point or dtype.is_complex:
        x = torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)
    elif dtype == torch.bool:
        x = torch.randint(0, 2, shape, generator=g).bool()
    else:
        x = torch.randint(-100, 100, shape, generator=g).to(dtype)
    return {"contiguous": x, "sliced": x[:, 3 : width + 3], "transposed": x.t()}[memory]


def _assert_equal(got, expected):
    assert len(got) == len(expected)
    for j, (g, e) in enumerate(zip(got, expected)):
        assert g.dtype == e.dtype and g.shape == e.shape, (j, g.dtype, g.shape, e.dtype, e.shape)
        assert torch.equal(g, e), (j, g, e)


# --- the checks, emulated and on CUDA -----------------------------------------------------------


@settings(max_examples=12)
@given(
    seed=st.integers(0, 10_000),
    batch=st.sampled_from([0, 1, 5, 33]),
    dtype=st.sampled_from(DTYPES + [torch.int64, torch.int16, torch.bool, torch.complex128]),
    memory=st.sampled_from(["contiguous", "sliced", "transposed"]),
    index_dtype=st.sampled_from([torch.int32, torch.int64]),
)
def test_forward_equals_reference(kernel, seed, batch, dtype, memory, index_dtype):
    layout = random_layout(seed)
    p, i, o, n = _plan(layout, index_dtype)
    xs = [_values(batch, w, dtype, memory, seed + k) for k, w in enumerate(layout.in_widths)]
    before = [x.clone() for x in xs]
    _assert_equal(kernel.forward(xs, p, i, o, n), permute_multi_embedding_reference(xs, p, i, o, n))
    _assert_equal(xs, before)


@settings(max_examples=8)
@given(seed=st.integers(0, 10_000), dtype=st.sampled_from(DTYPES))
def test_fused_cast_equals_reference(kernel, seed, dtype):
    layout = random_layout(seed)
    p, i, o, n = _plan(layout)
    mixed = [_values(7, w, DTYPES[(seed + k) % 4], "contiguous", seed + k) * 1e3
             for k, w in enumerate(layout.in_widths)]  # fmt: skip
    got = kernel.forward(mixed, p, i, o, n, dtype)
    _assert_equal(got, permute_multi_embedding_to_reference(mixed, p, i, o, n, dtype))


def test_fused_cast_rounds_like_torch(kernel):
    # Ties, values just above/below ties, infinities, overflow, subnormals, signed zeros, NaN.
    x = torch.tensor(
        [1 + 2**-8, 1 + 3 * 2**-8, 1 + 2**-8 + 2**-20, 1 - 2**-9, -(1 + 2**-8), 3.4e38,
         float("inf"), -float("inf"), 1e-40, -1e-40, 0.0, -0.0, 1.0, float("nan")],
    ).view(1, -1)  # fmt: skip
    p = torch.tensor([[0, 0, 0, 0, x.size(1), 0], [1, 1, 0, 0, x.size(1), 0]], dtype=torch.int32)
    shapes = torch.tensor([x.size(1)] * 2, dtype=torch.int32)
    for dtype in (torch.bfloat16, torch.float16):
        # Two dtypes in: the fused cast (one dtype in takes the byte copy after .to()).
        xs = [x.float(), x.double()]
        got = kernel.forward(xs, p, shapes, shapes, [x.size(1)] * 2, dtype)
        for g, src in zip(got, xs):
            # NaN's bits differ between CPU and CUDA conversions (in torch too): only NaN.
            assert torch.equal(g[:, :-1].view(torch.int16), src[:, :-1].to(dtype).view(torch.int16)), (dtype, g)
            assert g[0, -1].isnan()


@settings(max_examples=12)
@given(
    seed=st.integers(0, 10_000),
    batch=st.sampled_from([1, 6, 40]),
    grad_dtype=st.sampled_from(DTYPES),
    dtype=st.sampled_from(DTYPES),
    none=st.booleans(),
)
def test_backward_equals_reference(kernel, seed, batch, grad_dtype, dtype, none):
    # random_layout duplicates keys inside and across groups and leaves keys unused.
    layout = random_layout(seed)
    p, i, o, n = _plan(layout)
    grads = [_values(batch, w, grad_dtype, "contiguous", seed + j) for j, w in enumerate(n)]
    if none and len(grads) > 1:
        grads[0] = None
    if len(grads) > 1 and grads[-1] is not None:  # read in place with stride 0
        grads[-1] = torch.ones(1, 1, dtype=grad_dtype).expand(batch, n[-1])
    in_lengths = layout.in_widths
    got = kernel.backward(grads, p, i, o, in_lengths, batch, dtype)
    _assert_equal(got, permute_multi_embedding_backward_reference(grads, p, i, o, in_lengths, batch, dtype))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_aligned_segments(kernel, dtype):
    # Widths and offsets in multiples of 16 bytes: the 16-byte vector paths.
    layout = random_layout(3, widths=(8, 16, 64))
    p, i, o, n = _plan(layout)
    for memory in ("contiguous", "sliced", "transposed"):
        xs = [_values(9, w, dtype, memory, k) for k, w in enumerate(layout.in_widths)]
        _assert_equal(kernel.forward(xs, p, i, o, n), permute_multi_embedding_reference(xs, p, i, o, n))
        grads = [_values(9, w, dtype, memory, 7 + j) for j, w in enumerate(n)]
        _assert_equal(
            kernel.backward(grads, p, i, o, layout.in_widths, 9, dtype),
            permute_multi_embedding_backward_reference(grads, p, i, o, layout.in_widths, 9, dtype),
        )


def _misaligned_plan(es):
    """Rows of widths 1..40 at every relative misalignment (bytes mod 16) of source and
    destination for elements of ``es`` bytes, the destination's own alignment varying
    with them; every pair of the two alignments at a few widths. One input of odd width,
    one output whose rows hold the segments 16 bytes apart (the gaps zero-filled)."""
    v = 16 // es  # elements per 16 bytes
    rows, out_off = [], 0
    for w in range(1, 41):
        pairs = [(a, c) for a in range(v) for c in range(v)] if w in (1, 15, 16, 17, 40) or v <= 4 \
            else [(((w + r) % v + r) % v, (w + r) % v) for r in range(v)]
        for a, c in pairs:
            out_off += (c - out_off) % v
            rows.append([0, 0, 8 * v + a, out_off, w, 0])
            out_off += w + v
    in_width, out_width = 8 * v + 40 + 2 * v + 1, out_off + 1
    return torch.tensor(rows), [in_width], [out_width]


@pytest.mark.parametrize("memory", ["contiguous", "sliced"])
@pytest.mark.parametrize("batch", [1, 33])
@pytest.mark.parametrize("dtype", [torch.int8, torch.bfloat16, torch.float32, torch.int64], ids=str)
def test_misaligned_segments_of_every_relative_alignment(kernel, dtype, batch, memory):
    # Segments whose source and destination are misaligned (relative to each other too):
    # a head and tail element by element, aligned 16-byte stores between them.
    p, in_widths, out_widths = _misaligned_plan(dtype.itemsize)
    i, o = torch.tensor(in_widths), torch.tensor(out_widths)
    xs = [_values(batch, in_widths[0], dtype, memory, 5)]
    want = permute_multi_embedding_reference(xs, p, i, o, out_widths)
    _assert_equal(kernel.forward(xs, p, i, o, out_widths), want)
    # Into outputs sliced from a wider buffer: another destination alignment per row.
    buf = _values(batch, out_widths[0] + 3, dtype, "contiguous", 6)
    outs = [buf[:, 1 : out_widths[0] + 1]]
    before = buf.clone()
    kernel.into(xs, p, i, o, outs)
    _assert_equal(outs, want)
    _assert_equal([buf[:, 0], buf[:, -2:]], [before[:, 0], before[:, -2:]])


def _misaligned_backward_plan(es, used_twice=False):
    """The backward's counterpart of ``_misaligned_plan``: rows of widths 1..40 writing
    disjoint columns of one input gradient (a key used once: a copy), at every relative
    misalignment of the gradient (source) and the input gradient (destination), every
    pair of the two alignments at a few widths; the gaps zero-filled. ``used_twice``: each
    key read again from a second gradient output at other alignments (a sum)."""
    v = 16 // es
    rows, in_off, out_off = [], 0, [0, 0]
    for w in range(1, 41):
        pairs = [(a, c) for a in range(v) for c in range(v)] if w in (1, 15, 16, 17, 40) or v <= 4 \
            else [(((w + r) % v + r) % v, (w + r) % v) for r in range(v)]
        for a, c in pairs:
            in_off += (a - in_off) % v
            for t in range(2 if used_twice else 1):
                out_off[t] += (c + 3 * t - out_off[t]) % v
                rows.append([0, t, in_off, out_off[t], w, 0])
                out_off[t] += w + v
            in_off += w + v
    out_widths = [n + 1 for n in out_off[: 2 if used_twice else 1]]
    return torch.tensor(rows), [in_off + 1], out_widths


@pytest.mark.parametrize("used_twice", [False, True], ids=["copied", "summed"])
@pytest.mark.parametrize("memory", ["contiguous", "sliced"])
@pytest.mark.parametrize("batch", [1, 33])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64], ids=str)
def test_backward_of_misaligned_segments_of_every_relative_alignment(
    kernel, dtype, batch, memory, used_twice
):
    # Gradient blocks copied into misaligned input-gradient segments (a key used once: a
    # head and tail element by element, aligned 16-byte stores between them), or summed
    # with another one (a key used twice); the CPU op's bits either way.
    p, in_widths, out_widths = _misaligned_backward_plan(dtype.itemsize, used_twice)
    i, o = torch.tensor(in_widths), torch.tensor(out_widths)
    grads = [_signed_values(batch, w + 5, dtype, 9 + j) for j, w in enumerate(out_widths)]
    grads = [g[:, 3:-2] if memory == "sliced" else g[:, :-5].contiguous() for g in grads]
    got = kernel.backward(grads, p, i, o, in_widths, batch, dtype)
    _assert_same_bits(got, ops.permute_multi_embedding_backward(grads, p, i, o, in_widths, batch, dtype))
    _assert_equal(got, permute_multi_embedding_backward_reference(grads, p, i, o, in_widths, batch, dtype))


@pytest.mark.parametrize("dtype", [torch.int8, torch.bfloat16, torch.float32, torch.int64], ids=str)
def test_vbe_misaligned_segments_of_every_relative_alignment(kernel, dtype):
    # The variable-batch forward's copy of misaligned segments, rows through an index.
    p, in_widths, out_widths = _misaligned_plan(dtype.itemsize)
    i, o = torch.tensor(in_widths), torch.tensor(out_widths)
    x = _values(5, in_widths[0], dtype, "sliced", 8)
    index = torch.tensor([3, 0, 4, 4, 1, 2, 0] * 5)[:33]
    want = permute_multi_embedding_reference([x[index]], p, i, o, out_widths)
    _assert_equal(kernel.vbe_forward([x], [index], p, i, o, out_widths, 33), want)


def test_key_used_more_often_than_a_block_lists(kernel):
    # One key 40 times (more rows than a block lists in shared memory: walked per
    # element), another 3 times.
    keys, lengths = [["a", "b", "c"]], [[3, 5, 2]]
    groups = [["a"] * 24 + ["b", "c"], ["a"] * 16 + ["b", "b"]]
    p, i, o, n = _plan((keys, lengths, groups))
    for dtype in (torch.float32, torch.bfloat16):
        grads = [_values(6, w, dtype, "contiguous", j) for j, w in enumerate(n)]
        _assert_equal(
            kernel.backward(grads, p, i, o, [10], 6, dtype),
            permute_multi_embedding_backward_reference(grads, p, i, o, [10], 6, dtype),
        )


def test_column_5_is_not_read(kernel):
    g = torch.arange(1.0, 9.0).view(2, 4)
    shapes, in_shapes = torch.tensor([4]), torch.tensor([2])
    # Rows 0 and 1 chain to each other forever; row 2 points past the table.
    rows = torch.tensor([[0, 0, 0, 0, 2, 1], [0, 0, 0, 2, 2, -1], [0, 0, 0, 0, 2, 99]])
    (got,) = kernel.backward([g], rows[:2], in_shapes, shapes, [2], 2, torch.float32)
    assert torch.equal(got, g[:, :2] + g[:, 2:])
    (got,) = kernel.backward([g], rows[2:], in_shapes, shapes, [2], 2, torch.float32)
    assert torch.equal(got, g[:, :2])


def test_chunked_launches(kernel):
    # More inputs and outputs than one launch addresses (32): the launches are chunked.
    m = 32
    keys = [[f"k{t}", f"w{t}"] for t in range(m + 3)]
    lengths = [[1 + t % 4, 2] for t in range(m + 3)]
    groups = [[f"k{(3 * g) % (m + 3)}", f"w{g}"] for g in range(m + 2)] + [["k0"]]
    p, i, o, n = _plan((keys, lengths, groups))
    for dtype in (torch.float32, torch.bfloat16):
        xs = [_values(3, sum(w), dtype, seed=t) for t, w in enumerate(lengths)]
        _assert_equal(kernel.forward(xs, p, i, o, n), permute_multi_embedding_reference(xs, p, i, o, n))
        grads = [_values(3, w, dtype, seed=j) for j, w in enumerate(n)]
        in_lengths = [sum(w) for w in lengths]
        _assert_equal(
            kernel.backward(grads, p, i, o, in_lengths, 3, dtype),
            permute_multi_embedding_backward_reference(grads, p, i, o, in_lengths, 3, dtype),
        )


BAD_ROWS = [
    [0, 0, 0, 0, 3, 0],  # out0[:, 0:3] = x0[:, 0:3]
    [0, 0, 1, 10, 2, 0],  # out0[:, 10:12] = x0[:, 1:3]; columns 3..9 no row writes
    [5, 0, 0, 12, 2, 0],  # no input 5: out0[:, 12:14] zeros
    [1, 0, 1, 14, 100, 0],  # clipped: out0[:, 14:16] = x1[:, 1:3]
    [0, 7, 0, 0, 1, 0],  # no output 7: nothing
    [1, 1, 0, -2, 5, 0],  # clipped: out1[:, 0:3] = x1[:, 2:5], x1 has no columns 3, 4
    [0, 1, 2, 4, 2**40, 0],  # clipped: out1[:, 4:6] = x0[:, 2:4]
    [0, 2, 2**62, 0, 2, 0],  # reads far outside x0: zeros
    [0, 2, -(2**63), 0, 2, 0],  # the same block, from the lowest offset
    [0, 1, 0, 3, -4, 0],  # negative length: nothing
]


def _bad_rows_expected(x0, x1):
    batch = x0.size(0)
    out0 = torch.zeros(batch, 16)
    out0[:, 0:3] = x0[:, 0:3]
    out0[:, 10:12] = x0[:, 1:3]
    out0[:, 14:16] = x1[:, 1:3]
    out1 = torch.zeros(batch, 6)
    out1[:, 0] = x1[:, 2]
    out1[:, 4:6] = x0[:, 2:4]
    return [out0, out1, torch.zeros(batch, 2)]


def test_bad_rows_are_clipped_and_gaps_zeroed(kernel):
    x0, x1 = torch.randn(4, 4), torch.randn(4, 3)
    p = torch.tensor(BAD_ROWS, dtype=torch.int64)
    i, o = torch.tensor([4, 3]), torch.tensor([16, 6, 2])
    _assert_equal(kernel.forward([x0, x1], p, i, o, [16, 6, 2]), _bad_rows_expected(x0, x1))


def test_into_writes_every_column_of_the_outputs_and_nothing_else(kernel):
    """Caller-owned outputs: column windows of wider buffers (row stride > width), gaps
    and bad rows included; every column of the windows is written (NaN before), the guard
    columns around them never."""
    x0, x1 = torch.randn(5, 4), torch.randn(5, 3)
    p = torch.tensor(BAD_ROWS, dtype=torch.int64)
    i, o = torch.tensor([4, 3]), torch.tensor([16, 6, 2])
    bufs = [torch.full((5, n + 7), float("nan")) for n in (16, 6, 2)]
    for b in bufs:
        b[:, :3] = b[:, -4:] = -7.0
    outs = [b[:, 3 : b.size(1) - 4] for b in bufs]
    kernel.into([x0, x1], p, i, o, outs)
    _assert_equal(outs, _bad_rows_expected(x0, x1))
    for b in bufs:
        assert (b[:, :3] == -7).all() and (b[:, -4:] == -7).all()


@pytest.mark.parametrize("n_narrow", [(150, 120), (20, 15)], ids=["many", "few"])
def test_gaps_in_some_outputs_and_one_very_wide_key(kernel, n_narrow):
    """One very wide key among narrow ones, a plan with gaps in one output only (rows
    dropped) and unused keys (input-gradient columns no row writes); with few narrow keys,
    more zero tiles than zero blocks, each block taking a run of them. Every column no row
    writes is zero, in the forward, _into (NaN before) and the backward."""
    na, nb = n_narrow
    narrow = [[f"a{t}" for t in range(na)], [f"b{t}" for t in range(nb)]]
    keys = [["wide"] + narrow[0], narrow[1] + ["unused0", "unused1"]]
    lengths = [[80_000] + [1 + t % 4 for t in range(na)], [2 + t % 3 for t in range(nb)] + [5, 3]]
    groups = [["wide"] + narrow[0][::2] + narrow[1][::2], narrow[0][1::2] + narrow[1][1::2],
              narrow[1][::3] + narrow[0][::5]]  # fmt: skip
    p, i, o, n = _plan((keys, lengths, groups), torch.int64)
    # Drop every fourth row of output 1: gaps there only.
    keep = [r for r in range(p.size(0)) if not (p[r, 1] == 1 and r % 4 == 0)]
    p = p[keep].contiguous()
    assert (p[:, 1] == 1).sum() < sum(1 for _ in groups[1])
    batch = 40
    xs = [_values(batch, sum(w), torch.float32, seed=k) for k, w in enumerate(lengths)]
    want = permute_multi_embedding_reference(xs, p, i, o, n)
    _assert_equal(kernel.forward(xs, p, i, o, n), want)
    outs = [torch.full((batch, w), float("nan")) for w in n]
    kernel.into(xs, p, i, o, outs)
    _assert_equal(outs, want)
    in_lengths = [sum(w) for w in lengths]
    for dtype in (torch.float32, torch.bfloat16):
        grads = [_values(batch, w, dtype, seed=10 + j) for j, w in enumerate(n)]
        got = kernel.backward(grads, p, i, o, in_lengths, batch, dtype)
        _assert_equal(got, permute_multi_embedding_backward_reference(grads, p, i, o, in_lengths, batch, dtype))
        assert (got[1][:, -8:] == 0).all()  # the unused keys


def test_into_copy_on_write_outputs_leave_their_sources_alone(kernel):
    """Outputs made by ``torch._lazy_clone`` share their source's storage until written:
    the kernel writes through the outputs' mutable pointers, which copies them first."""
    p, i, o, n = _plan((KEYS, LENGTHS, GROUPS))
    xs = [_values(6, sum(w), torch.float32, seed=k) for k, w in enumerate(LENGTHS)]
    device = "cuda" if isinstance(kernel, Cuda) else "cpu"
    sources = [torch.full((6, w), -5.0, device=device) for w in n]
    outs = [torch._lazy_clone(s) for s in sources]
    if isinstance(kernel, Cuda):
        ops.permute_multi_embedding_into([x.cuda() for x in xs], p.cuda(), i.cuda(), o.cuda(), outs)
    else:
        kernel.into(xs, p, i, o, outs)
    for s in sources:
        assert torch.equal(s.cpu(), torch.full(s.shape, -5.0))
    _assert_equal([t.cpu() for t in outs], permute_multi_embedding_reference(xs, p, i, o, n))


# --- hand-made plans: duplicates found in the plan, column 5 ignored ------------------------
# The backward's sums come from the rows themselves (which rows write which input-gradient
# columns), never from column 5 (torchrec's `next` chain), which the CPU op ignores too:
# every plan the op accepts gives the CPU op's bits.


def _bits(t):
    """The tensor's bits (signed zeros and NaN payloads differ here)."""
    return t.view({1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def _assert_same_bits(got, want):
    assert len(got) == len(want)
    for j, (g, w) in enumerate(zip(got, want)):
        assert g.dtype == w.dtype and g.shape == w.shape, (j, g.dtype, g.shape, w.dtype, w.shape)
        assert torch.equal(_bits(g), _bits(w)), (j, g, w)


def _signed_values(batch, width, dtype, seed, spread=10):
    """Random non-integer values of magnitudes 2**-spread to 2**spread (a sum's order shows
    in its bits; float32 sums of bfloat16 values need spread 24), some of them -0.0."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, width, generator=g, dtype=torch.float64)
    x *= 2.0 ** torch.randint(-spread, spread + 1, (batch, width), generator=g)
    x[torch.rand(batch, width, generator=g) < 0.1] = -0.0
    return x.to(dtype)


# (in_widths, out_widths, rows [in_t, out_t, in_off, out_off, length, next])
HAND_MADE = {
    # A key used twice, column 5 all zeros (no chain): both rows must be summed.
    "duplicates_without_chain": ([6], [6, 6], [[0, 0, 0, 0, 6, 0], [0, 1, 0, 0, 6, 0]]),
    # Key a's row chained to key b's row; b's two rows not chained.
    "chain_to_another_key": (
        [5], [5, 2], [[0, 0, 0, 0, 3, 1], [0, 0, 3, 3, 2, -3], [0, 1, 3, 0, 2, 0]],
    ),
    # One key three times, chained 0 -> 2 -> 1: the sum is in plan order all the same.
    "chain_out_of_plan_order": (
        [8], [8, 8, 8], [[0, 0, 0, 0, 8, 2], [0, 1, 0, 0, 8, -3], [0, 2, 0, 0, 8, -1]],
    ),
    # The first occurrence marked as a later one, the second as a key used once.
    "head_marked_as_later": ([4], [4, 4], [[0, 0, 0, 0, 4, -2], [0, 1, 0, 0, 4, 0]]),
    # Rows over partly shared columns: [0, 6) and [2, 8) of one input.
    "partial_overlap": ([8], [6, 6], [[0, 0, 0, 0, 6, 0], [0, 1, 2, 0, 6, 0]]),
    # An earlier row inside a later one: the later row's columns on both sides of it.
    "earlier_row_inside_later": (
        [9, 3], [2, 9, 3], [[0, 0, 3, 0, 2, 0], [1, 2, 0, 0, 3, 0], [0, 1, 0, 0, 9, 0]],
    ),
    # Three rows staggered over one input, another input's key used once, unread columns.
    "staggered": (
        [12, 5],
        [7, 5, 6],
        [[0, 0, 1, 0, 5, 0], [1, 1, 0, 0, 5, 9], [0, 2, 4, 0, 6, 0], [0, 0, 3, 5, 2, -1]],
    ),
    # More overlapping rows than a block lists in shared memory, each at its own columns.
    "many_overlaps": ([5], [3 * 40], [[0, 0, k % 3, 3 * k, 3, (7 * k) % 41 - 20] for k in range(40)]),
}


def _hand_made(name, index_dtype=torch.int64):
    in_widths, out_widths, rows = HAND_MADE[name]
    return (torch.tensor(rows, dtype=index_dtype), torch.tensor(in_widths),
            torch.tensor(out_widths), in_widths, out_widths)  # fmt: skip


@pytest.mark.parametrize("name", sorted(HAND_MADE))
@pytest.mark.parametrize(
    "grad_dtype,dtype",
    [(torch.float32,) * 2, (torch.bfloat16,) * 2, (torch.float16,) * 2, (torch.float64,) * 2,
     (torch.float32, torch.bfloat16), (torch.float16, torch.float64)],
    ids=["fp32", "bf16", "fp16", "fp64", "fp32_to_bf16", "fp16_to_fp64"],
)  # fmt: skip
def test_backward_of_hand_made_plans_has_the_cpu_ops_bits(kernel, name, grad_dtype, dtype):
    p, i, o, in_widths, out_widths = _hand_made(name)
    batch = 37
    grads = [_signed_values(batch, w, grad_dtype, 100 + j) for j, w in enumerate(out_widths)]
    got = kernel.backward(grads, p, i, o, in_widths, batch, dtype)
    _assert_same_bits(got, ops.permute_multi_embedding_backward(grads, p, i, o, in_widths, batch, dtype))
    if len(grads) > 1:  # a gradient given as None adds nothing
        grads[1] = None
        got = kernel.backward(grads, p, i, o, in_widths, batch, dtype)
        _assert_same_bits(got, ops.permute_multi_embedding_backward(grads, p, i, o, in_widths, batch, dtype))


@st.composite
def _random_plans(draw):
    """Rows of random tensors, offsets and lengths inside them and garbage in column 5."""
    in_widths = draw(st.lists(st.integers(0, 12), min_size=1, max_size=3))
    out_widths = draw(st.lists(st.integers(1, 12), min_size=1, max_size=3))
    rows = []
    for _ in range(draw(st.integers(0, 10))):
        it, ot = draw(st.integers(0, len(in_widths) - 1)), draw(st.integers(0, len(out_widths) - 1))
        length = draw(st.integers(0, min(in_widths[it], out_widths[ot])))
        rows.append([it, ot, draw(st.integers(0, in_widths[it] - length)),
                     draw(st.integers(0, out_widths[ot] - length)), length,
                     draw(st.integers(-12, 12))])  # fmt: skip
    return in_widths, out_widths, rows


@settings(max_examples=60)
@given(
    plan=_random_plans(),
    seed=st.integers(0, 10_000),
    batch=st.sampled_from([1, 9]),
    dtypes=st.sampled_from([(torch.float32,) * 2, (torch.bfloat16,) * 2, (torch.float64, torch.float16)]),
    index_dtype=st.sampled_from([torch.int32, torch.int64]),
)
def test_backward_of_random_plans_has_the_cpu_ops_bits(kernel, plan, seed, batch, dtypes, index_dtype):
    in_widths, out_widths, rows = plan
    p = torch.tensor(rows, dtype=index_dtype).view(-1, 6)
    i, o = torch.tensor(in_widths), torch.tensor(out_widths)
    grads = [_signed_values(batch, w, dtypes[0], seed + j) for j, w in enumerate(out_widths)]
    got = kernel.backward(grads, p, i, o, in_widths, batch, dtypes[1])
    _assert_same_bits(got, ops.permute_multi_embedding_backward(grads, p, i, o, in_widths, batch, dtypes[1]))


@pytest.mark.parametrize("op", ["backward", "vbe_backward"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_sums_follow_plan_order_not_the_chain(kernel, op, dtype):
    # 1 + -1 + 2**-30 in plan order is 2**-30; chained 0 -> 2 -> 1 it would be 0.
    p, i, o, in_widths, out_widths = _hand_made("chain_out_of_plan_order")
    grads = [torch.full((3, 8), v, dtype=dtype) for v in (1.0, -1.0, 2.0**-30)]
    if op == "backward":
        got = kernel.backward(grads, p, i, o, in_widths, 3, dtype)
        _assert_same_bits(got, [torch.full((3, 8), 2.0**-30, dtype=dtype)])
    else:  # rows 0 and 2 read by samples 1 and 0, 2
        args = (grads, [torch.tensor([2, 0, 2])], p, i, o, in_widths, [3])
        got = kernel.vbe_backward(*args, 3, dtype).view(3, 8)
        want = torch.tensor([2.0**-30, 0, 2 * 2.0**-30]).to(dtype).view(3, 1).expand(3, 8)
        _assert_same_bits([got], [want])


def test_duplicates_in_other_chunks_of_the_plan(kernel):
    # 300 rows (a block scans them kThreads at a time): each input column written by a row of the
    # first chunk and by rows of the second, chained nowhere.
    rows = [[0, 0, k, k, 1, 0] for k in range(150)]
    rows += [[0, 1, (7 * k) % 149, 2 * k, 2, 0] for k in range(150)]
    p, i, o = torch.tensor(rows), torch.tensor([150]), torch.tensor([150, 300])
    grads = [_signed_values(3, w, torch.float32, 300 + j) for j, w in enumerate((150, 300))]
    _assert_same_bits(kernel.backward(grads, p, i, o, [150], 3, torch.float32),
                      ops.permute_multi_embedding_backward(grads, p, i, o, [150], 3, torch.float32))  # fmt: skip
    args = (grads, [torch.tensor([1, 0, 1])], p, i, o, [150], [2])
    _assert_same_bits([kernel.vbe_backward(*args, 3, torch.float32)],
                      [ops.permute_multi_embedding_vbe_backward(*args, torch.float32)])  # fmt: skip


@pytest.mark.parametrize("name", sorted(HAND_MADE))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_vbe_backward_of_hand_made_plans_has_the_cpu_ops_bits(kernel, name, dtype):
    p, i, o, in_widths, out_widths = _hand_made(name)
    batch = 29
    g = torch.Generator().manual_seed(5)
    # Input 0 indexed (rows read by several samples, one by none), any other one not.
    in_rows = [7] + [batch] * (len(in_widths) - 1)
    indices = [torch.randint(0, 6, (batch,), generator=g)] + [None] * (len(in_widths) - 1)
    grads = [_signed_values(batch, w, dtype, 200 + j, spread=24) for j, w in enumerate(out_widths)]
    args = (grads, indices, p, i, o, in_widths, in_rows)
    _assert_same_bits([kernel.vbe_backward(*args, batch, dtype)], [ops.permute_multi_embedding_vbe_backward(*args, dtype)])
    # Without an index: a row is its own sample.
    args = (grads, [None] * len(in_widths), p, i, o, in_widths, [batch] * len(in_widths))
    _assert_same_bits([kernel.vbe_backward(*args, batch, dtype)], [ops.permute_multi_embedding_vbe_backward(*args, dtype)])


# --- the emulation runs blocks as a device may, and checks what a device checks ----------


@pytest.fixture
def emulation(kernel):
    if not isinstance(kernel, Emulated):
        pytest.skip("checks of the emulation (the GPU runs the kernels themselves)")
    yield kernel.ext
    kernel.ext.set_block_order(0)


def _every_op(ext):
    """Forward, _into, backward and the VBE ops on a random layout and hand-made plans."""
    layout = random_layout(11)
    p, i, o, n = _plan(layout)
    xs = [_values(9, w, torch.float32, seed=k) for k, w in enumerate(layout.in_widths)]
    outs = [torch.full((9, w), float("nan")) for w in n]
    ext.into(xs, p, outs)
    grads = [_signed_values(9, w, torch.float32, 40 + j) for j, w in enumerate(n)]
    got = ext.forward(xs, p, n, None) + outs
    got += ext.backward(grads, p, layout.in_widths, 9, torch.bfloat16)
    for name in ("staggered", "many_overlaps"):
        hp, _, _, in_widths, out_widths = _hand_made(name)
        hg = [_signed_values(6, w, torch.float32, 60 + j) for j, w in enumerate(out_widths)]
        got += ext.backward(hg, hp, in_widths, 6, torch.float32)
        index = [torch.tensor([2, 0, 2, 1, 0, 2])] + [None] * (len(in_widths) - 1)
        rows = [3] + [6] * (len(in_widths) - 1)
        got.append(ext.vbe_backward(hg, index, hp, in_widths, rows, 6, torch.float32))
    xs, indices, (p, i, o, n), in_rows = _vbe_case(5, 7, torch.float32, torch.int64)
    got += ext.vbe_forward(xs, indices, p, n, 7)
    return got


def test_results_do_not_depend_on_the_order_of_blocks(emulation):
    emulation.set_block_order(-1)  # index order
    want = _every_op(emulation)
    for seed in (1, 2, 3):
        emulation.set_block_order(seed)
        _assert_same_bits(_every_op(emulation), want)


def test_random_block_orders_show_a_race(emulation):
    # Two rows of a bad plan write the same output columns: which block runs last wins.
    p = torch.tensor([[0, 0, 0, 0, 4, 0], [1, 0, 0, 0, 4, 0]])
    xs = [torch.zeros(2, 4), torch.ones(2, 4)]
    seen = set()
    for seed in range(8):
        emulation.set_block_order(seed)
        (out,) = emulation.forward(xs, p, [4], None)
        seen.add(float(out[0, 0]))
    assert seen == {0.0, 1.0}


def test_shared_memory_is_poisoned_before_each_block(emulation):
    for seed in (-1, 1):
        emulation.set_block_order(seed)
        assert torch.equal(emulation.unwritten_shared(3), torch.full((3, 16), 0xFF, dtype=torch.uint8))


def test_misaligned_16_byte_accesses_are_trapped(emulation):
    emulation.vector_access(16)
    with pytest.raises(RuntimeError, match=r"misaligned 16-byte load at 0x[0-9a-f]+ \(block 0, thread 0\)"):
        emulation.vector_access(4)


@pytest.mark.parametrize(
    "call,message",
    [(lambda e: e.launch(0, 256), "grid of 0 blocks"),
     (lambda e: e.launch(2**31, 256), "grid of 2147483648 blocks"),
     (lambda e: e.launch(1, 1025), "1025 threads per block"),
     (lambda e: e.many_parameter_bytes(), "4100 bytes of kernel parameters"),
     (lambda e: e.shared_bytes(48 * 1024 + 1), "49153 bytes of shared memory")],
    ids=["no_blocks", "grid_x", "threads", "parameters", "shared_memory"],
)  # fmt: skip
def test_launches_past_the_device_limits_are_refused(emulation, call, message):
    emulation.launch(1, 256)
    emulation.shared_bytes(48 * 1024)
    with pytest.raises(ValueError, match="emulated launch over the device's limits: " + message):
        call(emulation)


# --- the variable-batch ops (permute_multi_embedding_vbe{,_backward}) -----------------------


def _vbe_case(seed, batch, dtype, index_dtype):
    """``(xs, indices, plan, in_rows)`` on a random_layout: each input without an index (one
    row per sample) or indexed: random rows, every sample on one row, most rows unused
    (more rows than samples), a strided index; inputs contiguous, sliced or transposed."""
    rng = random.Random(seed)
    layout = random_layout(seed)
    p, i, o, n = _plan(layout, index_dtype)
    g = torch.Generator().manual_seed(seed)
    xs, indices = [], []
    for k, w in enumerate(layout.in_widths):
        mode = rng.choice(["none", "random", "one_row", "unused", "strided"])
        rows = {"none": batch, "random": rng.randint(1, 6), "one_row": 4, "unused": batch + 7,
                "strided": rng.randint(1, 3)}[mode]  # fmt: skip
        memory = rng.choice(["contiguous", "sliced", "transposed"])
        xs.append(_values(rows, w, dtype, memory, seed + k))
        if mode == "none":
            indices.append(None)
            continue
        if mode == "one_row":
            ix = torch.full((batch,), rng.randrange(rows))
        elif mode == "unused":
            ix = torch.randint(0, max(1, rows // 3), (batch,), generator=g)
        else:
            ix = torch.randint(0, rows, (2 * batch if mode == "strided" else batch,), generator=g)
            ix = ix[::2] if mode == "strided" else ix
        indices.append(ix.to(index_dtype))
    return xs, indices, (p, i, o, n), [x.size(0) for x in xs]


@settings(max_examples=16, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    batch=st.sampled_from([0, 1, 3, 513]),
    dtype=st.sampled_from(DTYPES + [torch.int64, torch.bool]),
    index_dtype=st.sampled_from([torch.int32, torch.int64]),
)
def test_vbe_forward_equals_the_cpu_kernel(kernel, seed, batch, dtype, index_dtype):
    xs, indices, (p, i, o, n), _ = _vbe_case(seed, batch, dtype, index_dtype)
    before = [x.clone() for x in xs], [None if ix is None else ix.clone() for ix in indices]
    got = kernel.vbe_forward(xs, indices, p, i, o, n, batch)
    _assert_equal(got, ops.permute_multi_embedding_vbe(xs, indices, p, i, o, n))
    _assert_equal(got, permute_multi_embedding_vbe_reference(xs, indices, p, i, o, n))
    _assert_equal(xs, before[0])
    assert all(a is None or torch.equal(a, b) for a, b in zip(indices, before[1]))


@settings(max_examples=16, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    batch=st.sampled_from([0, 1, 3, 513]),
    dtype=st.sampled_from(DTYPES),
    index_dtype=st.sampled_from([torch.int32, torch.int64]),
    none=st.booleans(),
)
def test_vbe_backward_equals_the_cpu_kernel_bit_for_bit(kernel, seed, batch, dtype, index_dtype, none):
    # Duplicated keys (the plan's chains), rows no sample reads, all samples on one row.
    xs, indices, (p, i, o, n), in_rows = _vbe_case(seed, batch, dtype, index_dtype)
    grads = [_values(batch, w, dtype, "contiguous", seed + 50 + j) * 64 for j, w in enumerate(n)]
    if none and len(grads) > 1:
        grads[0] = None
    in_lengths = [x.size(1) for x in xs]
    got = kernel.vbe_backward(grads, indices, p, i, o, in_lengths, in_rows, batch, dtype)
    want = ops.permute_multi_embedding_vbe_backward(grads, indices, p, i, o, in_lengths, in_rows, dtype)
    assert got.dtype == want.dtype and got.shape == want.shape
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))  # the bits, zeros' signs too


def test_vbe_backward_sums_many_samples_of_one_row_in_sample_order(kernel):
    # 4000 samples, 3999 of them on one row: another order of the float32 sums shows in
    # their bits.
    keys, lengths, groups = [["a", "b"], ["c"]], [[3, 2], [4]], [["a", "c", "a"], ["b"]]
    p, i, o, n = _plan((keys, lengths, groups), torch.int64)
    indices = [torch.tensor([1] * 3999 + [0]), None]  # input 0 has 2 rows, input 1 4000
    grads = [_values(4000, w, torch.float32, seed=j) for j, w in enumerate(n)]
    args = (grads, indices, p, i, o, [5, 4], [2, 4000])
    got = kernel.vbe_backward(*args, 4000, torch.float32)
    assert torch.equal(got.view(torch.int32), ops.permute_multi_embedding_vbe_backward(*args, torch.float32).view(torch.int32))


def test_vbe_chunked_launches(kernel):
    # More inputs than one launch addresses (32), each indexed.
    m = 32
    keys = [[f"k{t}"] for t in range(m + 3)]
    lengths = [[1 + t % 3] for t in range(m + 3)]
    groups = [[f"k{(5 * g) % (m + 3)}", f"k{g}"] for g in range(m + 2)]
    p, i, o, n = _plan((keys, lengths, groups))
    xs = [_values(2 + t % 3, w[0], torch.float32, seed=t) for t, w in enumerate(lengths)]
    indices = [torch.tensor([t % x.size(0), 0, x.size(0) - 1]) for t, x in enumerate(xs)]
    _assert_equal(kernel.vbe_forward(xs, indices, p, i, o, n, 3),
                  ops.permute_multi_embedding_vbe(xs, indices, p, i, o, n))  # fmt: skip
    grads = [_values(3, w, torch.float32, seed=j) for j, w in enumerate(n)]
    rows, widths = [x.size(0) for x in xs], [x.size(1) for x in xs]
    assert torch.equal(
        kernel.vbe_backward(grads, indices, p, i, o, widths, rows, 3, torch.float32),
        ops.permute_multi_embedding_vbe_backward(grads, indices, p, i, o, widths, rows, torch.float32),
    )


def _vbe_many_inputs(m, batch, dtype, index_dtype, seed=0, widths=(1, 3, 5, 7, 33)):
    """``(xs, indices, plan, in_rows)``: m inputs of one to three keys of `widths` (odd
    ones by default), every third without an index, the others indexed (one to six rows,
    some unused); keys used in two groups and twice in one, some unused; contiguous or
    sliced inputs."""
    rng = random.Random(seed)
    keys = [[f"k{t}_{k}" for k in range(1 + t % 3)] for t in range(m)]
    lengths = [[rng.choice(widths) for _ in ks] for ks in keys]
    used = [k for ks in keys for k in ks if rng.random() < 0.9]
    groups = [used[g::5] for g in range(5)]
    groups[0] += used[1:8]  # across groups
    groups[1] += used[4:6] * 2  # twice in one group, and across
    p, i, o, n = _plan((keys, lengths, groups), index_dtype)
    g = torch.Generator().manual_seed(seed)
    xs, indices = [], []
    for t, w in enumerate(lengths):
        rows = batch if t % 3 == 0 else rng.randint(1, 6)
        xs.append(_values(rows, sum(w), dtype, rng.choice(["contiguous", "sliced"]), seed + t))
        indices.append(None if t % 3 == 0 else
                       torch.randint(0, max(1, rows - (t % 2)), (batch,), generator=g).to(index_dtype))  # fmt: skip
    return xs, indices, (p, i, o, n), [x.size(0) for x in xs]


@pytest.mark.parametrize("m", [40, 70])
@pytest.mark.parametrize("batch", [0, 1, 37])
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64], ids=["int32", "int64"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["fp32", "fp16", "bf16"])
def test_vbe_more_inputs_than_a_launch_took_have_the_cpu_ops_bits(kernel, m, batch, index_dtype, dtype):
    # More than 32 inputs (the chunk of a launch before the device table), odd widths,
    # duplicated keys, rows no sample reads; forward and backward against the CPU op.
    xs, indices, (p, i, o, n), in_rows = _vbe_many_inputs(m, batch, dtype, index_dtype, seed=m + batch)
    _assert_same_bits(kernel.vbe_forward(xs, indices, p, i, o, n, batch),
                      ops.permute_multi_embedding_vbe(xs, indices, p, i, o, n))  # fmt: skip
    spread = 8 if dtype == torch.float16 else 24  # float16 sums stay finite
    grads = [_signed_values(batch, w, dtype, 70 + j, spread=spread) for j, w in enumerate(n)]
    widths = [x.size(1) for x in xs]
    args = (grads, indices, p, i, o, widths, in_rows)
    _assert_same_bits([kernel.vbe_backward(*args, batch, dtype)],
                      [ops.permute_multi_embedding_vbe_backward(*args, dtype)])  # fmt: skip
    grads[1] = None  # an undefined gradient adds nothing
    _assert_same_bits([kernel.vbe_backward(*args, batch, dtype)],
                      [ops.permute_multi_embedding_vbe_backward(*args, dtype)])  # fmt: skip


def test_vbe_forward_zero_fills_gaps_and_rows_of_bad_inputs(kernel):
    # A plan with gaps in wide outputs (zero tiles: more than the few zero blocks take,
    # each taking several) and a row reading an input past the list (a no-op); no plan.
    xs = [torch.randn(3, 4), torch.randn(2, 3)]
    indices = [torch.tensor([2, 0, 1, 2] * 10), torch.tensor([1, 1, 0, 1] * 10)]
    rows = [[0, 0, 0, 4000, 2, 0], [1, 0, 0, 4005, 3, 0], [5, 0, 0, 1, 2, 0], [0, 1, 1, 0, 3, 0]]
    p, i, o, n = torch.tensor(rows), torch.tensor([4, 3]), torch.tensor([5000, 7]), [5000, 7]
    want = [torch.zeros(40, 5000), torch.zeros(40, 7)]
    want[0][:, 4000:4002] = xs[0][indices[0], 0:2]
    want[0][:, 4005:4008] = xs[1][indices[1], 0:3]
    want[1][:, 0:3] = xs[0][indices[0], 1:4]
    _assert_same_bits(kernel.vbe_forward(xs, indices, p, i, o, n, 40), want)
    none = torch.zeros(0, 6, dtype=torch.int64)
    _assert_same_bits(kernel.vbe_forward(xs, indices, none, i, o, n, 40),
                      [torch.zeros(40, 5000), torch.zeros(40, 7)])  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_vbe_aligned_keys_have_the_cpu_ops_bits(kernel, dtype):
    # Widths of 16-byte multiples: the 16-byte vector paths (a key once, no index).
    xs, indices, (p, i, o, n), in_rows = _vbe_many_inputs(40, 21, dtype, torch.int64, 3, (8, 16, 64))
    xs = [x.contiguous() for x in xs]
    _assert_same_bits(kernel.vbe_forward(xs, indices, p, i, o, n, 21),
                      ops.permute_multi_embedding_vbe(xs, indices, p, i, o, n))  # fmt: skip
    grads = [_signed_values(21, w, dtype, 80 + j, spread=24) for j, w in enumerate(n)]
    args = (grads, indices, p, i, o, [x.size(1) for x in xs], in_rows)
    _assert_same_bits([kernel.vbe_backward(*args, 21, dtype)],
                      [ops.permute_multi_embedding_vbe_backward(*args, dtype)])  # fmt: skip


@pytest.mark.parametrize("bad", [5, -1], ids=["past_the_end", "negative"])
def test_vbe_index_out_of_range_names_the_input_and_sample(kernel, bad):
    if isinstance(kernel, Cuda):
        pytest.skip("a device-side assert ends the process's CUDA context")
    xs, indices, (p, i, o, n), rows = _vbe_case(7, 4, torch.float32, torch.int64)
    xs = [torch.randn(3, x.size(1)) for x in xs]
    # The kernels check the indices they read: those of an input some row reads.
    k = int(p[0, 0])
    indices = [torch.tensor([0, 2, 1, 0]) for _ in xs]
    indices[k] = torch.tensor([0, 2, bad, 1])
    message = rf"indices\[{k}\]\[2\] = {bad} is out of range for input {k}, which has 3 rows"
    with pytest.raises(IndexError, match=message):
        ops.permute_multi_embedding_vbe(xs, indices, p, i, o, n)  # the CPU kernel's message
    with pytest.raises(IndexError, match="permute_multi_embedding_vbe: " + message):
        kernel.vbe_forward(xs, indices, p, i, o, n, 4)
    grads = [torch.randn(4, w) for w in n]
    with pytest.raises(IndexError, match="permute_multi_embedding_vbe_backward: " + message):
        kernel.vbe_backward(grads, indices, p, i, o, [x.size(1) for x in xs], [3] * len(xs), 4, torch.float32)


# --- CUDA only: the ops on a GPU ------------------------------------------------------------------

# Odd widths, keys duplicated inside a group (a) and across groups (b, e), unused keys
# (d, g), a single-key group.
KEYS = [["a", "b", "c", "d"], ["e", "f"], ["g", "h", "i"]]
LENGTHS = [[1, 3, 7, 127], [5, 16], [2, 64, 9]]
GROUPS = [["e", "a", "i", "a"], ["c", "b", "h", "e"], ["f"], ["b"]]
FLOATS = [torch.float32, torch.float16, torch.bfloat16, torch.float64]


def cuda_plan(device="cuda", index_dtype=torch.int32):
    p, i, o, n = kt_regroup.kt_regroup_arguments(torch.empty(0), KEYS, LENGTHS, GROUPS)
    return p.to(device, index_dtype), i.to(device), o.to(device), list(n)


def cuda_inputs(batch, dtype=torch.float32, requires_grad=False, seed=0):
    return [_values(batch, sum(w), dtype, seed=seed + k).cuda().requires_grad_(requires_grad)
            for k, w in enumerate(LENGTHS)]  # fmt: skip


def cuda_grads(batch, n, dtype=torch.float32, seed=10):
    return [_values(batch, w, dtype, seed=seed + j).cuda() for j, w in enumerate(n)]


def _cpu(tensors):
    return [None if t is None else t.cpu() for t in tensors]


@needs_cuda_kernels
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64], ids=str)
def test_cuda_plan_on_the_cpu_is_checked_and_gives_the_same_results(index_dtype):
    p, i, o, n = cuda_plan("cpu", index_dtype)
    xs = cuda_inputs(130)
    ref = permute_multi_embedding_reference(_cpu(xs), p, i, o, n)
    _assert_equal(_cpu(ops.permute_multi_embedding(xs, p, i, o, n)), ref)
    _assert_equal(_cpu(ops.permute_multi_embedding_to(xs, p, i, o, n, torch.bfloat16)),
                  [r.bfloat16() for r in ref])  # fmt: skip
    outs = [torch.full((130, w), float("nan"), device="cuda") for w in n]
    ops.permute_multi_embedding_into(xs, p, i, o, outs)
    _assert_equal(_cpu(outs), ref)
    grads = cuda_grads(130, n)
    grads[2] = None
    in_lengths = [sum(w) for w in LENGTHS]
    _assert_equal(
        _cpu(ops.permute_multi_embedding_backward(grads, p, i, o, in_lengths, 130, torch.float32)),
        permute_multi_embedding_backward_reference(_cpu(grads), p, i, o, in_lengths, 130, torch.float32),
    )
    # A bad row is caught on the host before anything runs (the plan on the device is not).
    bad = p.clone()
    bad[0, 4] = 1000
    with pytest.raises(IndexError, match=r"permutes\[0\] reads columns"):
        ops.permute_multi_embedding(xs, bad, i, o, n)
    with pytest.raises(IndexError, match=r"permutes\[0\] reads columns"):
        ops.permute_multi_embedding_into(xs, bad, i, o, outs)


def _error(fn):
    with pytest.raises((ValueError, TypeError, IndexError)) as info:
        fn()
    return info.type, str(info.value).splitlines()[0]


@needs_cuda_kernels
@pytest.mark.parametrize(
    "case", ["3d", "mixed_dtypes", "batch", "permutes_shape", "permutes_dtype", "in_shapes",
             "out_shapes", "negative_length", "empty"],
)  # fmt: skip
def test_cuda_errors_with_the_plan_on_the_device_are_the_cpu_kernels(case):
    x, y = torch.randn(2, 4), torch.randn(2, 3)
    p = torch.tensor([[0, 0, 0, 0, 4, 0], [1, 0, 0, 4, 3, 0]], dtype=torch.int32)
    ins, outs, n = torch.tensor([4, 3]), torch.tensor([7]), [7]
    args = {
        "3d": ([x, y.view(2, 3, 1)], p, ins, outs, n),
        "mixed_dtypes": ([x, y.double()], p, ins, outs, n),
        "batch": ([x, torch.randn(3, 3)], p, ins, outs, n),
        "permutes_shape": ([x, y], p[:, :5], ins, outs, n),
        "permutes_dtype": ([x, y], p.float(), ins, outs, n),
        "in_shapes": ([x, y], p, ins[:1], outs, n),
        "out_shapes": ([x, y], p, ins, torch.tensor([7, 1]), n),
        "negative_length": ([x, y], p, ins, outs, [-7]),
        "empty": ([], p, ins, outs, n),
    }[case]
    on = [[t.cuda() for t in args[0]], *[a.cuda() for a in args[1:4]], args[4]]
    expected = _error(lambda: ops.permute_multi_embedding(*args))
    assert _error(lambda: ops.permute_multi_embedding(*on)) == expected


@needs_cuda_kernels
@pytest.mark.parametrize("dtype", FLOATS, ids=str)
def test_cuda_training_step_calls_the_backward_kernel(dtype):
    p, i, o, n = cuda_plan()
    xs = cuda_inputs(64, dtype, requires_grad=True)
    weights = cuda_grads(64, n, dtype, seed=20)
    outs = ops.permute_multi_embedding(xs, p, i, o, n)
    sum((out * w).sum() for out, w in zip(outs, weights)).backward()
    _assert_equal(_cpu(outs), permute_multi_embedding_reference(_cpu([x.detach() for x in xs]), p.cpu(), i.cpu(), o.cpu(), n))
    # The gradient of sum(out * w) is w; the backward op sums w's blocks per key.
    expected = permute_multi_embedding_backward_reference(
        _cpu(weights), p.cpu(), i.cpu(), o.cpu(), [x.size(1) for x in xs], 64, dtype)
    _assert_equal(_cpu([x.grad for x in xs]), expected)


def _calls(p, i, o, n, xs, grads, outs, train, weights):
    in_lengths = [x.size(1) for x in xs]

    def step():
        loss = sum((out * w).sum() for out, w in zip(ops.permute_multi_embedding(train, p, i, o, n), weights))
        loss.backward()

    return {
        "forward": lambda: ops.permute_multi_embedding(xs, p, i, o, n),
        "to": lambda: ops.permute_multi_embedding_to(xs, p, i, o, n, torch.bfloat16),
        "into": lambda: ops.permute_multi_embedding_into(xs, p, i, o, outs),
        "backward": lambda: ops.permute_multi_embedding_backward(grads, p, i, o, in_lengths, xs[0].size(0), torch.float32),
        "step": step,
    }


@needs_cuda_kernels
def test_cuda_no_host_sync_with_the_plan_on_the_device():
    p, i, o, n = cuda_plan()
    xs, grads = cuda_inputs(128), cuda_grads(128, n)
    outs = [torch.empty(128, w, device="cuda") for w in n]
    train = [x.clone().requires_grad_() for x in xs]
    weights = cuda_grads(128, n, seed=30)
    calls = _calls(p, i, o, n, xs, grads, outs, train, weights)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for fn in calls.values():
            fn()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    # And the results are right (the mode skipped nothing).
    ref = permute_multi_embedding_reference(_cpu(xs), p.cpu(), i.cpu(), o.cpu(), n)
    _assert_equal(_cpu(outs), ref)
    expected = permute_multi_embedding_backward_reference(
        _cpu(weights), p.cpu(), i.cpu(), o.cpu(), [x.size(1) for x in xs], 128, torch.float32)
    _assert_equal(_cpu([x.grad for x in train]), expected)


@needs_cuda_kernels
def test_cuda_one_launch_per_call():
    from torch.profiler import ProfilerActivity, profile

    p, i, o, n = cuda_plan()
    xs, grads = cuda_inputs(1000), cuda_grads(1000, n)
    outs = [torch.empty(1000, w, device="cuda") for w in n]
    calls = _calls(p, i, o, n, xs, grads, outs, None, None)
    del calls["step"]
    for name, fn in calls.items():
        fn()  # warm
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        kernels = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        assert len(kernels) == 1 and "permute_" in kernels[0], (name, kernels)


def _captured(step):
    """``step`` warmed up on a side stream, then captured: ``(graph, its outputs)``."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = step()
    return graph, outs


@needs_cuda_kernels
def test_cuda_graph_captures_forward_into_and_backward():
    p, i, o, n = cuda_plan()
    xs, grads = cuda_inputs(64, seed=15), cuda_grads(64, n, seed=16)
    in_lengths = [x.size(1) for x in xs]
    outs = [torch.empty(64, w, device="cuda") for w in n]

    def step():
        fwd = ops.permute_multi_embedding(xs, p, i, o, n)
        ops.permute_multi_embedding_into(xs, p, i, o, outs)
        back = ops.permute_multi_embedding_backward(grads, p, i, o, in_lengths, 64, torch.float32)
        return fwd, back

    graph, (fwd, back) = _captured(step)
    for t in xs + grads:
        t.mul_(2)
    graph.replay()
    torch.cuda.synchronize()
    ref = permute_multi_embedding_reference(_cpu(xs), p.cpu(), i.cpu(), o.cpu(), n)
    _assert_equal(_cpu(fwd), ref)
    _assert_equal(_cpu(outs), ref)
    _assert_equal(_cpu(back), permute_multi_embedding_backward_reference(
        _cpu(grads), p.cpu(), i.cpu(), o.cpu(), in_lengths, 64, torch.float32))


@needs_cuda_kernels
def test_cuda_opcheck_of_every_op():
    p, i, o, n = cuda_plan()
    xs, grads = cuda_inputs(5), cuda_grads(5, n)
    grads[1] = None
    in_lengths = [x.size(1) for x in xs]
    for op, args in [
        (ops.permute_multi_embedding, (xs, p, i, o, n)),
        (ops.permute_multi_embedding_to, (xs, p, i, o, n, torch.float16)),
        (ops.permute_multi_embedding_into, (xs, p, i, o, [torch.empty(5, w, device="cuda") for w in n])),
        (ops.permute_multi_embedding_backward, (grads, p, i, o, in_lengths, 5, torch.float32)),
    ]:
        torch.library.opcheck(op, args)


def _vbe_on(device, xs, indices, plan):
    xs = [x.detach().to(device).clone() for x in xs]
    indices = [None if ix is None else ix.to(device) for ix in indices]
    return xs, indices, [t.to(device) for t in plan[:3]] + [plan[3]]


@needs_cuda_kernels
@pytest.mark.parametrize("plan_device", ["cuda", "cpu"])
@pytest.mark.parametrize("dtype", FLOATS, ids=str)
def test_cuda_vbe_training_step_equals_the_cpu_op(plan_device, dtype):
    xs, indices, plan, _ = _vbe_case(11, 300, dtype, torch.int32)
    weights = [_values(300, w, dtype, seed=40 + j) for j, w in enumerate(plan[3])]

    def step(device):
        leaves, idx, (p, i, o, n) = _vbe_on(device, xs, indices, plan)
        p, i, o = (t.to(plan_device if device == "cuda" else "cpu") for t in (p, i, o))
        leaves = [x.requires_grad_() for x in leaves]
        outs = ops.permute_multi_embedding_vbe(leaves, idx, p, i, o, n)
        sum((out * w.to(device)).sum() for out, w in zip(outs, weights)).backward()
        return _cpu([t.detach() for t in outs]), _cpu([x.grad for x in leaves])

    got, want = step("cuda"), step("cpu")
    _assert_equal(got[0], want[0])
    _assert_equal(got[1], want[1])  # the backward's bits: sample order, float32 sums


@needs_cuda_kernels
def test_cuda_vbe_opcheck_one_forward_launch_and_no_host_sync():
    from torch.profiler import ProfilerActivity, profile

    xs, indices, plan, rows = _vbe_case(5, 64, torch.float32, torch.int64)
    xs, indices, (p, i, o, n) = _vbe_on("cuda", xs, indices, plan)
    grads = [_values(64, w, torch.float32, seed=j).cuda() for j, w in enumerate(n)]
    widths = [x.size(1) for x in xs]
    forward = (xs, indices, p, i, o, n)
    backward = (grads, indices, p, i, o, widths, rows, torch.float32)
    torch.library.opcheck(ops.permute_multi_embedding_vbe.default, forward)
    torch.library.opcheck(ops.permute_multi_embedding_vbe_backward.default, backward)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        outs = ops.permute_multi_embedding_vbe(*forward)
        flat = ops.permute_multi_embedding_vbe_backward(*backward)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    _assert_equal(_cpu(outs), ops.permute_multi_embedding_vbe(_cpu(xs), _cpu(indices), p.cpu(), i.cpu(), o.cpu(), n))
    cpu_backward = [_cpu(grads), _cpu(indices), p.cpu(), i.cpu(), o.cpu(), widths, rows, torch.float32]
    assert torch.equal(flat.cpu(), ops.permute_multi_embedding_vbe_backward(*cpu_backward))
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        ops.permute_multi_embedding_vbe(*forward)
        torch.cuda.synchronize()
    events = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    # One kernel and the copy of its table of tensors from pinned memory.
    kernels = [e for e in events if not e.startswith("Memcpy")]
    assert len(kernels) == 1 and "vbe_copy_kernel" in kernels[0], events
    assert len(events) == 2 and "HtoD" in [e for e in events if e.startswith("Memcpy")][0], events
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        ops.permute_multi_embedding_vbe_backward(*backward)
        torch.cuda.synchronize()
    events = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    # The keys, ATen's sort and search, the sums: one of ours each, whatever the inputs.
    assert sum("vbe_keys_kernel" in e for e in events) == 1, events
    assert sum("vbe_backward_kernel" in e for e in events) == 1, events


@needs_cuda_kernels
def test_cuda_graph_captures_the_vbe_ops():
    # The table of tensors is copied from pinned memory kept for the graph: a replay reads
    # the inputs' new values through it.
    xs, indices, plan, rows = _vbe_many_inputs(40, 64, torch.float32, torch.int32)
    xs, indices, (p, i, o, n) = _vbe_on("cuda", xs, indices, plan)
    grads = [_signed_values(64, w, torch.float32, 90 + j).cuda() for j, w in enumerate(n)]
    widths = [x.size(1) for x in xs]

    def step():
        outs = ops.permute_multi_embedding_vbe(xs, indices, p, i, o, n)
        flat = ops.permute_multi_embedding_vbe_backward(grads, indices, p, i, o, widths, rows, torch.float32)
        return outs, flat

    graph, (outs, flat) = _captured(step)
    step()  # another call between capture and replay reuses no captured staging block
    for t in xs + grads:
        t.mul_(2)
    graph.replay()
    torch.cuda.synchronize()
    cpu = (_cpu(indices), p.cpu(), i.cpu(), o.cpu())
    _assert_equal(_cpu(outs), ops.permute_multi_embedding_vbe(_cpu(xs), *cpu, n))
    assert torch.equal(flat.cpu(), ops.permute_multi_embedding_vbe_backward(
        _cpu(grads), *cpu, widths, rows, torch.float32))  # fmt: skip


@needs_cuda_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_cuda_compiled_training_step_equals_eager_and_calls_the_op(dtype):
    from torch._inductor.utils import run_and_get_code

    p, i, o, n = cuda_plan()
    weights = cuda_grads(37, n, dtype)

    def step(inputs):
        outs = ops.permute_multi_embedding(inputs, p, i, o, n)
        sum((out * w).float().sum() for out, w in zip(outs, weights)).backward()
        return [out.detach() for out in outs]

    eager_inputs = cuda_inputs(37, dtype, requires_grad=True)
    expected = step(eager_inputs)
    inputs = cuda_inputs(37, dtype, requires_grad=True)
    got, codes = run_and_get_code(torch.compile(step), inputs)
    _assert_equal(got, expected)
    _assert_equal([x.grad for x in inputs], [x.grad for x in eager_inputs])
    code = "\n".join(codes)
    assert "kt_regroup.permute_multi_embedding." in code, code[:3000]
    assert "kt_regroup.permute_multi_embedding_backward." in code, code[:3000]


@needs_cuda_kernels
def test_cuda_compiled_ktregroupasdict_step_equals_eager():
    pytest.importorskip("torchrec", reason="KTRegroupAsDict needs torchrec")
    from torchrec.sparse.jagged_tensor import KeyedTensor

    names = [f"g{j}" for j in range(len(GROUPS))]

    def step(module, inputs):
        kts = [KeyedTensor(keys=k, length_per_key=w, values=v) for k, w, v in zip(KEYS, LENGTHS, inputs)]
        outs = module(kts)
        sum((outs[name] * (j + 1)).sum() for j, name in enumerate(names)).backward()
        return [outs[name].detach() for name in names]

    module = kt_regroup.KTRegroupAsDict(GROUPS, names)
    eager_inputs = cuda_inputs(19, requires_grad=True)
    expected = step(module, eager_inputs)
    inputs = cuda_inputs(19, requires_grad=True)
    _assert_equal(torch.compile(step)(module, inputs), expected)
    _assert_equal([x.grad for x in inputs], [x.grad for x in eager_inputs])


# --- CUDA only: fresh processes with only torch and the library -----------------------------------


def _fresh(code: str, *args: str, cwd=None) -> dict:
    """Runs ``code`` in an interpreter that loads only torch and the library (``-I``), as a
    deployment does; returns the JSON it prints last."""
    prelude = textwrap.dedent(f"""
        import json, sys, torch
        from torch.profiler import ProfilerActivity, profile
        torch.ops.load_library({kt_regroup.library_path()!r})

        def kernels(fn):
            fn()
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                fn()
                torch.cuda.synchronize()
            return [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    """)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KT_REGROUP", "PYTHONPATH"))}
    proc = subprocess.run(
        [sys.executable, "-I", "-c", prelude + textwrap.dedent(code), *args],
        capture_output=True, text=True, timeout=600, env=env, cwd=cwd,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-6000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    loaded = [m for m in ("kt_regroup", "torchrec", "fbgemm_gpu") if m in report.pop("modules")]
    assert loaded == [], loaded
    return report


class Regroup(torch.nn.Module):
    """A deployed model: the plan in buffers, the op on the inputs. ``to_cuda``: takes CPU
    inputs (as the C++ predictor makes them), regroups on CUDA, returns CPU tensors."""

    def __init__(self, to_cuda: bool = False):
        super().__init__()
        p, i, o, self.out_lengths = cuda_plan()
        self.register_buffer("permutes", p)
        self.register_buffer("in_shapes", i)
        self.register_buffer("out_shapes", o)
        self.to_cuda = to_cuda

    def forward(self, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor):
        if self.to_cuda:
            a, b, c = a.cuda(), b.cuda(), c.cuda()
        outs = torch.ops.kt_regroup.permute_multi_embedding(
            [a, b, c], self.permutes, self.in_shapes, self.out_shapes, self.out_lengths)
        return [out.cpu() for out in outs] if self.to_cuda else outs


@needs_cuda_kernels
def test_cuda_torchscript_model_in_a_fresh_process(tmp_path):
    model = Regroup()
    xs = cuda_inputs(77)
    torch.jit.script(model).save(str(tmp_path / "scripted.pt"))
    torch.jit.trace(model, tuple(xs), strict=False).save(str(tmp_path / "traced.pt"))
    torch.save({"inputs": _cpu(xs), "outputs": _cpu(model(*xs))}, tmp_path / "io.pt")
    report = _fresh("""
        io = torch.load(sys.argv[1] + "/io.pt")
        xs = [x.cuda() for x in io["inputs"]]
        out = {"modules": list(sys.modules)}
        for name in ("scripted", "traced"):
            model = torch.jit.load(f"{sys.argv[1]}/{name}.pt")
            equal = all(torch.equal(g.cpu(), e) for g, e in zip(model(*xs), io["outputs"]))
            out[name] = [equal, kernels(lambda: model(*xs))]
        print(json.dumps(out))
    """, str(tmp_path))
    for name in ("scripted", "traced"):
        equal, launched = report[name]
        assert equal, name
        assert len(launched) == 1 and "permute_" in launched[0], (name, launched)


@needs_cuda_kernels
@pytest.mark.skipif(shutil.which("cmake") is None, reason="cmake is not installed")
def test_cuda_cpp_predictor_runs_a_cuda_model(tmp_path):
    # examples/cpp_predictor (no Python) runs a TorchScript model that regroups on CUDA.
    torch.jit.script(Regroup(to_cuda=True)).save(str(tmp_path / "on_cuda.pt"))
    build = tmp_path / "build"
    for cmd in (
        ["cmake", "-S", str(ROOT / "examples" / "cpp_predictor"), "-B", str(build),
         f"-DCMAKE_PREFIX_PATH={torch.utils.cmake_prefix_path}", "-DCMAKE_BUILD_TYPE=Release"],
        ["cmake", "--build", str(build), "-j4"],
    ):  # fmt: skip
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    batch, widths = 13, [sum(w) for w in LENGTHS]
    run = subprocess.run(
        [str(build / "predictor"), str(tmp_path / "on_cuda.pt"), kt_regroup.library_path(),
         *[f"{batch}x{w}" for w in widths]],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    # The predictor's inputs (element i = i % 17 - 8) and checksums, computed here.
    inputs = [(torch.arange(batch * w, dtype=torch.float32) % 17 - 8).reshape(batch, w) for w in widths]
    sums = []
    for out in permute_multi_embedding_reference(inputs, *cuda_plan("cpu")):
        weights = torch.arange(out.numel(), dtype=torch.float64) % 101 + 1
        sums.append(int((out.double().flatten() * weights).sum().item()))
    printed = [int(line.split("checksum")[1]) for line in run.stdout.splitlines() if "checksum" in line]
    assert printed == sums


_AOTI_RUN = """
    model = torch._inductor.aoti_load_package(sys.argv[1])
    inputs = [x.cuda() for x in torch.load(sys.argv[2])]
    outputs = model(*inputs)
    torch.save([o.cpu() for o in outputs], sys.argv[3])
    print(json.dumps({"modules": list(sys.modules), "device": kernels(lambda: model(*inputs))}))
"""


def _aoti_check(model, example, inputs, expected, tmp_path):
    """torch.export (dynamic batch) + AOTInductor of ``model``: the package calls the
    library's op, and run on ``inputs`` in a fresh process with only torch and the library
    gives ``expected`` with the op's one kernel launch."""
    batch = torch.export.Dim("batch", min=1, max=65536)
    program = torch.export.export(model, tuple(example), dynamic_shapes=tuple({0: batch} for _ in example))
    targets = {str(n.target) for n in program.graph.nodes if n.op == "call_function"}
    assert "kt_regroup.permute_multi_embedding.default" in targets, targets
    package = tmp_path / "model.pt2"
    torch._inductor.aoti_compile_and_package(program, package_path=str(package))
    torch.save(_cpu(inputs), tmp_path / "inputs.pt")
    report = _fresh(_AOTI_RUN, str(package), str(tmp_path / "inputs.pt"), str(tmp_path / "out.pt"), cwd=tmp_path)
    assert any("permute_" in k for k in report["device"]), report["device"]
    _assert_equal(torch.load(tmp_path / "out.pt"), expected)


@needs_cuda_kernels
def test_cuda_aoti_package_runs_in_a_fresh_process(tmp_path):
    inputs = cuda_inputs(37)  # a batch the export never saw
    expected = permute_multi_embedding_reference(_cpu(inputs), *cuda_plan("cpu"))
    _aoti_check(Regroup().eval(), cuda_inputs(8), inputs, expected, tmp_path)


@needs_cuda_kernels
def test_cuda_aoti_package_of_the_deploy_example(tmp_path):
    """``examples/deploy.py``'s model (KeyedTensors built in forward, KTRegroupAsDict) on
    CUDA, compared with the same model on CPU (the library's CPU kernel)."""
    pytest.importorskip("torchrec", reason="the example model uses torchrec's KeyedTensor")
    import importlib.util

    spec = importlib.util.spec_from_file_location("example_deploy", ROOT / "examples" / "deploy.py")
    deploy = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(deploy)
    model = deploy.OverArchInput().eval()
    model(*[x.cuda() for x in deploy.example_inputs(2)])  # the plan, cached on CUDA
    inputs = [x.cuda() for x in deploy.example_inputs(37)]
    expected = list(deploy.build()(*deploy.example_inputs(37)))
    _aoti_check(model, [x.cuda() for x in deploy.example_inputs(4)], inputs, expected, tmp_path)


# --- a library without its CUDA kernels ----------------------------------------------------------


@pytest.mark.skipif(torch.version.cuda is not None, reason="torch is a CUDA build")
def test_cpu_torch_library_has_no_cuda_kernels():
    # A CPU-only build: the portable kernels serve every non-CPU device.
    assert not _library_has_cuda()


@pytest.mark.skipif(
    not HAS_GPU or _library_has_cuda(),
    reason="needs a GPU and a library built without its CUDA kernels (KT_REGROUP_CUDA=0); "
    "only CUDA tensors reach the portable kernel's warning",
)
def test_portable_kernel_on_cuda_warns_once_how_to_build_the_cuda_kernels(tmp_path):
    p, i, o, n = cuda_plan()
    xs = cuda_inputs(3)
    torch.save((p, i, o), tmp_path / "plan.pt")
    torch.save(xs, tmp_path / "xs.pt")
    report = _fresh("""
        import warnings
        p, i, o = torch.load(sys.argv[1] + "/plan.pt")
        xs = torch.load(sys.argv[1] + "/xs.pt")
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            for _ in range(3):
                outs = torch.ops.kt_regroup.permute_multi_embedding(xs, p, i, o, %r)
            torch.ops.kt_regroup.permute_multi_embedding_into(xs, p, i, o, outs)
        print(json.dumps({"modules": list(sys.modules), "warnings": [str(w.message) for w in seen],
                          "outs": [o.cpu().tolist() for o in outs]}))
    """ % (n,), str(tmp_path))
    assert len(report["warnings"]) == 1, report["warnings"]
    assert "pip install --no-build-isolation ." in report["warnings"][0]
    expected = permute_multi_embedding_reference(_cpu(xs), p.cpu(), i.cpu(), o.cpu(), n)
    _assert_equal([torch.tensor(t) for t in report["outs"]], expected)

