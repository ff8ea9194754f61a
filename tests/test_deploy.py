"""Deployment, the way users run it: ``examples/deploy.py`` saves an AOTInductor package
(and, with ``--torchscript``, the legacy TorchScript file); a fresh process that imports
neither kt_regroup nor torchrec loads them next to the compiled op library and gets the
eager result, and so does the C++ predictor of ``examples/cpp_predictor``
(``AOTIModelPackageLoader`` / ``torch::jit::load``), built against the installed libtorch."""

from __future__ import annotations

import importlib.util
import os
import pathlib
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch

import kt_regroup

pytestmark = pytest.mark.skipif(
    kt_regroup.library_path() is None, reason="the compiled op library is not loaded"
)

EXAMPLES = pathlib.Path(__file__).resolve().parent.parent / "examples"


def _example():
    spec = importlib.util.spec_from_file_location("example_deploy", EXAMPLES / "deploy.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


deploy = _example()


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> pathlib.Path:
    """The user's step: run the example script; plus a graph traced before any batch."""
    out = tmp_path_factory.mktemp("deploy")
    proc = subprocess.run(
        [sys.executable, str(EXAMPLES / "deploy.py"), str(out), "--torchscript"],
        capture_output=True, text=True, timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert kt_regroup.library_path() in proc.stdout
    deploy.save_torchscript(deploy.build(warm=False), out / "cold.pt")
    return out


def _run_without_python_packages(code: str, cwd: pathlib.Path) -> subprocess.CompletedProcess:
    """A new interpreter that imports only torch (``-I``: no PYTHONPATH, no cwd on path)."""
    prelude = f"""
        import sys, torch
        torch.ops.load_library({kt_regroup.library_path()!r})
    """
    check = """
        loaded = [m for m in ("kt_regroup", "torchrec", "fbgemm_gpu") if m in sys.modules]
        assert not loaded, loaded
    """
    script = textwrap.dedent(prelude) + textwrap.dedent(code) + textwrap.dedent(check)
    env = {k: v for k, v in os.environ.items() if not k.startswith("KT_REGROUP")}
    return subprocess.run(
        [sys.executable, "-I", "-c", script], capture_output=True, text=True, cwd=cwd,
        env=env, timeout=600,
    )


def _expected(batch: int):
    return list(deploy.build()(*deploy.example_inputs(batch)))


def test_aoti_package_runs_with_only_the_library(saved):
    # (a) torch.export + AOTInductor, dynamic batch: a batch the export never saw.
    batch = 9
    torch.save(deploy.example_inputs(batch), saved / "inputs_aoti.pt")
    proc = _run_without_python_packages(
        """
        model = torch._inductor.aoti_load_package("model.pt2")
        torch.save(list(model(*torch.load("inputs_aoti.pt"))), "outputs_aoti.pt")
        """,
        cwd=saved,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    got = torch.load(saved / "outputs_aoti.pt")
    for g, e in zip(got, _expected(batch), strict=True):
        torch.testing.assert_close(g, e, rtol=0, atol=0)


@pytest.mark.parametrize("name", ["model.pt", "cold.pt"], ids=["warm-plan", "traced-cold"])
def test_torchscript_runs_with_only_the_library(saved, name):
    # (c) the legacy TorchScript file, traced warm (the plan in the graph) or cold (a layout
    # the graph does not hold): either way the graph calls the C++ kt_regroup_arguments
    # where the layout differs, then permute_multi_embedding.
    batch = 7
    torch.save(deploy.example_inputs(batch), saved / "inputs.pt")
    proc = _run_without_python_packages(
        f"""
        model = torch.jit.load({str(saved / name)!r})
        outputs = model(*torch.load("inputs.pt"))
        torch.save(list(outputs), "outputs_{name}")
        """,
        cwd=saved,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    got = torch.load(saved / f"outputs_{name}")
    for g, e in zip(got, _expected(batch), strict=True):
        torch.testing.assert_close(g, e, rtol=0, atol=0)


@pytest.fixture(scope="module")
def predictor(tmp_path_factory) -> pathlib.Path:
    """The C++ program of examples/cpp_predictor, built against the wheel's libtorch."""
    build = tmp_path_factory.mktemp("predictor")
    configure = subprocess.run(
        ["cmake", "-S", str(EXAMPLES / "cpp_predictor"), "-B", str(build),
         f"-DCMAKE_PREFIX_PATH={torch.utils.cmake_prefix_path}", "-DCMAKE_BUILD_TYPE=Release"],
        capture_output=True, text=True, timeout=600,
    )
    assert configure.returncode == 0, configure.stdout[-3000:] + configure.stderr[-3000:]
    compiled = subprocess.run(
        ["cmake", "--build", str(build), "-j2"], capture_output=True, text=True, timeout=900
    )
    assert compiled.returncode == 0, compiled.stdout[-3000:] + compiled.stderr[-3000:]
    return build / "predictor"


@pytest.mark.skipif(shutil.which("cmake") is None, reason="cmake is not installed")
@pytest.mark.parametrize("name", ["model.pt2", "model.pt"], ids=["aoti", "torchscript"])
def test_cpp_predictor_prints_the_eager_checksums(saved, predictor, name):
    # (b) the AOTInductor package (AOTIModelPackageLoader) and the legacy TorchScript file.
    batch = 11
    shapes = [f"{batch}x{t.size(1)}" for t in deploy.example_inputs(batch)]
    run = subprocess.run(
        [str(predictor), str(saved / name), kt_regroup.library_path(), *shapes, "--calls", "3"],
        capture_output=True, text=True, timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    lines = run.stdout.splitlines()
    printed = [int(line.split("checksum")[1]) for line in lines if "checksum" in line]
    assert printed == deploy.checksums(_expected(batch))
    assert lines[-1].startswith("per call: ") and lines[-1].endswith("us (3 calls)"), lines
    assert all(c != 0 for c in printed)
