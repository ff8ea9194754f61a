"""``kt_regroup.KTRegroupAsDict``: torchrec parity, caching, staleness, fx/TorchScript,
``torch.compile`` and ``torch.export``."""

import logging
import random
import sys
import threading

import pytest
import torch
from conftest import (
    FBGEMM_DTYPES,
    SEEDS,
    SMALL_LAYOUT,
    Layout,
    assert_no_alias,
    assert_same_list,
    clone_all,
    expected_regroup,
    group_names,
    keyed_tensors,
    make_values,
    needs_fbgemm,
    random_layout,
    wiring_cells,
)
from torchrec.modules.regroup import KTRegroupAsDict as TorchrecKTRegroupAsDict
from torchrec.sparse.jagged_tensor import KeyedTensor
from torchrec.types import DataType

import kt_regroup
from kt_regroup import KTRegroupAsDict

LAYOUTS = {f"seed{s}": random_layout(s) for s in SEEDS}
LAYOUTS["small"] = SMALL_LAYOUT



def _check_dict(out: dict[str, torch.Tensor], values, layout, dtype=None):
    names = group_names(layout)
    assert list(out) == names
    expected = expected_regroup(values, layout)
    if dtype is not None:
        expected = [e.to(dtype) for e in expected]
    assert_same_list([out[n] for n in names], expected)


# A layout whose widths / key order differ from SMALL_LAYOUT's but that has the same keys.
WIDER = Layout(SMALL_LAYOUT.keys, [[3, 1], [7, 3, 127]], SMALL_LAYOUT.groups)
REORDERED = Layout([["b", "a"], ["e", "c", "d"]], [[7, 3], [127, 1, 3]], SMALL_LAYOUT.groups)


# --- parity -----------------------------------------------------------------------------


@pytest.mark.parametrize("name,dtype,batch,noncontiguous", wiring_cells(list(LAYOUTS)))
def test_module_parity(name, dtype, batch, noncontiguous):
    layout = LAYOUTS[name]
    values = make_values(layout, batch, dtype, noncontiguous, seed=5)
    before = clone_all(values)
    m = KTRegroupAsDict(layout.groups, group_names(layout))
    for _ in range(2):  # first call builds the plan, second uses the cache
        out = m(keyed_tensors(layout, values))
        _check_dict(out, values, layout)
        assert_no_alias(list(out.values()), values)
    assert_same_list(values, before)


@needs_fbgemm
@pytest.mark.parametrize("name,dtype,batch,noncontiguous", wiring_cells(list(LAYOUTS), FBGEMM_DTYPES))
def test_module_matches_torchrec_module(name, dtype, batch, noncontiguous):
    layout = LAYOUTS[name]
    values = make_values(layout, batch, dtype, noncontiguous, seed=6)
    ours = KTRegroupAsDict(layout.groups, group_names(layout))
    theirs = TorchrecKTRegroupAsDict(layout.groups, group_names(layout))
    for _ in range(2):
        a = ours(keyed_tensors(layout, values))
        b = theirs(keyed_tensors(layout, values))
        assert list(a) == list(b)
        assert_same_list(list(a.values()), list(b.values()))


def test_module_gradients_match_torchrec_module_on_used_keys_and_are_zero_elsewhere():
    layout = SMALL_LAYOUT
    base = make_values(layout, 4)
    xs = [v.clone().requires_grad_() for v in base]
    ys = [v.clone().requires_grad_() for v in base]
    a = KTRegroupAsDict(layout.groups, group_names(layout))(keyed_tensors(layout, xs))
    b = TorchrecKTRegroupAsDict(layout.groups, group_names(layout))(keyed_tensors(layout, ys))
    grads = {k: torch.randn_like(v) for k, v in a.items()}
    torch.autograd.backward([a[k] for k in grads], [grads[k] for k in grads])
    torch.autograd.backward([b[k] for k in grads], [grads[k] for k in grads])
    # key 'b' (input 0, columns 3:10) is unused: FBGEMM leaves it undefined, ours is 0.
    torch.testing.assert_close(xs[0].grad[:, :3], ys[0].grad[:, :3])
    torch.testing.assert_close(xs[1].grad, ys[1].grad)
    assert torch.equal(xs[0].grad[:, 3:], torch.zeros(4, 7))


def test_state_dict_is_empty_and_buffers_non_persistent():
    m = KTRegroupAsDict(SMALL_LAYOUT.groups, group_names(SMALL_LAYOUT))
    assert m.state_dict() == {}
    m(keyed_tensors(SMALL_LAYOUT, make_values(SMALL_LAYOUT, 2)))
    assert m.state_dict() == {}
    assert len(list(m.buffers())) == 3  # the cached plan is there, just not saved
    assert list(m.parameters()) == []
    # Loading an (empty) checkpoint into a fresh module works strictly.
    KTRegroupAsDict(SMALL_LAYOUT.groups, group_names(SMALL_LAYOUT)).load_state_dict(
        m.state_dict(), strict=True
    )


