"""The Triton kernels (``kt_regroup.kernels.triton``), checked against the reference.

Without a GPU they run on CPU tensors in Triton's interpreter (``TRITON_INTERPRET=1``,
set below before Triton is imported); with one they run compiled on CUDA. Results must be
bit-exact: the reference kernel and the slice-and-cat oracle of ``conftest`` are the
truth. The interpreter executes every program in Python, so shapes are small and the
cases few.
"""

import atexit
import os
import subprocess
import sys
import textwrap

import pytest
import torch

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1" or not torch.cuda.is_available()
if _INTERPRET:
    os.environ["TRITON_INTERPRET"] = "1"  # must precede the first @triton.jit it affects
pytest.importorskip("triton", reason="triton is not installed")

from conftest import (  # noqa: E402
    SMALL_LAYOUT,
    Layout,
    assert_no_alias,
    assert_same_list,
    clone_all,
    dtype_ids,
    expected_regroup,
    make_values,
    random_layout,
)
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from reference import (  # noqa: E402
    permute_multi_embedding_backward_reference,
    permute_multi_embedding_reference,
    permute_multi_embedding_to_reference,
)
from torch.overrides import TorchFunctionMode  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from torchrec.sparse.jagged_tensor import _kt_regroup_arguments  # noqa: E402

import kt_regroup  # noqa: E402
import kt_regroup.kernels.triton as kt  # noqa: E402
from kt_regroup.kernels.triton import (  # noqa: E402
    permute_multi_embedding_backward_triton,
    permute_multi_embedding_triton,
)

DEVICE = torch.device("cpu" if _INTERPRET else "cuda")


def test_kernels_run_where_this_module_expects():
    # If kt_regroup.kernels.triton was imported before TRITON_INTERPRET=1 was set, its
    # kernels are compiled ones and every CPU test below would fail for that reason.
    interpreted = type(kt._permute_kernel).__name__ == "InterpretedFunction"
    assert interpreted == _INTERPRET, (
        "kt_regroup.kernels.triton was imported before this module set TRITON_INTERPRET=1"
    )


def test_kernels_use_no_triton_library_jit_functions():
    # triton.language's own @triton.jit helpers (cdiv, zeros, max, ...) are interpreted
    # only if Triton was imported after TRITON_INTERPRET=1 was set; in a full test run
    # another module may import it first. The kernels must not depend on that order.
    import inspect
    import re

    import triton.language as tl

    source = inspect.getsource(kt)
    used = set(re.findall(r"\btl\.([a-z_]+)\(", source))
    library = {n for n in used if hasattr(getattr(tl, n), "fn")}  # jit'd: they wrap .fn
    assert used and library == set(), library


# --- layouts and metadata -----------------------------------------------------------------

# Widths that are multiples of 16 bytes take the vector branch, the others the masked one.
ALIGNED_MIX = random_layout(5, n_inputs=3, keys_per_input=(2, 4), widths=(4, 8, 3, 16))
# An input with no keys, a zero-width key, an empty group.
EDGES = Layout(
    keys=[["a", "z", "b"], [], ["c"]],
    lengths=[[3, 0, 8], [], [5]],
    groups=[["c", "z", "a", "c"], [], ["b", "a"]],
)
# Adjacent keys used once (merged by coalescing) around a key used three times.
MERGEABLE = Layout(
    keys=[["a", "b", "c"], ["d", "e"]],
    lengths=[[4, 3, 8], [4, 1]],
    groups=[["b", "c", "a"], ["d", "e", "a", "a"]],
)
# Three inputs and three groups, small: the many-tensor paths with MAX_TENSORS = 2.
THREE = Layout(
    keys=[["a"], ["b", "e", "c"], ["d"]],
    lengths=[[2], [1, 3, 4], [3]],
    groups=[["d", "a"], ["b", "a"], ["c", "d"]],
)
LAYOUTS = {
    "seed0": random_layout(0),
    "seed1": random_layout(1),
    "small": SMALL_LAYOUT,
    "aligned_mix": ALIGNED_MIX,
    "edges": EDGES,
    "mergeable": MERGEABLE,
}


def coalesce_keeping_chains(permutes: torch.Tensor) -> torch.Tensor:
    """Merges adjacent rows of keys used once (``next == 0``) that copy one contiguous
    run, and renumbers the duplicate chains: the coalesced form the kernels are fed."""
    rows = permutes.tolist()
    merged, new_index = [], []
    for r in rows:
        p = merged[-1] if merged else None
        if (
            p is not None
            and p[5] == 0
            and r[5] == 0
            and p[0] == r[0]
            and p[1] == r[1]
            and p[2] + p[4] == r[2]
            and p[3] + p[4] == r[3]
        ):
            p[4] += r[4]
        else:
            merged.append(list(r))
        new_index.append(len(merged) - 1)
    for r in merged:
        if r[5] > 0:
            r[5] = new_index[r[5]]
        elif r[5] < 0:
            r[5] = -len(merged) if -r[5] == len(rows) else -new_index[-r[5]]
    return torch.tensor(merged, dtype=permutes.dtype).reshape(-1, 6).to(permutes.device)


