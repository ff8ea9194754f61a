"""The native CPU kernels (``kt_regroup/csrc``) against the oracle (``tests/reference.py``).

The reference functions are plain slices; the ops dispatch to the C++ kernels. Forward results and fp32/fp64 gradients must be bit-identical, and so
must float16/bfloat16 gradients of duplicated keys (both accumulate in float32 in row
order and round once).
"""

from __future__ import annotations

import re

import pytest
import torch
from conftest import (
    SMALL_LAYOUT,
    WIDTHS,
    assert_same_list,
    clone_all,
    dtype_ids,
    expected_grads,
    expected_regroup,
    intra_op_threads,
    keyed_tensors,
    make_values,
    needs_cpp_autograd,
    needs_cpu_kernel,
    plan_args,
    random_grads,
    random_layout,
)
from reference import (
    permute_multi_embedding_backward_reference,
    permute_multi_embedding_into_reference,
    permute_multi_embedding_reference,
    permute_multi_embedding_to_reference,
)

import kt_regroup
from kt_regroup.plan import get_plan

OP = torch.ops.kt_regroup.permute_multi_embedding
BACKWARD_OP = torch.ops.kt_regroup.permute_multi_embedding_backward


LAYOUTS = [random_layout(s) for s in range(6)] + [
    random_layout(10, n_inputs=1, keys_per_input=(5, 8), n_groups=2),
    random_layout(11, n_inputs=4, keys_per_input=(1, 2), n_groups=5),
    SMALL_LAYOUT,
]
LAYOUT_IDS = [f"seed{s}" for s in range(6)] + ["one-input", "many-groups", "small"]
FLOAT_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]
# The forward is a byte copy dispatched on element size: one dtype of each size (1, 2, 4
# and 8 bytes) stands for all dtypes of that size. Sums (the backward) and casts need each
# float dtype's own arithmetic, and use FLOAT_DTYPES.
COPY_DTYPES = [torch.uint8, torch.bfloat16, torch.float32, torch.float64]

# The copy program's tests, run again in processes of the interpreter's builds (see
# test_the_interpreter_builds_of_the_copy_program_pass_the_same_tests).
copy_program = pytest.mark.copy_program


def _values(layout, batch, dtype, noncontiguous=False, seed=0):
    if dtype in (torch.int8, torch.uint8):
        gen = torch.Generator().manual_seed(seed)
        lo, hi = (-128, 128) if dtype == torch.int8 else (0, 256)
        vals = [torch.randint(lo, hi, (batch, w), generator=gen, dtype=dtype)
                for w in layout.in_widths]
        if noncontiguous:
            vals = [torch.cat([v, v], 1)[:, v.size(1):] if v.numel() else v for v in vals]
        return vals
    return make_values(layout, batch, dtype, noncontiguous=noncontiguous, seed=seed)


# --- forward ----------------------------------------------------------------------------


@needs_cpu_kernel
@pytest.mark.parametrize("layout", LAYOUTS, ids=LAYOUT_IDS)
@pytest.mark.parametrize("batch", [0, 1, 5, 33])
@pytest.mark.parametrize("dtype", COPY_DTYPES, ids=dtype_ids)
def test_forward_is_bit_identical_to_reference(layout, batch, dtype):
    args = plan_args(layout)
    for noncontiguous in (False, True):
        values = _values(layout, batch, dtype, noncontiguous, seed=batch)
        got = OP(values, *args)
        want = permute_multi_embedding_reference(values, *args)
        assert_same_list(got, want)
        assert all(o.is_contiguous() and o.dtype == dtype for o in got)


@needs_cpu_kernel
def test_forward_accepts_int64_metadata_and_odd_strides():
    layout = SMALL_LAYOUT
    base = torch.randn(9, 400)
    # Rows 3 apart, columns contiguous: a strided view read without a copy.
    values = [base[::3, 5:15], base[::3, 100:231]]
    assert not values[0].is_contiguous()
    # Transposed storage: column stride != 1.
    values_t = [v.t().contiguous().t() for v in values]
    for vals in (values, values_t):
        args = plan_args(layout, torch.int64)
        assert_same_list(OP(vals, *args), permute_multi_embedding_reference(vals, *args))


@needs_cpu_kernel
@pytest.mark.parametrize("width", WIDTHS)
def test_forward_untiled_plans_zero_the_gaps_and_keep_row_order(width):
    # Gaps (output columns no row writes) and overlapping writes (later rows win).
    x = torch.randn(7, width + 4)
    permutes = torch.tensor(
        [
            [0, 0, 0, 2, width, 0],  # columns 0:2 of output 0 are a gap
            [0, 0, 1, 3, min(width, 2), 0],  # overlaps the previous row
            [0, 1, 4, 1, width, 0],
        ],
        dtype=torch.int32,
    )
    out_lengths = [width + 4, width + 3]
    args = (permutes, torch.tensor([width + 4]), torch.tensor(out_lengths), out_lengths)
    # Poison the allocator so an unzeroed gap would show.
    garbage = torch.full((1 << 15,), float("nan"))
    del garbage
    got = OP([x], *args)
    want = permute_multi_embedding_reference([x], *args)
    assert_same_list(got, want)
    assert torch.equal(got[0][:, :2], torch.zeros(7, 2))


# --- backward ---------------------------------------------------------------------------


@needs_cpu_kernel
@pytest.mark.parametrize("layout", LAYOUTS, ids=LAYOUT_IDS)
@pytest.mark.parametrize("batch", [0, 1, 5, 33])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=dtype_ids)
def test_backward_is_bit_identical_to_reference(layout, batch, dtype):
    plan = get_plan(*layout)
    permutes, in_shapes, out_shapes, out_lengths = plan_args(layout)
    args = (permutes, in_shapes, out_shapes, plan.in_lengths, batch, dtype)
    for none_at in ((), (0,), tuple(range(len(out_lengths)))):
        grads = random_grads(out_lengths, batch, dtype, seed=batch + len(none_at), none_at=none_at)
        got = BACKWARD_OP(grads, *args)
        want = permute_multi_embedding_backward_reference(grads, *args)
        assert_same_list(got, want)


