"""Backends: what ``KT_REGROUP_BACKEND`` selects per device, the warning of a missing
one, and parity of the ops, whatever backend serves them, with the reference kernels.

The parity tests (``-k parity``) run on the backend of this process; one test reruns
them with ``KT_REGROUP_BACKEND=triton TRITON_INTERPRET=1`` (the Triton kernels on CPU
tensors, in Triton's interpreter) and with ``KT_REGROUP_BACKEND=fbgemm`` (FBGEMM's CPU
op, where fbgemm_gpu is installed). Shapes are small: the interpreter runs every
program in Python.
"""

from __future__ import annotations

import functools
import json
import os
import pathlib
import subprocess
import sys
import textwrap

import pytest
import torch
from conftest import (
    SMALL_LAYOUT,
    Layout,
    assert_same_list,
    dtype_ids,
    expected_regroup,
    has_fbgemm_permute,
    make_values,
    random_layout,
)

import kt_regroup
from kt_regroup.kernels import reference
from kt_regroup.plan import get_plan

TESTS = pathlib.Path(__file__).resolve().parent
BACKEND = os.environ.get("KT_REGROUP_BACKEND", "auto")
SERVING = kt_regroup.backend("cpu")


def run_python(code: str, **env) -> subprocess.CompletedProcess:
    full = {k: v for k, v in os.environ.items() if k not in ("KT_REGROUP_BACKEND", "TRITON_INTERPRET")}
    full["PYTHONPATH"] = os.pathsep.join(filter(None, [str(TESTS.parent), full.get("PYTHONPATH")]))
    full.update(env)
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, env=full, timeout=300)


# --- selection ------------------------------------------------------------------------------

PROBE = """
    import json, sys, torch
    import kt_regroup
    loaded = [m for m in ("triton", "fbgemm_gpu") if m in sys.modules]
    x = torch.arange(10.0).view(2, 5)
    out = kt_regroup.regroup_keyed_tensor([x], [["a", "b"]], [[2, 3]], [["b", "a", "b"]])[0]
    print(json.dumps({
        "loaded_at_import": loaded,
        "cuda_initialized": torch.cuda.is_initialized(),
        "right": torch.equal(out, torch.cat([x[:, 2:], x[:, :2], x[:, 2:]], 1)),
        "cpu": kt_regroup.backend("cpu"),
        "cuda": kt_regroup.backend("cuda"),
        "cpu_again": kt_regroup.backend("cpu"),
    }))
"""


def _fbgemm_has(key: str) -> bool:
    if not has_fbgemm_permute():
        return False
    return torch._C._dispatch_has_kernel_for_dispatch_key("fbgemm::permute_multi_embedding_function", key)


@functools.cache
def _triton_imports() -> bool:
    return run_python("import triton").returncode == 0


CPU_NATIVE = "cpp" if kt_regroup.library_path() is not None else "reference"


@pytest.mark.parametrize(
    "env,cpu,cuda",
    [
        ({}, CPU_NATIVE, "triton"),
        ({"KT_REGROUP_BACKEND": "cpp"}, "cpp", "reference"),
        ({"KT_REGROUP_BACKEND": "reference"}, "reference", "reference"),
        ({"KT_REGROUP_BACKEND": "triton"}, CPU_NATIVE, "triton"),
        ({"KT_REGROUP_BACKEND": "triton", "TRITON_INTERPRET": "1"}, "triton", "triton"),
        ({"KT_REGROUP_BACKEND": "fbgemm"}, "fbgemm", "fbgemm"),
    ],
    ids=["auto", "cpp", "reference", "triton", "triton_interpreted", "fbgemm"],
)
def test_selection_per_device(env, cpu, cuda):
    if env.get("KT_REGROUP_BACKEND") == "cpp" and kt_regroup.library_path() is None:
        pytest.skip("KT_REGROUP_BACKEND=cpp needs the compiled library")
    if "triton" in (cpu, cuda) and not _triton_imports():
        cpu, cuda = (CPU_NATIVE if cpu == "triton" else cpu), "reference"
    if env.get("KT_REGROUP_BACKEND") == "fbgemm":
        cpu = "fbgemm" if _fbgemm_has("CPU") else CPU_NATIVE
        cuda = "fbgemm" if _fbgemm_has("CUDA") else "reference"
    proc = run_python(PROBE, **env)
    assert proc.returncode == 0, proc.stderr
    info = json.loads(proc.stdout.splitlines()[-1])
    # import kt_regroup loads neither Triton nor fbgemm_gpu and never initialises CUDA.
    assert info == {"loaded_at_import": [], "cuda_initialized": False, "right": True,
                    "cpu": cpu, "cuda": cuda, "cpu_again": cpu}
    unavailable = proc.stderr.count("backend is unavailable")
    assert unavailable == (cpu == CPU_NATIVE and env.get("KT_REGROUP_BACKEND") == "fbgemm") + (
        cuda == "reference" and env.get("KT_REGROUP_BACKEND", "auto") in ("auto", "triton", "fbgemm")
    ), proc.stderr
    assert "Overriding a previously registered kernel" not in proc.stderr