def metadata(kind: str, layout: Layout, device=DEVICE):
    """``(permutes, in_shapes, out_shapes, out_lengths)`` built three ways."""
    probe = torch.empty(0, device=device)
    if kind == "torchrec":
        return _kt_regroup_arguments(probe, layout.keys, layout.lengths, layout.groups)
    permutes, in_shapes, out_shapes, out_lengths = kt_regroup.kt_regroup_arguments(
        probe.cpu(), layout.keys, layout.lengths, layout.groups
    )
    if kind == "coalesced":
        permutes = coalesce_keeping_chains(permutes)
    return permutes.to(device), in_shapes.to(device), out_shapes.to(device), out_lengths


def test_coalescing_keeps_valid_chains_and_merges():
    permutes, *_ = metadata("torchrec", MERGEABLE, "cpu")
    merged = coalesce_keeping_chains(permutes)
    assert merged.size(0) == permutes.size(0) - 2
    # Every duplicate row is still reached from its head: walk all chains.
    reached = set()
    for head in range(merged.size(0)):
        nxt = int(merged[head, 5])
        if nxt < 0:
            continue
        reached.add(head)
        while 0 < nxt < merged.size(0):
            reached.add(nxt)
            assert merged[nxt, [0, 2, 4]].tolist() == merged[head, [0, 2, 4]].tolist()
            nxt = -int(merged[nxt, 5])
    assert reached == set(range(merged.size(0)))


def values_on(layout, batch, dtype, noncontiguous=False, seed=0):
    return [v.to(DEVICE) for v in make_values(layout, batch, dtype, noncontiguous, seed)]


def random_grads(out_lengths, batch, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [
        torch.randn(batch, n, generator=gen, dtype=torch.float64).to(dtype).to(DEVICE)
        for n in out_lengths
    ]


def check_forward(values, meta, dtype=None, expected=None):
    permutes, in_shapes, out_shapes, out_lengths = meta
    before = clone_all(values)
    out = permute_multi_embedding_triton(
        values, permutes, in_shapes, out_shapes, out_lengths, dtype
    )
    ref = permute_multi_embedding_reference(
        [v.cpu() for v in values], permutes.cpu(), in_shapes.cpu(), out_shapes.cpu(), out_lengths
    )
    if dtype is not None:
        ref = [r.to(dtype) for r in ref]
    assert_same_list([o.cpu() for o in out], ref)
    if expected is not None:
        assert_same_list([o.cpu() for o in out], [e.to(ref[0].dtype) for e in expected])
    assert all(o.is_contiguous() and o.device == values[0].device for o in out)
    assert_no_alias(out, values)
    assert_same_list(values, before)  # inputs never modified
    return out


def check_backward(grads, meta, in_lengths, batch, dtype):
    permutes, in_shapes, out_shapes, _ = meta
    before = clone_all(grads)
    got = permute_multi_embedding_backward_triton(
        grads, permutes, in_shapes, out_shapes, in_lengths, batch, dtype
    )
    ref = permute_multi_embedding_backward_reference(
        [None if g is None else g.cpu() for g in grads],
        permutes.cpu(), in_shapes.cpu(), out_shapes.cpu(), in_lengths, batch, dtype,
    )  # fmt: skip
    assert_same_list([g.cpu() for g in got], ref)
    assert all(g.dtype == dtype and g.is_contiguous() for g in got)
    assert_no_alias(got, [g for g in grads if g is not None])
    assert_same_list(grads, before)
    return got


# --- parity -------------------------------------------------------------------------------


# torchrec's rows on every layout but one, ours there (the same rows, built by the op),
# and the coalesced form where coalescing merges rows.
CASES = [(name, "torchrec") for name in LAYOUTS if name != "seed1"] + [
    ("seed1", "ours"), ("seed1", "coalesced"), ("mergeable", "coalesced"),
    ("edges", "coalesced"),
]  # fmt: skip


@pytest.mark.parametrize("name,kind", CASES)
def test_forward_and_backward_match_reference(name, kind):
    layout = LAYOUTS[name]
    meta = metadata(kind, layout)
    values = values_on(layout, 5, torch.float32, seed=1)
    check_forward(values, meta, expected=expected_regroup([v.cpu() for v in values], layout))
    grads = random_grads(meta[3], 5, torch.float32, seed=2)
    check_backward(grads, meta, layout.in_widths, 5, torch.float32)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64], ids=dtype_ids)
