"""Every bad input raises a clear error that names the culprit; nothing reads out of bounds.

Each bad-permutes case runs through the dispatched op. The checks live once, in the op
library; the fake kernels check only what output sizes need. The tests check the
exception type and that the message names the culprit (the row, the value).
"""


import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torchrec.sparse.jagged_tensor import KeyedTensor

import kt_regroup
from kt_regroup.plan import get_plan

I32 = torch.int32


def _meta(in_widths, out_widths):
    return torch.tensor(in_widths, dtype=I32), torch.tensor(out_widths, dtype=I32)


# --- layout errors (plan, functional, module) ----------------------------------------


def _kt(keys, widths, batch=2, dtype=torch.float32):
    return KeyedTensor(
        keys=keys, length_per_key=widths, values=torch.randn(batch, sum(widths), dtype=dtype)
    )


MISSING = r"group 1 asks for key 'zz'.*none of the 2 inputs.*looked in: input 0: \['a', 'b'\]; input 1: \['c'\]"


def test_missing_key_every_surface():
    # One builder (the library's op), one exception type: IndexError, as FBGEMM's ops.
    kts = [_kt(["a", "b"], [1, 2]), _kt(["c"], [3])]
    groups = [["a"], ["c", "zz"]]
    with pytest.raises(IndexError, match=MISSING):
        get_plan([["a", "b"], ["c"]], [[1, 2], [3]], groups)
    with pytest.raises(IndexError, match=MISSING):
        kt_regroup.KTRegroupAsDict(groups, ["x", "y"])(kts)
    with pytest.raises(IndexError, match=MISSING):
        kt_regroup.regroup(kts, groups)
    with pytest.raises(IndexError, match=MISSING):
        kt_regroup.regroup_as_dict(kts, groups, ["x", "y"])
    with pytest.raises(IndexError, match=MISSING):
        kt_regroup.regroup_keyed_tensor(
            [kt.values() for kt in kts], [["a", "b"], ["c"]], [[1, 2], [3]], groups
        )
    with pytest.raises(IndexError, match=MISSING):
        kt_regroup.kt_regroup_arguments(torch.empty(0), [["a", "b"], ["c"]], [[1, 2], [3]], groups)


def test_missing_key_preview_is_bounded_for_many_keys():
    keys = [f"k{i}" for i in range(1000)]
    with pytest.raises(IndexError, match=r"'nope'.*'k0', 'k1'.*\.\.\. \(1000 keys\)") as info:
        get_plan([keys], [[1] * 1000], [["nope"]])
    assert len(str(info.value)) < 400


def test_missing_key_in_key_dim_fallback():
    kt = KeyedTensor(keys=["a"], length_per_key=[2], values=torch.randn(2, 3), key_dim=0)
    with pytest.raises(IndexError, match=r"asks for key 'b'"):
        kt_regroup.regroup([kt], [["b"]])


def test_key_in_two_inputs_is_ambiguous():
    kts = [_kt(["a", "b"], [1, 2]), _kt(["c", "b"], [3, 2])]
    match = r"key 'b' appears in input 0 and input 1.*ambiguous"
    with pytest.raises(ValueError, match=match):
        get_plan([["a", "b"], ["c", "b"]], [[1, 2], [3, 2]], [["a"]])
    with pytest.raises(ValueError, match=match):
        kt_regroup.regroup(kts, [["a"]])
    with pytest.raises(ValueError, match=match):
        kt_regroup.KTRegroupAsDict([["a"]], ["x"])(kts)


def test_key_twice_in_one_input_is_ambiguous():
    with pytest.raises(ValueError, match=r"key 'a' appears in input 0 and input 0"):
        get_plan([["a", "a"]], [[1, 2]], [["a"]])


def test_non_string_key():
    # The op schema refuses it on every path, showing the offending value.
    match = r"(?s)List\[List\[str\]\]' for argument '(keys|groups)'.*7"
    kt = KeyedTensor(keys=["a", 7], length_per_key=[1, 2], values=torch.randn(2, 3))
    for call in (
        lambda: get_plan([["a"], ["b", 7]], [[1], [2, 3]], [["a"]]),
        lambda: get_plan([["a"]], [[1]], [["a", 7]]),
        lambda: kt_regroup.KTRegroupAsDict([["a"]], ["x"])([kt]),
        lambda: kt_regroup.regroup([kt], [["a"]]),
    ):
        with pytest.raises(RuntimeError, match=match):
            call()