# --- emb_dtype, key_dim, devices, cache ---------------------------------------------------


@needs_fbgemm
def test_emb_dtype_torchrec_datatype_matches_torchrec():
    layout = SMALL_LAYOUT
    values = make_values(layout, 3)
    ours = KTRegroupAsDict(layout.groups, group_names(layout), emb_dtype=DataType.FP16)
    theirs = TorchrecKTRegroupAsDict(layout.groups, group_names(layout), emb_dtype=DataType.FP16)
    a = ours(keyed_tensors(layout, values))
    b = theirs(keyed_tensors(layout, values))
    assert all(t.dtype == torch.float16 for t in a.values())
    assert_same_list(list(a.values()), list(b.values()))
    _check_dict(a, values, layout, dtype=torch.float16)


@pytest.mark.parametrize("emb_dtype", [torch.bfloat16, torch.float64, DataType.FP32], ids=str)
def test_emb_dtype(emb_dtype):
    layout = LAYOUTS["seed1"]
    values = make_values(layout, 3)
    want = {DataType.FP32: torch.float32}.get(emb_dtype, emb_dtype)
    out = KTRegroupAsDict(layout.groups, group_names(layout), emb_dtype=emb_dtype)(
        keyed_tensors(layout, values)
    )
    assert all(t.dtype == want for t in out.values())
    _check_dict(out, values, layout, dtype=want)


def test_key_dim_zero_falls_back_and_matches_torchrec():
    a = KeyedTensor(["a", "b"], [2, 3], torch.randn(5, 4), key_dim=0)
    b = KeyedTensor(["c"], [1], torch.randn(1, 4), key_dim=0)
    groups = [["c", "a"], ["b", "a"]]
    m = KTRegroupAsDict(groups, ["x", "y"])
    out = m([a, b])
    assert torch.equal(out["x"], torch.cat([b.values(), a.values()[:2]]))
    assert torch.equal(out["y"], torch.cat([a.values()[2:], a.values()[:2]]))
    expected = KeyedTensor.regroup_as_dict([a, b], groups, ["x", "y"])
    for k in ("x", "y"):
        assert torch.equal(out[k], expected[k])
    # and back to key_dim=1 on the same module: the plan is rebuilt, still right
    layout = Layout([["a", "b"], ["c"]], [[2, 3], [1]], groups)
    values = make_values(layout, 4)
    out = m(keyed_tensors(layout, values))
    assert_same_list([out["x"], out["y"]], expected_regroup(values, layout))


def test_clear_cache_rebuilds():
    layout = SMALL_LAYOUT
    m = KTRegroupAsDict(layout.groups, group_names(layout))
    assert not m._is_inited  # torchrec's attribute name, read by its tools
    v1 = make_values(layout, 2)
    _check_dict(m(keyed_tensors(layout, v1)), v1, layout)
    assert m._is_inited
    m.clear_cache()
    assert m._plan.in_keys == [] and not m._is_inited
    v2 = make_values(WIDER, 3)
    _check_dict(m(keyed_tensors(WIDER, v2)), v2, WIDER)
    assert m._plan.in_lengths == WIDER.lengths


def test_set_device_moves_the_cached_plan():
    layout = SMALL_LAYOUT
    m = KTRegroupAsDict(layout.groups, group_names(layout))
    m(keyed_tensors(layout, make_values(layout, 2)))
    m.set_device("meta")
    assert {b.device.type for b in m.buffers()} == {"meta"}
    # Inputs on that device now use the moved plan (meta: shapes only).
    meta_values = [torch.empty(6, w, device="meta") for w in layout.in_widths]
    out = m(keyed_tensors(layout, meta_values))
    assert [tuple(t.shape) for t in out.values()] == [(6, 5), (6, 133), (6, 1)]
    assert all(t.device.type == "meta" for t in out.values())
    m.set_device("meta")  # moving again is harmless
    # meta holds no data to move back: clear_cache() makes the next call rebuild it.
    m.clear_cache()
    values = make_values(layout, 3)
    _check_dict(m(keyed_tensors(layout, values)), values, layout)
    assert {b.device.type for b in m.buffers()} == {"cpu"}
    m.set_device("cpu")
    _check_dict(m(keyed_tensors(layout, values)), values, layout)


