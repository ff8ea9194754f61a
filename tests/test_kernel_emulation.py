"""The device code of the library's CUDA kernels (``kt_regroup/csrc/cuda/kernels.cuh``),
run on the CPU by ``tests/cuda_emulation.cpp`` (thread blocks as threads), against the
reference: indexing, vector and element paths, clipping of bad rows, the zero fill,
chunked launches, the duplicate chains of the backward. Machines without a GPU check the
kernels' logic here; ``test_cuda_kernel.py`` runs the compiled kernels on a GPU.

Outputs start filled with a marker (NaN or -77), so an element no kernel writes fails
the comparison.
"""

from __future__ import annotations

import pathlib
import shutil

import pytest
import torch
from conftest import DTYPES, random_layout
from hypothesis import given, settings
from hypothesis import strategies as st
from reference import (
    permute_multi_embedding_backward_reference,
    permute_multi_embedding_to_reference,
)

import kt_regroup

ROOT = pathlib.Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.skipif(shutil.which("c++") is None, reason="no C++ compiler")


@pytest.fixture(scope="module")
def emulated(tmp_path_factory):
    from torch.utils.cpp_extension import load

    return load(
        name="kt_regroup_cuda_emulation",
        sources=[str(ROOT / "tests" / "cuda_emulation.cpp")],
        extra_include_paths=[str(ROOT / "kt_regroup" / "csrc" / "cuda")],
        extra_cflags=["-std=c++20", "-O1"],
        build_directory=str(tmp_path_factory.mktemp("emulation")),
    )


def _plan(layout, index_dtype=torch.int32):
    p, i, o, n = kt_regroup.kt_regroup_arguments(torch.empty(0), *layout)
    return p.to(index_dtype), i, o, list(n)


def _values(batch, width, dtype, memory, seed):
    g = torch.Generator().manual_seed(seed)
    shape = {"contiguous": (batch, width), "sliced": (batch, width + 5), "transposed": (width, batch)}[memory]
    if dtype.is_floating_point:
        x = torch.randn(shape, generator=g).to(dtype)
    else:
        x = torch.randint(-100, 100, shape, generator=g).to(dtype)
    return {"contiguous": x, "sliced": x[:, 3 : width + 3], "transposed": x.t()}[memory]


def _assert_equal(got, expected):
    assert len(got) == len(expected)
    for g, e in zip(got, expected):
        assert g.dtype == e.dtype and g.shape == e.shape
        assert torch.equal(g, e), (g, e)


@settings(max_examples=12)
@given(
    seed=st.integers(0, 10_000),
    batch=st.sampled_from([1, 5, 33]),
    dtype=st.sampled_from(DTYPES + [torch.int64, torch.int16]),
    memory=st.sampled_from(["contiguous", "sliced", "transposed"]),
    index_dtype=st.sampled_from([torch.int32, torch.int64]),
)
def test_emulated_forward_equals_reference(emulated, seed, batch, dtype, memory, index_dtype):
    layout = random_layout(seed)
    p, i, o, n = _plan(layout, index_dtype)
    xs = [_values(batch, w, dtype, memory, seed + k) for k, w in enumerate(layout.in_widths)]
    got = emulated.forward(xs, p, n, None)
    _assert_equal(got, permute_multi_embedding_to_reference(xs, p, i, o, n))


@settings(max_examples=8)
@given(seed=st.integers(0, 10_000), dtype=st.sampled_from(DTYPES))
def test_emulated_fused_cast_equals_reference(emulated, seed, dtype):
    layout = random_layout(seed)
    p, i, o, n = _plan(layout)
    mixed = [_values(7, w, DTYPES[(seed + k) % 4], "contiguous", seed + k)
             for k, w in enumerate(layout.in_widths)]
    got = emulated.forward(mixed, p, n, dtype)
    _assert_equal(got, permute_multi_embedding_to_reference(mixed, p, i, o, n, dtype))


@settings(max_examples=12)
@given(
    seed=st.integers(0, 10_000),
    batch=st.sampled_from([1, 6, 40]),
    grad_dtype=st.sampled_from(DTYPES),
    dtype=st.sampled_from(DTYPES),
    none=st.booleans(),
)
def test_emulated_backward_equals_reference(emulated, seed, batch, grad_dtype, dtype, none):
    # random_layout duplicates keys inside and across groups and leaves keys unused.
    layout = random_layout(seed)
    p, i, o, n = _plan(layout)
    grads = [_values(batch, w, grad_dtype, "contiguous", seed + j) for j, w in enumerate(n)]
    if none and len(grads) > 1:
        grads[0] = None
    if len(grads) > 1 and grads[-1] is not None:  # read in place with stride 0
        grads[-1] = torch.ones(1, 1, dtype=grad_dtype).expand(batch, n[-1])
    in_lengths = layout.in_widths
    got = emulated.backward(grads, p, in_lengths, batch, dtype)
    expected = permute_multi_embedding_backward_reference(grads, p, i, o, in_lengths, batch, dtype)
    _assert_equal(got, expected)


