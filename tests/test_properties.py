"""Property-based tests: random layouts, every surface against an independent oracle.

Layouts: 1-6 inputs, 1-300 keys (inputs may have none), widths 0-300, duplicated keys
(inside and across groups), unused keys, reordered and in-order groups, empty groups;
batch 0-257; every dtype; contiguous, transposed and column-sliced inputs. Every surface
(the op with torchrec-format metadata, ``regroup``,
``regroup_as_dict``, ``KTRegroupAsDict`` before and after a layout change) must equal
slices + ``torch.cat`` bit for bit, forward and gradients. Gradients of duplicated keys
in float16/bfloat16 equal the exact sum rounded once (output gradients are multiples of
1/8, so float32 sums are exact and any intermediate rounding would show).

Profiles (tests/conftest.py): ``ci`` (default, fixed seed) and ``long`` (thousands of
examples): ``KT_REGROUP_HYPOTHESIS_PROFILE=long`` or ``pytest --hypothesis-profile long``.
"""

from __future__ import annotations

import random
from typing import NamedTuple

import torch
from conftest import Layout, expected_grads, expected_regroup, keyed_tensors
from hypothesis import given
from hypothesis import strategies as st

import kt_regroup
from kt_regroup import KTRegroupAsDict, get_plan, regroup, regroup_as_dict

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
INT_DTYPES = (torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64, torch.bool)
# Input + output elements per example: keeps one example in milliseconds.
ELEMENT_BUDGET = 1 << 19


class Case(NamedTuple):
    layout: Layout
    batch: int
    dtype: torch.dtype
    memory: str  # contiguous | transposed | column_slice
    seed: int


def _width(rng: random.Random) -> int:
    r = rng.random()
    if r < 0.6:
        return rng.randint(0, 8)
    if r < 0.9:
        return rng.randint(9, 64)
    return rng.randint(65, 300)


def _layout(rng: random.Random, n_inputs: int, n_keys: int, n_groups: int, skip: float,
            dups: int, in_order: bool, empty_group: bool) -> Layout:
    cuts = sorted(rng.randint(0, n_keys) for _ in range(n_inputs - 1))
    sizes = [b - a for a, b in zip([0, *cuts], [*cuts, n_keys])]
    keys = [[f"k{t}_{i}" for i in range(n)] for t, n in enumerate(sizes)]
    lengths = [[_width(rng) for _ in k] for k in keys]
    all_keys = [k for tk in keys for k in tk]
    used = [k for k in all_keys if rng.random() >= skip]
    groups: list[list[str]] = [[] for _ in range(n_groups)]
    for k in used if in_order else rng.sample(used, len(used)):
        groups[rng.randrange(n_groups)].append(k)
    for _ in range(dups if used else 0):  # duplicates, inside and across groups
        g = groups[rng.randrange(n_groups)]
        g.insert(rng.randint(0, len(g)), rng.choice(used))
    if empty_group:
        groups.insert(rng.randint(0, n_groups), [])
    return Layout(keys, lengths, groups)


@st.composite
def cases(draw, dtypes=FLOAT_DTYPES + INT_DTYPES) -> Case:
    seed = draw(st.integers(0, 2**32 - 1))
    layout = _layout(
        random.Random(seed),
        n_inputs=draw(st.integers(1, 6)),
        n_keys=draw(st.integers(1, 300)),
        n_groups=draw(st.integers(1, 8)),
        skip=draw(st.sampled_from([0.0, 0.3, 0.9])),
        dups=draw(st.integers(0, 12)),
        in_order=draw(st.booleans()),
        empty_group=draw(st.booleans()),
    )
    batch = draw(st.integers(0, 257))
    columns = sum(layout.in_widths) + sum(sum(_widths(layout, g)) for g in layout.groups)
    batch = min(batch, ELEMENT_BUDGET // max(columns, 1))
    return Case(layout, batch, draw(st.sampled_from(dtypes)),
                draw(st.sampled_from(["contiguous", "transposed", "column_slice"])), seed)


def _widths(layout: Layout, group) -> list[int]:
    width = {k: w for tk, tl in zip(layout.keys, layout.lengths) for k, w in zip(tk, tl)}
    return [width[k] for k in group]


def _random(shape, dtype, gen) -> torch.Tensor:
    if dtype.is_floating_point:
        return torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=gen).bool()
    lo, hi = (0, 256) if dtype == torch.uint8 else (-128, 128)
    return torch.randint(lo, hi, shape, generator=gen, dtype=torch.int64).to(dtype)