def test_negative_width_in_layout():
    with pytest.raises(ValueError, match=r"key 'b' of input 0 has negative width -2"):
        get_plan([["a", "b"]], [[1, -2]], [["a"]])


def test_keys_lengths_mismatch():
    with pytest.raises(ValueError, match=r"input 0 has 2 keys but 1 lengths"):
        get_plan([["a", "b"]], [[1]], [["a"]])
    with pytest.raises(ValueError, match=r"keys for 2 tensors but lengths for 1"):
        get_plan([["a"], ["b"]], [[1]], [["a"]])
    with pytest.raises(ValueError, match=r"2 tensors but keys for 1"):
        kt_regroup.regroup_keyed_tensor(
            [torch.ones(2, 1), torch.ones(2, 1)], [["a"]], [[1]], [["a"]]
        )


def test_different_batch_sizes():
    kts = [_kt(["a"], [2], batch=4), _kt(["b"], [3], batch=3)]
    match = r"pooled_embs\[1\] has batch size 3 but pooled_embs\[0\] has 4"
    with pytest.raises(ValueError, match=match):
        kt_regroup.regroup(kts, [["a", "b"]])
    with pytest.raises(ValueError, match=match):
        kt_regroup.KTRegroupAsDict([["a", "b"]], ["x"])(kts)


def test_different_dtypes():
    # The ops take one dtype (regroup promotes, the fused cast casts: test_hardening.py).
    kts = [_kt(["a"], [2]), _kt(["b"], [3], dtype=torch.float64)]
    values = [kt.values() for kt in kts]
    match = r"pooled_embs\[1\] is (torch.float64|Double) but pooled_embs\[0\] is"
    with pytest.raises(TypeError, match=match):
        kt_regroup.regroup_keyed_tensor(values, [["a"], ["b"]], [[2], [3]], [["a", "b"]])
    with pytest.raises(TypeError, match=r"set emb_dtype"):
        kt_regroup.KTRegroupAsDict([["a", "b"]], ["x"])(kts)


def test_different_devices():
    a, b = torch.randn(2, 3), torch.randn(2, 3, device="meta")
    p = torch.tensor([[0, 0, 0, 0, 3, 0]], dtype=I32)
    i, o = _meta([3, 3], [3])
    with pytest.raises(ValueError, match=r"pooled_embs\[0\] is on cpu but .* meta; all must"):
        torch.ops.kt_regroup.permute_multi_embedding([a, b], p, i, o, [3])
    with pytest.raises(ValueError, match=r"pooled_embs\[1\] is on cpu but .* meta; all must"):
        torch.ops.kt_regroup.permute_multi_embedding([b, a], p, i, o, [3])


def test_metadata_on_meta_with_real_inputs_is_refused():
    # The Meta (fake) kernel would otherwise be chosen and return uninitialised memory.
    a = torch.randn(2, 3)
    p = torch.tensor([[0, 0, 0, 0, 3, 0]], dtype=I32)
    i, o = _meta([3], [3])
    with pytest.raises(ValueError, match=r"pooled_embs\[0\] is on cpu but .* meta"):
        torch.ops.kt_regroup.permute_multi_embedding([a], p.to("meta"), i, o, [3])
    with pytest.raises(ValueError, match=r"grad_outputs\[0\] is on cpu but .* meta"):
        torch.ops.kt_regroup.permute_multi_embedding_backward(
            [a], p.to("meta"), i, o, [3], 2, a.dtype
        )