@needs_cpu_kernel
def test_backward_strided_and_mixed_dtype_gradients_match_reference():
    layout = SMALL_LAYOUT
    plan = get_plan(*layout)
    permutes, in_shapes, out_shapes, out_lengths = plan_args(layout)
    args = (permutes, in_shapes, out_shapes, plan.in_lengths, 6)
    # Non-contiguous gradients: transposed storage, and an expanded (stride 0) row.
    strided = [torch.randn(n, 6).t() for n in out_lengths]
    expanded = [torch.randn(1, n).expand(6, n) for n in out_lengths]
    for grads in (strided, expanded):
        got = BACKWARD_OP(grads, *args, torch.float32)
        want = permute_multi_embedding_backward_reference(grads, *args, torch.float32)
        assert_same_list(got, want)
    # float32 gradients of a bfloat16 input: the portable algorithm's promotion rules.
    grads = random_grads(out_lengths, 6, torch.float32, seed=1)
    got = BACKWARD_OP(grads, *args, torch.bfloat16)
    assert_same_list(got, permute_multi_embedding_backward_reference(grads, *args, torch.bfloat16))
    # Integer "gradients" (the op is usable as a scatter-add): wrap like the reference.
    grads = [torch.randint(-100, 100, (6, n), dtype=torch.int8) for n in out_lengths]
    got = BACKWARD_OP(grads, *args, torch.int8)
    assert_same_list(got, permute_multi_embedding_backward_reference(grads, *args, torch.int8))


# Upstream gradients as autograd hands them over: any strides, stride 0 included.
def _strided_grad(kind: str, batch: int, n: int, values: torch.Tensor) -> torch.Tensor:
    """``values`` ([batch, n], contiguous) laid out as ``kind``; equal values, new strides."""
    if kind == "contiguous":
        return values
    if kind == "transposed":  # strides (1, batch)
        return values.t().contiguous().t()
    if kind == "column-slice":  # row stride n + 5
        wide = torch.zeros(batch, n + 5, dtype=values.dtype)
        wide[:, 2 : 2 + n] = values
        return wide[:, 2 : 2 + n]
    if kind == "every-other":  # strides (2 * 2n, 2)
        tall = torch.zeros(2 * batch, 2 * n, dtype=values.dtype)
        tall[::2, ::2] = values
        return tall[::2, ::2]
    if kind == "expanded":  # strides (0, 0): what loss = out.sum() hands back
        return values[:1, :1].expand(batch, n) if values.numel() else values
    if kind == "expanded-rows":  # strides (0, 1)
        return values[:1].expand(batch, n) if batch else values
    if kind == "expanded-columns":  # strides (1, 0)
        return values[:, :1].expand(batch, n) if n else values
    raise AssertionError(kind)


GRAD_KINDS = ["contiguous", "transposed", "column-slice", "every-other", "expanded",
              "expanded-rows", "expanded-columns"]


def _oracle_backward(layout, grads, batch, dtype):
    """Input gradients by slicing, summed exactly (float64, int64 for integers), cast once."""
    acc = torch.int64 if not dtype.is_floating_point else torch.float64
    return [o.to(dtype) for o in expected_grads(layout, grads, batch, acc)]


def _dyadic(batch, n, dtype, gen):
    """Values every dtype holds exactly whose sums of a few are exact in float32: any
    summation order then rounds to the same result as float64."""
    if not dtype.is_floating_point:
        return torch.randint(-128, 128, (batch, n), generator=gen).to(dtype)
    return (torch.randint(-256, 256, (batch, n), generator=gen) / 16).to(dtype)


@needs_cpu_kernel
@pytest.mark.parametrize("dtype", FLOAT_DTYPES + [torch.int8, torch.int32], ids=dtype_ids)
def test_backward_reads_any_gradient_strides_bit_exact(dtype):
    gen = torch.Generator().manual_seed(0)
    for layout in LAYOUTS:
        plan = get_plan(*layout)
        permutes, in_shapes, out_shapes, out_lengths = plan_args(layout)
        for batch in (0, 1, 6, 33):
            args = (permutes, in_shapes, out_shapes, plan.in_lengths, batch, dtype)
            for shift, kind in enumerate(GRAD_KINDS):
                # One kind for all outputs, and the kinds mixed across outputs.
                for kinds in ([kind] * len(out_lengths),
                              [GRAD_KINDS[(shift + j) % len(GRAD_KINDS)]
                               for j in range(len(out_lengths))]):
                    dense = [_dyadic(batch, n, dtype, gen) for n in out_lengths]
                    grads = [_strided_grad(k, batch, n, v)
                             for k, v, n in zip(kinds, dense, out_lengths)]
                    got = BACKWARD_OP(grads, *args)
                    assert_same_list(got, _oracle_backward(layout, grads, batch, dtype))
                    # Row-order float32 sums too (random values round): like the reference
                    # on the same gradients made contiguous.
                    if dtype.is_floating_point:
                        rand = [torch.randn(batch, n, generator=gen, dtype=torch.float64)
                                .to(dtype) for n in out_lengths]
                        grads = [_strided_grad(k, batch, n, v)
                                 for k, v, n in zip(kinds, rand, out_lengths)]
                        want = permute_multi_embedding_backward_reference(
                            [g.contiguous() for g in grads], *args)
                        assert_same_list(BACKWARD_OP(grads, *args), want)


