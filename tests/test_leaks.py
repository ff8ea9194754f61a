"""No leaks: 3,000 warm calls leave resident memory and live tensors where they were,
and the plan caches stay bounded.

Robust on a loaded machine: every surface is warmed up first, memory is read after a
garbage collection and a ``malloc_trim``, and the tolerance is a fraction of what a leak
of one output tensor per call would add (each output is >= 16 KiB, so such a leak grows
resident memory by >= 48 MiB over 3,000 calls; the bound is 12 MiB). No timing.
"""

from __future__ import annotations

import ctypes
import gc
import os
import warnings

import pytest
import torch
from conftest import intra_op_threads
from torchrec.sparse.jagged_tensor import KeyedTensor

import kt_regroup
from kt_regroup import plan as plan_module

CALLS = 3_000
BATCH = 64
KEYS = [["a", "b", "c"], ["d", "e"]]
LENGTHS = [[64, 7, 127], [64, 64]]
GROUPS = [["a", "d", "d"], ["c", "e"], ["b", "a", "e"]]  # every output >= 64 columns
ONE_OUTPUT = BATCH * 64 * 4  # bytes of the smallest output (float32)
PAGE = os.sysconf("SC_PAGE_SIZE")

try:
    _trim = ctypes.CDLL("libc.so.6").malloc_trim
except (OSError, AttributeError):  # not glibc: no trimming, the bound still holds
    _trim = None


def resident_bytes() -> int:
    gc.collect()
    if _trim is not None:
        _trim(0)
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


def live_tensors() -> int:
    gc.collect()
    with warnings.catch_warnings():  # isinstance on deprecated torch objects warns
        warnings.simplefilter("ignore")
        return sum(1 for o in gc.get_objects() if isinstance(o, torch.Tensor))


def _inputs(requires_grad: bool):
    gen = torch.Generator().manual_seed(0)
    values = [torch.randn(BATCH, sum(w), generator=gen).requires_grad_(requires_grad) for w in LENGTHS]
    return values, [KeyedTensor(k, w, v) for k, w, v in zip(KEYS, LENGTHS, values)]


def _surfaces(requires_grad: bool):
    values, kts = _inputs(requires_grad)
    module = kt_regroup.KTRegroupAsDict(GROUPS, ["x", "y", "z"])
    permutes, in_shapes, out_shapes, out_lengths = kt_regroup.kt_regroup_arguments(
        values[0], KEYS, LENGTHS, GROUPS
    )
    return values, {
        "module": lambda: list(module(kts).values()),
        "regroup": lambda: kt_regroup.regroup(kts, GROUPS),
        "op": lambda: torch.ops.kt_regroup.permute_multi_embedding(
            values, permutes, in_shapes, out_shapes, out_lengths
        ),
        "regroup_keyed_tensor": lambda: kt_regroup.regroup_keyed_tensor(values, KEYS, LENGTHS, GROUPS),
    }


def _step(call, values, backward: bool) -> None:
    outs = call()
    if backward:
        grads = torch.autograd.grad(outs, values, [torch.ones_like(o) for o in outs])
        assert grads[0].shape == values[0].shape


@pytest.fixture
def one_thread():
    # Leaks do not depend on threads. With two, each call's copy (132 KiB, past the
    # parallel grain) wakes an OpenMP thread, which on a busy machine (pytest-xdist's
    # other worker) waits milliseconds for a core.
    with intra_op_threads(1):
        yield


@pytest.mark.parametrize("backward", [False, True], ids=["forward", "forward_backward"])
def test_thousands_of_warm_calls_do_not_grow_memory_or_live_tensors(backward, one_thread):
    values, surfaces = _surfaces(requires_grad=backward)
    for name, call in surfaces.items():
        for _ in range(200):  # warm: plans built, caches and allocator pools filled
            _step(call, values, backward)
        tensors, rss = live_tensors(), resident_bytes()
        for _ in range(CALLS):
            _step(call, values, backward)
        grown_tensors, grown = live_tensors() - tensors, resident_bytes() - rss
        print(f"{name}: {grown_tensors:+d} live tensors, {grown / 2**20:+.1f} MiB resident")
        # A leak of one output per call: CALLS more tensors, CALLS * ONE_OUTPUT more bytes.
        assert grown_tensors <= 10, f"{name}: {grown_tensors} more live tensors after {CALLS} calls"
        assert grown < CALLS * ONE_OUTPUT // 4, (
            f"{name}: resident memory grew by {grown / 2**20:.1f} MiB over {CALLS} calls"
        )


def test_plan_cache_stays_bounded():
    layout = lambda n: (KEYS, [[1 + n, 7, 127], [64, 64]], GROUPS)  # noqa: E731
    first = plan_module.get_plan(*layout(0))
    size = plan_module._cached.cache_info().maxsize
    for n in range(3 * size):  # distinct layouts: all but the first miss
        last = plan_module.get_plan(*layout(n))
        # The caller's own tensors, every time: the plan holds none.
        assert last.tensors()[0] is not last.tensors()[0]
        assert plan_module._cached.cache_info().currsize <= size
    assert plan_module._cached.cache_info().currsize == size
    assert plan_module.get_plan(*layout(3 * size - 1)) is last  # newest kept
    assert plan_module.get_plan(*layout(0)) is not first  # oldest evicted, built afresh


def test_module_keeps_one_plan_across_layout_changes():
    module = kt_regroup.KTRegroupAsDict(GROUPS, ["x", "y", "z"])
    held = None
    for n in range(50):  # every call a new layout: the module swaps, never accumulates
        widths = [[1 + n % 7, 7, 127], [64, 64 + n]]
        kts = [KeyedTensor(k, w, torch.zeros(2, sum(w))) for k, w in zip(KEYS, widths)]
        module(kts)
        # one plan, its three tensors the module's only buffers
        assert [name for name, _ in module.named_buffers()] == ["_permutes", "_in_shapes", "_out_shapes"]
        assert module._plan.permutes is module._permutes
        assert module._plan is not held
        held = module._plan
    info = plan_module._cached.cache_info()
    assert info.currsize <= info.maxsize
