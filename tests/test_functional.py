"""``kt_regroup.regroup`` / ``regroup_as_dict`` against torchrec's regroup functions."""

import pytest
import torch
from conftest import (
    DTYPES,
    SEEDS,
    SMALL_LAYOUT,
    assert_no_alias,
    assert_same_list,
    clone_all,
    dtype_ids,
    expected_regroup,
    keyed_tensors,
    make_values,
    random_layout,
    wiring_cells,
)
from torchrec.sparse.jagged_tensor import KeyedTensor, _regroup_keyed_tensors

import kt_regroup

LAYOUTS = {f"seed{s}": random_layout(s) for s in SEEDS}
LAYOUTS["small"] = SMALL_LAYOUT
LAYOUTS["wide"] = random_layout(42, n_inputs=6, keys_per_input=(2, 8), n_groups=5)



@pytest.mark.parametrize("name,dtype,batch,noncontiguous", wiring_cells(list(LAYOUTS)))
def test_regroup_matches_torchrec(name, dtype, batch, noncontiguous):
    layout = LAYOUTS[name]
    values = make_values(layout, batch, dtype, noncontiguous, seed=11)
    before = clone_all(values)
    kts = keyed_tensors(layout, values)
    ours = kt_regroup.regroup(kts, layout.groups)
    assert_same_list(ours, expected_regroup(values, layout))
    assert_same_list(ours, _regroup_keyed_tensors(kts, layout.groups))
    assert_same_list(ours, KeyedTensor.regroup(kts, layout.groups))
    assert_no_alias(ours, values)
    assert_same_list(values, before)


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_ids)
@pytest.mark.parametrize("name", ["small", "seed1", "wide"])
def test_regroup_as_dict_matches_torchrec(name, dtype):
    layout = LAYOUTS[name]
    kts = keyed_tensors(layout, make_values(layout, 3, dtype))
    names = [f"g{i}" for i in range(len(layout.groups))]
    ours = kt_regroup.regroup_as_dict(kts, layout.groups, names)
    theirs = KeyedTensor.regroup_as_dict(kts, layout.groups, names)
    assert list(ours) == list(theirs) == names
    for k in names:
        torch.testing.assert_close(ours[k], theirs[k], rtol=0, atol=0)


@pytest.mark.parametrize("name", ["small", "seed0", "seed3"])
def test_regroup_gradients_match_torchrec(name):
    layout = LAYOUTS[name]
    base = make_values(layout, 4, torch.float64)
    ours_in = [v.clone().requires_grad_() for v in base]
    theirs_in = [v.clone().requires_grad_() for v in base]
    ours = kt_regroup.regroup(keyed_tensors(layout, ours_in), layout.groups)
    theirs = _regroup_keyed_tensors(keyed_tensors(layout, theirs_in), layout.groups)
    grads = [torch.randn_like(t) for t in theirs]
    torch.autograd.backward(ours, grads)
    torch.autograd.backward(theirs, grads)
    for a, b in zip(ours_in, theirs_in):
        torch.testing.assert_close(a.grad, b.grad)


def test_regroup_gradcheck_float64():
    layout = LAYOUTS["seed2"]
    values = make_values(layout, 3, torch.float64, noncontiguous=True, requires_grad=True)

    def fn(*xs):
        return tuple(kt_regroup.regroup(keyed_tensors(layout, xs), layout.groups))

    assert torch.autograd.gradcheck(fn, tuple(values))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=dtype_ids)
def test_key_dim_zero_fallback_matches_torchrec(dtype):
    # Keys along dim 0 ([sum(widths), D]): the fused op does not apply; the fallback does.
    a = KeyedTensor(["a", "b"], [2, 3], torch.randn(5, 4, dtype=dtype), key_dim=0)
    b = KeyedTensor(["c"], [1], torch.randn(1, 4, dtype=dtype), key_dim=0)
    groups = [["c", "a"], ["b", "a"]]
    ours = kt_regroup.regroup([a, b], groups)
    theirs = _regroup_keyed_tensors([a, b], groups)
    assert_same_list(ours, theirs)
    assert_same_list(
        ours, [torch.cat([b.values(), a.values()[:2]]), torch.cat([a.values()[2:], a.values()[:2]])]
    )


def test_regroup_single_keyed_tensor_identity_group_is_a_copy():
    kt = KeyedTensor.from_tensor_list(["a", "b"], [torch.randn(3, 2), torch.randn(3, 5)])
    (out,) = kt_regroup.regroup([kt], [["a", "b"]])
    torch.testing.assert_close(out, kt.values(), rtol=0, atol=0)
    assert out.data_ptr() != kt.values().data_ptr()


class _UsesRegroup(torch.nn.Module):
    def forward(self, kts: list[KeyedTensor]) -> dict[str, torch.Tensor]:
        return kt_regroup.regroup_as_dict(kts, [["c", "a"], ["e"]], ["x", "y"])


def test_regroup_is_a_single_fx_node_and_traced_graph_is_right():
    from torchrec.fx import symbolic_trace

    gm = symbolic_trace(_UsesRegroup())
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert kt_regroup.regroup_as_dict in targets
    values = make_values(SMALL_LAYOUT, 3)
    kts = keyed_tensors(SMALL_LAYOUT, values)
    out = gm(kts)
    expected = KeyedTensor.regroup_as_dict(kts, [["c", "a"], ["e"]], ["x", "y"])
    for k in ("x", "y"):
        torch.testing.assert_close(out[k], expected[k], rtol=0, atol=0)


def test_regroup_torchscript():
    @torch.jit.script
    def scripted(kts: list[KeyedTensor], groups: list[list[str]]) -> list[torch.Tensor]:
        return kt_regroup.regroup(kts, groups)

    values = make_values(SMALL_LAYOUT, 2)
    kts = keyed_tensors(SMALL_LAYOUT, values)
    assert_same_list(scripted(kts, SMALL_LAYOUT.groups), expected_regroup(values, SMALL_LAYOUT))
