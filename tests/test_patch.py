"""``kt_regroup.patch_torchrec()``: code written against torchrec's names runs on kt_regroup.

Each check computes the reference with torchrec unpatched (its own FBGEMM / ``torch.cat``
paths), then the same call under the patch, and asserts bit-equal results and that the
work went through ``torch.ops.kt_regroup`` (recorded by a ``TorchDispatchMode`` or read
from the captured graph; nothing is mocked). Covered: torchrec's ``KTRegroupAsDict``
(built after patching, and built before), ``KeyedTensor.regroup`` / ``regroup_as_dict``,
the ``jagged_tensor`` helpers, gradients, fx (torch's and torchrec's tracer), TorchScript,
``torch.compile``, ``torch.export``, and torchrec's quantized inference path.
"""

import logging
import sys
import types
from typing import Dict, List, Tuple

import pytest
import torch
import torchrec.modules.regroup as tr_regroup
import torchrec.sparse.jagged_tensor as tr_jagged
from conftest import (
    SMALL_LAYOUT,
    Layout,
    assert_same_list,
    keyed_tensors,
    make_values,
    needs_fbgemm,
)
from torch.utils._python_dispatch import TorchDispatchMode
from torchrec.sparse.jagged_tensor import KeyedTensor
from torchrec.types import DataType

import kt_regroup

pytestmark = needs_fbgemm  # the references are torchrec's own FBGEMM paths

# Every key used exactly once: torchrec's KeyedTensor.regroup takes its FBGEMM
# permute_pooled_embs path for this one, its torch.cat path for SMALL_LAYOUT.
ALL_ONCE = Layout(
    keys=[["a", "b"], ["c", "d", "e"]],
    lengths=[[3, 7], [1, 3, 127]],
    groups=[["c", "a"], ["e", "b", "d"]],
)
LAYOUTS = {"all-once": ALL_ONCE, "skips-and-duplicates": SMALL_LAYOUT}


def _names(groups: List[List[str]]) -> List[str]:
    return [f"g{i}" for i in range(len(groups))]


# Each entry point is looked up at call time, so the patched binding is the one called.
ENTRY_POINTS = {
    "KTRegroupAsDict": lambda kts, g: list(tr_regroup.KTRegroupAsDict(g, _names(g))(kts).values()),
    "KeyedTensor.regroup": lambda kts, g: KeyedTensor.regroup(kts, g),
    "KeyedTensor.regroup_as_dict": lambda kts, g: list(
        KeyedTensor.regroup_as_dict(kts, g, _names(g)).values()
    ),
    "_regroup_keyed_tensors": lambda kts, g: tr_jagged._regroup_keyed_tensors(kts, g),
    "permute_multi_embedding": lambda kts, g: tr_jagged.permute_multi_embedding(kts, g),
    "regroup_kts": lambda kts, g: tr_jagged.regroup_kts(kts, g),
    "_fbgemm_permute_pooled_embs": lambda kts, g: tr_jagged._fbgemm_permute_pooled_embs(kts, g),
}
ALL_ONCE_ONLY = {"_fbgemm_permute_pooled_embs"}  # FBGEMM's op needs each key once