def test_empty_input_list():
    with pytest.raises(ValueError, match=r"no input tensors given"):
        get_plan([], [], [["a"]])
    with pytest.raises(ValueError, match=r"kt_regroup.regroup: keyed_tensors is empty"):
        kt_regroup.regroup([], [["a"]])
    with pytest.raises(ValueError, match=r"KTRegroupAsDict: keyed_tensors is empty"):
        kt_regroup.KTRegroupAsDict([["a"]], ["x"])([])
    with pytest.raises(ValueError, match=r"no input tensors given"):
        kt_regroup.regroup_keyed_tensor([], [], [], [["a"]])
    p = torch.empty(0, 6, dtype=I32)
    with pytest.raises(ValueError, match=r"permute_multi_embedding: pooled_embs is empty"):
        torch.ops.kt_regroup.permute_multi_embedding([], p, *_meta([], []), [])


def test_module_groups_keys_mismatch():
    with pytest.raises(ValueError, match=r"2 groups but 1 keys"):
        kt_regroup.KTRegroupAsDict([["a"], ["b"]], ["x"])
    with pytest.raises(ValueError, match=r"regroup_as_dict: 1 groups but 2 keys"):
        kt_regroup.regroup_as_dict([_kt(["a"], [1])], [["a"]], ["x", "y"])


# --- bad permutes ---------------------------------------------------------------------

# Two inputs of widths 4 and 3, one output of width 5; a valid row is [0, 0, 0, 0, 4, 0].
# Each case: the bad row, the exception, what the message must name.
BAD_ROWS = [
    pytest.param([2, 0, 0, 0, 1, 0], IndexError, r"permutes\[1\] in_tensor=2 .*\[0, 2\)", id="in_tensor-high"),
    pytest.param([-1, 0, 0, 0, 1, 0], IndexError, r"permutes\[1\] in_tensor=-1 ", id="in_tensor-negative"),
    pytest.param([1, 1, 0, 0, 1, 0], IndexError, r"permutes\[1\] out_tensor=1 .*\[0, 1\)", id="out_tensor-high"),
    pytest.param([1, -3, 0, 0, 1, 0], IndexError, r"permutes\[1\] out_tensor=-3 ", id="out_tensor-negative"),
    pytest.param([1, 0, 0, 4, -1, 0], ValueError, r"permutes\[1\] .*negative length -1", id="negative-length"),
    pytest.param([1, 0, 2, 4, 2, 0], IndexError, r"permutes\[1\] reads columns \[2, 4\) of input 1, .*3 columns", id="read-past-width"),
    pytest.param([1, 0, -1, 4, 1, 0], IndexError, r"permutes\[1\] reads columns \[-1, 0\) of input 1", id="read-negative-offset"),
    pytest.param([1, 0, 0, 4, 2, 0], IndexError, r"permutes\[1\] writes columns \[4, 6\) of output 0, .*5 columns", id="write-past-width"),
    pytest.param([1, 0, 0, -1, 1, 0], IndexError, r"permutes\[1\] writes columns \[-1, 0\) of output 0", id="write-negative-offset"),
    pytest.param([1, 0, 0, 4, 2**30, 0], IndexError, r"permutes\[1\] reads columns \[0, 1073741824\)", id="huge-length"),
]


@pytest.mark.parametrize("row,error,match", BAD_ROWS)
def test_bad_permute_row(row, error, match):
    kernel = torch.ops.kt_regroup.permute_multi_embedding
    a, b = torch.randn(3, 4), torch.randn(3, 3)
    before = (a.clone(), b.clone())
    permutes = torch.tensor([[0, 0, 0, 0, 4, 0], row], dtype=I32)
    with pytest.raises(error, match=match):
        kernel([a, b], permutes, *_meta([4, 3], [5]), [5])
    assert torch.equal(a, before[0]) and torch.equal(b, before[1])


@pytest.mark.parametrize("row,error,match", BAD_ROWS)
def test_bad_permute_row_backward(row, error, match):
    g = torch.randn(3, 5)
    permutes = torch.tensor([[0, 0, 0, 0, 4, 0], row], dtype=I32)
    with pytest.raises(error, match=match):
        torch.ops.kt_regroup.permute_multi_embedding_backward(
            [g], permutes, *_meta([4, 3], [5]), [4, 3], 3, torch.float32
        )