def test_multi_device_moves_the_plan_to_the_inputs():
    layout = SMALL_LAYOUT
    m = KTRegroupAsDict(layout.groups, group_names(layout), multi_device=True)
    values = make_values(layout, 2)
    _check_dict(m(keyed_tensors(layout, values)), values, layout)
    meta_values = [torch.empty(6, w, device="meta") for w in layout.in_widths]
    out = m(keyed_tensors(layout, meta_values))
    assert [tuple(t.shape) for t in out.values()] == [(6, 5), (6, 133), (6, 1)]
    assert {b.device.type for b in m.buffers()} == {"cpu"}


# --- staleness ------------------------------------------------------------------------------


@pytest.mark.parametrize("new_layout", [WIDER, REORDERED], ids=["widths", "key-order"])
def test_stale_layout_is_rebuilt_in_eager(new_layout, caplog):
    m = KTRegroupAsDict(SMALL_LAYOUT.groups, group_names(SMALL_LAYOUT))
    v1 = make_values(SMALL_LAYOUT, 3)
    _check_dict(m(keyed_tensors(SMALL_LAYOUT, v1)), v1, SMALL_LAYOUT)
    with caplog.at_level(logging.WARNING, logger="kt_regroup.module"):
        for seed in range(3):
            v2 = make_values(new_layout, 3, seed=seed)
            _check_dict(m(keyed_tensors(new_layout, v2)), v2, new_layout)
            _check_dict(m(keyed_tensors(SMALL_LAYOUT, v1)), v1, SMALL_LAYOUT)
    warnings = [r for r in caplog.records if "rebuilding" in r.getMessage()]
    assert len(warnings) == 1  # once per module


def test_stale_fewer_inputs_is_rebuilt():
    m = KTRegroupAsDict([["a"], ["c"]], ["x", "y"])
    layout2 = Layout([["a", "b"], ["c"]], [[2, 3], [4]], [["a"], ["c"]])
    layout1 = Layout([["a", "b", "c"]], [[2, 3, 4]], [["a"], ["c"]])
    for layout in (layout2, layout1, layout2):
        values = make_values(layout, 2)
        out = m(keyed_tensors(layout, values))
        assert_same_list([out["x"], out["y"]], expected_regroup(values, layout))


# --- fx / TorchScript ----------------------------------------------------------------------


def _tracers():
    from torchrec.fx import symbolic_trace as torchrec_trace

    return [
        pytest.param(torch.fx.symbolic_trace, id="torch.fx"),
        pytest.param(torchrec_trace, id="torchrec.fx"),
    ]


def _assert_graph_calls_regroup(gm):
    # The traced graph must do the regroup, not pass its inputs through.
    names = {
        getattr(n.target, "__name__", str(n.target))
        for n in gm.graph.nodes
        if n.op == "call_function"
    }
    assert "regroup_with_plan" in names, names


@pytest.mark.parametrize("warm", [False, True], ids=["before-first-forward", "after-first-forward"])
@pytest.mark.parametrize("tracer", _tracers())
def test_fx_trace_computes_the_regroup(tracer, warm):
    layout = SMALL_LAYOUT
    m = KTRegroupAsDict(layout.groups, group_names(layout))
    v0 = make_values(layout, 2, seed=1)
    if warm:
        m(keyed_tensors(layout, v0))
    gm = tracer(m)
    _assert_graph_calls_regroup(gm)
    for batch in (0, 1, 5):
        values = make_values(layout, batch, seed=batch)
        _check_dict(gm(keyed_tensors(layout, values)), values, layout)
    # Stale layout in the traced graph: the captured plan is bypassed, answer still right.
    for new in (WIDER, REORDERED):
        values = make_values(new, 3)
        _check_dict(gm(keyed_tensors(new, values)), values, new)


@pytest.mark.parametrize("warm", [False, True], ids=["before-first-forward", "after-first-forward"])
def test_jit_script_of_traced_module(warm):
    layout = SMALL_LAYOUT
    m = KTRegroupAsDict(layout.groups, group_names(layout), emb_dtype=torch.float64 if warm else None)
    if warm:
        m(keyed_tensors(layout, make_values(layout, 2)))
    scripted = torch.jit.script(torch.fx.symbolic_trace(m))
    want = torch.float64 if warm else None
    for lay in (layout, WIDER, REORDERED):
        values = make_values(lay, 4)
        _check_dict(scripted(keyed_tensors(lay, values)), values, lay, dtype=want)


def test_jit_script_of_module_itself():
    layout = SMALL_LAYOUT
    scripted = torch.jit.script(KTRegroupAsDict(layout.groups, group_names(layout)))
    for lay in (layout, WIDER, REORDERED):
        values = make_values(lay, 3)
        _check_dict(scripted(keyed_tensors(lay, values)), values, lay)


