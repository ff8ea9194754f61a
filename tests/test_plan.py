"""The permute plan: torchrec's argument format, exactly, built by the library's op, and
the one plan cache, which must never hand out another layout's plan."""

import itertools
import os
import signal
import sys
import threading
import time

import pytest
import torch
from conftest import (
    SEEDS,
    SMALL_LAYOUT,
    Layout,
    assert_same_list,
    expected_regroup,
    needs_fbgemm,
    random_layout,
)
from reference import permute_multi_embedding_reference
from torchrec.sparse.jagged_tensor import _kt_regroup_arguments

import kt_regroup
from kt_regroup import plan as plan_module
from kt_regroup.plan import get_plan

PERMUTE_COLUMNS = 6

LAYOUTS = (
    [SMALL_LAYOUT]
    + [random_layout(s) for s in SEEDS]
    + [
        random_layout(10, n_inputs=1, n_groups=1),
        random_layout(11, n_inputs=5, keys_per_input=(3, 6), n_groups=4),
        # a key used three times in one group and twice elsewhere: long duplicate chains
        Layout([["x", "y"], ["z"]], [[1, 3], [7]], [["x", "x", "z", "x"], ["z", "y", "x"]]),
        # empty group, unused input
        Layout([["x"], ["y"]], [[3], [7]], [["x"], []]),
    ]
)


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda lay: f"{len(lay.keys)}in-{len(lay.groups)}out")
def test_kt_regroup_arguments_equals_torchrec(layout):
    embs = torch.empty(2, sum(layout.in_widths))
    ours = kt_regroup.kt_regroup_arguments(embs, layout.keys, layout.lengths, layout.groups)
    theirs = _kt_regroup_arguments(embs, layout.keys, layout.lengths, layout.groups)
    for name, a, b in zip(("permutes", "in_shapes", "out_shapes"), ours[:3], theirs[:3]):
        assert a.dtype == b.dtype == torch.int32, name
        assert a.device == b.device, name
        # Every column, the `next` duplicate chain included.
        assert torch.equal(a, b), f"{name}:\nours={a}\ntorchrec={b}"
    assert ours[3] == theirs[3]
    assert ours[0].shape == (sum(len(g) for g in layout.groups), PERMUTE_COLUMNS)


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda lay: f"{len(lay.keys)}in-{len(lay.groups)}out")
def test_plan_tensors_equal_the_op_and_torchrec(layout):
    # RegroupPlan (Python) and the kt_regroup_arguments op (C++ where the library is
    # loaded) are two builders of one format: torchrec's.
    embs = torch.empty(0)
    plan = get_plan(*layout)
    theirs = _kt_regroup_arguments(embs, layout.keys, layout.lengths, layout.groups)
    for a, b in zip(plan.tensors(), theirs[:3]):
        assert torch.equal(a, b)
    assert list(plan.out_lengths) == theirs[3]


def test_kt_regroup_arguments_op_and_python_function_agree():
    embs = torch.empty(3, 4)
    L = SMALL_LAYOUT
    a = torch.ops.kt_regroup.kt_regroup_arguments(embs, L.keys, L.lengths, L.groups)
    b = kt_regroup.kt_regroup_arguments(embs, L.keys, L.lengths, L.groups)
    for x, y in zip(a[:3], b[:3]):
        assert torch.equal(x, y)
    assert a[3] == b[3] == [1 + 3 + 1, 127 + 3 + 3, 1]


def test_small_layout_rows_by_hand():
    plan = get_plan(*SMALL_LAYOUT)
    # [in_tensor, out_tensor, in_offset, out_offset, length, next]
    assert [list(r[:5]) for r in plan.rows] == [
        [1, 0, 0, 0, 1],  # c
        [0, 0, 0, 1, 3],  # a
        [1, 0, 0, 4, 1],  # c again
        [1, 1, 4, 0, 127],  # e
        [1, 1, 1, 127, 3],  # d
        [0, 1, 0, 130, 3],  # a again
        [1, 2, 0, 0, 1],  # c a third time
    ]
    assert plan.in_lengths == (10, 131)
    assert plan.out_lengths == (5, 133, 1)