def test_in_shapes_mismatch():
    kernel = torch.ops.kt_regroup.permute_multi_embedding
    a, b = torch.randn(3, 4), torch.randn(3, 3)
    p = torch.tensor([[0, 0, 0, 0, 4, 0]], dtype=I32)
    with pytest.raises(ValueError, match=r"in_shapes\[1\]=5 but pooled_embs.*3"):
        kernel([a, b], p, *_meta([4, 5], [4]), [4])
    with pytest.raises(
        ValueError, match=r"in_shapes must have one entry per input tensor \(2\), got shape \(3,\)"
    ):
        kernel([a, b], p, *_meta([4, 3, 1], [4]), [4])


def test_out_shapes_mismatch():
    kernel = torch.ops.kt_regroup.permute_multi_embedding
    a = torch.randn(3, 4)
    p = torch.tensor([[0, 0, 0, 0, 4, 0]], dtype=I32)
    with pytest.raises(ValueError, match=r"out_shapes\[0\]=5 but out_lengths\[0\]=4"):
        kernel([a], p, *_meta([4], [5]), [4])
    with pytest.raises(ValueError, match=r"out_shapes must have one entry per output \(1\)"):
        kernel([a], p, *_meta([4], [4, 4]), [4])
    with pytest.raises(ValueError, match=r"out_lengths\[0\] is negative \(-1\)"):
        kernel([a], p[:0], *_meta([4], [-1]), [-1])


def test_wrong_permutes_shape_or_dtype():
    kernel = torch.ops.kt_regroup.permute_multi_embedding
    a = torch.randn(3, 4)
    i, o = _meta([4], [4])
    with pytest.raises(ValueError, match=r"permutes must have shape \[n, 6\].*got \(1, 5\)"):
        kernel([a], torch.zeros(1, 5, dtype=I32), i, o, [4])
    with pytest.raises(ValueError, match=r"permutes must have shape \[n, 6\].*got \(6,\)"):
        kernel([a], torch.zeros(6, dtype=I32), i, o, [4])
    with pytest.raises(TypeError, match=r"permutes must be int32 or int64, got (torch.float32|Float)"):
        kernel([a], torch.zeros(1, 6), i, o, [4])
    with pytest.raises(TypeError, match=r"in_shapes must be int32 or int64, got (torch.float32|Float)"):
        kernel([a], torch.zeros(1, 6, dtype=I32), i.float(), o, [4])


def test_non_2d_input():
    kernel = torch.ops.kt_regroup.permute_multi_embedding
    p = torch.tensor([[0, 0, 0, 0, 4, 0]], dtype=I32)
    with pytest.raises(
        ValueError, match=r"pooled_embs\[0\] must be 2-D \[batch, width\], got shape \(3, 4, 1\)"
    ):
        kernel([torch.randn(3, 4, 1)], p, *_meta([4], [4]), [4])


def test_fake_kernel_checks_only_sizes_and_the_kernel_checks_the_rest():
    # Under FakeTensorMode (compile, export) outputs come from out_lengths; the metadata's
    # values exist only at run time, where the library's checks refuse them.
    with FakeTensorMode():
        bad = torch.empty(1, 5, dtype=I32)
        (out,) = torch.ops.kt_regroup.permute_multi_embedding(
            [torch.empty(3, 4)], bad, *_meta([4], [4]), [4]
        )
        assert out.shape == (3, 4)
        with pytest.raises(ValueError, match=r"permute_multi_embedding: pooled_embs is empty"):
            torch.ops.kt_regroup.permute_multi_embedding([], bad, *_meta([4], [4]), [4])
    with pytest.raises(ValueError, match=r"permutes must have shape \[n, 6\]"):
        torch.ops.kt_regroup.permute_multi_embedding(
            [torch.ones(3, 4)], torch.zeros(1, 5, dtype=I32), *_meta([4], [4]), [4]
        )