def test_jit_script_of_warm_module_and_key_dim_fallback():
    layout = SMALL_LAYOUT
    m = KTRegroupAsDict([["c", "a"]], ["x"])
    m(keyed_tensors(layout, make_values(layout, 2)))
    scripted = torch.jit.script(torch.fx.symbolic_trace(m))
    a = KeyedTensor(["a", "b"], [2, 3], torch.randn(5, 4), key_dim=0)
    c = KeyedTensor(["c"], [1], torch.randn(1, 4), key_dim=0)
    out = scripted([a, c])
    assert torch.equal(out["x"], torch.cat([c.values(), a.values()[:2]]))


class _Model(torch.nn.Module):
    """KTRegroupAsDict between two dense layers: the shape of a DLRM over-arch input."""

    def __init__(self, layout, regroup_cls=KTRegroupAsDict):
        super().__init__()
        self.layout = layout
        self.regroup = regroup_cls(layout.groups, group_names(layout))
        self.proj = torch.nn.ModuleList(
            [torch.nn.Linear(_width(layout, grp), 4) for grp in layout.groups]
        )

    def forward(self, kts: list[KeyedTensor]) -> torch.Tensor:
        groups = self.regroup(kts)
        return torch.stack([p(groups[f"g{i}"]) for i, p in enumerate(self.proj)]).sum(0)


def _width(layout, group):
    w = {k: n for ks, ns in zip(layout.keys, layout.lengths) for k, n in zip(ks, ns)}
    return sum(w[k] for k in group)


# --- torch.compile / torch.export --------------------------------------------------------------


def test_torch_compile_fullgraph_forward_backward_matches_eager():
    torch._dynamo.reset()
    layout = LAYOUTS["seed0"]
    torch.manual_seed(0)
    model = _Model(layout)
    compiled = torch.compile(model, fullgraph=True)
    for batch in (4, 7):  # second batch size: a dynamic-shape recompile must stay right
        base = make_values(layout, batch, seed=batch)
        xs = [v.clone().requires_grad_() for v in base]
        ys = [v.clone().requires_grad_() for v in base]
        model.zero_grad()
        eager = model(keyed_tensors(layout, xs))
        eager.square().sum().backward()
        eager_param_grads = [p.grad.clone() for p in model.parameters()]
        model.zero_grad()
        comp = compiled(keyed_tensors(layout, ys))
        comp.square().sum().backward()
        torch.testing.assert_close(comp, eager)
        for x, y in zip(xs, ys):
            torch.testing.assert_close(y.grad, x.grad)
        for p, g in zip(model.parameters(), eager_param_grads):
            torch.testing.assert_close(p.grad, g)
    # Unused key gradients are exact zeros in the compiled backward too.
    used = layout.used_keys()
    for t, (ks, ns) in enumerate(zip(layout.keys, layout.lengths)):
        off = 0
        for k, n in zip(ks, ns):
            if k not in used:
                assert torch.equal(ys[t].grad[:, off : off + n], torch.zeros(7, n)), k
            off += n


def test_torch_compile_module_stale_layout_recompiles_right():
    torch._dynamo.reset()
    layout = SMALL_LAYOUT
    m = KTRegroupAsDict(layout.groups, group_names(layout))
    compiled = torch.compile(m, fullgraph=True)
    for lay in (layout, WIDER, layout):
        values = make_values(lay, 3)
        _check_dict(compiled(keyed_tensors(lay, values)), values, lay)


@pytest.mark.parametrize("allow_views", [False, True])
def test_torch_compile_cold_module_never_recompiles(allow_views):
    # Compiled before its first forward: the graph holds a plan of its own and the module
    # state (which dynamo guards) stays as it was, so later calls do not recompile.
    torch._dynamo.reset()
    layout = SMALL_LAYOUT
    m = KTRegroupAsDict(layout.groups, group_names(layout), allow_views=allow_views)

    def f(kts):
        return m(kts)

    compiled = torch.compile(f, fullgraph=True, dynamic=True)
    with torch._dynamo.config.patch(error_on_recompile=True):
        for batch in (3, 5, 8):
            values = make_values(layout, batch, seed=batch)
            _check_dict(compiled(keyed_tensors(layout, values)), values, layout)
    assert m._plan.in_keys == []


class _ExportWrapper(torch.nn.Module):
    """torch.export cannot flatten KeyedTensor inputs: build them inside forward."""

    def __init__(self, layout):
        super().__init__()
        self.layout = layout
        self.model = _Model(layout)

    def forward(self, values: list[torch.Tensor]) -> torch.Tensor:
        kts = [
            KeyedTensor(keys=k, length_per_key=n, values=v)
            for k, n, v in zip(self.layout.keys, self.layout.lengths, values)
        ]
        return self.model(kts)


