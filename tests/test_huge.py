"""Huge shapes: tensors of more than 2^31 elements (every index needs int64), bfloat16
and int8, forward and backward, against plain indexing.

Marked slow (deselected by default); run with ``pytest -m slow tests/test_huge.py``.
Needs about 11 GiB of free memory (bf16: a 4 GiB input, a 2 GiB output, a 4 GiB
gradient); skipped where less is available.
"""

from __future__ import annotations

import gc

import pytest
import torch

import kt_regroup

pytestmark = pytest.mark.slow

BATCH = 2**15 + 1
KEYS = [f"k{i}" for i in range(9)]
WIDTHS = [8192] * 8 + [1]  # 65537 columns: BATCH * 65537 = 2^31 + 98305 elements
assert BATCH * sum(WIDTHS) > 2**31
GIB = 2**30


def _available_bytes() -> int:
    with open("/proc/meminfo") as f:
        info = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f}
    return info["MemAvailable"]


def _needs(gib: float):
    if _available_bytes() < gib * GIB:
        pytest.skip(f"needs {gib} GiB of available memory, {_available_bytes() / GIB:.1f} free")


def _offsets():
    out, off = {}, 0
    for k, w in zip(KEYS, WIDTHS):
        out[k] = (off, w)
        off += w
    return out


def _input(dtype) -> torch.Tensor:
    # 256 values in a random pattern: a block read from a wrong offset shows.
    gen = torch.Generator().manual_seed(0)
    return torch.randint(-128, 128, (BATCH, sum(WIDTHS)), generator=gen, dtype=torch.int8).to(dtype)


def _check_grad(grad_in, grad_out, group, dtype) -> None:
    """Each key's gradient block against the output gradient's columns (plain indexing)."""
    where, starts, off = _offsets(), {}, 0
    for k in group:
        starts.setdefault(k, []).append(off)
        off += where[k][1]
    for k, (in_off, w) in where.items():
        got = grad_in[:, in_off : in_off + w]
        if k not in starts:
            assert not got.any(), f"key {k}: unused, its gradient must be zeros"
            continue
        blocks = [grad_out[:, s : s + w] for s in starts[k]]
        if len(blocks) == 1:
            assert torch.equal(got, blocks[0]), f"key {k}"
        else:  # a duplicate: the sum (float32 for bf16, rounded once; int8 wraps as add_ does)
            acc = blocks[0].float() if dtype == torch.bfloat16 else blocks[0].clone()
            for b in blocks[1:]:
                acc += b
            assert torch.equal(got, acc.to(dtype)), f"key {k} (duplicated)"


def test_bfloat16_over_2_31_elements_forward_and_backward():
    _needs(11)
    x = _input(torch.bfloat16).requires_grad_()
    group = ["k7", "k5", "k8", "k3", "k1", "k8"]  # reversed, skipped keys, a duplicate
    (out,) = kt_regroup.regroup_keyed_tensor([x], [KEYS], [WIDTHS], [group])
    where = _offsets()
    expected = torch.cat([x.detach()[:, where[k][0] : where[k][0] + where[k][1]] for k in group], 1)
    assert torch.equal(out.detach(), expected)
    del expected
    gc.collect()
    grad_out = out.detach()  # the output itself: distinct values, no extra memory
    (grad_in,) = torch.autograd.grad([out], [x], [grad_out])
    del out
    assert grad_in.shape == x.shape and grad_in.dtype == torch.bfloat16
    _check_grad(grad_in, grad_out, group, torch.bfloat16)


def test_int8_over_2_31_elements_forward_and_backward():
    _needs(9)
    x = _input(torch.int8)
    group = list(reversed(KEYS)) + ["k8"]  # every key, reversed, one twice: > 2^31 out too
    permutes, in_shapes, out_shapes, out_lengths = kt_regroup.kt_regroup_arguments(
        x, [KEYS], [WIDTHS], [group]
    )
    (out,) = torch.ops.kt_regroup.permute_multi_embedding([x], permutes, in_shapes, out_shapes, out_lengths)
    assert out.numel() > 2**31
    where = _offsets()
    expected = torch.cat([x[:, where[k][0] : where[k][0] + where[k][1]] for k in group], 1)
    assert torch.equal(out, expected)
    del expected, x
    gc.collect()
    (grad_in,) = torch.ops.kt_regroup.permute_multi_embedding_backward(
        [out], permutes, in_shapes, out_shapes, [sum(WIDTHS)], BATCH, torch.int8
    )
    assert grad_in.shape == (BATCH, sum(WIDTHS)) and grad_in.dtype == torch.int8
    _check_grad(grad_in, out, group, torch.int8)
