"""The autograd of the library (csrc/autograd.cpp) beyond reverse mode: forward-mode AD
(tangents of the forward, the fused cast and the backward op; ``torch.func.jvp``),
forward-over-reverse and reverse-over-forward, complex with real inputs, gradcheck."""

import pytest
import torch
from conftest import SMALL_LAYOUT, expected_grads, key_columns, make_values
from torch.autograd import forward_ad as fwAD

OPS = torch.ops.kt_regroup


def _plan(layout, like):
    return OPS.kt_regroup_arguments(like, layout.keys, layout.lengths, layout.groups)


def _cat_oracle(values, layout):
    """Slices + torch.cat, without detaching: tangents and gradients flow through it."""
    where = key_columns(layout)
    return [
        torch.cat([values[where[k][0]][:, where[k][1] : where[k][1] + where[k][2]] for k in g], 1)
        for g in layout.groups
    ]


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