@needs_cpp_autograd
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=dtype_ids)
def test_sum_backward_reads_the_expanded_gradient_without_a_copy(dtype):
    from torch.profiler import profile

    for layout in LAYOUTS:
        values = make_values(layout, 9, dtype, requires_grad=True)
        outs = OP(values, *plan_args(layout))
        loss = sum(o.sum() for o in outs)
        seed = torch.ones((), dtype=dtype)  # made here: backward() would fill one in
        with profile() as prof:
            loss.backward(seed)
        names = {e.name for e in prof.events()}
        assert "kt_regroup::permute_multi_embedding_backward" in names
        assert not names & {"aten::contiguous", "aten::clone", "aten::copy_", "aten::zeros",
                            "aten::zero_", "aten::fill_"}, names
        # Each column's gradient: how many times its key is used.
        ones = [torch.ones(9, n) for n in get_plan(*layout).out_lengths]
        assert_same_list([v.grad for v in values], _oracle_backward(layout, ones, 9, dtype))


@needs_cpu_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=dtype_ids)
def test_autograd_gradients_are_exact(dtype):
    for layout in LAYOUTS:
        values = make_values(layout, 5, dtype, requires_grad=True, seed=7)
        args = plan_args(layout)
        outs = OP(values, *args)
        grads = random_grads(args[3], 5, dtype, seed=8)
        torch.autograd.backward(outs, grads)
        plan = get_plan(*layout)
        want = permute_multi_embedding_backward_reference(
            grads, *args[:3], plan.in_lengths, 5, dtype
        )
        assert_same_list([v.grad for v in values], want)


@needs_cpu_kernel
def test_unused_keys_get_exact_zero_gradients():
    layout = SMALL_LAYOUT  # 'b' (input 0, columns 3:10) is used by no group
    for dtype in FLOAT_DTYPES:
        garbage = torch.full((1 << 15,), float("nan"), dtype=dtype)
        del garbage
        values = make_values(layout, 4, dtype, requires_grad=True)
        outs = OP(values, *plan_args(layout))
        # Only one output contributes: the other outputs' keys get zeros too.
        outs[0].sum().backward()
        assert torch.equal(values[0].grad[:, 3:], torch.zeros(4, 7, dtype=dtype))
        assert torch.equal(values[1].grad[:, 4:], torch.zeros(4, 127, dtype=dtype))


@needs_cpu_kernel
def test_gradcheck_float64():
    layout = SMALL_LAYOUT
    values = make_values(layout, 3, torch.float64, requires_grad=True)
    args = plan_args(layout)
    assert torch.autograd.gradcheck(lambda *v: OP(list(v), *args), values)


@needs_cpp_autograd
def test_plan_tensors_made_under_inference_mode_work_with_autograd():
    layout = SMALL_LAYOUT
    with torch.inference_mode():
        args = plan_args(layout)
    values = make_values(layout, 2, requires_grad=True)
    outs = OP(values, *args)
    sum(o.sum() for o in outs).backward()
    assert values[1].grad[:, 0].eq(3).all()  # 'c': twice in group 0, once in group 2


@needs_cpp_autograd
def test_autograd_kernel_is_cpp_and_backward_is_an_op():
    values = make_values(SMALL_LAYOUT, 2, requires_grad=True)
    outs = OP(values, *plan_args(SMALL_LAYOUT))
    assert type(outs[0].grad_fn).__name__ == "CppFunction"
    from torch.profiler import profile

    with profile() as prof:
        outs[0].sum().backward()
    names = {e.name for e in prof.events()}
    assert "kt_regroup::permute_multi_embedding_backward" in names


# --- validation -------------------------------------------------------------------------


def _bad_cases():
    layout = SMALL_LAYOUT
    values = make_values(layout, 2)
    permutes, in_shapes, out_shapes, out_lengths = plan_args(layout)

    def with_row(r, col, v, dtype=torch.int32):
        p = permutes.to(dtype).clone()
        p[r, col] = v
        return p

    big = 1 << 62
    meta = (in_shapes, out_shapes, out_lengths)
    wide, tall = values[1].double(), torch.randn(3, 131)

    def call(vals=values, p=permutes, i=in_shapes, o=out_shapes, n=out_lengths):
        return (vals, p, i, o, n)

    return {
        "in_tensor out of range": ("in_tensor=5", (values, with_row(1, 0, 5), *meta)),
        "out_tensor negative": ("out_tensor=-1", (values, with_row(2, 1, -1), *meta)),
        "negative length": ("negative length -3", (values, with_row(0, 4, -3), *meta)),
        "read overflow": ("permutes[3] reads", (values, with_row(3, 2, 100), *meta)),
        "int64 offset overflow": ("permutes[0] reads", (values, _overflow(permutes, big), *meta)),
        "in_shapes mismatch": ("in_shapes[1]=9", call(i=torch.tensor([10, 9]).int())),
        "in_shapes count": ("in_shapes must have one entry", call(i=in_shapes[:1])),
        "out_shapes mismatch": ("out_shapes[0]", call(o=out_shapes + 1)),
        "negative out_lengths": ("out_lengths[2] is negative", call(n=[*out_lengths[:2], -1])),
        "permutes shape": ("permutes must have shape", call(p=permutes[:, :5])),
        "permutes dtype": ("permutes must be int32 or int64", call(p=permutes.float())),
        "dtype mix": ("pooled_embs[1] is", call(vals=[values[0], wide])),
        "batch mix": ("pooled_embs[1] has batch size 3", call(vals=[values[0], tall])),
        "not 2-D": ("pooled_embs[0] must be 2-D", call(vals=[values[0][0], values[1]])),
        "empty": ("pooled_embs is empty", call(vals=[])),
    }


def _overflow(permutes, big):
    # in_offset + length overflows int64 if summed naively.
    p = permutes.to(torch.int64).clone()
    p[0, 2] = big
    p[0, 4] = big
    return p


BAD = _bad_cases()


