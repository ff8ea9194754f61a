"""Issue 15, the C++ library's part: `_into` against `copy_`, int32-range plans, forward-mode
AD and complex gradients.

Each test failed before its fix: `_into` took stride-0 and cross-Storage outs, leaves that
require grad and bumped no version counter; `kt_regroup_arguments` wrapped widths of 2^31
or more; tangents were dropped (or "jvp is not implemented"); complex64 + float32 inputs
failed in backward.
"""

import pytest
import torch

import kt_regroup

OPS = torch.ops.kt_regroup
INT32_MAX = 2**31 - 1

pytestmark = pytest.mark.skipif(
    kt_regroup.library_path() is None, reason="the C++ op library is not built"
)


# ---- int32 plans -----------------------------------------------------------------------------


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


