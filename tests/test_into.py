"""``permute_multi_embedding_into`` (caller-owned outputs): it accepts and refuses what
``copy_`` does (stride-0 outs, overlap by address through any Storage, leaves that require
grad), bumps version counters like an in-place op, and refuses rows that share memory."""

import numpy as np
import pytest
import torch
from torch.autograd import forward_ad as fwAD

OPS = torch.ops.kt_regroup


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