@needs_cpu_kernel
@pytest.mark.parametrize("case", list(BAD), ids=list(BAD))
def test_bad_inputs_raise_naming_the_culprit(case):
    culprit, args = BAD[case]
    before = clone_all(args[0])
    with pytest.raises((ValueError, TypeError, IndexError)) as ours:
        OP(*args)
    assert culprit in str(ours.value)
    assert_same_list(args[0], before)


@needs_cpu_kernel
def test_bad_backward_inputs_raise_naming_the_culprit():
    plan = get_plan(*SMALL_LAYOUT)
    permutes, in_shapes, out_shapes, out_lengths = plan_args(SMALL_LAYOUT)
    grads = random_grads(out_lengths, 2, torch.float32, seed=0)
    meta = (permutes, in_shapes, out_shapes)
    f32 = torch.float32
    cases = [
        ([grads[0], torch.randn(2, 5), grads[2]], *meta, plan.in_lengths, 2, f32),
        (grads, *meta, [10, 130], 2, f32),
        (grads, *meta, plan.in_lengths, 3, f32),
        ([grads[0], grads[1].half(), grads[2]], *meta, plan.in_lengths, 2, f32),
    ]
    culprits = ["grad_outputs[1] has shape (2, 5)", "in_lengths[1]", "grad_outputs[0] has shape",
                "grad_outputs[1] is"]
    for args, culprit in zip(cases, culprits):
        with pytest.raises((ValueError, TypeError)) as ours:
            BACKWARD_OP(*args)
        assert culprit in str(ours.value), ours.value


# --- opcheck / compile ------------------------------------------------------------------


@needs_cpu_kernel
@pytest.mark.parametrize(
    "dtype,batch,noncontiguous",
    [(torch.float32, 5, False), (torch.float32, 0, False), (torch.bfloat16, 3, True),
     (torch.float64, 1, True), (torch.float16, 4, False)],
    ids=["fp32", "empty-batch", "bf16-strided", "fp64-batch1", "fp16"],
)
def test_opcheck(dtype, batch, noncontiguous):
    layout = SMALL_LAYOUT
    values = make_values(layout, batch, dtype, noncontiguous, requires_grad=True)
    args = plan_args(layout)
    torch.library.opcheck(OP.default, (values, *args))
    plan = get_plan(*layout)
    grads = random_grads(args[3], batch, dtype, seed=2, none_at=(2,))
    torch.library.opcheck(
        BACKWARD_OP.default, (grads, *args[:3], plan.in_lengths, batch, dtype)
    )


@needs_cpu_kernel
def test_compiled_forward_and_backward_match_eager():
    layout = SMALL_LAYOUT
    args = plan_args(layout)

    def f(a, b):
        outs = OP([a, b], *args)
        return outs[0] * 2 + 1, outs[1].sin()

    compiled = torch.compile(f, backend="aot_eager", dynamic=True, fullgraph=True)
    for batch in (3, 8):
        eager_in = make_values(layout, batch, requires_grad=True, seed=batch)
        comp_in = [v.detach().clone().requires_grad_() for v in eager_in]
        e, c = f(*eager_in), compiled(*comp_in)
        assert_same_list(list(c), list(e))
        sum(o.sum() for o in e).backward()
        sum(o.sum() for o in c).backward()
        assert_same_list([v.grad for v in comp_in], [v.grad for v in eager_in])


# --- fused cast / preallocated outputs --------------------------------------------------

TO_OP = torch.ops.kt_regroup.permute_multi_embedding_to
INTO_OP = torch.ops.kt_regroup.permute_multi_embedding_into


@needs_cpu_kernel
@pytest.mark.parametrize("src", FLOAT_DTYPES + [torch.int8], ids=dtype_ids)
@pytest.mark.parametrize(
    "dst", [None, torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int32],
    ids=lambda d: "same" if d is None else dtype_ids(d),
)
def test_fused_cast_matches_cast_after_reference(src, dst):
    for layout in LAYOUTS[:4]:
        for batch, noncontiguous in ((0, False), (5, True), (33, False)):
            values = _values(layout, batch, src, noncontiguous, seed=batch)
            args = plan_args(layout)
            got = TO_OP(values, *args, dst)
            want = permute_multi_embedding_to_reference(values, *args, dst)
            assert_same_list(got, want)
            assert all(g.dtype == (dst or src) for g in got)


@needs_cpu_kernel
def test_fused_cast_gradients_come_back_in_the_input_dtype():
    layout = SMALL_LAYOUT
    values = make_values(layout, 4, torch.float32, requires_grad=True)
    args = plan_args(layout)
    outs = TO_OP(values, *args, torch.bfloat16)
    grads = random_grads(args[3], 4, torch.bfloat16, seed=3)
    torch.autograd.backward(outs, grads)
    plan = get_plan(*layout)
    want = permute_multi_embedding_backward_reference(
        grads, *args[:3], plan.in_lengths, 4, torch.float32
    )
    assert_same_list([v.grad for v in values], want)
    torch.library.opcheck(TO_OP.default, (values, *args, torch.bfloat16))


@needs_cpu_kernel
@pytest.mark.parametrize("dtype", FLOAT_DTYPES + [torch.uint8], ids=dtype_ids)
def test_into_overwrites_preallocated_outputs_like_the_reference(dtype):
    for layout in LAYOUTS[:4]:
        values = _values(layout, 6, dtype, noncontiguous=True, seed=1)
        permutes, in_shapes, out_shapes, out_lengths = plan_args(layout)
        ours = [torch.full((6, n), 7).to(dtype) for n in out_lengths]
        ref = [t.clone() for t in ours]
        INTO_OP(values, permutes, in_shapes, out_shapes, ours)
        permute_multi_embedding_into_reference(values, permutes, in_shapes, out_shapes, ref)
        assert_same_list(ours, ref)
        assert_same_list(ours, permute_multi_embedding_reference(values, permutes, in_shapes,
                                                                 out_shapes, out_lengths))


