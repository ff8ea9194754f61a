"""The Triton kernels inside compiled and exported graphs (``kernels/triton.py``:
``register_graph_rules`` and the triton_ops).

Without a GPU: a separate process (the kernels compiled, not interpreted) traces the ops
on fake CUDA tensors the way AOTAutograd does (``FunctionalTensorMode``), with Triton's
driver replaced by one that names an sm_90 target, so Triton's and Inductor's own
analysis of the kernels runs: the graph must hold the two Triton kernels and no call of
the op, clone nothing but what the kernels write, and nothing at all once Inductor's
reinplacing pass has run. CPU tensors, a dtype the kernels
do not take and ``torch.export`` keep the library's op; a compiled CPU training step
still calls the library's forward and backward ops.

With CUDA (tests named ``*cuda*``, selected by ``-k cuda``): ``torch.compile`` of a training
step and an AOTInductor package of an inference model contain the kernels, equal eager,
and the package runs in a fresh process that loads only torch and the op library, with at
most 3 kernel launches per call.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import kt_regroup

pytest.importorskip("triton", reason="triton is not installed")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KERNELS = ["_permute_kernel", "_zero_unwritten_kernel"]

_TRACE_SCRIPT = textwrap.dedent(
    """
    import json, sys, torch, triton
    from triton.backends.compiler import GPUTarget


    class CompileOnlyDriver:
        # Triton's active driver where there is no GPU: a CUDA target to compile for.
        def get_current_target(self):
            return GPUTarget("cuda", 90, 32)

        def get_current_device(self):
            return 0


    if not torch.cuda.is_available():
        triton.runtime.driver.set_active(CompileOnlyDriver())

    import kt_regroup
    from kt_regroup.kernels import triton as kt
    from torch._dynamo.backends.common import aot_autograd
    from torch._higher_order_ops.triton_kernel_wrap import kernel_side_table
    from torch._inductor.fx_passes.reinplace import reinplace_inplaceable_ops_core
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch._subclasses.functional_tensor import dispatch_functionalize
    from torch.export._trace import _disable_custom_triton_op_functional_decomposition
    from torch.fx.experimental.proxy_tensor import make_fx

    if not torch.cuda.is_available():  # kt_regroup.ops registers them where CUDA is present
        lib = torch.library.Library("kt_regroup", "FRAGMENT")
        kt.register_graph_rules(lib)

    ops = torch.ops.kt_regroup
    keys, lengths = [["a", "b"], ["c", "d"]], [[2, 3], [4, 8]]
    groups = [["c", "a"], ["b", "a", "d"], ["d"]]
    plan = kt_regroup.kt_regroup_arguments(torch.empty(0), keys, lengths, groups)
    permutes, in_shapes, out_shapes, out_lengths = plan
    records = {}


    def record(case, gm):
        calls = [n for n in gm.graph.nodes if n.op == "call_function"]
        records[case] = {
            "ops": sorted({str(n.target) for n in calls if "kt_regroup" in str(n.target)}),
            "kernels": [
                [kernel_side_table.get_kernel(n.kwargs["kernel_idx"]).fn.__name__,
                 sorted(n.kwargs["tensors_to_clone"])]
                for n in calls if "triton_kernel_wrapper" in str(n.target)
            ],
        }


    def trace(case, fn, device, dtypes=(torch.float32, torch.float32), batch=4):
        with FakeTensorMode():
            xs = [torch.empty(batch, sum(w), dtype=d, device=device)
                  for w, d in zip(lengths, dtypes)]
            meta = [torch.empty(t.shape, dtype=t.dtype, device=device)
                    for t in (permutes, in_shapes, out_shapes)]
            gm = make_fx(dispatch_functionalize(fn))(xs, *meta)
            record(case, gm)
            # Inductor's reinplacing pass: what is still cloned when the graph runs.
            reinplace_inplaceable_ops_core(gm.graph)
            records[case]["cloned_when_run"] = [
                n.kwargs["tensors_to_clone"] for n in gm.graph.nodes
                if "triton_kernel_wrapper" in str(n.target)
            ]


    forward = lambda xs, p, i, o: ops.permute_multi_embedding(xs, p, i, o, out_lengths)
    cast = lambda xs, p, i, o: ops.permute_multi_embedding_to(
        xs, p, i, o, out_lengths, torch.float16)


    def backward(xs, p, i, o):
        grads = [xs[0].new_empty(xs[0].size(0), n) for n in out_lengths]
        grads[1] = None
        widths = [sum(w) for w in lengths]
        return ops.permute_multi_embedding_backward(
            grads, p, i, o, widths, xs[0].size(0), torch.float32)


    trace("forward_cuda", forward, "cuda")
    trace("cast_mixed_cuda", cast, "cuda", (torch.bfloat16, torch.float32))
    trace("backward_cuda", backward, "cuda")
    trace("forward_cpu", forward, "cpu")
    trace("forward_int32_cuda", forward, "cuda", (torch.int32, torch.int32))
    with _disable_custom_triton_op_functional_decomposition():  # what torch.export runs under
        trace("export_cuda", forward, "cuda")

    # A CPU training step through AOTAutograd (as torch.compile runs it, graphs captured).
    captured = []

    def capture(gm, example_inputs):
        captured.append(gm)
        return gm

    def step(a, b):
        outs = ops.permute_multi_embedding([a, b], permutes, in_shapes, out_shapes, out_lengths)
        return sum((o * (j + 1)).sum() for j, o in enumerate(outs))

    a, b = (torch.randn(3, sum(w), requires_grad=True) for w in lengths)
    compiled = torch.compile(step, backend=aot_autograd(fw_compiler=capture, bw_compiler=capture))
    compiled(a, b).backward()
    grads = [a.grad.clone(), b.grad.clone()]
    a.grad = b.grad = None
    step(a, b).backward()
    records["cpu_step_equal"] = all(torch.equal(g, e) for g, e in zip(grads, [a.grad, b.grad]))
    for case, gm in zip(["cpu_step_forward", "cpu_step_backward"], captured):
        record(case, gm)
    print(json.dumps(records))
    """
)


@pytest.fixture(scope="module")
def traced():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([ROOT, env.get("PYTHONPATH", "")])
    proc = subprocess.run(
        [sys.executable, "-c", _TRACE_SCRIPT], env=env, cwd=ROOT, text=True,
        capture_output=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


# What each kernel writes (Triton's TTIR read by torch's mutation analysis): the copy
# kernel the column mask and the outputs, the zero fill the outputs. Nothing else is
# cloned: no input, no plan.
FORWARD_KERNELS = [
    ["_permute_kernel", ["w0", "w1", "w2", "written_ptr"]],
    ["_zero_unwritten_kernel", ["w0", "w1", "w2"]],
]


# Inductor's reinplacing then drops every clone: the kernels write the fresh buffers.
NOTHING_CLONED = [[], []]


def test_forward_on_cuda_traces_to_the_triton_kernels(traced):
    assert traced["forward_cuda"] == {
        "ops": [], "kernels": FORWARD_KERNELS, "cloned_when_run": NOTHING_CLONED
    }


def test_mixed_dtype_cast_on_cuda_traces_to_the_triton_kernels(traced):
    # The bfloat16 input is widened by an ATen copy; the regroup is the two kernels.
    assert traced["cast_mixed_cuda"] == {
        "ops": [], "kernels": FORWARD_KERNELS, "cloned_when_run": NOTHING_CLONED
    }


def test_backward_on_cuda_traces_to_the_triton_kernels(traced):
    # Two inputs' gradients written; the gradients of the outputs are only read.
    assert traced["backward_cuda"] == {
        "ops": [],
        "kernels": [
            ["_permute_kernel", ["w0", "w1", "written_ptr"]],
            ["_zero_unwritten_kernel", ["w0", "w1"]],
        ],
        "cloned_when_run": NOTHING_CLONED,
    }


@pytest.mark.parametrize("case", ["forward_cpu", "forward_int32_cuda", "export_cuda"])
def test_cpu_other_dtypes_and_export_keep_the_librarys_op(traced, case):
    assert traced[case] == {
        "ops": ["kt_regroup.permute_multi_embedding.default"], "kernels": [],
        "cloned_when_run": [],
    }


def test_compiled_cpu_training_step_calls_the_librarys_ops(traced):
    assert traced["cpu_step_equal"] is True
    assert traced["cpu_step_forward"]["ops"] == ["kt_regroup.permute_multi_embedding.default"]
    assert traced["cpu_step_backward"]["ops"] == [
        "kt_regroup.permute_multi_embedding_backward.default"
    ]
    assert traced["cpu_step_forward"]["kernels"] == traced["cpu_step_backward"]["kernels"] == []


# --- CUDA ---------------------------------------------------------------------------------

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

# Aligned and unaligned widths, a key used twice, an unused key.
KEYS = [["a", "b", "c"], ["d", "e", "unused"]]
LENGTHS = [[16, 8, 3], [32, 7, 4]]
GROUPS = [["d", "a", "c"], ["b", "a", "e"], ["c"]]


def _plan(device="cuda"):
    return kt_regroup.kt_regroup_arguments(torch.empty(0, device=device), KEYS, LENGTHS, GROUPS)


def _inputs(batch, dtype=torch.float32, requires_grad=False):
    gen = torch.Generator().manual_seed(batch)
    return [
        torch.randn(batch, sum(w), generator=gen).to("cuda", dtype).requires_grad_(requires_grad)
        for w in LENGTHS
    ]


class Regroup(torch.nn.Module):
    """An inference model: the plan in buffers, the op in forward."""

    def __init__(self) -> None:
        super().__init__()
        permutes, in_shapes, out_shapes, self.out_lengths = _plan()
        self.register_buffer("permutes", permutes)
        self.register_buffer("in_shapes", in_shapes)
        self.register_buffer("out_shapes", out_shapes)

    def forward(self, a: torch.Tensor, b: torch.Tensor):
        return tuple(
            torch.ops.kt_regroup.permute_multi_embedding(
                [a, b], self.permutes, self.in_shapes, self.out_shapes, self.out_lengths
            )
        )


def _assert_triton_code(codes, n_graphs):
    """Each of the ``n_graphs`` generated modules holds both kernels and no call of an op."""
    with_kernels = [c for c in codes if all(k in c for k in KERNELS)]
    assert len(with_kernels) >= n_graphs, [c[:2000] for c in codes]
    assert not any("kt_regroup.permute_multi_embedding" in c for c in codes)


@cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_cuda_compiled_training_step_runs_the_triton_kernels(dtype):
    from torch._inductor.utils import run_and_get_code

    permutes, in_shapes, out_shapes, out_lengths = _plan()
    weights = [torch.randn(37, n, device="cuda", dtype=dtype) for n in out_lengths]

    def step(inputs):
        outs = torch.ops.kt_regroup.permute_multi_embedding(
            inputs, permutes, in_shapes, out_shapes, out_lengths
        )
        # Linear in the outputs: their gradients are exactly the weights.
        loss = sum((o * w).float().sum() for o, w in zip(outs, weights))
        loss.backward()
        return [o.detach() for o in outs]

    eager_inputs = _inputs(37, dtype, requires_grad=True)
    expected = step(eager_inputs)
    inputs = _inputs(37, dtype, requires_grad=True)
    compiled = torch.compile(step)
    got, codes = run_and_get_code(compiled, inputs)
    for g, e in zip(got, expected, strict=True):
        torch.testing.assert_close(g, e, rtol=0, atol=0)
    for x, e in zip(inputs, eager_inputs, strict=True):
        torch.testing.assert_close(x.grad, e.grad, rtol=0, atol=0)
    _assert_triton_code(codes, n_graphs=2)  # the forward and the backward


@cuda
def test_cuda_compiled_ktregroupasdict_step_runs_the_triton_kernels():
    pytest.importorskip("torchrec", reason="KTRegroupAsDict needs torchrec")
    from torch._inductor.utils import run_and_get_code
    from torchrec.sparse.jagged_tensor import KeyedTensor

    names = [f"g{j}" for j in range(len(GROUPS))]

    def step(module, inputs):
        kts = [KeyedTensor(keys=k, length_per_key=n, values=v)
               for k, n, v in zip(KEYS, LENGTHS, inputs)]  # fmt: skip
        outs = module(kts)
        loss = sum((outs[name] * (j + 1)).sum() for j, name in enumerate(names))
        loss.backward()
        return {k: v.detach() for k, v in outs.items()}

    module = kt_regroup.KTRegroupAsDict(GROUPS, names)
    eager_inputs = _inputs(19, requires_grad=True)
    expected = step(module, eager_inputs)
    inputs = _inputs(19, requires_grad=True)
    got, codes = run_and_get_code(torch.compile(step), module, inputs)
    for name in names:
        torch.testing.assert_close(got[name], expected[name], rtol=0, atol=0)
    for x, e in zip(inputs, eager_inputs, strict=True):
        torch.testing.assert_close(x.grad, e.grad, rtol=0, atol=0)
    _assert_triton_code(codes, n_graphs=2)


@cuda
def test_cuda_triton_ops_opcheck():
    permutes, _, out_shapes, out_lengths = _plan()
    inputs = _inputs(5)
    torch.library.opcheck(
        torch.ops.kt_regroup._permute_multi_embedding_triton,
        (inputs, permutes, out_lengths, None),
    )
    grads = [torch.randn(5, n, device="cuda") for n in out_lengths]
    grads[1] = None
    torch.library.opcheck(
        torch.ops.kt_regroup._permute_multi_embedding_backward_triton,
        (grads, permutes, out_shapes, [sum(w) for w in LENGTHS], 5, torch.float32),
    )


_AOTI_RUN = textwrap.dedent(
    """
    import json, sys, torch
    from torch.profiler import ProfilerActivity, profile

    torch.ops.load_library(sys.argv[1])
    model = torch._inductor.aoti_load_package(sys.argv[2])
    inputs = [x.cuda() for x in torch.load(sys.argv[3])]
    model(*inputs)  # loads the kernels
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        outputs = model(*inputs)
        torch.cuda.synchronize()
    torch.save([o.cpu() for o in outputs], sys.argv[4])
    device = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    host = sorted({e.name for e in prof.events() if "kt_regroup" in e.name})
    loaded = [m for m in ("kt_regroup", "torchrec", "fbgemm_gpu") if m in sys.modules]
    print(json.dumps({"device": device, "ops": host, "loaded": loaded}))
    """
)


def _aoti_check(model, example, inputs, expected, tmp_path):
    """torch.export (dynamic batch) + AOTInductor of ``model``; the package run on ``inputs``
    in a fresh process that loads only torch and the op library must give ``expected``, with
    at most 3 device launches per call and no call of a kt_regroup op."""
    import zipfile

    batch = torch.export.Dim("batch", min=1, max=65536)
    program = torch.export.export(
        model, tuple(example), dynamic_shapes=tuple({0: batch} for _ in example)
    )
    # The exported program keeps the library's op: it is portable, the compile decomposes.
    targets = {str(n.target) for n in program.graph.nodes if n.op == "call_function"}
    assert "kt_regroup.permute_multi_embedding.default" in targets, targets
    package = tmp_path / "model.pt2"
    torch._inductor.aoti_compile_and_package(program, package_path=str(package))
    with zipfile.ZipFile(package) as z:
        assert any(b"_permute_kernel" in z.read(n) for n in z.namelist()), z.namelist()

    torch.save([x.cpu() for x in inputs], tmp_path / "inputs.pt")
    runner = tmp_path / "run.py"
    runner.write_text(_AOTI_RUN)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KT_REGROUP", "PYTHONPATH"))}
    proc = subprocess.run(
        [sys.executable, "-I", str(runner), kt_regroup.library_path(), str(package),
         str(tmp_path / "inputs.pt"), str(tmp_path / "outputs.pt")],
        capture_output=True, text=True, cwd=tmp_path, env=env, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["loaded"] == [], report
    assert report["ops"] == [], report  # no kt_regroup op ran: the kernels are in the package
    assert 1 <= len(report["device"]) <= 3, report["device"]
    got = torch.load(tmp_path / "outputs.pt")
    for g, e in zip(got, expected, strict=True):
        torch.testing.assert_close(g, e, rtol=0, atol=0)


@cuda
def test_cuda_aoti_package_runs_triton_in_a_fresh_process(tmp_path):
    inputs = _inputs(37)  # a batch the export never saw
    permutes, in_shapes, out_shapes, out_lengths = _plan("cpu")  # the library's CPU kernel
    expected = torch.ops.kt_regroup.permute_multi_embedding(
        [x.cpu() for x in inputs], permutes, in_shapes, out_shapes, out_lengths
    )
    _aoti_check(Regroup().eval(), _inputs(8), inputs, expected, tmp_path)


@cuda
def test_cuda_aoti_package_of_the_deploy_example_runs_triton(tmp_path):
    """``examples/deploy.py``'s model (KeyedTensors built in forward, KTRegroupAsDict) on
    CUDA, compared with the same model on CPU (the library's C++ kernel)."""
    pytest.importorskip("torchrec", reason="the example model uses torchrec's KeyedTensor")
    import importlib.util

    path = os.path.join(ROOT, "examples", "deploy.py")
    spec = importlib.util.spec_from_file_location("example_deploy", path)
    deploy = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(deploy)
    model = deploy.OverArchInput().eval()
    model(*[x.cuda() for x in deploy.example_inputs(2)])  # the plan, cached on CUDA
    inputs = [x.cuda() for x in deploy.example_inputs(37)]
    expected = list(deploy.build()(*deploy.example_inputs(37)))
    _aoti_check(model, [x.cuda() for x in deploy.example_inputs(4)], inputs, expected, tmp_path)