def test_each_dtype(dtype):
    # SMALL_LAYOUT uses 'c' three times: half types must sum in float32, rounded once.
    layout = SMALL_LAYOUT
    meta = metadata("torchrec", layout)
    check_forward(values_on(layout, 3, dtype, seed=3), meta)
    check_backward(random_grads(meta[3], 3, dtype, seed=4), meta, layout.in_widths, 3, dtype)


@pytest.mark.parametrize("batch", [0, 1, 7])
def test_batch_sizes(batch):
    layout = LAYOUTS["aligned_mix"]
    meta = metadata("coalesced", layout)
    check_forward(values_on(layout, batch, torch.float32, seed=batch), meta)
    grads = random_grads(meta[3], batch, torch.float32, seed=batch)
    check_backward(grads, meta, layout.in_widths, batch, torch.float32)


def test_many_row_blocks_and_zero_fill_programs(monkeypatch):
    # Tiny tiles: several batch blocks per row and several row groups in the zero fill.
    monkeypatch.setattr(kt, "_BLOCK_ELEMENTS", 8)
    monkeypatch.setattr(kt, "_ZERO_ROWS_PER_PROGRAM", 2)
    monkeypatch.setattr(kt, "_ZERO_ROWS", 1)
    layout = EDGES
    meta = metadata("coalesced", layout)
    check_forward(values_on(layout, 5, torch.float32, seed=5), meta)
    check_backward(
        random_grads(meta[3], 5, torch.float32), meta, layout.in_widths, 5, torch.float32
    )


# (input dtype, output dtype) of permute_multi_embedding_to; gradients arrive in the output
# dtype and go back in the input dtype.
CASTS = [
    (torch.float32, torch.bfloat16),
    (torch.float64, torch.float16),  # via float32, as PyTorch rounds
    (torch.float16, torch.bfloat16),
    (torch.bfloat16, torch.float64),
]


@pytest.mark.parametrize("src,dst", CASTS, ids=lambda d: dtype_ids(d))
def test_fused_cast_forward_and_backward(src, dst):
    layout = SMALL_LAYOUT
    meta = metadata("torchrec", layout)
    values = [v * 1e3 for v in values_on(layout, 3, src, seed=6)]  # exercise the rounding
    check_forward(values, meta, dtype=dst)
    grads = random_grads(meta[3], 3, dst, seed=7)
    check_backward(grads, meta, layout.in_widths, 3, src)


def test_bfloat16_rounds_to_nearest_even_like_torch():
    # Ties, values just above/below ties, infinities, overflow to inf, subnormals.
    x = torch.tensor(
        [1 + 2**-8, 1 + 3 * 2**-8, 1 + 2**-8 + 2**-20, 1 - 2**-9, -(1 + 2**-8), 3.4e38,
         float("inf"), -float("inf"), 1e-40, -1e-40, 0.0, -0.0, 1.0],
        dtype=torch.float32,
    ).view(1, -1)  # fmt: skip
    p = torch.tensor([[0, 0, 0, 0, x.size(1), 0]], dtype=torch.int32, device=DEVICE)
    shapes = torch.tensor([x.size(1)], dtype=torch.int32, device=DEVICE)
    for dtype in (torch.bfloat16, torch.float16):
        (out,) = permute_multi_embedding_triton(
            [x.to(DEVICE)], p, shapes, shapes, [x.size(1)], dtype
        )
        assert torch.equal(out.cpu().view(torch.int16), x.to(dtype).view(torch.int16))
    nan = torch.tensor([[float("nan")]], device=DEVICE)
    p1 = torch.tensor([[0, 0, 0, 0, 1, 0]], dtype=torch.int32, device=DEVICE)
    one = torch.tensor([1], dtype=torch.int32, device=DEVICE)
    (out,) = permute_multi_embedding_triton([nan], p1, one, one, [1], torch.bfloat16)
    assert torch.isnan(out).all()


# --- strides, expanded and missing gradients, many tensors ---------------------------------


def test_noncontiguous_inputs():
    # Column stride != 1 (transposed storage) ...
    layout = LAYOUTS["seed1"]
    meta = metadata("coalesced", layout)
    check_forward(values_on(layout, 5, torch.float32, noncontiguous=True, seed=8), meta)
    # ... and column slices of a wider buffer (row stride != width, aligned or not).
    layout = ALIGNED_MIX
    meta = metadata("coalesced", layout)
    bases = [torch.randn(6, w + 8, device=DEVICE) for w in layout.in_widths]
    check_forward([b[:, 4 : 4 + w] for b, w in zip(bases, layout.in_widths)], meta)
    check_forward([b[:, 1 : 1 + w] for b, w in zip(bases, layout.in_widths)], meta)


