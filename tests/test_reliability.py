"""Issue 15, the C++ library's part: `_into` against `copy_`, int32-range plans, forward-mode
AD and complex gradients.

Each test failed before its fix: `_into` took stride-0 and cross-Storage outs, leaves that
require grad and bumped no version counter; `kt_regroup_arguments` wrapped widths of 2^31
or more; tangents were dropped (or "jvp is not implemented"); complex64 + float32 inputs
failed in backward.
"""

import pytest
import torch
from conftest import SMALL_LAYOUT, expected_grads, key_columns, make_values
from torch.autograd import forward_ad as fwAD

import kt_regroup

OPS = torch.ops.kt_regroup
INT32_MAX = 2**31 - 1

pytestmark = pytest.mark.skipif(
    kt_regroup.library_path() is None, reason="the C++ op library is not built"
)


def _plan(layout, like):
    return OPS.kt_regroup_arguments(like, layout.keys, layout.lengths, layout.groups)


def _cat_oracle(values, layout):
    """Slices + torch.cat, without detaching: tangents and gradients flow through it."""
    where = key_columns(layout)
    return [
        torch.cat([values[where[k][0]][:, where[k][1] : where[k][1] + where[k][2]] for k in g], 1)
        for g in layout.groups
    ]


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


# ---- forward-mode AD -------------------------------------------------------------------------

LAYOUT = SMALL_LAYOUT


def _tangents(values, which):
    gen = torch.Generator().manual_seed(7)
    return [torch.randn(v.shape, generator=gen).to(v.dtype) if i in which else None
            for i, v in enumerate(values)]


def _duals(values, tangents):
    return [v if t is None else fwAD.make_dual(v, t) for v, t in zip(values, tangents)]


@pytest.mark.parametrize("which", [{0, 1}, {1}], ids=["all", "one"])
@pytest.mark.parametrize("requires_grad", [False, True])
@pytest.mark.parametrize("grad_mode", [torch.enable_grad, torch.no_grad])
def test_forward_ad_tangents_match_cat(which, requires_grad, grad_mode):
    values = make_values(LAYOUT, 5, requires_grad=requires_grad)
    tangents = _tangents(values, which)
    permutes, in_shapes, out_shapes, out_lengths = _plan(LAYOUT, values[0])
    with fwAD.dual_level(), grad_mode():
        duals = _duals(values, tangents)
        calls = {
            "permute_multi_embedding": OPS.permute_multi_embedding(duals, permutes, in_shapes, out_shapes, out_lengths),
            "permute_multi_embedding_to": OPS.permute_multi_embedding_to(duals, permutes, in_shapes, out_shapes, out_lengths, None),
            "regroup_keyed_tensor": OPS.regroup_keyed_tensor(duals, LAYOUT.keys, LAYOUT.lengths, LAYOUT.groups),
        }
        want = [fwAD.unpack_dual(o) for o in _cat_oracle(duals, LAYOUT)]
        for name, outs in calls.items():
            for o, w in zip(outs, want):
                got = fwAD.unpack_dual(o)
                assert got.tangent is not None, name
                torch.testing.assert_close(got.primal, w.primal, rtol=0, atol=0)
                torch.testing.assert_close(got.tangent, w.tangent, rtol=0, atol=0)
                assert o.requires_grad == (requires_grad and grad_mode is torch.enable_grad), name


def test_forward_ad_tangents_of_the_fused_cast_are_cast():
    values = make_values(LAYOUT, 3)
    tangents = _tangents(values, {0, 1})
    permutes, in_shapes, out_shapes, out_lengths = _plan(LAYOUT, values[0])
    with fwAD.dual_level():
        outs = OPS.permute_multi_embedding_to(_duals(values, tangents), permutes, in_shapes,
                                              out_shapes, out_lengths, torch.float64)
        want = _cat_oracle([t.double() for t in tangents], LAYOUT)
        for o, w in zip(outs, want):
            torch.testing.assert_close(fwAD.unpack_dual(o).tangent, w, rtol=0, atol=0)