@needs_cpu_kernel
def test_into_rejects_bad_outputs_naming_the_culprit():
    values = make_values(SMALL_LAYOUT, 2)
    permutes, in_shapes, out_shapes, out_lengths = plan_args(SMALL_LAYOUT)
    good = [torch.empty(2, n) for n in out_lengths]
    bad_sets = [
        [good[0], torch.empty(2 * out_lengths[1]), good[2]],  # not 2-D
        [good[0], torch.empty(3, out_lengths[1]), good[2]],  # batch
        [good[0], good[1].double(), good[2]],  # dtype
        [good[0], torch.empty(out_lengths[1], 2).t(), good[2]],  # column stride
        [good[0], torch.empty(2, out_lengths[1] + 1), good[2]],  # width vs out_shapes
        [good[0], values[1][:, :out_lengths[1]], good[2]],  # overlaps an input
        [good[0], good[0][:, : out_lengths[1]], good[2]] if out_lengths[1] <= out_lengths[0]
        else [good[1][:, : out_lengths[0]], good[1], good[2]],  # overlaps another output
    ]
    culprits = ["outs[1]", "outs[1]", "outs[1]", "outs[1]", "out_shapes[1]",
                "outs[1] overlaps pooled_embs[1]", "overlaps outs[0]"]
    for outs, culprit in zip(bad_sets, culprits):
        before = [t.clone() for t in values]
        with pytest.raises((ValueError, TypeError)) as ours:
            INTO_OP(values, permutes, in_shapes, out_shapes, outs)
        assert culprit in str(ours.value), ours.value
        assert_same_list(values, before)


def test_fused_cast_accepts_plan_tensors_made_under_inference_mode():
    with torch.inference_mode():
        args = plan_args(SMALL_LAYOUT)
    values = make_values(SMALL_LAYOUT, 2, requires_grad=True)
    outs = TO_OP(values, *args, torch.float64)
    sum(o.sum() for o in outs).backward()
    assert values[1].grad.dtype == torch.float32
    assert values[1].grad[:, 0].eq(3).all()  # 'c': twice in group 0, once in group 2


# --- the multi-threaded path ------------------------------------------------------------

# Rows of 4-8 KiB: a batch of a few hundred rows is many of the kernel's 128 KiB grains,
# so at::parallel_for splits it across threads.
WIDE_LAYOUT = random_layout(21, n_inputs=3, keys_per_input=(3, 5), widths=(127, 255, 511))


@pytest.fixture
def four_threads():
    with intra_op_threads(4):
        yield


@needs_cpu_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dtype_ids)
def test_multithreaded_forward_and_backward_match_the_oracle(four_threads, dtype):
    batch = 777
    plan = get_plan(*WIDE_LAYOUT)
    row_bytes = sum(plan.out_lengths) * dtype.itemsize
    assert batch * row_bytes >= 4 << 20, "must span many 128 KiB grains"
    values = make_values(WIDE_LAYOUT, batch, dtype, requires_grad=True, seed=5)
    args = plan_args(WIDE_LAYOUT)
    outs = OP(values, *args)
    assert_same_list(outs, expected_regroup(values, WIDE_LAYOUT))
    gen = torch.Generator().manual_seed(6)
    dense = [_dyadic(batch, n, dtype, gen) for n in plan.out_lengths]
    for kind in ("contiguous", "transposed", "expanded-rows"):
        grads = [_strided_grad(kind, batch, n, v) for n, v in zip(plan.out_lengths, dense)]
        for v in values:
            v.grad = None
        torch.autograd.backward(OP(values, *args), grads)
        assert_same_list([v.grad for v in values],
                         _oracle_backward(WIDE_LAYOUT, grads, batch, dtype))