@pytest.mark.parametrize("warm", [False, True], ids=["before-first-forward", "after-first-forward"])
def test_torch_export_with_dynamic_batch(warm):
    layout = LAYOUTS["seed1"]
    torch.manual_seed(0)
    model = _ExportWrapper(layout)
    example = make_values(layout, 4)
    if warm:
        model(example)
    batch = torch.export.Dim("batch")
    ep = torch.export.export(model, (example,), dynamic_shapes=([{0: batch}] * len(example),))
    ops = {str(n.target) for n in ep.graph.nodes if n.op == "call_function"}
    assert "kt_regroup.permute_multi_embedding.default" in ops
    for b in (2, 9):
        values = make_values(layout, b, seed=b)
        torch.testing.assert_close(ep.module()(values), model(values))
    # the eager module was not left holding fake tensors
    regroup = model.model.regroup
    assert not any(type(t).__name__.startswith("Fake") for t in [*regroup._plan[3:6], *regroup.buffers()])


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
def test_module_under_no_grad_and_inference_mode(mode):
    layout = LAYOUTS["seed2"]
    m = KTRegroupAsDict(layout.groups, group_names(layout))
    ctx = torch.no_grad if mode == "no_grad" else torch.inference_mode
    for batch in (3, 0):
        values = make_values(layout, batch)
        with ctx():
            out = m(keyed_tensors(layout, values))
        _check_dict(out, values, layout)
    # the plan built under inference mode still serves a training step afterwards
    xs = [v.requires_grad_() for v in make_values(layout, 2)]
    out = m(keyed_tensors(layout, xs))
    sum((t * (i + 1)).sum() for i, t in enumerate(out.values())).backward()
    # same gradients as a module that never saw inference mode
    ys = [v.detach().clone().requires_grad_() for v in xs]
    fresh = KTRegroupAsDict(layout.groups, group_names(layout))(keyed_tensors(layout, ys))
    sum((t * (i + 1)).sum() for i, t in enumerate(fresh.values())).backward()
    for x, y in zip(xs, ys):
        torch.testing.assert_close(x.grad, y.grad, rtol=0, atol=0)


def test_module_backward_with_empty_batch():
    layout = SMALL_LAYOUT
    xs = make_values(layout, 0, requires_grad=True)
    out = KTRegroupAsDict(layout.groups, group_names(layout))(keyed_tensors(layout, xs))
    sum(t.sum() for t in out.values()).backward()
    assert [tuple(x.grad.shape) for x in xs] == [(0, 10), (0, 131)]


def _view_layout_inputs(batch=4, requires_grad=False):
    # "dense" is input 0 whole, in order; "tail" and "last" are contiguous runs of input 1;
    # "mixed" needs a copy
    dense = torch.randn(batch, 2 + 3, requires_grad=requires_grad)
    sparse = torch.randn(batch, 7 + 1 + 4, requires_grad=requires_grad)
    kts = [
        KeyedTensor(["d0", "d1"], [2, 3], dense),
        KeyedTensor(["s0", "s1", "s2"], [7, 1, 4], sparse),
    ]
    groups = [["d0", "d1"], ["s1", "s2"], ["s0", "d1", "s1"], ["s2"]]
    return kts, groups, ["dense", "tail", "mixed", "last"]


def test_allow_views_returns_views_only_for_contiguous_runs():
    kts, groups, names = _view_layout_inputs()
    dense, sparse = kts[0].values(), kts[1].values()
    out = KTRegroupAsDict(groups, names, allow_views=True)(kts)
    expected = TorchrecKTRegroupAsDict(groups, names)(kts)
    for name in names:
        torch.testing.assert_close(out[name], expected[name], rtol=0, atol=0)
    # views share the inputs' storage at the right offsets; the rest are fresh
    assert out["dense"].data_ptr() == dense.data_ptr()
    assert out["tail"].data_ptr() == sparse.data_ptr() + 7 * sparse.element_size()
    assert out["mixed"].untyped_storage().data_ptr() not in (
        dense.untyped_storage().data_ptr(),
        sparse.untyped_storage().data_ptr(),
    )
    # off by default: the same layout comes back as copies
    default = KTRegroupAsDict(groups, names)(kts)
    assert_no_alias(list(default.values()), [dense, sparse])


