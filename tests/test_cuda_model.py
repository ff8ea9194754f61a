"""``benchmarks/cuda_model.py``, the device-free cost model, held to issue 36's goals that
it meets: one launch per forward, backward and ``_into`` call (ATen's included), sector
efficiency of at least 0.9 on the seed layout (float32 and bfloat16) and of at least 0.8
for the forward, ``_into`` and backward of odd-width keys (bfloat16: misaligned segments), at most
5% idle blocks on every layout it runs (seed, narrow, odd width, VBE; the other bench
layouts take longer to emulate: ``python -m benchmarks.cuda_model`` shows them),
including a plan with gaps in one output only; on the VBE layout (1,001 inputs) one
launch per forward, at most 8 per backward (ATen's sort and search included), whatever
the number of inputs, one host-to-device copy each (their table of tensors) and sector
efficiency of at least 0.8. The goal it misses (sector efficiency of narrow keys) has
no test here."""

import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import cuda_model  # noqa: E402


@pytest.fixture(scope="module")
def model():
    if shutil.which("c++") is None:
        pytest.skip("no C++ compiler to build the emulation")
    ext = cuda_model.emulation()
    records = cuda_model.records(ext, ["seed", "narrow", "odd_width", "vbe"])
    return {(r["layout"], r["dtype"], r["op"]): r for r in records}


def test_every_record_has_the_fields(model):
    fields = {"layout", "dtype", "op", "launches", "blocks", "idle_blocks", "bytes", "sectors",
              "min_sectors"}  # fmt: skip
    assert set(model) == {(layout, dtype, op) for layout, dtype in
                          [("seed", "float32"), ("seed", "bfloat16"), ("narrow", "bfloat16"),
                           ("odd_width", "bfloat16")]
                          for op in cuda_model.OPS} | {("vbe", "float32", op)
                                                       for op in cuda_model.VBE_OPS}  # fmt: skip
    for r in model.values():
        assert fields <= set(r), r
        assert r["bytes"] > 0 and r["min_sectors"] <= r["sectors"], r


def test_one_launch_per_call(model):
    for key, r in model.items():
        if key[2] != "vbe_backward":
            assert r["launches"] == 1, (key, r)


def test_vbe_launches_copies_idle_blocks_and_sector_efficiency(model):
    fwd, back = model["vbe", "float32", "vbe_forward"], model["vbe", "float32", "vbe_backward"]
    assert back["launches"] <= 8, back  # keys, sort, search, sums
    for r in (fwd, back):
        assert r["copies"] == 1, r  # the table of tensors, from pinned memory
        assert r["min_sectors"] / r["sectors"] >= 0.8, r


def _vbe_call(ext, m, op):
    """The VBE op on m inputs of one 8-wide key each, every other one indexed (3 rows)."""
    import torch

    import kt_regroup

    keys, lengths = [[f"k{t}"] for t in range(m)], [[8] for _ in range(m)]
    groups = [[f"k{t}" for t in range(g, m, 3)] for g in range(3)]
    p, _, _, n = kt_regroup.kt_regroup_arguments(torch.empty(0), keys, lengths, groups)
    rows = [4 if t % 2 else 3 for t in range(m)]
    xs = [torch.randn(r, 8) for r in rows]
    indices = [None if t % 2 else torch.tensor([0, 2, 1, 2]) for t in range(m)]
    if op == "vbe_forward":
        return lambda: ext.vbe_forward(xs, indices, p, list(n), 4)
    grads = [torch.randn(4, w) for w in n]
    return lambda: ext.vbe_backward(grads, indices, p, [8] * m, rows, 4, torch.float32)


@pytest.mark.parametrize("op", cuda_model.VBE_OPS)
def test_vbe_launches_do_not_grow_with_the_inputs(op):
    if shutil.which("c++") is None:
        pytest.skip("no C++ compiler to build the emulation")
    ext = cuda_model.emulation()
    counts = [cuda_model._traced(ext, _vbe_call(ext, m, op)) for m in (40, 70, 400)]
    assert len({(c["launches"], c["aten_ops"], c["copies"]) for c in counts}) == 1, counts
    assert counts[0]["launches"] == (1 if op == "vbe_forward" else 4), counts


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("op", cuda_model.OPS)
def test_seed_layout_sector_efficiency(model, dtype, op):
    r = model["seed", dtype, op]
    assert r["min_sectors"] / r["sectors"] >= 0.9, r


@pytest.mark.parametrize("op", ["forward", "_into", "backward"])
def test_odd_width_sector_efficiency(model, op):
    # Misaligned segments: aligned 16-byte stores between a head and a tail (the backward's
    # keys are used once: its gradient blocks are copied the same way).
    r = model["odd_width", "bfloat16", op]
    assert r["min_sectors"] / r["sectors"] >= 0.8, r


def test_idle_blocks_at_every_layout(model):
    for key, r in model.items():
        assert r["idle_blocks"] / r["blocks"] <= 0.05, (key, r)


@pytest.mark.parametrize("op", cuda_model.OPS)
def test_idle_blocks_with_gaps_in_one_output(op):
    # Gaps in one output only (rows dropped) and an unused key: the zero blocks are few
    # whatever the plan, so few are idle.
    if shutil.which("c++") is None:
        pytest.skip("no C++ compiler to build the emulation")
    import torch

    import kt_regroup

    ext = cuda_model.emulation()
    # One very wide key: many zero tiles, few copy blocks.
    keys = [["wide"] + [f"a{t}" for t in range(30)], [f"b{t}" for t in range(30)] + ["unused"]]
    lengths = [[40_000] + [8 + t % 3 for t in range(30)], [4 + t % 5 for t in range(30)] + [64]]
    groups = [["wide"] + [f"a{t}" for t in range(0, 30, 2)] + [f"b{t}" for t in range(0, 30, 2)],
              [f"a{t}" for t in range(1, 30, 2)] + [f"b{t}" for t in range(1, 30, 2)]]  # fmt: skip
    p, _, _, n = kt_regroup.kt_regroup_arguments(torch.empty(0), keys, lengths, groups)
    p = p[[r for r in range(p.size(0)) if not (p[r, 1] == 1 and r % 5 == 0)]].contiguous()
    widths, batch = [sum(w) for w in lengths], 8
    xs = [torch.randn(batch, w) for w in widths]
    grads = [torch.randn(batch, w) for w in n]
    outs = [torch.empty(batch, w) for w in n]
    call = {
        "forward": lambda: ext.forward(xs, p, list(n), None),
        "backward": lambda: ext.backward(grads, p, widths, batch, torch.float32),
        "_into": lambda: ext.into(xs, p, outs),
    }[op]
    r = cuda_model._traced(ext, call)
    assert r["launches"] == 1, r
    assert r["idle_blocks"] / r["blocks"] <= 0.05, r


def test_bytes_are_what_the_outputs_need(model):
    # The forward reads and writes each output element once: 2 x the outputs' bytes.
    r = model["seed", "float32", "forward"]
    sizes = cuda_model.LAYOUTS["seed"][0]
    width = sizes["n_dense"] * sizes["dim_dense"] + sizes["n_sparse"] * sizes["dim_sparse"]
    assert r["bytes"] == 2 * r["batch"] * width * 4
