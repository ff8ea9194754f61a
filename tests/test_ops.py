"""``torch.ops.kt_regroup.*``: parity, opcheck, gradients.

Every op result is compared bit-exactly with the obvious slice-and-cat oracle
(``conftest.expected_regroup``), with the portable reference kernel, and with
FBGEMM's ``permute_multi_embedding`` given the same arguments where FBGEMM supports
the dtype.
"""

import gc

import pytest
import torch
from conftest import (
    DTYPES,
    FBGEMM_DTYPES,
    SEEDS,
    SMALL_LAYOUT,
    Layout,
    assert_no_alias,
    assert_same_list,
    clone_all,
    dtype_ids,
    expected_grads,
    expected_regroup,
    make_values,
    needs_fbgemm,
    random_layout,
    wiring_cells,
)
from reference import (
    permute_multi_embedding_backward_reference,
    permute_multi_embedding_reference,
)
from torchrec.sparse.jagged_tensor import _kt_regroup_arguments

import kt_regroup

LAYOUTS = {f"seed{s}": random_layout(s) for s in SEEDS}
LAYOUTS["small"] = SMALL_LAYOUT



def _args(kind, values, layout):
    """The op's metadata two ways: torchrec's builder, ours."""
    if kind == "torchrec":
        return _kt_regroup_arguments(values[0], layout.keys, layout.lengths, layout.groups)
    return kt_regroup.kt_regroup_arguments(values[0], layout.keys, layout.lengths, layout.groups)


# --- forward parity ---------------------------------------------------------------------


@pytest.mark.parametrize("name,dtype,batch,noncontiguous", wiring_cells(list(LAYOUTS)))
def test_permute_multi_embedding_parity(name, dtype, batch, noncontiguous):
    layout = LAYOUTS[name]
    values = make_values(layout, batch, dtype, noncontiguous, seed=batch)
    before = clone_all(values)
    expected = expected_regroup(values, layout)
    for kind in ("torchrec", "ours"):
        args = _args(kind, values, layout)
        out = torch.ops.kt_regroup.permute_multi_embedding(values, *args)
        assert_same_list(out, expected)
        assert_same_list(permute_multi_embedding_reference(values, *args), expected)
        assert_no_alias(out, values)
        assert all(o.is_contiguous() for o in out)
    assert_same_list(values, before)  # inputs never modified


@pytest.mark.parametrize("name,dtype,batch,noncontiguous", wiring_cells(list(LAYOUTS)))
def test_regroup_keyed_tensor_parity(name, dtype, batch, noncontiguous):
    layout = LAYOUTS[name]
    values = make_values(layout, batch, dtype, noncontiguous, seed=batch + 1)
    before = clone_all(values)
    out = torch.ops.kt_regroup.regroup_keyed_tensor(
        values, layout.keys, layout.lengths, layout.groups
    )
    assert_same_list(out, expected_regroup(values, layout))
    out2 = kt_regroup.regroup_keyed_tensor(values, layout.keys, layout.lengths, layout.groups)
    assert_same_list(out2, out)
    assert_no_alias(out, values)
    assert_same_list(values, before)


@needs_fbgemm
@pytest.mark.parametrize("name,dtype,batch,noncontiguous", wiring_cells(list(LAYOUTS), FBGEMM_DTYPES))
def test_permute_multi_embedding_matches_fbgemm(name, dtype, batch, noncontiguous):
    layout = LAYOUTS[name]
    values = make_values(layout, batch, dtype, noncontiguous, seed=7)
    for kind in ("torchrec", "ours"):
        args = _args(kind, values, layout)
        theirs = torch.ops.fbgemm.permute_multi_embedding(values, *args)
        ours = torch.ops.kt_regroup.permute_multi_embedding(values, *args)
        assert_same_list(ours, theirs)