def test_allow_views_gradients_match_copies():
    kts, groups, names = _view_layout_inputs(requires_grad=True)
    xs = [kt.values() for kt in kts]
    ys = [x.detach().clone().requires_grad_() for x in xs]
    kts_copy = [KeyedTensor(kt.keys(), kt.length_per_key(), y) for kt, y in zip(kts, ys)]
    weights = {n: float(i + 1) for i, n in enumerate(names)}
    out = KTRegroupAsDict(groups, names, allow_views=True)(kts)
    sum(weights[n] * t.sum() for n, t in out.items()).backward()
    ref = KTRegroupAsDict(groups, names)(kts_copy)
    sum(weights[n] * t.sum() for n, t in ref.items()).backward()
    for x, y in zip(xs, ys):
        torch.testing.assert_close(x.grad, y.grad, rtol=0, atol=0)


def test_allow_views_in_traced_scripted_and_compiled_graphs():
    kts, groups, names = _view_layout_inputs()
    m = KTRegroupAsDict(groups, names, allow_views=True)
    eager = m(kts)
    traced = torch.fx.symbolic_trace(m)
    scripted = torch.jit.script(traced)
    compiled = torch.compile(m, fullgraph=True)
    for run in (traced, scripted, compiled):
        got = run(kts)
        for name in names:
            torch.testing.assert_close(got[name], eager[name], rtol=0, atol=0)
    # the graph keeps the views
    assert traced(kts)["dense"].data_ptr() == kts[0].values().data_ptr()
    # a changed layout in a captured graph still gives the right (copied) answer
    swapped = [kts[1], kts[0]]
    want = TorchrecKTRegroupAsDict(groups, names)(swapped)
    got = scripted(swapped)
    for name in names:
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=0)


def test_allow_views_with_emb_dtype_casts_every_group():
    kts, groups, names = _view_layout_inputs()
    out = KTRegroupAsDict(groups, names, emb_dtype=torch.float64, allow_views=True)(kts)
    ref = KTRegroupAsDict(groups, names)(kts)
    for name in names:
        assert out[name].dtype == torch.float64
        torch.testing.assert_close(out[name], ref[name].double(), rtol=0, atol=0)


def test_allow_views_with_an_empty_group_and_only_view_groups():
    kts, _, _ = _view_layout_inputs()
    groups, names = [["d0", "d1"], [], ["s0", "s1", "s2"]], ["dense", "none", "sparse"]
    out = KTRegroupAsDict(groups, names, allow_views=True)(kts)  # nothing left to copy
    assert out["dense"].data_ptr() == kts[0].values().data_ptr()
    assert out["sparse"].data_ptr() == kts[1].values().data_ptr()
    assert out["none"].shape == (4, 0)
    torch.testing.assert_close(out["sparse"], kts[1].values(), rtol=0, atol=0)


def _modes(layout):
    """The warm module in every mode it runs in: eager, fx, TorchScript, torch.compile."""
    def make():
        m = KTRegroupAsDict(layout.groups, group_names(layout))
        m(keyed_tensors(layout, make_values(layout, 2)))  # the plan of `layout`
        return m

    return {
        "eager": make(),
        "fx": torch.fx.symbolic_trace(make()),
        "torchscript": torch.jit.script(torch.fx.symbolic_trace(make())),
        "compile": torch.compile(make(), backend="aot_eager"),
    }


def test_a_changed_layout_gives_the_same_results_and_errors_in_every_mode():
    layout = SMALL_LAYOUT
    for mode, m in _modes(layout).items():
        for lay in (WIDER, REORDERED, layout):
            values = make_values(lay, 3, seed=len(lay.keys[0]))
            _check_dict(m(keyed_tensors(lay, values)), values, lay)
        # TorchScript raises errors as RuntimeErrors (torch.jit.Error), with the same
        # message (its dtypes print as numbers).
        script = mode == "torchscript"
        # Mixed dtypes without emb_dtype: one TypeError, naming emb_dtype, in every mode,
        # for the plan's layout and for a changed one.
        for lay in (layout, WIDER):
            values = make_values(lay, 3)
            values[1] = values[1].double()
            with pytest.raises(torch.jit.Error if script else TypeError,
                               match=r"KTRegroupAsDict: input 1 is .* set emb_dtype"):
                m(keyed_tensors(lay, values))
        # A key no input has: the library's IndexError in every mode.
        missing = Layout([["zz", "b"], layout.keys[1]], layout.lengths, layout.groups)
        with pytest.raises(RuntimeError if script else IndexError,
                           match=r"group 0 asks for key 'a'"):
            m(keyed_tensors(missing, make_values(missing, 2)))


