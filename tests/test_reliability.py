"""Issue 15, the C++ library's part: `_into` against `copy_`, int32-range plans, forward-mode
AD and complex gradients.

Each test failed before its fix: `_into` took stride-0 and cross-Storage outs, leaves that
require grad and bumped no version counter; `kt_regroup_arguments` wrapped widths of 2^31
or more; tangents were dropped (or "jvp is not implemented"); complex64 + float32 inputs
failed in backward.
"""

import numpy as np
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


# ---- _into against copy_ ---------------------------------------------------------------------
#
# One input, one group of all its columns: `_into(x -> out)` writes what `out.copy_(x)` does,
# so each case runs both and expects the same outcome.

IDENTITY = ([["a", "b"]], [[1, 2]], [["a", "b"]])


def _into(src, out):
    permutes, in_shapes, out_shapes, _ = OPS.kt_regroup_arguments(src, *IDENTITY)
    OPS.permute_multi_embedding_into([src], permutes, in_shapes, out_shapes, [out])


def _expanded():
    return torch.zeros(1, 3).expand(4, 3), torch.randn(4, 3)


def _partial_overlap():  # contiguous and one Storage: copy_ sees the overlap
    buf = torch.randn(13)
    return buf[1:13].view(4, 3), buf[:12].view(4, 3)


def _leaf():
    return torch.zeros(4, 3, requires_grad=True), torch.randn(4, 3)


def _view_of_leaf():
    return torch.zeros(4, 6, requires_grad=True)[:, :3], torch.randn(4, 3)


def _inference_out():
    with torch.inference_mode():
        return torch.zeros(4, 3), torch.randn(4, 3)


def _plain():
    return torch.zeros(4, 3), torch.randn(4, 3)


COPY_CASES = {
    # name: (out, src) factory, whether copy_ (and so _into) refuses, error pattern of _into
    "plain": (_plain, None),
    "expanded out": (_expanded, "more than one element of the written-to tensor refers to a single memory location"),
    "out partially overlaps the input": (_partial_overlap, r"outs\[0\] overlaps pooled_embs\[0\]"),
    "leaf that requires grad": (_leaf, r"outs\[0\]: a leaf Variable that requires grad is being used in an in-place operation"),
    "view of such a leaf": (_view_of_leaf, r"outs\[0\]: a view of a leaf Variable that requires grad"),
    "inference out outside inference mode": (_inference_out, r"outs\[0\] is an inference tensor: Inplace update to inference tensor outside InferenceMode"),
}


@pytest.mark.parametrize("case", list(COPY_CASES))
def test_into_accepts_and_refuses_what_copy_does(case):
    make, pattern = COPY_CASES[case]
    out, src = make()
    copy_error = None
    try:
        out.copy_(src)
    except RuntimeError as exc:
        copy_error = exc
    assert (copy_error is None) == (pattern is None), copy_error
    out, src = make()
    src_before, out_before = src.detach().clone(), out.detach().clone()
    if pattern is None:
        _into(src, out)
        torch.testing.assert_close(out, src, rtol=0, atol=0)
    else:
        with pytest.raises((ValueError, RuntimeError), match=pattern):
            _into(src, out)
        torch.testing.assert_close(out.detach(), out_before, rtol=0, atol=0)  # nothing written
    torch.testing.assert_close(src.detach(), src_before, rtol=0, atol=0)


def test_into_on_a_leaf_under_no_grad_succeeds_like_copy_():
    out, src = _leaf()
    want = out.detach().clone()
    with torch.no_grad():
        want.copy_(src)
        _into(src, out)
    torch.testing.assert_close(out.detach(), want, rtol=0, atol=0)
    assert out.is_leaf and out.requires_grad


def test_into_bumps_the_version_counter_like_copy_():
    src = torch.randn(4, 3)
    ours, theirs = torch.zeros(4, 3), torch.zeros(4, 3)
    for mode in (torch.enable_grad, torch.no_grad, torch.inference_mode):
        with mode():
            theirs.copy_(src)
            _into(src, ours)
        assert ours._version == theirs._version, mode
    assert ours._version == 3


def test_into_over_a_saved_tensor_makes_backward_raise_like_copy_():
    x = torch.randn(4, 3, requires_grad=True)
    for write in (lambda w: w.copy_(torch.randn(4, 3)), lambda w: _into(torch.randn(4, 3), w)):
        w = torch.randn(4, 3)
        loss = (x * w).sum()  # saves w
        write(w)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            loss.backward()


def test_into_refuses_outs_whose_rows_share_memory():
    # The stride-0 expand above, and rows that overlap (row stride below the width), where
    # copy_ gives an order-dependent result: refused too.
    src = torch.randn(4, 3)
    for out in (torch.zeros(1, 3).expand(4, 3), torch.zeros(10).as_strided((4, 3), (1, 1)),
                torch.zeros(1).as_strided((4, 1), (0, 1))):
        with pytest.raises(ValueError, match=r"outs\[0\] has strides .* refers to a single memory location"):
            _into(src, out)
    _into(src, torch.zeros(40).as_strided((4, 3), (3, 1)))  # rows side by side: fine


def _numpy_pair():
    arr = np.zeros(13, dtype=np.float32)
    return torch.from_numpy(arr), torch.from_numpy(arr)


def _dlpack_pair():
    buf = torch.zeros(13)
    return buf, torch.utils.dlpack.from_dlpack(torch.utils.dlpack.to_dlpack(buf))


def _frombuffer_pair():
    raw = bytearray(13 * 4)
    return torch.frombuffer(raw, dtype=torch.float32), torch.frombuffer(raw, dtype=torch.float32)