def make_inputs(case: Case, requires_grad: bool) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(case.seed)
    out = []
    for w in case.layout.in_widths:
        if case.memory == "transposed":  # strides (1, batch + 2)
            t = _random((w + 3, case.batch + 2), case.dtype, gen).t()[1 : 1 + case.batch, 2 : 2 + w]
        elif case.memory == "column_slice":  # strides (w + 5, 1)
            t = _random((case.batch, w + 5), case.dtype, gen)[:, 3 : 3 + w]
        else:
            t = _random((case.batch, w), case.dtype, gen)
        out.append(t.requires_grad_(requires_grad))
    return out


def oracle_grads(grad_outputs, layout: Layout, batch: int, dtype) -> list[torch.Tensor]:
    """Exact sums (float64) rounded once to ``dtype``."""
    return [a.to(dtype) for a in expected_grads(layout, grad_outputs, batch, torch.float64)]


def make_grad_outputs(outs, seed: int) -> list[torch.Tensor]:
    # Multiples of 1/8 in [-8, 8]: float32 sums are exact, float16/bfloat16 ones round.
    gen = torch.Generator().manual_seed(seed + 1)
    return [(torch.randint(-64, 65, o.shape, generator=gen) / 8).to(o.dtype) for o in outs]


def assert_bitwise(actual, expected, what: str) -> None:
    assert len(actual) == len(expected), (what, len(actual), len(expected))
    for i, (a, e) in enumerate(zip(actual, expected)):
        assert a.dtype == e.dtype and a.shape == e.shape, (what, i, a.dtype, e.dtype, a.shape, e.shape)
        assert torch.equal(a, e), f"{what}: output {i} differs"


def check_surface(name, run, case: Case) -> None:
    """``run(inputs) -> outputs`` equals the oracle; with float inputs, so do gradients."""
    grad = case.dtype.is_floating_point
    inputs = make_inputs(case, requires_grad=grad)
    before = [t.detach().clone() for t in inputs]
    outs = run(inputs)
    assert_bitwise([o.detach() for o in outs], expected_regroup(inputs, case.layout), name)
    assert_bitwise([t.detach() for t in inputs], before, f"{name}: inputs modified")
    if not grad:
        return
    grad_outputs = make_grad_outputs(outs, case.seed)
    got = torch.autograd.grad(outs, inputs, grad_outputs, allow_unused=True)
    got = [torch.zeros_like(t) if g is None else g for g, t in zip(got, inputs)]
    expected = oracle_grads(grad_outputs, case.layout, case.batch, case.dtype)
    assert_bitwise([g.contiguous() for g in got], expected, f"{name} gradients")


@given(case=cases())
def test_every_surface_equals_the_oracle(case):
    layout = case.layout
    plan = get_plan(*layout)
    names = [f"g{j}" for j in range(len(layout.groups))]
    op = torch.ops.kt_regroup.permute_multi_embedding
    args = torch.ops.kt_regroup.kt_regroup_arguments(torch.empty(0), *layout)
    # The library's own plan builder writes the same torchrec-format metadata.
    assert_bitwise(list(args[:3]), list(plan.tensors()), "kt_regroup_arguments")
    assert list(args[3]) == list(plan.out_lengths)
    surfaces = {
        "op, torchrec format": lambda v: op(v, *plan.tensors(), list(plan.out_lengths)),
        "regroup_keyed_tensor": lambda v: kt_regroup.regroup_keyed_tensor(v, *layout),
        "regroup": lambda v: regroup(keyed_tensors(layout, v), layout.groups),
        "regroup_as_dict": lambda v: list(
            regroup_as_dict(keyed_tensors(layout, v), layout.groups, names).values()
        ),
        "KTRegroupAsDict": lambda v: list(
            KTRegroupAsDict(layout.groups, names)(keyed_tensors(layout, v)).values()
        ),
    }
    for name, run in surfaces.items():
        check_surface(name, run, case)


def _relayout(layout: Layout, seed: int) -> Layout:
    """The same keys in another order, with other widths and inputs in another order."""
    rng = random.Random(seed)
    keys, lengths = [], []
    for tk in layout.keys:
        keys.append(rng.sample(tk, len(tk)))
        lengths.append([_width(rng) for _ in tk])
    order = rng.sample(range(len(keys)), len(keys))
    return Layout([keys[i] for i in order], [lengths[i] for i in order], layout.groups)


@given(case=cases(), swap_seed=st.integers(0, 2**16))
def test_module_after_a_layout_change_equals_the_oracle(case, swap_seed):
    names = [f"g{j}" for j in range(len(case.layout.groups))]
    module = KTRegroupAsDict(case.layout.groups, names)
    second = case._replace(layout=_relayout(case.layout, swap_seed), seed=case.seed + 7)
    for c in (case, second, case):  # first plan, changed layout, back again
        check_surface(
            "KTRegroupAsDict after a layout change",
            lambda v, c=c: list(module(keyed_tensors(c.layout, v)).values()),
            c,
        )