def test_missing_triton_one_warning_and_the_previous_kernels():
    # Triton made unimportable (sys.modules[name] = None is how Python spells "absent").
    proc = run_python(
        """
        import sys; sys.modules["triton"] = None
        import json, torch, kt_regroup
        x = torch.arange(10.0).view(2, 5).requires_grad_()
        outs = kt_regroup.regroup_keyed_tensor([x], [["a", "b"]], [[2, 3]], [["b"], ["b", "a"]])
        sum(o.sum() for o in outs).backward()
        print(json.dumps([kt_regroup.backend("cpu"), kt_regroup.backend("cuda"),
                          kt_regroup.backend("cuda"), x.grad[0].tolist()]))
        """,
        KT_REGROUP_BACKEND="triton", TRITON_INTERPRET="1",
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.splitlines()[-1]) == [
        CPU_NATIVE, "reference", "reference", [1.0, 1.0, 2.0, 2.0, 2.0]
    ]
    for key in ("CPU", "CUDA"):
        assert proc.stderr.count(f"the triton backend is unavailable for {key} tensors") == 1, proc.stderr
    assert "ModuleNotFoundError: import of triton halted" in proc.stderr


def test_unknown_backend_names_the_choices():
    proc = run_python("import kt_regroup", KT_REGROUP_BACKEND="tpu")
    assert proc.returncode != 0
    assert "KT_REGROUP_BACKEND='tpu': expected one of auto, reference, cpp, triton, fbgemm" in proc.stderr


# --- parity of this process's backend with the reference ------------------------------------

LAYOUTS = {
    "seed0": random_layout(0),
    "seed5": random_layout(5, widths=(4, 8, 3, 16)),
    "small": SMALL_LAYOUT,
    # An input with no keys, a zero-width key, an empty group; 'b' skipped.
    "edges": Layout([["a", "z", "b"], [], ["c"]], [[3, 0, 8], [], [5]],
                    [["c", "z", "a", "c"], [], ["a"]]),
}
# What this backend computes natively; the others take the fallback, checked all the same.
DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]
# On a CUDA machine the same tests run on CUDA tensors too (there: Triton, unless
# KT_REGROUP_BACKEND says otherwise), compared with the reference on the CPU.
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else [])


def _metadata(layout: Layout, device="cpu"):
    plan = get_plan(layout.keys, layout.lengths, layout.groups)
    return (*plan.tensors(torch.device(device)), list(plan.out_lengths))


def _grads(out_lengths, batch, dtype, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(batch, n, generator=gen, dtype=torch.float64).to(dtype) for n in out_lengths]


def _on(device, tensors):
    return [t.to(device) for t in tensors]


def _exact_for_duplicates(dtype, device) -> bool:
    # FBGEMM adds duplicated keys' gradients in their dtype; the others accumulate
    # float16/bfloat16 in float32 and round once.
    return not (kt_regroup.backend(device) == "fbgemm" and dtype in (torch.float16, torch.bfloat16))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", sorted(LAYOUTS))
@pytest.mark.parametrize("batch", [0, 1, 5])
def test_parity_forward_and_backward(name, batch, device):
    layout = LAYOUTS[name]
    permutes, in_shapes, out_shapes, out_lengths = _metadata(layout)
    values = make_values(layout, batch, seed=batch)
    outs = kt_regroup.permute_multi_embedding(
        _on(device, values), *_metadata(layout, device)[:3], out_lengths)
    assert_same_list(_on("cpu", outs), expected_regroup(values, layout))
    grads = _grads(out_lengths, batch, torch.float32)
    got = torch.ops.kt_regroup.permute_multi_embedding_backward(
        _on(device, grads), *_metadata(layout, device)[:3], layout.in_widths, batch, torch.float32)
    want = reference.permute_multi_embedding_backward_reference(
        grads, permutes, in_shapes, out_shapes, layout.in_widths, batch, torch.float32)
    assert_same_list(_on("cpu", got), want)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_ids)