def test_backward_grad_shape_mismatch():
    p = torch.tensor([[0, 0, 0, 0, 4, 0]], dtype=I32)
    with pytest.raises(
        ValueError, match=r"grad_outputs\[0\] has shape \(3, 3\), expected \(3, 4\)"
    ):
        torch.ops.kt_regroup.permute_multi_embedding_backward(
            [torch.randn(3, 3)], p, *_meta([4], [4]), [4], 3, torch.float32
        )
    with pytest.raises(ValueError, match=r"in_shapes\[0\]=4 but in_lengths\[0\]=5"):
        torch.ops.kt_regroup.permute_multi_embedding_backward(
            [torch.randn(3, 4)], p, *_meta([4], [4]), [5], 3, torch.float32
        )


@pytest.mark.parametrize("warm", [False, True], ids=["cold", "warm"])
def test_float_widths_same_warm_and_cold(warm):
    """Whole-number float widths work as ints whether the plan exists or not; a fractional
    width is a TypeError naming its key, warm or cold (before: the schema's RuntimeError)."""
    values = torch.randn(4, 5)
    module = kt_regroup.KTRegroupAsDict([["a"], ["b"]], ["x", "y"])
    if warm:
        module([KeyedTensor(["a", "b"], [3, 2], values)])
    out = module([KeyedTensor(["a", "b"], [3.0, 2.0], values)])
    torch.testing.assert_close(out["x"], values[:, :3])
    torch.testing.assert_close(out["y"], values[:, 3:])
    with pytest.raises(TypeError, match=r"input 0 key 'b' has width 1\.5"):
        module([KeyedTensor(["a", "b"], [3, 1.5], values[:, :4])])
    with pytest.raises(TypeError, match=r"key 'a' has width 2\.5"):
        kt_regroup.regroup_as_dict([KeyedTensor(["a", "b"], [2.5, 2.5], values)], [["a"]], ["x"])