@needs_fbgemm
def test_plan_tensors_give_fbgemm_the_right_gradient_for_duplicates():
    # FBGEMM's backward follows the `next` chain: with a chain lost, the gradient of a
    # duplicated key comes out 1.0 instead of 2.0.
    layout = Layout([["a", "b"]], [[2, 3]], [["a", "b"], ["a"]])
    x = torch.ones(4, 5, requires_grad=True)
    plan = get_plan(*layout)
    outs = torch.ops.fbgemm.permute_multi_embedding([x], *plan.tensors(), plan.out_lengths)
    sum(o.sum() for o in outs).backward()
    assert torch.equal(x.grad, torch.tensor([[2.0, 2.0, 1.0, 1.0, 1.0]] * 4))


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda lay: f"{len(lay.keys)}in-{len(lay.groups)}out")
def test_duplicate_chains_are_valid_torchrec_chains(layout):
    # Follow every chain of the rows: it must visit exactly the rows that copy the same
    # input block, first to last, and end with minus the row count.
    rows = get_plan(*layout).rows
    visited = set()
    for i, row in enumerate(rows):
        if row[5] <= 0 or i in visited:
            continue
        chain, j = [i], row[5]
        while True:
            chain.append(j)
            assert rows[j][5] < 0, (chain, rows)
            if rows[j][5] == -len(rows):
                break
            j = -rows[j][5]
        assert len({(rows[k][0], rows[k][2], rows[k][4]) for k in chain}) == 1, chain
        visited.update(chain)
    assert all(r[5] <= 0 or i in visited for i, r in enumerate(rows))


def test_get_plan_is_memoised_and_accepts_tuples_or_lists():
    L = SMALL_LAYOUT
    p1 = kt_regroup.get_plan(L.keys, L.lengths, L.groups)
    p2 = kt_regroup.get_plan(
        tuple(tuple(k) for k in L.keys), [list(x) for x in L.lengths], [tuple(g) for g in L.groups]
    )
    assert p1 is p2
    assert p1 == get_plan(*L)


def test_plan_tensors_dtype_and_shape():
    plan = get_plan(*SMALL_LAYOUT)
    permutes, in_shapes, out_shapes = plan.tensors("cpu")
    assert permutes.dtype == in_shapes.dtype == out_shapes.dtype == torch.int32
    assert permutes.shape[1] == PERMUTE_COLUMNS
    assert in_shapes.tolist() == list(plan.in_lengths)
    assert out_shapes.tolist() == list(plan.out_lengths)


def test_plan_with_no_rows():
    plan = get_plan([["a"]], [[3]], [[]])
    permutes, _, out_shapes = plan.tensors()
    assert permutes.shape == (0, PERMUTE_COLUMNS)
    outs = permute_multi_embedding_reference([torch.ones(2, 3)], *plan.tensors(), plan.out_lengths)
    assert outs[0].shape == (2, 0)
    assert out_shapes.tolist() == [0]


def test_view_specs_and_restricted_plan():
    plan = get_plan(
        [["a", "b"], ["c", "d", "e"]],
        [[2, 3], [4, 1, 6]],
        [["a", "b"], ["d", "e"], ["e", "a"], [], ["c"]],
    )
    assert plan.view_specs() == [(0, 0, 5), (1, 4, 7), None, None, (1, 0, 4)]
    sub = plan.restricted([2, 3])
    assert sub.out_lengths == (8, 0)
    assert [list(r) for r in sub.rows] == [[1, 0, 5, 0, 6, 0], [0, 0, 0, 6, 2, 0]]
    assert sub == get_plan(plan.keys, plan.lengths, [["e", "a"], []])


# --- the plan cache ---------------------------------------------------------------------------


def _one_group_of(keys):
    return [list(keys)], [[1] * len(keys)]


def test_plan_cache_never_returns_another_layouts_plan():
    # The id-reuse repro: 120 orderings of five width-1 keys, in three rounds with other
    # groups, through a cache smaller than the number of layouts, so plans are evicted
    # and freed all the time. A cache keyed by id() returned evicted plans' permutes.
    x = torch.arange(5.0).reshape(1, 5)
    keys = ["a", "b", "c", "d", "e"]
    for extra in ([], ["a"], ["b", "c"]):
        for order in itertools.permutations(keys):
            order = [*order, *extra]
            expected = torch.tensor([[float(keys.index(k)) for k in order]])
            out = kt_regroup.regroup_keyed_tensor([x], [keys], [[1] * 5], [list(order)])
            assert torch.equal(out[0], expected), order
            plan = kt_regroup.get_plan([keys], [[1] * 5], [list(order)])
            out = torch.ops.kt_regroup.permute_multi_embedding(
                [x], *plan.tensors(), plan.out_lengths
            )
            assert torch.equal(out[0], expected), order
    info = plan_module._cached.cache_info()
    assert info.currsize <= info.maxsize == 128


def test_200_distinct_layouts_every_surface():
    from torchrec.sparse.jagged_tensor import KeyedTensor

    module = kt_regroup.KTRegroupAsDict([["k1", "k0"], ["k2"]], ["x", "y"])
    for i in range(200):
        widths = [1 + (i + j) % 5 for j in range(3)] + [1 + i % 7]
        keys = [f"k{(j + i) % 4}" for j in range(4)]  # rotated key order
        x = torch.randn(3, sum(widths))
        layout = Layout([keys], [widths], [["k1", "k0"], ["k2"]])
        expected = expected_regroup([x], layout)
        kt = KeyedTensor(keys=keys, length_per_key=widths, values=x)
        assert_same_list(kt_regroup.regroup_keyed_tensor([x], *layout), expected)
        assert_same_list(kt_regroup.regroup([kt], layout.groups), expected)
        assert_same_list(list(module([kt]).values()), expected)
        plan = kt_regroup.get_plan(*layout)
        assert_same_list(
            torch.ops.kt_regroup.permute_multi_embedding([x], *plan.tensors(), plan.out_lengths),
            expected,
        )