def test_int64_and_strided_permutes():
    layout = MERGEABLE
    permutes, in_shapes, out_shapes, out_lengths = metadata("torchrec", layout)
    values = values_on(layout, 2, torch.float32, seed=17)
    grads = random_grads(out_lengths, 2, torch.float32, seed=18)
    transposed = permutes.long().t().contiguous().t()  # strides (1, n)
    assert transposed.stride() == (1, permutes.size(0))
    meta = (transposed, in_shapes, out_shapes, out_lengths)
    check_forward(values, meta)
    check_backward(grads, meta, layout.in_widths, 2, torch.float32)


def test_expanded_none_and_strided_gradients():
    layout = SMALL_LAYOUT
    meta = metadata("torchrec", layout)
    batch, lengths = 4, meta[3]
    # out.sum()'s gradient: a stride-0 view, never materialised.
    ones = torch.ones((), dtype=torch.bfloat16, device=DEVICE)
    expanded = [ones.expand(batch, n) for n in lengths]
    assert all(g.stride() == (0, 0) for g in expanded)
    check_backward(expanded, meta, layout.in_widths, batch, torch.bfloat16)
    grads = random_grads(lengths, batch, torch.float32, seed=9)
    check_backward([grads[0], None, grads[2]], meta, layout.in_widths, batch, torch.float32)
    strided = [torch.randn(n + 5, batch, device=DEVICE).t()[:, 2 : 2 + n] for n in lengths]
    check_backward(strided, meta, layout.in_widths, batch, torch.float32)
    # No gradient at all: exact zeros.
    zeros = check_backward([None] * 3, meta, layout.in_widths, batch, torch.float32)
    assert all(not z.any() for z in zeros)


def test_more_tensors_than_one_launch_addresses(monkeypatch):
    # Chunked launches (inputs and outputs) and the backward's concatenation fallback.
    monkeypatch.setattr(kt, "MAX_TENSORS", 2)
    layout = THREE
    meta = metadata("coalesced", layout)
    assert len(layout.keys) > 2 and len(layout.groups) > 2
    check_forward(values_on(layout, 3, torch.float32, seed=10), meta)
    grads = random_grads(meta[3], 3, torch.bfloat16, seed=11)
    check_backward(grads, meta, layout.in_widths, 3, torch.bfloat16)
    check_backward([grads[0], None, grads[2]], meta, layout.in_widths, 3, torch.bfloat16)


def test_into_caller_owned_outputs_writes_only_their_columns():
    layout = ALIGNED_MIX
    permutes, in_shapes, out_shapes, out_lengths = metadata("coalesced", layout)
    values = values_on(layout, 5, torch.float32, seed=12)
    # Outputs are column windows of wider buffers: the guard columns must stay untouched.
    bufs = [torch.full((5, n + 8), 7.0, device=DEVICE) for n in out_lengths]
    outs = [b[:, 4 : 4 + n] for b, n in zip(bufs, out_lengths)]
    got = permute_multi_embedding_triton(
        values, permutes, in_shapes, out_shapes, out_lengths, out=outs
    )
    assert all(g is o for g, o in zip(got, outs))
    expected = expected_regroup([v.cpu() for v in values], layout)
    assert_same_list([o.cpu() for o in outs], expected)
    for b, n in zip(bufs, out_lengths):
        assert torch.equal(b[:, :4], torch.full((5, 4), 7.0, device=DEVICE))
        assert torch.equal(b[:, 4 + n :], torch.full((5, 4), 7.0, device=DEVICE))


# --- arbitrary valid rows: gaps in outputs (hypothesis) ------------------------------------


@settings(max_examples=4, deadline=None, derandomize=True)
@given(
    seed=st.integers(0, 50),
    batch=st.sampled_from([1, 2, 3]),
    gaps=st.lists(st.integers(0, 5), min_size=3, max_size=3),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
)
def test_columns_no_row_writes_are_zero(seed, batch, gaps, dtype):
    """Rows as torchrec builds them, with output columns left out in the middle and at
    the end of each output (plans never do that; the op allows it)."""
    layout = random_layout(seed, n_inputs=2, keys_per_input=(1, 3), widths=(1, 3, 4))
    permutes, in_shapes, _, out_lengths = metadata("torchrec", layout, "cpu")
    rows = permutes.tolist()
    out_lengths = list(out_lengths)
    for j, gap in enumerate(gaps):
        cut = out_lengths[j] // 2
        for r in rows:
            if r[1] == j and r[3] >= cut:
                r[3] += gap
        out_lengths[j] += 2 * gap  # the same gap again after the last row
    permutes = torch.tensor(rows, dtype=torch.int32).reshape(-1, 6)
    out_shapes = torch.tensor(out_lengths, dtype=torch.int32)
    meta = (permutes.to(DEVICE), in_shapes.to(DEVICE), out_shapes.to(DEVICE), out_lengths)
    check_forward(values_on(layout, batch, dtype, seed=seed), meta)
    grads = random_grads(out_lengths, batch, dtype, seed=seed)
    check_backward(grads, meta, layout.in_widths, batch, dtype)


