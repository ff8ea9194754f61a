"""The permute plan: torchrec's argument format, exactly, and coalescing that changes nothing."""

import pytest
import torch
from conftest import (
    SEEDS,
    SMALL_LAYOUT,
    Layout,
    assert_same_list,
    expected_regroup,
    make_values,
    random_layout,
)
from torchrec.sparse.jagged_tensor import _kt_regroup_arguments

import kt_regroup
from kt_regroup.kernels.reference import permute_multi_embedding_reference
from kt_regroup.plan import PERMUTE_COLUMNS, RegroupPlan, coalesce_rows

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


def test_kt_regroup_arguments_op_and_python_function_agree():
    embs = torch.empty(3, 4)
    L = SMALL_LAYOUT
    a = torch.ops.kt_regroup.kt_regroup_arguments(embs, L.keys, L.lengths, L.groups)
    b = kt_regroup.kt_regroup_arguments(embs, L.keys, L.lengths, L.groups)
    for x, y in zip(a[:3], b[:3]):
        assert torch.equal(x, y)
    assert a[3] == b[3] == [1 + 3 + 1, 127 + 3 + 3, 1]


def test_small_layout_rows_by_hand():
    plan = RegroupPlan.build(*SMALL_LAYOUT)
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
    assert plan.in_lengths == [10, 131]
    assert plan.out_lengths == [5, 133, 1]


@pytest.mark.parametrize("layout", LAYOUTS[:6], ids=str)
def test_coalesced_plan_computes_the_same(layout):
    plan = RegroupPlan.build(*layout)
    values = make_values(layout, batch=3)
    full = permute_multi_embedding_reference(
        values, *plan.tensors(coalesced=False), plan.out_lengths
    )
    merged = permute_multi_embedding_reference(
        values, *plan.tensors(coalesced=True), plan.out_lengths
    )
    assert_same_list(full, expected_regroup(values, layout))
    assert_same_list(merged, full)
    assert len(plan.coalesced_rows) <= len(plan.rows)


def test_coalesce_merges_adjacent_runs_and_drops_empty_rows():
    rows = [
        [0, 0, 0, 0, 2, 0],
        [0, 0, 2, 2, 3, 0],  # continues the previous run in input and output
        [0, 0, 9, 5, 0, 0],  # zero width: dropped
        [1, 0, 0, 5, 4, 0],  # other input: new run
        [1, 1, 4, 0, 1, 0],  # other output: new run
    ]
    assert coalesce_rows(rows) == [[0, 0, 0, 0, 5, 0], [1, 0, 0, 5, 4, 0], [1, 1, 4, 0, 1, 0]]


def test_coalesced_keys_contiguous_in_input_and_output_become_one_row():
    plan = RegroupPlan.build([["a", "b", "c"]], [[1, 3, 7]], [["a", "b", "c"]])
    assert [list(r) for r in plan.coalesced_rows] == [[0, 0, 0, 0, 11, 0]]
    assert len(plan.rows) == 3


def test_get_plan_is_memoised_and_accepts_tuples_or_lists():
    L = SMALL_LAYOUT
    p1 = kt_regroup.get_plan(L.keys, L.lengths, L.groups)
    p2 = kt_regroup.get_plan(
        tuple(tuple(k) for k in L.keys), [list(x) for x in L.lengths], [tuple(g) for g in L.groups]
    )
    assert p1 is p2
    assert p1 == RegroupPlan.build(*L)


def test_plan_tensors_dtype_and_shape():
    plan = RegroupPlan.build(*SMALL_LAYOUT)
    permutes, in_shapes, out_shapes = plan.tensors("cpu")
    assert permutes.dtype == in_shapes.dtype == out_shapes.dtype == torch.int32
    assert permutes.shape[1] == PERMUTE_COLUMNS
    assert in_shapes.tolist() == plan.in_lengths
    assert out_shapes.tolist() == plan.out_lengths


def test_plan_with_no_rows():
    plan = RegroupPlan.build([["a"]], [[3]], [[]])
    permutes, _, out_shapes = plan.tensors()
    assert permutes.shape == (0, PERMUTE_COLUMNS)
    outs = permute_multi_embedding_reference([torch.ones(2, 3)], *plan.tensors(), plan.out_lengths)
    assert outs[0].shape == (2, 0)
    assert out_shapes.tolist() == [0]


def test_view_specs_and_restricted_plan():
    plan = RegroupPlan.build(
        [["a", "b"], ["c", "d", "e"]],
        [[2, 3], [4, 1, 6]],
        [["a", "b"], ["d", "e"], ["e", "a"], [], ["c"]],
    )
    assert plan.view_specs() == [(0, 0, 5), (1, 4, 7), None, None, (1, 0, 4)]
    sub = plan.restricted([2, 3])
    assert sub.out_lengths == [8, 0]
    assert [list(r) for r in sub.coalesced_rows] == [[1, 0, 5, 0, 6, 0], [0, 0, 0, 6, 2, 0]]
    assert [list(r) for r in sub.rows] == [[1, 0, 5, 0, 6, 0], [0, 0, 0, 6, 2, 0]]