@needs_fbgemm
@pytest.mark.parametrize("dtype", FBGEMM_DTYPES, ids=dtype_ids)
def test_gradients_match_fbgemm_for_used_keys(dtype):
    # FBGEMM's CPU backward leaves gradients of unused keys uninitialised, so compare
    # only the columns some group reads; ours must be exact zeros elsewhere.
    layout = SMALL_LAYOUT
    values = make_values(layout, 4, dtype, seed=3)
    args = _args("torchrec", values, layout)
    grads = [torch.randn(4, n, dtype=torch.float64).to(dtype) for n in args[3]]
    xs_ours = [v.clone().requires_grad_() for v in values]
    xs_fb = [v.clone().requires_grad_() for v in values]
    torch.autograd.backward(torch.ops.kt_regroup.permute_multi_embedding(xs_ours, *args), grads)
    torch.autograd.backward(torch.ops.fbgemm.permute_multi_embedding(xs_fb, *args), grads)
    # a: cols 0:3 used, b: cols 3:10 unused; input 1 fully used. 'c' is used three times:
    # FBGEMM sums its gradients in half precision, we in float32 (rounded once), so
    # half types agree to a few ulps only.
    tol = {"rtol": 1e-2, "atol": 1e-2} if dtype != torch.float32 else {}
    torch.testing.assert_close(xs_ours[0].grad[:, :3], xs_fb[0].grad[:, :3], **tol)
    torch.testing.assert_close(xs_ours[1].grad, xs_fb[1].grad, **tol)
    assert torch.equal(xs_ours[0].grad[:, 3:], torch.zeros(4, 7, dtype=dtype))


def test_python_wrappers_are_the_ops():
    layout = SMALL_LAYOUT
    values = make_values(layout, 2)
    args = kt_regroup.kt_regroup_arguments(values[0], *layout)
    assert_same_list(
        kt_regroup.permute_multi_embedding(values, *args),
        torch.ops.kt_regroup.permute_multi_embedding(values, *args),
    )


def test_out_lengths_may_exceed_what_permutes_write_and_unwritten_columns_are_zero():
    # A hand-made plan that leaves output columns 2:4 uncovered: they must read as 0,
    # never as whatever the allocator returned.
    garbage = torch.full((1 << 16,), float("nan"))
    del garbage
    x = torch.arange(6.0).reshape(2, 3)
    permutes = torch.tensor([[0, 0, 1, 0, 2, 0]], dtype=torch.int32)
    out = torch.ops.kt_regroup.permute_multi_embedding(
        [x],
        permutes,
        torch.tensor([3], dtype=torch.int32),
        torch.tensor([4], dtype=torch.int32),
        [4],
    )
    assert torch.equal(out[0], torch.tensor([[1.0, 2.0, 0.0, 0.0], [4.0, 5.0, 0.0, 0.0]]))


def test_int64_metadata_is_accepted():
    layout = SMALL_LAYOUT
    values = make_values(layout, 3)
    p, i, o, n = kt_regroup.kt_regroup_arguments(values[0], *layout)
    out = torch.ops.kt_regroup.permute_multi_embedding(values, p.long(), i.long(), o.long(), n)
    assert_same_list(out, expected_regroup(values, layout))


# --- opcheck ------------------------------------------------------------------------------


def _opcheck_samples():
    samples = []
    for dtype, batch, noncontig, layout in (
        [
            (torch.float32, 3, False, SMALL_LAYOUT),
            (torch.float32, 0, False, SMALL_LAYOUT),
            (torch.float64, 5, True, LAYOUTS["seed1"]),
            (torch.float16, 1, False, LAYOUTS["seed2"]),
            (torch.bfloat16, 4, True, LAYOUTS["seed3"]),
        ]
    ):
        samples.append(
            pytest.param(
                dtype,
                batch,
                noncontig,
                layout,
                id=f"{dtype_ids(dtype)}-b{batch}-nc{int(noncontig)}",
            )
        )
    return samples


@pytest.mark.parametrize("dtype,batch,noncontiguous,layout", _opcheck_samples())
def test_opcheck_permute_multi_embedding(dtype, batch, noncontiguous, layout):
    values = make_values(layout, batch, dtype, noncontiguous, requires_grad=True)
    args = kt_regroup.kt_regroup_arguments(values[0], *layout)
    torch.library.opcheck(torch.ops.kt_regroup.permute_multi_embedding.default, (values, *args))