@needs_cpu_kernel
def test_one_module_from_8_threads_forward_and_backward(four_threads):
    # One KTRegroupAsDict shared by 8 threads, each with its own key order (the plan is
    # swapped under the others' feet) and batch sizes, on the kernel's parallel path.
    import random
    import threading


    keys = [k for ks in WIDE_LAYOUT.keys for k in ks]
    width = dict(zip(keys, [w for ws in WIDE_LAYOUT.lengths for w in ws]))
    groups = WIDE_LAYOUT.groups
    module = kt_regroup.KTRegroupAsDict(groups, [f"g{i}" for i in range(len(groups))])
    cases = []
    for t in range(8):
        order = random.Random(t).sample(keys, len(keys))
        cut = 1 + t % (len(keys) - 1)
        layout = type(WIDE_LAYOUT)([order[:cut], order[cut:]],
                                   [[width[k] for k in order[:cut]],
                                    [width[k] for k in order[cut:]]], groups)
        batch = 150 + 97 * t
        values = make_values(layout, batch, requires_grad=True, seed=t)
        ones = [torch.ones(batch, n) for n in get_plan(*layout).out_lengths]
        cases.append((layout, values, expected_regroup(values, layout),
                      _oracle_backward(layout, ones, batch, torch.float32)))
    failures: list = []
    start = threading.Barrier(8)

    def work(t: int) -> None:
        layout, values, want, want_grads = cases[t]
        kts = keyed_tensors(layout, [v.detach() for v in values])
        start.wait()
        for i in range(12):
            # a wrong value raises here; the main thread asserts that nothing was recorded
            try:
                if i % 3:
                    assert_same_list(list(module(kts).values()), want)
                else:
                    leaves = [v.detach().requires_grad_() for v in values]
                    got = list(module(keyed_tensors(layout, leaves)).values())
                    sum(o.sum() for o in got).backward()
                    assert_same_list(got, want)
                    assert_same_list([v.grad for v in leaves], want_grads)
            except Exception as exc:  # noqa: BLE001  (an exception is a failure too)
                failures.append((t, i, repr(exc)[:200]))

    threads = [threading.Thread(target=work, args=(t,)) for t in range(8)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert failures == []


# Keys of 130, 257 and 3 columns: copies of hundreds of bytes whose edges fall inside
# cache lines (streamed whole lines, normal stores at the edges), with a duplicated key.
WIDE_ODD_LAYOUT = SMALL_LAYOUT._replace(
    keys=[["p", "q", "r"], ["s", "t"]], lengths=[[130, 257, 3], [131, 64]],
    groups=[["t", "p", "r", "q"], ["s", "q"]])


@needs_cpp_autograd
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dtype_ids)
@pytest.mark.parametrize("layout", [SMALL_LAYOUT, WIDE_ODD_LAYOUT], ids=["small", "wide-odd"])
@copy_program
def test_streaming_stores_past_32mib_match_the_oracle(four_threads, dtype, layout):
    # Outputs and gradients past 32 MiB (in huge pages, or the _into op's) are written
    # with non-temporal stores on any machine, by every thread; odd widths (1, 3, 7, 127,
    # 130) put segment edges off 16-byte alignment.
    width = sum(get_plan(*layout).out_lengths)
    batch = (33 << 20) // (width * dtype.itemsize) + 1
    values = make_values(layout, batch, dtype, requires_grad=True, seed=8)
    args = plan_args(layout)
    outs = OP(values, *args)
    assert sum(o.nbytes for o in outs) >= 32 << 20
    assert_same_list(outs, expected_regroup(values, layout))
    into = [torch.full_like(o, 7) for o in outs]  # caller-owned memory streams too
    INTO_OP([v.detach() for v in values], *args[:3], into)
    assert_same_list(into, outs)
    gen = torch.Generator().manual_seed(9)
    for kind in ("contiguous", "expanded", "expanded-rows"):
        dense = [_dyadic(batch, n, dtype, gen) for n in args[3]]
        grads = [_strided_grad(kind, batch, n, v) for n, v in zip(args[3], dense)]
        got = torch.autograd.grad(outs, values, grads, retain_graph=True)
        assert_same_list(got, _oracle_backward(layout, grads, batch, dtype))


# --- narrow segments: the forward's copy program ----------------------------------------

# Every width from 1 to 130 columns, split over two inputs and shuffled into three groups,
# with keys used twice: copies of every byte width the program has a fixed move for, and
# of the widths around them.
# Also a serving-sized row (widths 1-40: 3.3 KB in float32): rows that stay in L1.
def _narrow_layout(top=131):
    import random

    groups = [[f"w{w}" for w in range(1, top) if w % 3 == g] for g in range(3)]
    for g, group in enumerate(groups):
        random.Random(g).shuffle(group)
        group += group[:3]  # duplicated keys
    return SMALL_LAYOUT._replace(
        keys=[[f"w{w}" for w in range(1, top, 2)], [f"w{w}" for w in range(2, top, 2)]],
        lengths=[list(range(1, top, 2)), list(range(2, top, 2))], groups=groups)


# Serving-style keys of one width per input (2, 4, 8 and 16 columns): runs of copies that
# write back to back (only their sources read); runs of odd and even length, runs cut
# where a group leaves the output order, and a duplicated key inside a run.
def _uniform_layout():
    import random

    widths = {2: 7, 4: 9, 8: 11, 16: 5}
    keys = [[f"c{w}_{k}" for k in range(n)] for w, n in widths.items()]
    in_order = [k for ks in keys for k in ks]
    shuffled = list(in_order)
    random.Random(0).shuffle(shuffled)
    groups = [in_order[::2], shuffled[:20], in_order[1::2][::-1]]
    groups[0][5:5] = [groups[0][4]]  # a duplicate right after itself
    return SMALL_LAYOUT._replace(
        keys=keys, lengths=[[w] * n for w, n in widths.items()], groups=groups)


NARROW_LAYOUT = _narrow_layout()
NARROW_LAYOUTS = [NARROW_LAYOUT, _narrow_layout(41), _uniform_layout()]
NARROW_IDS = ["1-130", "1-40", "uniform"]
# One dtype per element size (1, 2, 4, 8 and 16 bytes): the copies move bytes, so bool,
# int8 and uint8 take the same code, as do int32 and float32, and so on. Floats where the
# size has one: random bit patterns then include NaN payloads and -0.0.
SIZE_DTYPES = [torch.uint8, torch.float16, torch.float32, torch.float64, torch.complex128]
assert sorted(d.itemsize for d in SIZE_DTYPES) == [1, 2, 4, 8, 16]