class OpRecorder(TorchDispatchMode):
    """Records the namespace of every op that reaches the dispatcher."""

    def __init__(self) -> None:
        super().__init__()
        self.names: List[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(func.name())
        return func(*args, **(kwargs or {}))

    def assert_fused(self) -> None:
        assert any(n.startswith("kt_regroup::") for n in self.names), self.names
        assert not any(_is_fbgemm_regroup(n) for n in self.names), self.names


def _is_fbgemm_regroup(name: str) -> bool:
    # FBGEMM's permute/regroup ops (its embedding lookups are not ours to replace).
    return name.startswith("fbgemm") and ("permute" in name or "regroup" in name)


def _graph_targets(gm: torch.fx.GraphModule) -> List[str]:
    """``kt_regroup.permute_multi_embedding[.default]`` for ops, ``module.name`` for functions."""
    out = []
    for node in gm.graph.nodes:
        if node.op == "call_function":
            t = node.target
            is_op = isinstance(t, (torch._ops.OpOverload, torch._ops.OpOverloadPacket))
            out.append(str(t) if is_op else f"{t.__module__}.{t.__name__}")
    return out


def _assert_graph_fused(targets: List[str]) -> None:
    assert any(t.startswith("kt_regroup.permute_multi_embedding") for t in targets), targets
    assert not any(_is_fbgemm_regroup(t) for t in targets), targets


@pytest.fixture(autouse=True)
def _never_leak_the_patch():
    yield
    kt_regroup.unpatch_torchrec()


def _originals() -> Dict[str, object]:
    return {
        "KTRegroupAsDict": tr_regroup.KTRegroupAsDict,
        "_regroup_keyed_tensors": tr_jagged._regroup_keyed_tensors,
        "permute_multi_embedding": tr_jagged.permute_multi_embedding,
        "regroup_kts": tr_jagged.regroup_kts,
        "_fbgemm_permute_pooled_embs": tr_jagged._fbgemm_permute_pooled_embs,
        "jagged._kt_regroup_arguments": tr_jagged._kt_regroup_arguments,
        "regroup._kt_regroup_arguments": tr_regroup._kt_regroup_arguments,
        "KeyedTensor.regroup": KeyedTensor.__dict__["regroup"],
        "KeyedTensor.regroup_as_dict": KeyedTensor.__dict__["regroup_as_dict"],
    }


# --- mechanics -----------------------------------------------------------------------------


def test_patch_rebinds_every_name_is_idempotent_and_unpatch_restores_the_originals():
    before = _originals()
    kt_regroup.patch_torchrec()
    kt_regroup.patch_torchrec()  # idempotent
    assert tr_regroup.KTRegroupAsDict is kt_regroup.KTRegroupAsDict
    for name in (
        "_regroup_keyed_tensors",
        "permute_multi_embedding",
        "regroup_kts",
        "_fbgemm_permute_pooled_embs",
    ):
        new = getattr(tr_jagged, name)
        assert new is kt_regroup.patch._MODULE_LEVEL[name][1], name
        assert new.__module__ == "kt_regroup.patch" and new.__name__ == name, name
    assert tr_jagged._kt_regroup_arguments is kt_regroup.patch._kt_regroup_arguments
    assert tr_regroup._kt_regroup_arguments is kt_regroup.patch._kt_regroup_arguments
    patched = _originals()
    for name in ("KeyedTensor.regroup", "KeyedTensor.regroup_as_dict"):
        assert patched[name] is not before[name], name
    kt_regroup.unpatch_torchrec()
    kt_regroup.unpatch_torchrec()  # idempotent
    after = _originals()
    for name, original in before.items():
        assert after[name] is original, name


def test_context_manager_undoes_its_patch_even_on_error_and_nesting_keeps_the_outer():
    original = tr_regroup.KTRegroupAsDict
    with pytest.raises(RuntimeError, match="boom"):
        with kt_regroup.patch_torchrec():
            assert tr_regroup.KTRegroupAsDict is kt_regroup.KTRegroupAsDict
            raise RuntimeError("boom")
    assert tr_regroup.KTRegroupAsDict is original
    with kt_regroup.patch_torchrec():
        with kt_regroup.patch_torchrec():
            pass
        assert tr_regroup.KTRegroupAsDict is kt_regroup.KTRegroupAsDict  # outer still active
    assert tr_regroup.KTRegroupAsDict is original


def test_a_plain_patch_made_inside_a_with_block_outlives_the_block():
    """A block gives back only its own hold (before: its exit undid the plain call too)."""
    original = tr_regroup.KTRegroupAsDict
    try:
        with kt_regroup.patch_torchrec():
            kt_regroup.patch_torchrec()
        assert tr_regroup.KTRegroupAsDict is kt_regroup.KTRegroupAsDict
        with kt_regroup.patch_torchrec():  # a block inside the plain patch leaves it on
            pass
        assert tr_regroup.KTRegroupAsDict is kt_regroup.KTRegroupAsDict
    finally:
        kt_regroup.unpatch_torchrec()
    assert tr_regroup.KTRegroupAsDict is original
    # A block whose patch unpatch_torchrec() ended gives back nothing at its exit.
    with kt_regroup.patch_torchrec():
        kt_regroup.unpatch_torchrec()
        assert tr_regroup.KTRegroupAsDict is original
        kt_regroup.patch_torchrec()
    assert tr_regroup.KTRegroupAsDict is kt_regroup.KTRegroupAsDict
    kt_regroup.unpatch_torchrec()
    assert tr_regroup.KTRegroupAsDict is original


def test_only_torchrec_modules_are_rebound_including_ones_imported_while_patched(monkeypatch):
    original = tr_regroup.KTRegroupAsDict
    # Stand-ins for modules that did `from torchrec.modules.regroup import KTRegroupAsDict`.
    early = types.ModuleType("torchrec._kt_regroup_test_early")
    early.KTRegroupAsDict = original
    user = types.ModuleType("kt_regroup_test_user_model")
    user.KTRegroupAsDict = original
    # torchrec.ir's serializer rebuilds torchrec's own class by this name and checks the
    # type: rebinding it broke the IR round trip of modules built before the patch.
    ir = types.ModuleType("torchrec.ir._kt_regroup_test_serializer")
    ir.KTRegroupAsDict = original
    for m in (early, user, ir):
        monkeypatch.setitem(sys.modules, m.__name__, m)
    with kt_regroup.patch_torchrec():
        assert early.KTRegroupAsDict is kt_regroup.KTRegroupAsDict
        assert user.KTRegroupAsDict is original  # documented: not a torchrec module
        assert ir.KTRegroupAsDict is original
        late = types.ModuleType("torchrec._kt_regroup_test_late")
        late.KTRegroupAsDict = tr_regroup.KTRegroupAsDict  # imported while patched
        monkeypatch.setitem(sys.modules, late.__name__, late)
    assert early.KTRegroupAsDict is original
    assert late.KTRegroupAsDict is original


def test_patch_and_unpatch_log_what_they_change(caplog):
    with caplog.at_level(logging.INFO, logger="kt_regroup.patch"):
        with kt_regroup.patch_torchrec():
            pass
    text = caplog.text
    assert "torchrec.modules.regroup.KTRegroupAsDict -> kt_regroup.module.KTRegroupAsDict" in text
    assert "torchrec.sparse.jagged_tensor.KeyedTensor.regroup -> kt_regroup" in text
    assert (
        "torchrec.sparse.jagged_tensor._regroup_keyed_tensors -> kt_regroup.patch._regroup_keyed_tensors"
        in text
    )
    assert "restored torchrec.modules.regroup.KTRegroupAsDict" in text


# --- eager: bit-equal to torchrec, computed by kt_regroup -----------------------------------


def _eager_cells() -> list:
    """Every entry point on every layout it takes, each with one of the (dtype, batch)
    pairs in turn: the patch's wiring, not the kernel (test_cpu_kernel has the grids)."""
    pairs = [(d, b) for b in (1, 5) for d in (torch.float32, torch.float16, torch.bfloat16)]
    cells = [(e, n) for e in ENTRY_POINTS for n in LAYOUTS
             if e not in ALL_ONCE_ONLY or n == "all-once"]
    return [pytest.param(e, n, *pairs[i % len(pairs)], id=f"{e}-{n}-{pairs[i % len(pairs)][0]}"
                         f"-b{pairs[i % len(pairs)][1]}") for i, (e, n) in enumerate(cells)]


@pytest.mark.parametrize("entry,layout_name,dtype,batch", _eager_cells())
def test_eager_equals_torchrec_and_runs_on_kt_regroup(entry, layout_name, dtype, batch):
    layout = LAYOUTS[layout_name]
    values = make_values(layout, batch, dtype=dtype, seed=batch)
    call = ENTRY_POINTS[entry]
    expected = call(keyed_tensors(layout, values), layout.groups)
    with kt_regroup.patch_torchrec(), OpRecorder() as rec:
        got = call(keyed_tensors(layout, values), layout.groups)
    rec.assert_fused()
    assert_same_list(got, expected)


def test_kt_regroup_arguments_equal_torchrec_rows():
    values = make_values(SMALL_LAYOUT, 2)
    args = (values[0], SMALL_LAYOUT.keys, SMALL_LAYOUT.lengths, SMALL_LAYOUT.groups)
    expected = tr_jagged._kt_regroup_arguments(*args)
    with kt_regroup.patch_torchrec(), OpRecorder() as rec:
        got = tr_jagged._kt_regroup_arguments(*args)
    assert "kt_regroup::kt_regroup_arguments" in rec.names
    for g, e in zip(got[:3], expected[:3]):
        assert torch.equal(g, e) and g.dtype == e.dtype
    assert list(got[3]) == list(expected[3])


def test_module_built_before_patching_stays_torchrecs_and_one_built_after_is_ours():
    layout = SMALL_LAYOUT
    before = tr_regroup.KTRegroupAsDict(layout.groups, _names(layout.groups))
    values = make_values(layout, 4)
    expected = before(keyed_tensors(layout, values))
    with kt_regroup.patch_torchrec():
        got = before(keyed_tensors(layout, values))
        after = tr_regroup.KTRegroupAsDict(layout.groups, _names(layout.groups))
        with OpRecorder() as rec:
            got_after = after(keyed_tensors(layout, values))
    assert type(before) is not kt_regroup.KTRegroupAsDict  # objects are not swapped
    assert type(after) is kt_regroup.KTRegroupAsDict
    rec.assert_fused()
    assert_same_list(list(got.values()), list(expected.values()))
    assert_same_list(list(got_after.values()), list(expected.values()))


@pytest.mark.parametrize("data_type", [DataType.FP16, DataType.BF16], ids=str)
def test_emb_dtype_cast_equals_torchrec(data_type):
    layout = SMALL_LAYOUT
    values = make_values(layout, 3)
    expected = tr_regroup.KTRegroupAsDict(
        layout.groups, _names(layout.groups), emb_dtype=data_type
    )(keyed_tensors(layout, values))
    with kt_regroup.patch_torchrec():
        m = tr_regroup.KTRegroupAsDict(layout.groups, _names(layout.groups), emb_dtype=data_type)
        got = m(keyed_tensors(layout, values))
    assert_same_list(list(got.values()), list(expected.values()))


def test_key_dim_zero_equals_torchrec():
    # KeyedTensors keyed along dim 0 (torchrec's torch.cat path; kt_regroup's fallback).
    kts = [
        KeyedTensor(["a", "b"], [2, 3], torch.randn(5, 4), key_dim=0),
        KeyedTensor(["c"], [4], torch.randn(4, 4), key_dim=0),
    ]
    groups = [["c", "a"], ["b", "a"]]
    expected = [
        KeyedTensor.regroup(kts, groups),
        tr_regroup.KTRegroupAsDict(groups, ["x", "y"])(kts),
    ]
    with kt_regroup.patch_torchrec():
        got = [
            KeyedTensor.regroup(kts, groups),
            tr_regroup.KTRegroupAsDict(groups, ["x", "y"])(kts),
        ]
    assert_same_list(got[0], expected[0])
    assert_same_list(list(got[1].values()), list(expected[1].values()))


# --- gradients ----------------------------------------------------------------------------------


@pytest.mark.parametrize("entry", ["KTRegroupAsDict", "KeyedTensor.regroup", "regroup_kts"])
def test_gradients_equal_torchrec_and_unused_keys_get_exact_zeros(entry):
    layout = SMALL_LAYOUT  # 'b' unused, 'c' three times
    call = ENTRY_POINTS[entry]
    values = make_values(layout, 6, requires_grad=True)
    # Small integers as upstream gradients: every accumulation order sums them exactly.
    gen = torch.Generator().manual_seed(3)
    width = {k: w for ks, ws in zip(layout.keys, layout.lengths) for k, w in zip(ks, ws)}
    upstream = [
        torch.randint(-8, 9, (6, sum(width[k] for k in g)), generator=gen).float()
        for g in layout.groups
    ]
    # torchrec's torch.cat path: autograd accumulates duplicates, unused keys get zeros.
    outs = tr_jagged._regroup_keyed_tensors(keyed_tensors(layout, values), layout.groups)
    expected = torch.autograd.grad(outs, values, upstream)
    with kt_regroup.patch_torchrec(), OpRecorder() as rec:
        outs = call(keyed_tensors(layout, values), layout.groups)
        got = torch.autograd.grad(outs, values, upstream)
    rec.assert_fused()
    assert "kt_regroup::permute_multi_embedding_backward" in rec.names
    assert_same_list(got, expected)
    unused = got[0][:, 3:10]  # key 'b'
    assert torch.equal(unused, torch.zeros_like(unused))


# --- fx, TorchScript, compile, export ----------------------------------------------------------


class _TorchrecStyleModel(torch.nn.Module):
    """Written against torchrec's names only."""

    def __init__(self, groups: List[List[str]]) -> None:
        super().__init__()
        self.groups = groups
        self.regroup = tr_regroup.KTRegroupAsDict(groups, _names(groups))

    def forward(
        self, kts: List[KeyedTensor]
    ) -> Tuple[Dict[str, torch.Tensor], List[torch.Tensor], Dict[str, torch.Tensor]]:
        by_module = self.regroup(kts)
        by_method = KeyedTensor.regroup(kts, self.groups)
        as_dict = KeyedTensor.regroup_as_dict(kts, self.groups, _names(self.groups))
        return by_module, by_method, as_dict


def _flat(outputs) -> List[torch.Tensor]:
    by_module, by_method, as_dict = outputs
    return list(by_module.values()) + list(by_method) + list(as_dict.values())


class _FromTensors(torch.nn.Module):
    """torch.export / compile entry: builds the KeyedTensors from plain tensors."""

    def __init__(self, layout: Layout) -> None:
        super().__init__()
        self.layout = layout
        self.inner = _TorchrecStyleModel(layout.groups)

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> List[torch.Tensor]:
        return _flat(self.inner(keyed_tensors(self.layout, [a, b])))


def _torchrec_reference(layout: Layout, values) -> List[torch.Tensor]:
    # Unpatched torchrec: the three regroups of _TorchrecStyleModel.
    kts = keyed_tensors(layout, values)
    one = KeyedTensor.regroup(kts, layout.groups)
    return one * 3


def _tracers():
    from torchrec.fx import symbolic_trace as torchrec_trace

    return [
        pytest.param(torch.fx.symbolic_trace, id="torch.fx"),
        pytest.param(torchrec_trace, id="torchrec.fx"),
    ]


@pytest.mark.parametrize("tracer", _tracers())
def test_fx_trace_and_script_of_a_torchrec_style_model(tracer):
    layout = SMALL_LAYOUT
    with kt_regroup.patch_torchrec():
        model = _TorchrecStyleModel(layout.groups)
        model(keyed_tensors(layout, make_values(layout, 2)))  # builds the module's plan
        gm = tracer(model)
        scripted = torch.jit.script(gm)
    targets = _graph_targets(gm)
    # KeyedTensor's methods are single calls to kt_regroup's functions, as torchrec's are.
    assert "kt_regroup.functional.regroup" in targets, targets
    assert "kt_regroup.functional.regroup_as_dict" in targets, targets
    assert not any("_all_keys_used_once" in t for t in targets), targets
    for batch in (1, 7):
        values = make_values(layout, batch, seed=batch)
        expected = _torchrec_reference(layout, values)  # unpatched again here
        with OpRecorder() as rec:
            traced_out = gm(keyed_tensors(layout, values))
        rec.assert_fused()
        assert_same_list(_flat(traced_out), expected)
        assert_same_list(_flat(scripted(keyed_tensors(layout, values))), expected)


class _ScriptedCalls(torch.nn.Module):
    def forward(self, kts: List[KeyedTensor], groups: List[List[str]]) -> List[torch.Tensor]:
        out = KeyedTensor.regroup(kts, groups)
        out += list(KeyedTensor.regroup_as_dict(kts, groups, ["x", "y", "z"]).values())
        out += tr_jagged.regroup_kts(kts, groups)
        out += tr_jagged.permute_multi_embedding(kts, groups)
        return out


def test_torchscript_of_torchrec_calls():
    layout = SMALL_LAYOUT
    with kt_regroup.patch_torchrec():
        calls = torch.jit.script(_ScriptedCalls())
    values = make_values(layout, 5)
    expected = KeyedTensor.regroup(keyed_tensors(layout, values), layout.groups)
    with OpRecorder() as rec:
        got = calls(keyed_tensors(layout, values), layout.groups)
    rec.assert_fused()
    assert_same_list(got, expected * 4)


def test_torch_compile_fullgraph_forward_and_backward():
    layout = SMALL_LAYOUT
    graphs: List[torch.fx.GraphModule] = []

    def recording_backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    with kt_regroup.patch_torchrec():
        model = _FromTensors(layout)
        compiled = torch.compile(model, backend=recording_backend, fullgraph=True)
        values = make_values(layout, 5, requires_grad=True)
        got = compiled(*values)
        grads = torch.autograd.grad(sum(o.sum() for o in got), values)
    _assert_graph_fused([t for g in graphs for t in _graph_targets(g)])
    assert_same_list(got, _torchrec_reference(layout, values))
    assert torch.equal(grads[0][:, 3:10], torch.zeros(5, 7))  # unused key 'b'


@pytest.mark.parametrize("strict", [True, False], ids=["strict", "non-strict"])
def test_torch_export_with_dynamic_batch(strict):
    layout = SMALL_LAYOUT
    batch = torch.export.Dim("batch")
    with kt_regroup.patch_torchrec():
        model = _FromTensors(layout)
        ep = torch.export.export(
            model,
            tuple(make_values(layout, 4)),
            dynamic_shapes=({0: batch}, {0: batch}),
            strict=strict,
        )
    _assert_graph_fused(_graph_targets(ep.graph_module))
    for n in (1, 9):
        values = make_values(layout, n, seed=n)
        assert_same_list(ep.module()(*values), _torchrec_reference(layout, values))


# --- torchrec's inference path: quantized EBC -> KTRegroupAsDict -------------------------------


def _quantized_model():
    from torchrec.inference.modules import quantize_inference_model
    from torchrec.modules.embedding_configs import EmbeddingBagConfig
    from torchrec.modules.embedding_modules import EmbeddingBagCollection
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ebc = EmbeddingBagCollection(
                tables=[
                    EmbeddingBagConfig(
                        name=f"t{i}",
                        embedding_dim=4 * (i + 1),
                        num_embeddings=10,
                        feature_names=[f"f{i}"],
                    )
                    for i in range(4)
                ],
                device=torch.device("cpu"),
            )
            self.regroup = tr_regroup.KTRegroupAsDict(
                [["f2", "f0"], ["f1", "f2"]], ["user", "item"]
            )
            self.over = torch.nn.Linear(12 + 4 + 8 + 12, 1)

        def forward(self, features: KeyedJaggedTensor) -> torch.Tensor:
            groups = self.regroup([self.ebc(features)])
            return self.over(torch.cat([groups["user"], groups["item"]], dim=1))

    torch.manual_seed(0)
    return quantize_inference_model(Model().eval())


def _features(seed: int):
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, 3, (4 * 6,), generator=gen)
    values = torch.randint(0, 10, (int(lengths.sum()),), generator=gen)
    return KeyedJaggedTensor.from_lengths_sync(
        keys=["f0", "f1", "f2", "f3"], values=values, lengths=lengths
    )