@pytest.mark.parametrize("dtype", DTYPES)
def test_emulated_aligned_segments(emulated, dtype):
    # Widths and offsets in multiples of 16 bytes: the 16-byte vector path.
    layout = random_layout(3, widths=(8, 16, 64))
    p, i, o, n = _plan(layout)
    for memory in ("contiguous", "sliced"):
        xs = [_values(9, w, dtype, memory, k) for k, w in enumerate(layout.in_widths)]
        got = emulated.forward(xs, p, n, None)
        _assert_equal(got, permute_multi_embedding_to_reference(xs, p, i, o, n))
        grads = [_values(9, w, dtype, memory, 7 + j) for j, w in enumerate(n)]
        _assert_equal(
            emulated.backward(grads, p, layout.in_widths, 9, dtype),
            permute_multi_embedding_backward_reference(grads, p, i, o, layout.in_widths, 9, dtype),
        )


def test_emulated_long_duplicate_chain(emulated):
    # One key 20 times (more than a block keeps in shared memory: walked per element),
    # another 3 times.
    keys, lengths = [["a", "b", "c"]], [[3, 5, 2]]
    groups = [["a"] * 12 + ["b", "c"], ["a"] * 8 + ["b", "b"]]
    p, i, o, n = _plan((keys, lengths, groups))
    for dtype in (torch.float32, torch.bfloat16):
        grads = [_values(6, w, dtype, "contiguous", j) for j, w in enumerate(n)]
        _assert_equal(
            emulated.backward(grads, p, [10], 6, dtype),
            permute_multi_embedding_backward_reference(grads, p, i, o, [10], 6, dtype),
        )


def test_emulated_chunked_launches(emulated):
    # More inputs and outputs than one launch addresses: the launches are chunked.
    m = emulated.max_tensors
    keys = [[f"k{t}", f"w{t}"] for t in range(m + 3)]
    lengths = [[1 + t % 4, 2] for t in range(m + 3)]
    groups = [[f"k{(3 * g) % (m + 3)}", f"w{g}"] for g in range(m + 2)] + [["k0"]]
    p, i, o, n = _plan((keys, lengths, groups))
    xs = [torch.randn(3, sum(w)) for w in lengths]
    _assert_equal(emulated.forward(xs, p, n, None), permute_multi_embedding_to_reference(xs, p, i, o, n))
    grads = [torch.randn(3, w) for w in n]
    in_lengths = [sum(w) for w in lengths]
    _assert_equal(
        emulated.backward(grads, p, in_lengths, 3, torch.float32),
        permute_multi_embedding_backward_reference(grads, p, i, o, in_lengths, 3, torch.float32),
    )


def test_emulated_bad_rows_are_clipped_and_gaps_zeroed(emulated):
    batch = 4
    x0 = torch.randn(batch, 4)
    x1 = torch.randn(batch, 3)
    rows = [
        [0, 0, 0, 0, 3, 0],  # out0[:, 0:3] = x0[:, 0:3]
        [0, 0, 1, 10, 2, 0],  # out0[:, 10:12] = x0[:, 1:3]; columns 3..9 no row writes
        [5, 0, 0, 12, 2, 0],  # no input 5: out0[:, 12:14] zeros
        [1, 0, 1, 14, 100, 0],  # clipped: out0[:, 14:16] = x1[:, 1:3]
        [0, 7, 0, 0, 1, 0],  # no output 7: nothing
        [1, 1, 0, -2, 5, 0],  # clipped: out1[:, 0:3] = x1[:, 2:5], x1 has no columns 3, 4
        [0, 1, 2, 4, 2**40, 0],  # clipped: out1[:, 4:6] = x0[:, 2:4]
        [0, 2, 2**62, 0, 2, 0],  # reads far outside x0: zeros
        [0, 2, -(2**63), 0, 2, 0],  # the same block, from the lowest offset
    ]
    p = torch.tensor(rows, dtype=torch.int64)
    out0 = torch.zeros(batch, 16)
    out0[:, 0:3] = x0[:, 0:3]
    out0[:, 10:12] = x0[:, 1:3]
    out0[:, 14:16] = x1[:, 1:3]
    out1 = torch.zeros(batch, 6)
    out1[:, 0] = x1[:, 2]
    out1[:, 4:6] = x0[:, 2:4]
    _assert_equal(emulated.forward([x0, x1], p, [16, 6, 2], None), [out0, out1, torch.zeros(batch, 2)])