def _random_bits(batch, width, dtype, gen, row_stride_pad=0):
    """Random bit patterns (NaN payloads and -0.0 included), optionally a column slice."""
    if dtype == torch.bool:
        t = torch.randint(0, 2, (batch, width + row_stride_pad), generator=gen).bool()
    else:
        t = torch.randint(0, 256, (batch, (width + row_stride_pad) * dtype.itemsize),
                          generator=gen, dtype=torch.uint8).view(dtype)
    return t[:, row_stride_pad // 2: row_stride_pad // 2 + width]


def _same_bits(got, want):
    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


@needs_cpu_kernel
@pytest.mark.parametrize("batch", [0, 1, 3, 32, 513])
@pytest.mark.parametrize("dtype", SIZE_DTYPES, ids=dtype_ids)
@pytest.mark.parametrize("layout", NARROW_LAYOUTS, ids=NARROW_IDS)
@copy_program
def test_narrow_widths_copy_every_bit(batch, dtype, layout):
    gen = torch.Generator().manual_seed(batch)
    args = plan_args(layout)
    for pad in (0, 5):  # contiguous rows, and row strides past the width
        values = [_random_bits(batch, w, dtype, gen, pad) for w in layout.in_widths]
        want = permute_multi_embedding_reference(values, *args)
        _same_bits(OP(values, *args), want)
        _same_bits(TO_OP(values, *args, None), want)
        # _into, with outs that are column slices of wider buffers (row-strided)
        bases = [_random_bits(batch, n + 9, dtype, gen) for n in args[3]]
        outs = [b[:, 3:3 + n] for b, n in zip(bases, args[3])]
        edges = [(b[:, :3].clone(), b[:, 3 + n:].clone()) for b, n in zip(bases, args[3])]
        INTO_OP(values, *args[:3], outs)
        _same_bits(outs, want)
        for b, n, (left, right) in zip(bases, args[3], edges):
            _same_bits([b[:, :3], b[:, 3 + n:]], [left, right])
    if batch:  # transposed storage (column stride != 1)
        values = [v.t().contiguous().t() for v in values]
        _same_bits(OP(values, *args), permute_multi_embedding_reference(values, *args))


# Rows of 32 KiB and more are copied in input order, shorter ones in output order: a
# layout whose float64 and float32 rows are past that size and whose bf16 rows are not.
def _long_row_layout():
    import random

    widths = {16: 200, 128: 60, 3: 100}
    keys = [[f"l{w}_{k}" for k in range(n)] for w, n in widths.items()]
    in_order = [k for ks in keys for k in ks]
    shuffled = list(in_order)
    random.Random(1).shuffle(shuffled)
    groups = [in_order[::2], shuffled[:150] + in_order[:2], in_order[1::2][::-1]]
    return SMALL_LAYOUT._replace(
        keys=keys, lengths=[[w] * n for w, n in widths.items()], groups=groups)


@needs_cpu_kernel
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16], ids=dtype_ids)
@copy_program
def test_long_and_short_rows_copy_every_bit(dtype):
    layout = _long_row_layout()
    args = plan_args(layout)
    row_bytes = sum(args[3]) * dtype.itemsize
    assert (row_bytes >= 32 << 10) == (dtype != torch.bfloat16), row_bytes
    gen = torch.Generator().manual_seed(3)
    values = [_random_bits(33, w, dtype, gen, 5) for w in layout.in_widths]
    want = permute_multi_embedding_reference(values, *args)
    _same_bits(OP(values, *args), want)
    bases = [_random_bits(33, n + 9, dtype, gen) for n in args[3]]
    outs = [b[:, 3:3 + n] for b, n in zip(bases, args[3])]
    INTO_OP(values, *args[:3], outs)
    _same_bits(outs, want)


# Narrow copies go four rows at a time; each thread's share of the rows starts anywhere
# and ends with the rows left over.
@needs_cpu_kernel
@pytest.mark.parametrize("dtype", [torch.int8, torch.bfloat16, torch.float32], ids=dtype_ids)
@pytest.mark.parametrize("layout", NARROW_LAYOUTS[1:], ids=NARROW_IDS[1:])
@copy_program
def test_narrow_rows_split_across_threads_copy_every_bit(four_threads, dtype, layout):
    args = plan_args(layout)
    gen = torch.Generator().manual_seed(4)
    for batch in (777, 1023):
        values = [_random_bits(batch, w, dtype, gen, 3) for w in layout.in_widths]
        want = permute_multi_embedding_reference(values, *args)
        _same_bits(OP(values, *args), want)
        outs = [_random_bits(batch, n, dtype, gen) for n in args[3]]
        INTO_OP(values, *args[:3], outs)
        _same_bits(outs, want)


# On x86-64 Linux with AVX2, copy programs kept with their plans run as machine code,
# the rest in the interpreter's AVX2 build (32-byte moves); other CPUs run its baseline
# build (16-byte moves). The report says what ran for the last plan, and why.
@needs_cpu_kernel
@copy_program
def test_copy_programs_run_as_machine_code_on_x86_64_linux_with_avx2():
    import os
    import platform
    import sys

    x86 = platform.machine() in ("x86_64", "AMD64")
    has_avx2 = x86 and torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")
    avx2 = has_avx2 and os.environ.get("KT_REGROUP_AVX2") != "0"
    jit = avx2 and sys.platform == "linux" and os.environ.get("KT_REGROUP_JIT") != "0"
    why = ("KT_REGROUP_JIT=0" if avx2 and sys.platform == "linux"
           else "no machine code on this platform (x86-64 Linux only)" if not x86
           or sys.platform != "linux" else "KT_REGROUP_AVX2=0" if has_avx2
           else "the CPU has no AVX2")
    want = "machine code" if jit else f"{'avx2' if avx2 else 'baseline'} interpreter ({why})"
    values = make_values(SMALL_LAYOUT, 3)
    args = plan_args(SMALL_LAYOUT)
    assert_same_list(OP(values, *args), permute_multi_embedding_reference(values, *args))
    assert torch.ops.kt_regroup._cpu_copy_program() == want


# The machine code holds one register per tensor, ten at most (five of them the caller's,
# saved and restored); programs of more tensors run in the interpreter. Each side of the
# limit, many times over: a register the code failed to restore would show.
@needs_cpu_kernel
@pytest.mark.parametrize("n_in, n_out", [(6, 4), (7, 4), (1, 9)])
@pytest.mark.parametrize("dtype", [torch.int8, torch.bfloat16, torch.float64], ids=dtype_ids)
@copy_program
def test_copy_programs_of_many_tensors_copy_every_bit(n_in, n_out, dtype):
    import random

    rng = random.Random(n_in * 10 + n_out)
    keys = [[f"t{i}_{k}" for k in range(5)] for i in range(n_in)]
    lengths = [[rng.randint(1, 20) for _ in ks] for ks in keys]
    flat = [k for ks in keys for k in ks]
    # every group reads every input (all the tensors take registers), some keys twice
    groups = [[keys[i][(i + j) % 5] for i in range(n_in)] + rng.choices(flat, k=3)
              for j in range(n_out)]
    layout = SMALL_LAYOUT._replace(keys=keys, lengths=lengths, groups=groups)
    args = plan_args(layout)
    gen = torch.Generator().manual_seed(n_in)
    for batch in (1, 3, 33, 100):
        values = [_random_bits(batch, w, dtype, gen, 3) for w in layout.in_widths]
        want = permute_multi_embedding_reference(values, *args)
        for _ in range(20):
            _same_bits(OP(values, *args), want)
        outs = [_random_bits(batch, n, dtype, gen, 4) for n in args[3]]
        INTO_OP(values, *args[:3], outs)
        _same_bits(outs, want)