# --- bad rows stay inside the tensors -----------------------------------------------------


def test_bad_rows_are_clipped_and_never_leave_the_tensors():
    x = torch.arange(1.0, 13.0, device=DEVICE).view(2, 6)  # one input, 6 columns
    rows = [
        [0, 0, 4, 0, 3, 0],  # out0[0:3] <- x[4:7]: reads past the input's end read 0
        [0, 0, 0, 4, 9, 0],  # out0[4:13] <- x[0:9]: writes past the output's end clipped
        [0, 7, 0, 0, 2, 0],  # no such output: nothing happens
        [3, 1, 0, 4, 1, 0],  # no such input: nothing happens (out1[4] stays 0)
        [0, 1, -2, 1, 3, 0],  # out1[1:4] <- x[-2:1]: reads before the input read 0
        [0, 1, 1, -1, 2, 0],  # out1[-1:1] <- x[1:3]: writes before the output clipped
        [0, 1, 0, 4, -4, 0],  # negative length: nothing
    ]
    permutes = torch.tensor(rows, dtype=torch.int32, device=DEVICE)
    shapes = torch.tensor([6], dtype=torch.int32, device=DEVICE)
    out_shapes = torch.tensor([6, 5], dtype=torch.int32, device=DEVICE)
    buf0 = torch.full((2, 10), -7.0, device=DEVICE)
    buf1 = torch.full((2, 9), -7.0, device=DEVICE)
    outs = [buf0[:, 2:8], buf1[:, 2:7]]  # guard columns on both sides
    permute_multi_embedding_triton([x], permutes, shapes, out_shapes, [6, 5], out=outs)
    zero = torch.zeros(2, device=DEVICE)
    expected0 = torch.stack([x[:, 4], x[:, 5], zero, zero, x[:, 0], x[:, 1]], 1)
    expected1 = torch.stack([x[:, 2], zero, zero, x[:, 0], zero], 1)
    assert torch.equal(outs[0], expected0)
    assert torch.equal(outs[1], expected1)
    assert (buf0[:, :2] == -7).all() and (buf0[:, 8:] == -7).all()
    assert (buf1[:, :2] == -7).all() and (buf1[:, 7:] == -7).all()


def test_bad_chains_terminate_and_stay_in_bounds():
    g = torch.arange(1.0, 9.0, device=DEVICE).view(2, 4)
    shapes = torch.tensor([4], dtype=torch.int32, device=DEVICE)
    in_shapes = torch.tensor([2], dtype=torch.int32, device=DEVICE)
    # Rows 0 and 1 link to each other forever; row 2 points past the table.
    rows = [[0, 0, 0, 0, 2, 1], [0, 0, 0, 2, 2, -1], [0, 0, 0, 0, 2, 99]]
    permutes = torch.tensor(rows, dtype=torch.int32, device=DEVICE)
    (got,) = permute_multi_embedding_backward_triton(
        [g], permutes[:2], in_shapes, shapes, [2], 2, torch.float32
    )
    # The walk stops after len(permutes) steps: rows 0 and 1 once each.
    assert torch.equal(got, g[:, :2] + g[:, 2:])
    (got,) = permute_multi_embedding_backward_triton(
        [g], permutes[2:], in_shapes, shapes, [2], 2, torch.float32
    )
    assert torch.equal(got, g[:, :2])


# --- no host synchronisation ----------------------------------------------------------------

# Every way PyTorch hands tensor data to the host: the Python-level methods (seen by a
# function mode; ``tolist`` and ``numpy`` of a CPU tensor dispatch no operator) and the
# operators that read data or size outputs from it (seen by a dispatch mode).
_HOST_READ_METHODS = {"tolist", "numpy", "__array__", "item", "__bool__", "__int__",
                      "__index__", "__float__", "__dlpack__"}  # fmt: skip
_HOST_READ_OPS = {"_local_scalar_dense", "nonzero", "masked_select", "equal", "_unique",
                  "_unique2", "unique_dim", "unique_consecutive", "repeat_interleave"}  # fmt: skip