@pytest.mark.parametrize("convert", ["type", "double"])
def test_type_conversions_of_the_module_keep_the_plan(convert):
    """``model.type(torch.float64)`` casts every buffer, the plan's integer ones too; the
    plan is rebuilt from its host copy (before: every call raised "permutes must be int32
    or int64, got Double" until clear_cache())."""
    module = KTRegroupAsDict(groups=[["b"], ["a", "b"]], keys=["x", "y"])
    values = torch.randn(4, 5)
    module([KeyedTensor(["a", "b"], [3, 2], values)])
    if convert == "type":
        module.type(torch.float64)
    else:
        module.double()
    values = values.double()
    out = module([KeyedTensor(["a", "b"], [3, 2], values)])
    assert module._permutes.dtype == module._plan.permutes.dtype == torch.int32
    torch.testing.assert_close(out["x"], values[:, 3:], rtol=0, atol=0)
    torch.testing.assert_close(out["y"], values, rtol=0, atol=0)


KEYS = ["a", "b", "c", "d", "e", "f"]


WIDTHS = {"a": 64, "b": 128, "c": 32, "d": 96, "e": 128, "f": 64}


GROUPS = [["c", "a", "f"], ["e", "b", "a", "d"]]


def _layout(order):
    return Layout([list(order[:3]), list(order[3:])], [[WIDTHS[k] for k in order[:3]],
                  [WIDTHS[k] for k in order[3:]]], GROUPS)