def test_parity_dtypes_noncontiguous_and_unused_keys_get_zero(dtype, device):
    layout = random_layout(3)
    permutes, in_shapes, out_shapes, out_lengths = _metadata(layout)
    values = make_values(layout, 3, dtype, noncontiguous=True)
    # Non-contiguous on the device too: the same strided view of a moved buffer.
    here = [v.t().contiguous().to(device).t().requires_grad_() for v in values]
    outs = kt_regroup.permute_multi_embedding(here, *_metadata(layout, device)[:3], out_lengths)
    assert_same_list(_on("cpu", outs), expected_regroup(values, layout))
    grads = _grads(out_lengths, 3, dtype)
    got = _on("cpu", torch.autograd.grad(outs, here, _on(device, grads)))
    want = reference.permute_multi_embedding_backward_reference(
        grads, permutes, in_shapes, out_shapes, layout.in_widths, 3, dtype)
    if _exact_for_duplicates(dtype, device):
        assert_same_list(got, want)
    else:
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, atol=1e-2, rtol=1e-2)
    used = layout.used_keys()
    for g, tkeys, tlens in zip(got, layout.keys, layout.lengths):
        off = 0
        for k, w in zip(tkeys, tlens):
            if k not in used:
                assert torch.equal(g[:, off:off + w], torch.zeros_like(g[:, off:off + w])), k
            off += w


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [None, torch.bfloat16, torch.float64], ids=str)
def test_parity_fused_cast_of_mixed_input_dtypes(dtype, device):
    layout = random_layout(2)
    permutes, in_shapes, out_shapes, out_lengths = _metadata(layout)
    mixed = [torch.float16, torch.float32, torch.bfloat16]
    values = [v.to(mixed[i % 3]) for i, v in enumerate(make_values(layout, 5))]
    if dtype is None:
        values = [v.to(torch.float32) for v in values]
    got = kt_regroup.permute_multi_embedding_to(_on(device, values), *_metadata(layout, device)[:3],
                                                out_lengths, dtype)
    want = reference.permute_multi_embedding_to_reference(values, permutes, in_shapes,
                                                           out_shapes, out_lengths, dtype)
    assert_same_list(_on("cpu", got), want)


@pytest.mark.parametrize("device", DEVICES)
def test_parity_into_caller_owned_outputs(device):
    layout = SMALL_LAYOUT
    out_lengths = _metadata(layout)[3]
    values = make_values(layout, 4)
    # Row stride wider than the width; NaN where nothing may remain.
    outs = [torch.full((4, n + 2), float("nan"), device=device)[:, 1:1 + n] for n in out_lengths]
    kt_regroup.permute_multi_embedding_into(_on(device, values), *_metadata(layout, device)[:3], outs)
    assert_same_list(_on("cpu", outs), expected_regroup(values, layout))


def test_parity_compiled_fullgraph_forward_and_backward():
    # torch.compile sees the ops (fake kernels), whatever kernel serves them at run time.
    layout = random_layout(1)
    permutes, in_shapes, out_shapes, out_lengths = _metadata(layout)
    values = make_values(layout, 3, requires_grad=True)

    def f(*xs):
        outs = torch.ops.kt_regroup.permute_multi_embedding(list(xs), permutes, in_shapes,
                                                            out_shapes, out_lengths)
        return sum((o * (i + 1)).sum() for i, o in enumerate(outs))

    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
    got = torch.autograd.grad(compiled(*values), values)
    want = torch.autograd.grad(f(*values), values)
    assert_same_list(got, want)


def test_parity_bad_rows_raise_a_clear_error():
    # (CPU: on a device the rows are not read back; the kernels clip bad rows.)
    permutes, in_shapes, out_shapes, out_lengths = _metadata(SMALL_LAYOUT)
    values = make_values(SMALL_LAYOUT, 2)
    bad = permutes.clone()
    bad[0, 4] = 1000
    before = bad.clone()
    with pytest.raises(IndexError, match="permutes\\[0\\]"):
        kt_regroup.permute_multi_embedding(values, bad, in_shapes, out_shapes, out_lengths)
    assert torch.equal(bad, before)


# --- every backend that runs here passes the parity tests -----------------------------------

OTHER_BACKENDS = {
    "triton_interpreted": {"KT_REGROUP_BACKEND": "triton", "TRITON_INTERPRET": "1"},
    "fbgemm": {"KT_REGROUP_BACKEND": "fbgemm"},
}


@pytest.mark.parametrize("name", sorted(OTHER_BACKENDS))
def test_each_backend_passes_the_parity_tests(name):
    env = OTHER_BACKENDS[name]
    if all(os.environ.get(k) == v for k, v in env.items()):
        pytest.skip("this run is that backend")
    expected = "triton" if name.startswith("triton") else "fbgemm"
    if expected == "triton" and not _triton_imports():
        pytest.skip("triton does not import here")
    if expected == "fbgemm" and not _fbgemm_has("CPU"):
        pytest.skip("fbgemm_gpu with a CPU kernel is not installed")
    proc = run_python(
        f"""
        import sys, pytest, kt_regroup
        assert kt_regroup.backend("cpu") == {expected!r}, kt_regroup.backend("cpu")
        sys.exit(pytest.main(["-q", "-x", "-p", "no:cacheprovider", "-k", "parity and not each_backend",
                              {str(pathlib.Path(__file__))!r}]))
        """,
        **env,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert " passed" in proc.stdout and "failed" not in proc.stdout