OPS = torch.ops.kt_regroup


INT32_MAX = 2**31 - 1


@pytest.mark.parametrize("keys,lengths,groups,pattern", [
    ([["a", "b"]], [[2**32 + 1, 2]], [["b"]], r"key 'a' of input 0 has width 4294967297, more than an int32 plan holds \(2147483647\)"),
    ([["a", "b"]], [[2**31, 2]], [["b"]], r"key 'a' of input 0 has width 2147483648"),
    ([["a", "b"]], [[INT32_MAX, 2]], [["a"]], r"input 0 has 2147483649 columns up to key 'b' \(width 2\)"),
    ([["a"], ["b"]], [[INT32_MAX], [1]], [["a", "b"]], r"group 0 has 2147483648 columns up to key 'b' \(width 1\)"),
    ([["a"]], [[INT32_MAX]], [["a", "a"]], r"group 0 has 4294967294 columns up to key 'a'"),
])
def test_plans_that_int32_cannot_hold_are_refused(keys, lengths, groups, pattern):
    embs = torch.empty(0, 3)
    with pytest.raises(ValueError, match=pattern):
        OPS.kt_regroup_arguments(embs, keys, lengths, groups)
    with pytest.raises(ValueError, match=pattern):
        OPS.regroup_keyed_tensor([embs] * len(keys), keys, lengths, groups)


def test_the_largest_int32_plan_is_exact():
    permutes, in_shapes, out_shapes, out_lengths = OPS.kt_regroup_arguments(
        torch.empty(0, 1), [["a"], ["b"]], [[INT32_MAX - 1], [1]], [["b", "a"]])
    assert permutes.tolist() == [[1, 0, 0, 0, 1, 0], [0, 0, 0, 1, INT32_MAX - 1, 0]]
    assert in_shapes.tolist() == [INT32_MAX - 1, 1]
    assert out_shapes.tolist() == out_lengths == [INT32_MAX]


def test_plan_errors_stay_as_they_were():
    embs = torch.empty(2, 3)
    with pytest.raises(IndexError, match="group 0 asks for key 'z', which is in none of the 1 inputs"):
        OPS.kt_regroup_arguments(embs, [["a"]], [[3]], [["z"]])
    with pytest.raises(ValueError, match="key 'a' of input 0 has negative width -1"):
        OPS.kt_regroup_arguments(embs, [["a"]], [[-1]], [["a"]])


def test_plan_cache_under_concurrent_eviction():
    # Threads that miss at once used to evict the same oldest entry: KeyError. 8 threads x
    # 300 layouts of 2 widths each, through a cache of 128: evictions all the time.
    errors: list = []
    start = threading.Barrier(8)

    def work(t: int) -> None:
        start.wait()
        try:
            for i in range(300):
                widths = [1 + (t * 300 + i) % 997, 2 + i % 3]
                plan = kt_regroup.get_plan([["p", "q"]], [widths], [["q", "p"]])
                assert plan.out_lengths == (sum(widths),)
        except Exception as exc:  # noqa: BLE001  (any exception is the failure)
            errors.append(repr(exc))

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        threads = [threading.Thread(target=work, args=(t,)) for t in range(8)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
    finally:
        sys.setswitchinterval(interval)
    assert errors == []
    info = plan_module._cached.cache_info()
    assert info.currsize <= info.maxsize


def test_plan_cache_survives_fork_while_another_thread_misses():
    # A lock held by a thread at fork() stays held forever in the child: children
    # deadlocked in get_plan. The cache takes no lock of ours.
    stop = threading.Event()

    def hammer() -> None:
        i = 0
        while not stop.is_set():
            kt_regroup.get_plan([["p", "q"]], [[1 + i % 5000, 2]], [["q", "p"]])
            i += 1

    thread = threading.Thread(target=hammer)
    thread.start()
    stuck = 0
    try:
        for n in range(40):
            pid = os.fork()
            if pid == 0:  # the child: misses and hits, then leaves at once
                try:
                    plan = kt_regroup.get_plan([["a"]], [[3 + n]], [["a", "a"]])
                    os._exit(0 if plan.out_lengths == (6 + 2 * n,) else 1)
                finally:
                    os._exit(2)
            deadline = time.monotonic() + 20
            while True:
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    assert os.waitstatus_to_exitcode(status) == 0
                    break
                if time.monotonic() > deadline:
                    os.kill(pid, signal.SIGKILL)
                    os.waitpid(pid, 0)
                    stuck += 1
                    break
                time.sleep(0.01)
    finally:
        stop.set()
        thread.join()
    assert stuck == 0