@pytest.mark.parametrize("dtype,batch,noncontiguous,layout", _opcheck_samples())
def test_opcheck_permute_multi_embedding_backward(dtype, batch, noncontiguous, layout):
    values = make_values(layout, batch, dtype)
    p, i, o, out_lengths = kt_regroup.kt_regroup_arguments(values[0], *layout)
    grads = make_values(
        Layout([["g"]] * len(out_lengths), [[n] for n in out_lengths], []),
        batch,
        dtype,
        noncontiguous,
    )
    grads[-1] = None  # an output whose gradient autograd never materialised
    torch.library.opcheck(
        torch.ops.kt_regroup.permute_multi_embedding_backward.default,
        (grads, p, i, o, layout.in_widths, batch, dtype),
    )


@pytest.mark.parametrize("dtype,batch,noncontiguous,layout", _opcheck_samples()[:3])
def test_opcheck_regroup_keyed_tensor(dtype, batch, noncontiguous, layout):
    values = make_values(layout, batch, dtype, noncontiguous, requires_grad=True)
    torch.library.opcheck(
        torch.ops.kt_regroup.regroup_keyed_tensor.default,
        (values, layout.keys, layout.lengths, layout.groups),
    )


def test_opcheck_kt_regroup_arguments():
    for layout in (SMALL_LAYOUT, LAYOUTS["seed0"]):
        torch.library.opcheck(
            torch.ops.kt_regroup.kt_regroup_arguments.default,
            (torch.empty(2, 3), layout.keys, layout.lengths, layout.groups),
        )


def test_fake_tensor_output_sizes_come_from_out_lengths():
    from torch._subclasses.fake_tensor import FakeTensorMode

    layout = SMALL_LAYOUT
    with FakeTensorMode() as mode:
        values = [torch.empty(6, w) for w in layout.in_widths]
        args = kt_regroup.kt_regroup_arguments(values[0], *layout)
        out = torch.ops.kt_regroup.permute_multi_embedding(values, *args)
    assert [tuple(o.shape) for o in out] == [(6, n) for n in (5, 133, 1)]
    assert all(isinstance(o, torch._subclasses.fake_tensor.FakeTensor) for o in out)
    del mode


# --- gradients ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["small", "seed0", "seed2"])
def test_gradcheck_float64(name):
    layout = LAYOUTS[name]
    values = make_values(layout, 3, torch.float64, requires_grad=True)
    args = kt_regroup.kt_regroup_arguments(values[0], *layout)

    def fn(*xs):
        return tuple(torch.ops.kt_regroup.permute_multi_embedding(list(xs), *args))

    assert torch.autograd.gradcheck(fn, tuple(values), fast_mode=True)


def test_gradcheck_float64_strided_and_regroup_keyed_tensor():
    layout = LAYOUTS["seed1"]
    values = make_values(layout, 2, torch.float64, noncontiguous=True, requires_grad=True)

    def fn(*xs):
        return tuple(torch.ops.kt_regroup.regroup_keyed_tensor(list(xs), *layout))

    assert torch.autograd.gradcheck(fn, tuple(values))


@pytest.mark.parametrize("name", ["small", "seed1"])
def test_gradgradcheck_float64_forward_and_backward_ops(name):
    # The op is linear: the backward of the backward is the forward permute.
    layout = LAYOUTS[name]
    values = make_values(layout, 3, torch.float64, requires_grad=True)
    p, i, o, out_lengths = kt_regroup.kt_regroup_arguments(values[0], *layout)

    def forward(*xs):
        return tuple(torch.ops.kt_regroup.permute_multi_embedding(list(xs), p, i, o, out_lengths))

    assert torch.autograd.gradgradcheck(forward, tuple(values))
    grads = [torch.randn(3, n, dtype=torch.float64, requires_grad=True) for n in out_lengths]

    def backward(*gs):  # a None gradient among them
        gs = list(gs[:1]) + [None] + list(gs[1:])
        return tuple(torch.ops.kt_regroup.permute_multi_embedding_backward(
            gs, p, i, o, layout.in_widths, 3, torch.float64))

    defined = tuple(g for j, g in enumerate(grads) if j != 1)
    assert torch.autograd.gradcheck(backward, defined)
    assert torch.autograd.gradgradcheck(backward, defined)