# The interpreter's builds get the copy program's tests (marked copy_program) in processes
# started with KT_REGROUP_JIT=0 (its AVX2 build, on CPUs with AVX2) and KT_REGROUP_AVX2=0
# (its baseline build). The other tests reach the copy program through the same entry.
@needs_cpu_kernel
@pytest.mark.parametrize("env", ["KT_REGROUP_JIT", "KT_REGROUP_AVX2"])
def test_the_interpreter_builds_of_the_copy_program_pass_the_same_tests(env):
    import os
    import subprocess
    import sys

    env = dict(os.environ, **{env: "0"})
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
         __file__, "-m", "copy_program"],
        env=env, cwd=os.path.dirname(__file__), capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    # every marked test passed, none skipped: "N passed, M deselected in ..."
    summary = re.search(r"^(\d+) passed, \d+ deselected in ", run.stdout, re.M)
    assert summary and int(summary[1]) >= 90, run.stdout[-500:]


@needs_cpu_kernel
@pytest.mark.parametrize("batch", [0, 1, 3, 32, 513])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=dtype_ids)
@pytest.mark.parametrize("layout", NARROW_LAYOUTS, ids=NARROW_IDS)
@copy_program
def test_narrow_widths_backward_matches_reference(batch, dtype, layout):
    # duplicated keys (sums), unused columns (zeros), a missing gradient, stride-0 and
    # row-strided gradients, and the fused cast's backward (float32 gradients)
    plan = get_plan(*layout)
    permutes, in_shapes, out_shapes, out_lengths = plan_args(layout)
    args = (permutes, in_shapes, out_shapes, plan.in_lengths, batch, dtype)
    for grad_dtype in dict.fromkeys([dtype, torch.float32]):
        grads = random_grads(out_lengths, batch, grad_dtype, seed=batch, none_at=(1,))
        grads[0] = torch.ones((), dtype=grad_dtype).expand(batch, out_lengths[0])
        grads[2] = torch.randn(batch, out_lengths[2] + 7, dtype=torch.float64).to(
            grad_dtype)[:, 3:3 + out_lengths[2]]
        got = BACKWARD_OP(grads, *args)
        assert_same_list(got, permute_multi_embedding_backward_reference(grads, *args))


# --- the per-thread plan cache ----------------------------------------------------------


@needs_cpu_kernel
def test_a_plan_changed_in_place_is_checked_again():
    """The checked plan is reused only for the same values: writes that bump no version
    counter (through numpy) are seen, and bounds are checked again."""
    values = make_values(SMALL_LAYOUT, 4)
    permutes, in_shapes, out_shapes, out_lengths = plan_args(SMALL_LAYOUT)
    assert_same_list(OP(values, permutes, in_shapes, out_shapes, out_lengths),
                     permute_multi_embedding_reference(values, permutes, in_shapes, out_shapes,
                                                       out_lengths))
    rows = permutes.numpy()
    rows[0, 2] = 1000  # out of bounds, unseen by the version counter
    with pytest.raises(IndexError, match=r"permutes\[0\] reads columns \[1000"):
        OP(values, permutes, in_shapes, out_shapes, out_lengths)
    rows[0, 2] = 0
    rows[0, 4] = 0  # valid again, a different plan: an empty row
    assert_same_list(OP(values, permutes, in_shapes, out_shapes, out_lengths),
                     permute_multi_embedding_reference(values, permutes, in_shapes, out_shapes,
                                                       out_lengths))
    in_shapes.numpy()[0] += 1
    with pytest.raises(ValueError, match=r"in_shapes\[0\]"):
        OP(values, permutes, in_shapes, out_shapes, out_lengths)
    in_shapes.numpy()[0] -= 1
    wider = [torch.cat([values[0], values[0]], 1), values[1]]
    with pytest.raises(ValueError, match=r"in_shapes\[0\]"):
        OP(wider, permutes, in_shapes, out_shapes, out_lengths)


# --- the fused cast's backward ----------------------------------------------------------


@needs_cpu_kernel
@pytest.mark.parametrize("src, dst", [(s, d) for s in FLOAT_DTYPES for d in FLOAT_DTYPES
                                       if s != d], ids=str)
def test_fused_cast_backward_matches_reference_and_keeps_negative_zero(src, dst):
    layout = SMALL_LAYOUT
    values = make_values(layout, 5, src, requires_grad=True)
    args = plan_args(layout)
    outs = TO_OP(values, *args, dst)
    grads = random_grads(args[3], 5, dst, seed=1)
    for g in grads:
        g[:, ::2] = -0.0
    got = torch.autograd.grad(outs, values, grads)
    want = permute_multi_embedding_backward_reference(
        grads, *args[:3], get_plan(*layout).in_lengths, 5, src)
    assert_same_list(got, want)
    # 'd' (input 1, columns 1:4) is used once, at columns 127:130 of group 1: a copy,
    # whose -0.0 gradients stay -0.0 as in the plain path.
    assert torch.equal(torch.signbit(got[1][:, 1:4]), torch.signbit(grads[1][:, 127:130]))
    assert torch.signbit(got[1][:, 1:4]).any()