@pytest.mark.parametrize("width", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("warm", [False, True], ids=["cold", "warm"])
def test_non_finite_widths_name_the_key(warm, width):
    """NaN and inf widths get the library's message naming the key, as 2.5 does (before: a
    bare ValueError / OverflowError from int())."""
    values = torch.randn(4, 5)
    module = kt_regroup.KTRegroupAsDict([["a"], ["b"]], ["x", "y"])
    if warm:
        module([KeyedTensor(["a", "b"], [3, 2], values)])
    with pytest.raises(TypeError, match=r"input 0 key 'b' has width (nan|-?inf); widths must be integers"):
        module([KeyedTensor(["a", "b"], [3, width], values)])
    with pytest.raises(TypeError, match=r"kt_regroup.regroup: input 0 key 'b' has width"):
        kt_regroup.regroup([KeyedTensor(["a", "b"], [3, width], values)], [["a"]])


@pytest.mark.parametrize("where", ["keys", "groups"])
def test_a_key_that_is_not_utf8_is_named(where):
    """A lone surrogate cannot cross the schema: a ValueError naming the key (before: the
    schema's misleading "Expected a value of type 'List[List[str]]'")."""
    bad = "\ud800"
    keys, groups = (["a", bad], [["a"], [bad]]) if where == "keys" else (["a", "b"], [["a", bad]])
    kt = KeyedTensor(keys, [3, 2], torch.randn(4, 5))
    label = "input 0" if where == "keys" else "group 1" if len(groups) > 1 else "group 0"
    with pytest.raises(ValueError, match=rf"{label} has key '\\ud800', which is not valid UTF-8"):
        kt_regroup.KTRegroupAsDict(groups, [f"g{j}" for j in range(len(groups))])([kt])
    with pytest.raises(ValueError, match=rf"{label} has key '\\ud800', which is not valid UTF-8"):
        kt_regroup.regroup([kt], groups)


def test_a_missing_key_with_a_nul_byte_is_shown_whole():
    """Control bytes of a key are escaped in the message (before: cut at the NUL)."""
    kt = KeyedTensor(["a", "b"], [3, 2], torch.randn(4, 5))
    for call in (lambda: kt_regroup.regroup([kt], [["a", "zz\x00top"]]),
                 lambda: kt_regroup.KTRegroupAsDict([["zz\x00top\x1f"]], ["x"])([kt])):
        with pytest.raises(IndexError, match=r"asks for key 'zz\\x00top(\\x1f)?', which is in none"):
            call()


def _kt_key_dim(keys, widths, batch=3, key_dim=1):
    values = torch.randn(batch, sum(widths)) if key_dim == 1 else torch.randn(sum(widths), batch)
    return KeyedTensor(keys=keys, length_per_key=widths, values=values, key_dim=key_dim)


def test_mixed_key_dim_is_refused_everywhere():
    kts = [_kt_key_dim(["a"], [2]), _kt_key_dim(["b"], [3], key_dim=0)]
    match = r"same key_dim; input 1 has key_dim 0, input 0 has 1"
    with pytest.raises(ValueError, match=match):
        kt_regroup.regroup(kts, [["a", "b"]])
    with pytest.raises(ValueError, match=match):
        kt_regroup.KTRegroupAsDict([["a", "b"]], ["x"])(kts)
    # A module warmed on key_dim=1 inputs sees the change too.
    module = kt_regroup.KTRegroupAsDict([["a", "b"]], ["x"])
    module([_kt_key_dim(["a"], [2]), _kt_key_dim(["b"], [3])])
    with pytest.raises(ValueError, match=match):
        module(kts)


def test_careless_calls_get_clear_errors():
    module = kt_regroup.KTRegroupAsDict([["a"]], ["x"])
    kt = _kt_key_dim(["a", "b"], [1, 2])
    with pytest.raises(TypeError, match=r"list of KeyedTensors.*got dict"):
        module({"a": kt})
    with pytest.raises(TypeError, match=r"list of KeyedTensors.*got KeyedTensor"):
        module(kt)
    with pytest.raises(TypeError, match=r"keyed_tensors\[1\] is a Tensor"):
        module([kt, torch.ones(3, 1)])
    # The op schema refuses widths that are not ints, showing the value.
    with pytest.raises(RuntimeError, match=r"(?s)'List\[List\[int\]\]' for argument 'lengths'.*2\.7"):
        kt_regroup.get_plan([["a"]], [[2.7]], [["a"]])
    with pytest.raises(RuntimeError, match=r"(?s)'List\[List\[int\]\]' for argument 'lengths'.*'3'"):
        kt_regroup.get_plan([["a"]], [["3"]], [["a"]])
    p, i, o, _ = kt_regroup.kt_regroup_arguments(torch.empty(0), [["a"]], [[2]], [["a"]])
    backward = torch.ops.kt_regroup.permute_multi_embedding_backward
    with pytest.raises(ValueError, match=r"in_lengths\[0\] is negative \(-2\)"):
        backward([torch.ones(3, 2)], p, i, o, [-2], 3, torch.float32)
    with pytest.raises(ValueError, match=r"batch_size is negative \(-3\)"):
        backward([None], p, i, o, [2], -3, torch.float32)


# --- tensors that are not dense: sparse, mkldnn, quantized, nested (issue 35, item 3) ----


def _not_dense(kind: str, x: torch.Tensor) -> torch.Tensor:
    if kind == "sparse_coo":
        return x.to_sparse()
    if kind == "sparse_csr":
        return x.to_sparse_csr()
    if kind == "mkldnn":
        return x.to_mkldnn()
    if kind == "quantized":
        return torch.quantize_per_tensor(x, 0.1, 0, torch.quint8)
    if kind == "nested":
        return torch.nested.nested_tensor([x[0], x[1]])
    return torch.nested.nested_tensor([x[0], x[1, :2]], layout=torch.jagged)


NOT_DENSE = {
    "sparse_coo": r"has layout torch\.sparse_coo; pass a dense \(strided\) tensor",
    "sparse_csr": r"has layout torch\.sparse_csr; pass a dense \(strided\) tensor",
    "mkldnn": r"has layout torch\._mkldnn; pass a dense \(strided\) tensor",
    "quantized": r"is quantized \(QUInt8\); pass a dense tensor of a plain dtype",
    "nested": r"is a nested tensor; pass a dense \(strided\) tensor",
    "nested_jagged": r"is a nested tensor; pass a dense \(strided\) tensor",
}


def _calls(bad: torch.Tensor, x: torch.Tensor):
    """(op, culprit, call) for each place a tensor goes into the library's ops."""
    ops = torch.ops.kt_regroup
    p, i, o, n = ops.kt_regroup_arguments(x, [["a"]], [[3]], [["a"]])
    return [
        ("permute_multi_embedding", r"pooled_embs\[1\]",
         lambda: ops.permute_multi_embedding([x, bad], p, torch.tensor([3, 3], dtype=I32), o, n)),
        ("permute_multi_embedding_to", r"pooled_embs\[0\]",
         lambda: ops.permute_multi_embedding_to([bad], p, i, o, n, torch.float64)),
        ("permute_multi_embedding_into", r"outs\[0\]",
         lambda: ops.permute_multi_embedding_into([x], p, i, o, [bad])),
        ("permute_multi_embedding_backward", r"grad_outputs\[0\]",
         lambda: ops.permute_multi_embedding_backward([bad], p, i, o, [3], 4, torch.float32)),
        ("permute_multi_embedding_vbe", r"pooled_embs\[0\]",
         lambda: ops.permute_multi_embedding_vbe([bad], [None], p, i, o, n)),
        ("permute_multi_embedding_vbe", r"indices\[0\]",
         lambda: ops.permute_multi_embedding_vbe([x], [bad], p, i, o, n)),
        ("permute_multi_embedding_vbe_backward", r"grad_outputs\[0\]",
         lambda: ops.permute_multi_embedding_vbe_backward(
             [bad], [None], p, i, o, [3], [4], torch.float32)),
        # composite: nested inputs stop at its own kernel, the others at the permute it runs
        ("(regroup_keyed_tensor|permute_multi_embedding)", r"pooled_embs\[0\]",
         lambda: ops.regroup_keyed_tensor([bad], [["a"]], [[3]], [["a"]])),
        ("permute_multi_embedding", "permutes",
         lambda: ops.permute_multi_embedding([x], p.to_sparse(), i, o, n)),
    ]


@pytest.mark.filterwarnings("ignore::UserWarning")  # prototype / deprecated layouts
@pytest.mark.parametrize("inference", [False, True], ids=["grad", "inference_mode"])
@pytest.mark.parametrize("kind", list(NOT_DENSE))
def test_tensors_that_are_not_dense_are_named(kind, inference):
    """Each gets a TypeError of ours naming the argument, where ATen asserted or the
    dispatcher said no kernel exists (nested tensors, also under inference_mode, where
    autograd is skipped)."""
    x = torch.randn(4, 3)
    bad = _not_dense(kind, x)
    for op, culprit, call in _calls(bad, x):
        if culprit == "permutes" and kind != "sparse_coo":
            continue
        with torch.inference_mode(inference):
            with pytest.raises(TypeError, match=rf"^kt_regroup\.{op}: {culprit} {NOT_DENSE[kind]}"):
                call()


def test_outputs_past_any_memory_are_refused_before_allocation():
    """As torch.empty would say "Storage size calculation overflowed", but naming ours."""
    ops = torch.ops.kt_regroup
    x = torch.randn(4, 3)
    p = torch.tensor([[0, 0, 0, 0, 3, 0]], dtype=I32)
    i, o = _meta([3], [3])
    huge = torch.tensor([2**62], dtype=torch.int64)
    match = r"out_lengths\[0\] = 4611686018427387904 with a batch of 4 is more elements than"
    with pytest.raises(ValueError, match=rf"^kt_regroup\.permute_multi_embedding: {match}"):
        ops.permute_multi_embedding([x], p, i, huge, [2**62])
    with pytest.raises(ValueError, match=rf"^kt_regroup\.permute_multi_embedding_vbe: {match}"):
        ops.permute_multi_embedding_vbe([x], [None], p, i, huge, [2**62])
    match = r"in_lengths\[0\] = 4611686018427387904 with a batch of 2 is more elements than"
    with pytest.raises(ValueError, match=rf"^kt_regroup\.permute_multi_embedding_backward: {match}"):
        ops.permute_multi_embedding_backward([None], p, huge, o, [2**62], 2, torch.float32)