def test_forward_ad_tangents_of_the_backward_op():
    batch = 4
    permutes, in_shapes, out_shapes, out_lengths = _plan(LAYOUT, torch.empty(0))
    in_lengths = [sum(t) for t in LAYOUT.lengths]
    gen = torch.Generator().manual_seed(3)
    grads = [torch.randn(batch, n, generator=gen, dtype=torch.float64) for n in out_lengths]
    tangents = [torch.randn(batch, n, generator=gen, dtype=torch.float64) for n in out_lengths]
    with fwAD.dual_level():
        duals = [fwAD.make_dual(grads[0], tangents[0]), grads[1], None]  # one without tangent, one None
        outs = OPS.permute_multi_embedding_backward(duals, permutes, in_shapes, out_shapes,
                                                    in_lengths, batch, torch.float64)
        zero = torch.zeros(batch, out_lengths[2], dtype=torch.float64)
        want_primal = expected_grads(LAYOUT, [grads[0], grads[1], zero], batch, torch.float64)
        want_tangent = expected_grads(LAYOUT, [tangents[0], torch.zeros_like(grads[1]), zero],
                                      batch, torch.float64)
        for o, p, t in zip(outs, want_primal, want_tangent):
            got = fwAD.unpack_dual(o)
            torch.testing.assert_close(got.primal, p)
            torch.testing.assert_close(got.tangent, t)


def test_torch_func_jvp_matches_cat():
    values = make_values(LAYOUT, 3, dtype=torch.float64)
    tangents = _tangents(values, {0, 1})
    permutes, in_shapes, out_shapes, out_lengths = _plan(LAYOUT, values[0])
    ours = torch.func.jvp(
        lambda *xs: tuple(OPS.permute_multi_embedding(list(xs), permutes, in_shapes, out_shapes, out_lengths)),
        tuple(values), tuple(tangents))
    want = torch.func.jvp(lambda *xs: tuple(_cat_oracle(xs, LAYOUT)), tuple(values), tuple(tangents))
    for got, exp in zip(ours, want):
        for g, e in zip(got, exp):
            torch.testing.assert_close(g, e, rtol=0, atol=0)


def test_forward_over_reverse_and_reverse_over_forward():
    # Hessian-vector products of a loss through the op, both ways, against cat's: the
    # double backward and the backward op then see dual numbers too.
    values = make_values(LAYOUT, 3, dtype=torch.float64, requires_grad=True)
    tangents = _tangents(values, {0, 1})
    permutes, in_shapes, out_shapes, out_lengths = _plan(LAYOUT, values[0])
    weights = [torch.randn(3, n, dtype=torch.float64) for n in out_lengths]

    def ours(xs):
        return OPS.permute_multi_embedding(xs, permutes, in_shapes, out_shapes, out_lengths)

    def cat(xs):
        return _cat_oracle(xs, LAYOUT)

    def loss(outs):
        return sum(((o * o * o) * w).sum() for o, w in zip(outs, weights))

    def fwd_over_rev(fn):
        with fwAD.dual_level():
            duals = _duals(values, tangents)
            grads = torch.autograd.grad(loss(fn(duals)), duals, create_graph=True)
            return [fwAD.unpack_dual(g).tangent for g in grads]

    def rev_over_fwd(fn):
        with fwAD.dual_level():
            outs = fn(_duals(values, tangents))
            directional = sum((fwAD.unpack_dual(o).tangent * 3 * fwAD.unpack_dual(o).primal ** 2 * w).sum()
                              for o, w in zip(outs, weights))
        return torch.autograd.grad(directional, values)

    for transform in (fwd_over_rev, rev_over_fwd):
        for g, e in zip(transform(ours), transform(cat)):
            torch.testing.assert_close(g, e)