def test_one_module_many_threads_different_key_orders():
    # 8 threads share one module; each has its own key order (so the plan is rebuilt
    # under the others' feet) and batch size; rows are wide enough (~2 KiB) and batches
    # large enough for the CPU kernel's parallel path. Every output must be right.
    # A short switch interval makes threads interleave between any two bytecodes.
    module = kt_regroup.KTRegroupAsDict(GROUPS, ["x", "y"])
    orders = [random.Random(t).sample(KEYS, len(KEYS)) for t in range(8)]
    inputs = []
    for t in range(8):
        layout = _layout(orders[t])
        batches = [64 + 131 * t + 300 * (i % 4) for i in range(4)]  # up to ~1.1k rows
        values = [make_values(layout, b, seed=t * 10 + i) for i, b in enumerate(batches)]
        inputs.append([(keyed_tensors(layout, v), expected_regroup(v, layout)) for v in values])
    failures: list = []
    start = threading.Barrier(8)
    threads_before, interval = torch.get_num_threads(), sys.getswitchinterval()
    torch.set_num_threads(4)
    sys.setswitchinterval(1e-6)

    def work(t: int) -> None:
        start.wait()
        for i in range(150):
            kts, expected = inputs[t][i % 4]
            try:
                out = list(module(kts).values())
            except Exception as exc:  # noqa: BLE001  (an exception is a failure too)
                failures.append((t, i, repr(exc)[:200]))
                continue
            if not all(torch.equal(g, e) for g, e in zip(out, expected)):
                failures.append((t, i, "wrong values"))

    try:
        threads = [threading.Thread(target=work, args=(t,)) for t in range(8)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
    finally:
        torch.set_num_threads(threads_before)
        sys.setswitchinterval(interval)
    assert failures == []


def test_tuple_keys_reuse_the_plan(caplog):
    module = kt_regroup.KTRegroupAsDict([["b", "a"]], ["x"])
    values = torch.randn(4, 5)
    kt = KeyedTensor(keys=("a", "b"), length_per_key=(2, 3), values=values)
    with caplog.at_level(logging.WARNING, logger="kt_regroup.module"):
        first = module([kt])["x"]
        plan = module._plan
        for _ in range(3):
            again = module([kt])["x"]
            assert module._plan is plan  # not rebuilt
    assert "changed" not in caplog.text
    assert torch.equal(first, again)
    assert torch.equal(first, torch.cat([values[:, 2:], values[:, :2]], 1))


def test_module_moved_to_meta_and_back_with_to_empty():
    # A plan built on meta (meta init), then the module materialised with to_empty():
    # the plan's buffers would hold garbage; the module must still regroup right.
    layout = Layout([["a", "b"], ["c"]], [[3, 7], [5]], [["c", "a"], ["b"]])
    module = kt_regroup.KTRegroupAsDict(layout.groups, ["x", "y"])
    meta_values = [torch.empty(2, w, device="meta") for w in layout.in_widths]
    out = module(keyed_tensors(layout, meta_values))
    assert out["x"].device.type == "meta"
    values = make_values(layout, 4)
    assert_same_list(list(module(keyed_tensors(layout, values)).values()),
                     expected_regroup(values, layout))
    module.to("meta")
    module.to_empty(device="cpu")
    assert_same_list(list(module(keyed_tensors(layout, values)).values()),
                     expected_regroup(values, layout))


def _mixed_inputs(batch=5):
    dense = KeyedTensor(keys=["d0", "d1"], length_per_key=[3, 4],
                        values=torch.randn(batch, 7, dtype=torch.float64).float())
    fp16 = KeyedTensor(keys=["s0", "s1"], length_per_key=[8, 2],
                       values=torch.randn(batch, 10, dtype=torch.float64).half())
    bf16 = KeyedTensor(keys=["s2"], length_per_key=[6],
                       values=torch.randn(batch, 6, dtype=torch.float64).bfloat16())
    return [dense, fp16, bf16]


MIXED_GROUPS = [["s1", "d0", "s2", "s1"], ["d1", "s0"]]


def _mixed_expected(kts, dtype):
    blocks = {k: v.to(dtype) for kt in kts for k, v in kt.to_dict().items()}
    return [torch.cat([blocks[k] for k in g], 1) for g in MIXED_GROUPS]


@pytest.mark.parametrize("emb_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_module_with_emb_dtype_casts_mixed_inputs_in_the_copy(emb_dtype):
    from torchrec.modules.embedding_configs import dtype_to_data_type
    from torchrec.modules.regroup import KTRegroupAsDict as TorchrecKTRegroupAsDict

    kts = _mixed_inputs()
    ours = kt_regroup.KTRegroupAsDict(MIXED_GROUPS, ["x", "y"], emb_dtype=emb_dtype)(kts)
    theirs = TorchrecKTRegroupAsDict(
        MIXED_GROUPS, ["x", "y"], emb_dtype=dtype_to_data_type(emb_dtype)
    )(kts)
    assert_same_list(list(ours.values()), _mixed_expected(kts, emb_dtype))
    assert_same_list(list(ours.values()), list(theirs.values()))


def test_mixed_inputs_gradients_come_back_in_each_inputs_dtype():
    kts = _mixed_inputs()
    leaves = [kt.values().detach().requires_grad_() for kt in kts]
    kts = [KeyedTensor(kt.keys(), kt.length_per_key(), v) for kt, v in zip(kts, leaves)]
    out = kt_regroup.KTRegroupAsDict(MIXED_GROUPS, ["x", "y"], emb_dtype=torch.float32)(kts)
    (out["x"].sum() + 2 * out["y"].sum()).backward()
    assert [v.grad.dtype for v in leaves] == [torch.float32, torch.float16, torch.bfloat16]
    # s1 (fp16 input 1, columns 8:10) is used twice in group x; s0 once in y (weight 2).
    assert torch.equal(leaves[1].grad[:, 8:], torch.full((5, 2), 2.0, dtype=torch.float16))
    assert torch.equal(leaves[1].grad[:, :8], torch.full((5, 8), 2.0, dtype=torch.float16))


def test_mixed_inputs_without_emb_dtype():
    kts = _mixed_inputs()
    # torchrec's KeyedTensor.regroup promotes (torch.cat): so does kt_regroup.regroup.
    promoted = KeyedTensor.regroup(kts, MIXED_GROUPS)
    ours = kt_regroup.regroup(kts, MIXED_GROUPS)
    assert [o.dtype for o in ours] == [torch.float32, torch.float32]
    assert_same_list(ours, promoted)
    # torchrec's module refuses them (a dtype error from FBGEMM): ours says what to do.
    with pytest.raises(TypeError, match=r"set emb_dtype"):
        kt_regroup.KTRegroupAsDict(MIXED_GROUPS, ["x", "y"])(kts)


def test_mixed_inputs_through_fx_script_and_export():
    import torchrec.fx

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.regroup = kt_regroup.KTRegroupAsDict(MIXED_GROUPS, ["x", "y"], emb_dtype=torch.float32)

        def forward(self, dense: torch.Tensor, fp16: torch.Tensor, bf16: torch.Tensor):
            kts = [
                KeyedTensor(keys=["d0", "d1"], length_per_key=[3, 4], values=dense),
                KeyedTensor(keys=["s0", "s1"], length_per_key=[8, 2], values=fp16),
                KeyedTensor(keys=["s2"], length_per_key=[6], values=bf16),
            ]
            out = self.regroup(kts)
            return out["x"], out["y"]

    kts = _mixed_inputs(batch=6)
    args = tuple(kt.values() for kt in kts)
    model = Model()
    expected = _mixed_expected(kts, torch.float32)
    assert_same_list(list(model(*args)), expected)
    scripted = torch.jit.script(torchrec.fx.symbolic_trace(model))
    assert_same_list(list(scripted(*args)), expected)
    batch = torch.export.Dim("batch", min=1, max=1024)
    program = torch.export.export(model, args, dynamic_shapes=({0: batch},) * 3)
    assert_same_list(list(program.module()(*args)), expected)