def test_quantized_inference_model_equals_torchrec_eager_traced_and_scripted():
    from torchrec.fx import symbolic_trace

    with torch.inference_mode():
        expected = _quantized_model()(_features(1))
        with kt_regroup.patch_torchrec():
            model = _quantized_model()
            assert isinstance(model.regroup, kt_regroup.KTRegroupAsDict)
            with OpRecorder() as rec:
                got = model(_features(1))
            gm = symbolic_trace(model)
            scripted = torch.jit.script(gm)
    rec.assert_fused()
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    with torch.inference_mode():
        torch.testing.assert_close(gm(_features(1)), expected, rtol=0, atol=0)
        torch.testing.assert_close(scripted(_features(1)), expected, rtol=0, atol=0)


def test_every_replacement_keeps_torchrecs_signature_by_torchrecs_own_check():
    # torchrec's API-compatibility tests (schema/api_tests, not in the wheel) run this
    # checker on its public names; here it runs on every name patch_torchrec() replaces.
    import inspect

    from torchrec.schema.utils import is_signature_compatible

    from kt_regroup import patch

    pairs = []
    for name, (_, new) in patch._MODULE_LEVEL.items():
        old = patch._ORIGINALS[name]
        if isinstance(old, type):
            pairs += [(f"{name}.{m}", getattr(old, m), getattr(new, m)) for m in ("__init__", "forward")]
        else:
            pairs.append((name, old, new))
    for (cls, name, new), old in zip(patch._CLASS_LEVEL, patch._CLASS_ORIGINALS):
        pairs.append((f"{cls.__name__}.{name}", getattr(old, "__func__", old),
                      getattr(new, "__func__", new)))
    # 5 functions, KTRegroupAsDict (2 methods), 2 KeyedTensor methods, EBC.forward, the
    # sharded EBC's variable-batch awaitable's _wait_impl
    assert len(pairs) == 11
    for name, old, new in pairs:
        before, after = inspect.signature(old), inspect.signature(new)
        assert is_signature_compatible(before, after), f"{name}: {before} -> {after}"
        # The parameters torchrec has keep its names, in order (keyword callers).
        assert list(after.parameters)[: len(before.parameters)] == list(before.parameters), name