class HostReads(TorchFunctionMode):
    """Records every host read of tensor data made while it is active."""

    def __init__(self):
        super().__init__()
        self.seen = []
        outer = self

        class _Ops(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                if func._schema.name.split("::")[-1] in _HOST_READ_OPS:
                    outer.seen.append(str(func))
                return func(*args, **(kwargs or {}))

        self._ops = _Ops()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in _HOST_READ_METHODS:
            self.seen.append(func.__name__)
        return func(*args, **(kwargs or {}))

    def __enter__(self):
        self._ops.__enter__()
        return super().__enter__()

    def __exit__(self, *exc):
        super().__exit__(*exc)
        return self._ops.__exit__(*exc)


def test_host_read_detector_sees_host_reads():
    t = torch.tensor([[1, 2], [3, 4]], device=DEVICE)
    for read in (
        lambda: t.tolist(), lambda: t[0, 0].item(), lambda: int(t[0, 0]),
        lambda: bool(t[0, 0]), lambda: t.nonzero(), lambda: t.cpu().numpy(),
    ):  # fmt: skip
        with HostReads() as hr:
            read()
        assert hr.seen, read


@pytest.mark.parametrize("max_tensors", [8, 2], ids=["one_launch", "chunked"])
def test_no_host_reads_of_tensor_data(monkeypatch, max_tensors):
    """The kernels' host code never looks at tensor data: sizes come from shapes and
    int arguments, so nothing waits for the device and CUDA graphs can capture it.
    ``chunked`` takes the many-tensor paths (chunked launches, concatenated gradients)."""
    monkeypatch.setattr(kt, "MAX_TENSORS", max_tensors)
    layout = THREE if max_tensors == 2 else SMALL_LAYOUT
    permutes, in_shapes, out_shapes, out_lengths = metadata("torchrec", layout)
    values = values_on(layout, 3, torch.float32, seed=13)
    grads = random_grads(out_lengths, 3, torch.float32, seed=14)
    if DEVICE.type == "cuda":
        torch.cuda.set_sync_debug_mode("error")  # also fail on any implicit sync
    try:
        with HostReads() as hr:
            out = permute_multi_embedding_triton(
                values, permutes, in_shapes, out_shapes, out_lengths, torch.bfloat16
            )
            bufs = [torch.empty_like(o, dtype=torch.float32) for o in out]
            permute_multi_embedding_triton(
                values, permutes, in_shapes, out_shapes, out_lengths, out=bufs
            )
            back = permute_multi_embedding_backward_triton(
                [grads[0], None, grads[2]], permutes, in_shapes, out_shapes,
                layout.in_widths, 3, torch.float32,
            )  # fmt: skip
    finally:
        if DEVICE.type == "cuda":
            torch.cuda.set_sync_debug_mode("default")
    assert hr.seen == []
    # And they computed the right thing while being watched.
    expected = expected_regroup([v.cpu() for v in values], layout)
    assert_same_list([b.cpu() for b in bufs], expected)
    assert_same_list([o.cpu() for o in out], [e.to(torch.bfloat16) for e in expected])
    ref = permute_multi_embedding_backward_reference(
        [grads[0].cpu(), None, grads[2].cpu()], permutes.cpu(), in_shapes.cpu(),
        out_shapes.cpu(), layout.in_widths, 3, torch.float32,
    )  # fmt: skip
    assert_same_list([b.cpu() for b in back], ref)


def test_outputs_are_independent_allocations():
    # In-place use of one output (or gradient) never touches another.
    layout = SMALL_LAYOUT
    meta = metadata("torchrec", layout)
    out = check_forward(values_on(layout, 2, torch.float32), meta)
    storages = {o.untyped_storage().data_ptr() for o in out if o.numel()}
    assert len(storages) == sum(1 for o in out if o.numel())
    before = clone_all(out)
    out[0].add_(1)
    assert_same_list(out[1:], before[1:])


# --- compiled code (needs no GPU: Triton compiles for a CUDA target on the CPU) ------------

# Runs the host functions on CPU tensors with the two kernels' launches replaced by a
# compile for sm_90 of exactly the arguments the launch would get, and prints, per
# compiled variant, whether it has 128-bit global loads and stores.
_COMPILE_SCRIPT = textwrap.dedent(
    """
    import re, sys, torch, triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature
    import kt_regroup.kernels.triton as kt

    TARGET = GPUTarget("cuda", 90, 32)
    seen = set()

    class CompileInsteadOfLaunch:
        def __init__(self, fn):
            self.fn = fn

        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                backend = make_backend(TARGET)
                bind = create_function_from_signature(self.fn.signature, self.fn.params, backend)
                bound, spec, options = bind(*args, **kwargs)
                key = (self.fn.__name__, str(spec))
                if key in seen:
                    return
                seen.add(key)
                options, sig, consts, attrs = self.fn._pack_args(
                    backend, kwargs, bound, spec, options)
                src = ASTSource(self.fn, sig, consts, attrs)
                ptx = triton.compile(src, target=TARGET, options=options.__dict__).asm["ptx"]
                vec = sorted(set(re.findall(r"(?:ld|st)[.]global[.]v4[.]b32", ptx)))
                print(sys.argv[1], self.fn.__name__, kwargs.get("BACKWARD"), vec, flush=True)
            return launch

    kt._permute_kernel = CompileInsteadOfLaunch(kt._permute_kernel)
    kt._zero_unwritten_kernel = CompileInsteadOfLaunch(kt._zero_unwritten_kernel)

    def run(case, xs, rows, out_lengths, dtype=None, grad_dtype=None):
        sys.argv[1:] = [case]
        p = torch.tensor(rows, dtype=torch.int32)
        ins = torch.tensor([x.size(1) for x in xs], dtype=torch.int32)
        outs = torch.tensor(out_lengths, dtype=torch.int32)
        kt.permute_multi_embedding_triton(xs, p, ins, outs, out_lengths, dtype)
        grads = [torch.ones(8, n, dtype=grad_dtype or dtype or xs[0].dtype) for n in out_lengths]
        kt.permute_multi_embedding_backward_triton(
            grads, p, ins, outs, [x.size(1) for x in xs], 8, xs[0].dtype)

    x = [torch.empty(8, 128), torch.empty(8, 64)]
    rows = [[0, 0, 0, 0, 128, 1], [1, 0, 0, 128, 64, 0], [0, 1, 0, 0, 128, -3]]
    run("aligned", x, rows, [192, 128])
    # One tensor a side (1-tuples), widths and strides of 1 (compile-time constants), and
    # the float32 -> bfloat16 rounding of the fused cast.
    run("width1_cast", [torch.empty(8, 1)], [[0, 0, 0, 0, 1, 0]], [1], torch.bfloat16)
    # Inductor (torch.compile, AOTInductor) launches with every int argument equal to 1 as
    # a compile-time constant, whatever do_not_specialize says: one row, one batch row.
    for name in ("_permute_kernel", "_zero_unwritten_kernel"):
        fn = getattr(kt, name).fn.fn
        setattr(kt, name, CompileInsteadOfLaunch(triton.jit(fn)))
    run("ones_constant", [torch.empty(1, 1)], [[0, 0, 0, 0, 1, 0]], [1])
    """
)


def _start_compile_check():
    # Started when the module is imported so that it compiles on the second core while
    # the interpreter tests run on the first; the test below collects it.
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.Popen(
        [sys.executable, "-c", _COMPILE_SCRIPT], env=env, cwd=root, text=True,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )  # fmt: skip
    atexit.register(lambda: proc.poll() is None and proc.kill())
    return proc


_COMPILE_CHECK = _start_compile_check() if _INTERPRET else None


@pytest.mark.skipif(not _INTERPRET, reason="on CUDA the kernels are compiled and run instead")
def test_kernels_compile_for_cuda_with_128_bit_accesses():
    """Without a GPU the interpreter never compiles the kernels: compile the variants a few
    calls produce for sm_90 (Triton needs no GPU for that), including compile-time
    constant tuple elements, the bfloat16 cast and both kernels, and check that aligned
    segments use 128-bit loads and stores."""
    stdout, stderr = _COMPILE_CHECK.communicate(timeout=600)
    assert _COMPILE_CHECK.returncode == 0, stderr[-3000:]
    lines = stdout.strip().split("\n")
    vector = "['ld.global.v4.b32', 'st.global.v4.b32']"
    assert f"aligned _permute_kernel False {vector}" in lines, stdout
    assert f"aligned _permute_kernel True {vector}" in lines, stdout
    assert {line.split()[0] for line in lines} == {"aligned", "width1_cast", "ones_constant"}, stdout


# --- CUDA only ----------------------------------------------------------------------------


@pytest.mark.skipif(_INTERPRET, reason="needs CUDA (CUDA graphs)")
def test_cuda_graph_captures_forward_and_backward():
    layout = LAYOUTS["seed0"]
    permutes, in_shapes, out_shapes, out_lengths = metadata("coalesced", layout)
    values = values_on(layout, 64, torch.float32, seed=15)
    grads = random_grads(out_lengths, 64, torch.float32, seed=16)

    def step():
        out = permute_multi_embedding_triton(values, permutes, in_shapes, out_shapes, out_lengths)
        back = permute_multi_embedding_backward_triton(
            grads, permutes, in_shapes, out_shapes, layout.in_widths, 64, torch.float32
        )
        return out, back

    step()  # compile outside the capture
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, back = step()
    for v in values:
        v.mul_(2)
    graph.replay()
    torch.cuda.synchronize()
    check = check_forward(values, (permutes, in_shapes, out_shapes, out_lengths))
    assert_same_list(out, check)
    assert_same_list(
        back,
        permute_multi_embedding_backward_triton(
            grads, permutes, in_shapes, out_shapes, layout.in_widths, 64, torch.float32
        ),
    )


@pytest.fixture
def triton_on_cpu():
    """The Triton kernels registered for CPU on a Library of the test's own, destroyed after."""
    from kt_regroup.kernels import triton as kt_triton

    lib = torch.library.Library("kt_regroup", "IMPL")
    kt_triton.register(lib, "CPU")
    yield kt_triton
    lib._destroy()


def test_register_serves_the_ops_and_falls_back(triton_on_cpu, monkeypatch):
    calls = []
    real = triton_on_cpu._forward
    monkeypatch.setattr(triton_on_cpu, "_forward", lambda *a, **k: calls.append(1) or real(*a, **k))
    x = torch.arange(6.0).view(2, 3)
    p = torch.tensor([[0, 0, 1, 0, 2, -1]], dtype=torch.int32)
    args = (p, torch.tensor([3]), torch.tensor([2]), [2])
    (y,) = torch.ops.kt_regroup.permute_multi_embedding([x], *args)
    assert calls and torch.equal(y, x[:, 1:])
    calls.clear()
    xi = torch.arange(6, dtype=torch.int32).view(2, 3)  # Triton kernels do not take int32
    (yi,) = torch.ops.kt_regroup.permute_multi_embedding([xi], *args)
    assert not calls and torch.equal(yi, xi[:, 1:])


# --- argument checks: the library's own -----------------------------------------------------


def _error(fn):
    with pytest.raises((ValueError, TypeError, IndexError)) as info:
        fn()
    return info.type, str(info.value).splitlines()[0]


@pytest.mark.parametrize(
    "case", ["3d", "mixed_dtypes", "batch", "permutes_shape", "permutes_dtype", "in_shapes",
             "out_shapes", "negative_length", "empty"],
)  # fmt: skip
def test_forward_errors_are_the_librarys(case):
    """The Triton entry runs the C++ checks (``kt_regroup::_check_permute_args``): the same
    error type and message as the library's CPU kernel for the same bad arguments."""
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
    on = [(a.to(DEVICE) if isinstance(a, torch.Tensor) else a) for a in args]
    on[0] = [t.to(DEVICE) for t in args[0]]
    expected = _error(lambda: torch.ops.kt_regroup.permute_multi_embedding(*args))
    assert _error(lambda: permute_multi_embedding_triton(*on)) == expected


@pytest.mark.parametrize("case", ["batch", "dtypes", "negative_batch", "out_shapes"])
def test_backward_errors_are_the_librarys(case):
    g = torch.randn(2, 3)
    p = torch.tensor([[0, 0, 0, 0, 3, 0]], dtype=torch.int32)
    shapes = torch.tensor([3])
    args = {
        "batch": ([g, torch.randn(3, 1)], p, shapes, torch.tensor([3, 1]), [3], 2),
        "dtypes": ([g, torch.randn(2, 1).double()], p, shapes, torch.tensor([3, 1]), [3], 2),
        "negative_batch": ([None], p, shapes, shapes, [3], -1),
        "out_shapes": ([g], p, shapes, torch.tensor([3, 1]), [3], 2),
    }[case]
    on = [[None if t is None else t.to(DEVICE) for t in args[0]]] + [
        a.to(DEVICE) if isinstance(a, torch.Tensor) else a for a in args[1:]
    ]
    expected = _error(
        lambda: torch.ops.kt_regroup.permute_multi_embedding_backward(*args, torch.float32)
    )
    got = _error(lambda: permute_multi_embedding_backward_triton(*on, torch.float32))
    assert got == expected


# --- the triton_ops that compiled graphs run (tests/test_triton_compile.py traces them) ----


@pytest.mark.parametrize(
    "src,dst", [(None, None), ((torch.bfloat16, torch.float32), torch.float16)],
    ids=["one_dtype", "mixed_to_float16"],
)  # fmt: skip
def test_triton_ops_match_reference(src, dst):
    """``kt_regroup::_permute_multi_embedding_triton`` and its backward, called as ops (the
    calls a compiled graph makes), against the oracle; inputs never modified."""
    layout = SMALL_LAYOUT
    permutes, in_shapes, out_shapes, out_lengths = metadata("torchrec", layout)
    values = values_on(layout, 4, torch.float32, seed=21)
    if src is not None:
        values = [v.to(d) for v, d in zip(values, src)]
    before = clone_all(values)
    got = torch.ops.kt_regroup._permute_multi_embedding_triton(values, permutes, out_lengths, dst)
    ref = permute_multi_embedding_to_reference(
        [v.cpu().float() if src else v.cpu() for v in values], permutes.cpu(), in_shapes.cpu(),
        out_shapes.cpu(), out_lengths, dst,
    )  # fmt: skip
    assert_same_list([g.cpu() for g in got], ref)
    assert_same_list(values, before)
    grads = random_grads(out_lengths, 4, dst or torch.float32, seed=22)
    grads[1] = None
    back = torch.ops.kt_regroup._permute_multi_embedding_backward_triton(
        grads, permutes, out_shapes, layout.in_widths, 4, torch.float32
    )
    ref = permute_multi_embedding_backward_reference(
        [None if g is None else g.cpu() for g in grads], permutes.cpu(), in_shapes.cpu(),
        out_shapes.cpu(), layout.in_widths, 4, torch.float32,
    )  # fmt: skip
    assert_same_list([b.cpu() for b in back], ref)