@pytest.mark.parametrize("pair", [_numpy_pair, _dlpack_pair, _frombuffer_pair],
                         ids=["from_numpy", "dlpack", "frombuffer"])
def test_into_refuses_overlap_by_address_whatever_the_storage(pair):
    # The partial overlap copy_ refuses when it is one Storage, here through two Storage
    # objects over the same memory (which copy_ cannot see).
    a, b = pair()
    a[:12] = torch.arange(12, dtype=torch.float32)
    src, out = a[:12].view(4, 3), b[1:13].view(4, 3)
    before = a.clone()
    with pytest.raises(ValueError, match=r"outs\[0\] overlaps pooled_embs\[0\] in memory"):
        _into(src, out)
    torch.testing.assert_close(a, before, rtol=0, atol=0)  # input and out untouched
    # Two outs over the same memory through two Storage objects.
    a, b = pair()
    x = torch.randn(4, 3)
    permutes, in_shapes, out_shapes, _ = OPS.kt_regroup_arguments(
        x, [["a", "b"]], [[1, 2]], [["a", "b"], ["b"]])
    outs = [a[:12].view(4, 3), b[:8].view(4, 2)]
    with pytest.raises(ValueError, match=r"outs\[1\] overlaps outs\[0\] in memory"):
        OPS.permute_multi_embedding_into([x], permutes, in_shapes, out_shapes, outs)


def test_into_refuses_what_it_cannot_differentiate():
    x = torch.randn(4, 3)
    needs = torch.randn(4, 3, requires_grad=True)
    non_leaf = torch.zeros(4, 3, requires_grad=True) * 1
    for src, out, culprit in ((needs, torch.zeros(4, 3), r"pooled_embs\[0\]"),
                              (x, non_leaf, r"outs\[0\]")):
        with pytest.raises(RuntimeError, match=culprit + " requires grad, but this op records no gradients"):
            _into(src, out)
        with torch.no_grad():
            _into(src, out)  # as copy_ under no_grad
        torch.testing.assert_close(out.detach(), src.detach(), rtol=0, atol=0)
    with fwAD.dual_level():
        for src, out, culprit in ((fwAD.make_dual(x, torch.ones(4, 3)), torch.zeros(4, 3), r"pooled_embs\[0\]"),
                                  (x, fwAD.make_dual(torch.zeros(4, 3), torch.ones(4, 3)), r"outs\[0\]")):
            with pytest.raises(RuntimeError, match=culprit + " has a forward-mode AD tangent"):
                _into(src, out)


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


# ---- complex gradients -----------------------------------------------------------------------


def test_complex_and_real_inputs_get_gradients_as_cat_gives_them():
    layout = LAYOUT
    gen = torch.Generator().manual_seed(5)
    complex_in = torch.randn(4, sum(layout.lengths[0]), generator=gen,
                             dtype=torch.complex64).requires_grad_()
    real_in = torch.randn(4, sum(layout.lengths[1]), generator=gen).requires_grad_()
    values = [complex_in, real_in]
    permutes, in_shapes, out_shapes, out_lengths = _plan(layout, complex_in)
    grads = [torch.randn(4, n, generator=gen, dtype=torch.complex64) for n in out_lengths]
    for dtype in (torch.complex64, torch.complex128):
        outs = OPS.permute_multi_embedding_to(values, permutes, in_shapes, out_shapes, out_lengths, dtype)
        ours = torch.autograd.grad(outs, values, [g.to(dtype) for g in grads])
        want_outs = [o.to(dtype) for o in _cat_oracle([v.to(dtype) for v in values], layout)]
        want = torch.autograd.grad(want_outs, values, [g.to(dtype) for g in grads])
        for o, w in zip(outs, want_outs):
            torch.testing.assert_close(o, w, rtol=0, atol=0)
        for g, w, v in zip(ours, want, values):
            assert g.dtype == v.dtype
            torch.testing.assert_close(g, w)
    # A real input cast to complex: the real part, as x.to(torch.complex64) gives it.
    real_only = [real_in]
    p, i, o, n = OPS.kt_regroup_arguments(real_in, [["x"]], [[real_in.size(1)]], [["x"]])
    out = OPS.permute_multi_embedding_to(real_only, p, i, o, n, torch.complex64)
    (got,) = torch.autograd.grad(out, real_only, [grads[0][:, :1].expand(4, n[0]).contiguous()])
    (want,) = torch.autograd.grad([real_in.to(torch.complex64)], real_only,
                                  [grads[0][:, :1].expand(4, n[0]).contiguous()])
    torch.testing.assert_close(got, want)


# ---- gradcheck: reverse, forward and second order, real and complex --------------------------


@pytest.mark.parametrize("dtype", [torch.float64, torch.complex128])
def test_gradcheck_forward_and_reverse(dtype):
    layout = LAYOUT
    gen = torch.Generator().manual_seed(11)
    first = torch.randn(3, sum(layout.lengths[0]), generator=gen, dtype=dtype).requires_grad_()
    second = torch.randn(3, sum(layout.lengths[1]), generator=gen, dtype=torch.float64).requires_grad_()
    permutes, in_shapes, out_shapes, out_lengths = _plan(layout, first)

    def fn(a, b):
        return tuple(OPS.permute_multi_embedding_to([a, b], permutes, in_shapes, out_shapes,
                                                    out_lengths, dtype))

    assert torch.autograd.gradcheck(fn, (first, second), check_forward_ad=True,
                                    check_batched_grad=False)
    assert torch.autograd.gradgradcheck(fn, (first, second), check_fwd_over_rev=True,
                                        check_batched_grad=False)