def test_gradient_penalty_through_create_graph():
    # d/dx of ||d(out.w)/dx||^2 is 0 for a linear map, but the graph must exist: the
    # first-order gradient requires grad and feeds a second backward.
    layout = SMALL_LAYOUT
    x = make_values(layout, 2, torch.float64, requires_grad=True)
    out = kt_regroup.regroup_keyed_tensor(x, *layout)
    w = [torch.randn_like(o, requires_grad=True) for o in out]
    grads = torch.autograd.grad(sum((o * wi).sum() for o, wi in zip(out, w)), x, create_graph=True)
    assert all(g.requires_grad for g in grads)
    penalty = sum((g ** 2).sum() for g in grads)
    penalty.backward()
    # d penalty / d w = 2 * permute(grads): nonzero, and equal to the forward permute.
    p, i, o, n = kt_regroup.kt_regroup_arguments(x[0], *layout)
    expected = torch.ops.kt_regroup.permute_multi_embedding([2 * g.detach() for g in grads], p, i, o, n)
    assert_same_list([wi.grad for wi in w], expected)


def test_fused_cast_backward_with_the_default_dtype():
    layout = SMALL_LAYOUT
    x = make_values(layout, 2, requires_grad=True)
    p, i, o, n = kt_regroup.kt_regroup_arguments(x[0], *layout)
    for outs in (
        torch.ops.kt_regroup.permute_multi_embedding_to(x, p, i, o, n),  # dtype defaulted
        torch.ops.kt_regroup.permute_multi_embedding_to(x, p, i, o, n, None),
        kt_regroup.permute_multi_embedding_to(x, p, i, o, n),
    ):
        grads = torch.autograd.grad(sum(t.sum() for t in outs), x)
        assert torch.equal(grads[1][:, 0], torch.full((2,), 3.0))  # 'c' used three times


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_ids)
@pytest.mark.parametrize("name", ["small", "seed0", "seed3"])
def test_backward_accumulates_duplicates_zeroes_unused_keeps_dtype(name, dtype):
    layout = LAYOUTS[name]
    batch = 5
    values = make_values(layout, batch, dtype, requires_grad=True)
    args = kt_regroup.kt_regroup_arguments(values[0], *layout)
    grads = [torch.randn(batch, n, dtype=torch.float64).to(dtype) for n in args[3]]
    grads_before = clone_all(grads)
    # Dirty the allocator first: a kernel that forgets to zero unused columns
    # (FBGEMM's CPU backward) would return these NaNs.
    junk = [torch.full((batch, w), float("nan"), dtype=dtype) for w in layout.in_widths]
    del junk
    gc.collect()
    outs = torch.ops.kt_regroup.permute_multi_embedding(values, *args)
    torch.autograd.backward(outs, grads)
    acc = torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype
    expected = [e.to(dtype) for e in expected_grads(layout, grads, batch, acc)]
    for v, e in zip(values, expected):
        assert v.grad.dtype == dtype
        torch.testing.assert_close(v.grad, e, rtol=0, atol=0)
    assert_same_list(grads, grads_before)  # incoming gradients not modified
    # Unused keys: exact zeros, explicitly.
    used = layout.used_keys()
    for t, (tkeys, tlens) in enumerate(zip(layout.keys, layout.lengths)):
        off = 0
        for k, w in zip(tkeys, tlens):
            if k not in used:
                assert torch.equal(
                    values[t].grad[:, off : off + w], torch.zeros(batch, w, dtype=dtype)
                ), k
            off += w


def test_backward_of_unused_input_tensor_is_exact_zero():
    layout = Layout([["x"], ["y"]], [[3], [7]], [["x", "x"]])
    values = make_values(layout, 4, torch.float32, requires_grad=True)
    out = kt_regroup.regroup_keyed_tensor(values, *layout)
    out[0].sum().backward()
    assert torch.equal(values[0].grad, torch.full((4, 3), 2.0))
    assert torch.equal(values[1].grad, torch.zeros(4, 7))


def test_backward_with_only_some_outputs_used():
    layout = SMALL_LAYOUT
    values = make_values(layout, 3, torch.float64, requires_grad=True)
    outs = kt_regroup.regroup_keyed_tensor(values, *layout)
    # Only group 1 (e, d, a) contributes: 'c' and 'b' get zeros, 'a' gets ones.
    outs[1].sum().backward()
    assert torch.equal(values[0].grad[:, :3], torch.ones(3, 3, dtype=torch.float64))
    assert torch.equal(values[0].grad[:, 3:], torch.zeros(3, 7, dtype=torch.float64))
    assert torch.equal(values[1].grad[:, :1], torch.zeros(3, 1, dtype=torch.float64))
    assert torch.equal(values[1].grad[:, 1:], torch.ones(3, 130, dtype=torch.float64))


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_ids)
def test_backward_op_matches_reference_with_none_grads(dtype):
    layout = LAYOUTS["seed2"]
    batch = 3
    p, i, o, out_lengths = kt_regroup.kt_regroup_arguments(torch.empty(0), *layout)
    grads = [torch.randn(batch, n, dtype=torch.float64).to(dtype) for n in out_lengths]
    grads[1] = None
    got = torch.ops.kt_regroup.permute_multi_embedding_backward(
        grads, p, i, o, layout.in_widths, batch, dtype
    )
    ref = permute_multi_embedding_backward_reference(grads, p, i, o, layout.in_widths, batch, dtype)
    acc = torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype
    zero = torch.zeros(batch, out_lengths[1], dtype=dtype)
    by_hand = expected_grads(layout, [g if g is not None else zero for g in grads], batch, acc)
    assert_same_list(got, ref)
    assert_same_list(got, [e.to(dtype) for e in by_hand])
    # All gradients None: zeros of the right shape and dtype.
    none = torch.ops.kt_regroup.permute_multi_embedding_backward(
        [None] * len(out_lengths), p, i, o, layout.in_widths, batch, dtype
    )
    assert_same_list(none, [torch.zeros(batch, w, dtype=dtype) for w in layout.in_widths])


def test_half_precision_duplicates_accumulate_in_float32():
    # 2048 + 1 + 1 in fp16 step by step stays 2048; accumulated in fp32 it is 2050.
    layout = Layout([["a"]], [[1]], [["a", "a", "a"]])
    x = torch.zeros(1, 1, dtype=torch.float16, requires_grad=True)
    out = kt_regroup.regroup_keyed_tensor([x], *layout)
    out[0].backward(torch.tensor([[2048.0, 1.0, 1.0]], dtype=torch.float16))
    assert x.grad.dtype == torch.float16
    assert x.grad.item() == 2050.0


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_ids)
def test_fused_cast_of_mixed_input_dtypes(dtype):
    # Each input cast in the copy, whatever its dtype and position (the byte copy of an
    # input that already has the output dtype must use that dtype's element size).
    layout = LAYOUTS["seed1"]
    mixed = [torch.float32, torch.float16, torch.bfloat16, torch.float64]
    values = [v.to(mixed[i % 4]) for i, v in enumerate(make_values(layout, 6, torch.float64))]
    before = clone_all(values)
    for kind in ("torchrec", "ours"):
        args = _args(kind, values, layout)
        got = torch.ops.kt_regroup.permute_multi_embedding_to(values, *args, dtype)
        expected = expected_regroup([v.to(dtype) for v in values], layout)
        assert_same_list(got, expected)
    assert_same_list(values, before)
    leaves = [v.detach().requires_grad_() for v in values]
    outs = torch.ops.kt_regroup.permute_multi_embedding_to(leaves, *args, dtype)
    sum(o.double().sum() for o in outs).backward()
    assert [v.grad.dtype for v in leaves] == [v.dtype for v in values]
    with pytest.raises(TypeError, match=r"pooled_embs\[1\] is .* one dtype"):
        torch.ops.kt_regroup.permute_multi_embedding_to(values, *args)  # no dtype: no cast
