"""The op library's CUDA kernels (``kt_regroup/csrc/cuda``) and how ``setup.py`` decides
to build them.

The kernels are checked in a fresh interpreter that loads only torch and the library
(``tests/cuda_isolated.py``), as a TorchScript or AOTInductor deployment runs them: in
this process ``import kt_regroup`` has registered the Triton kernels for the CUDA
dispatch key, over the library's. Tests that need a GPU have ``cuda`` in their names
(``pytest -k cuda``); the build decision is tested everywhere.
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
import pathlib
import shutil
import subprocess
import sys

import pytest
import torch
from reference import permute_multi_embedding_reference

import kt_regroup

ROOT = pathlib.Path(__file__).resolve().parent.parent
ISOLATED = pathlib.Path(__file__).resolve().parent / "cuda_isolated.py"


def _setup_module():
    spec = importlib.util.spec_from_file_location("kt_regroup_setup", ROOT / "setup.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # not __main__: defines the helpers, builds nothing
    return module


setup_py = _setup_module()


def _library_has_cuda() -> bool:
    return hasattr(ctypes.CDLL(kt_regroup.library_path()), "kt_regroup_built_with_cuda")


# --- the build decision (any machine) ---------------------------------------------------------


@pytest.mark.parametrize(
    "torch_cuda, nvcc, env, built, why",
    [
        (None, "13.0", "", False, "CPU build"),
        ("13.0", None, "", False, "no nvcc"),
        ("12.8", "13.0", "", False, "major versions must match"),
        ("13.0", "12.9", "", False, "major versions must match"),
        ("13.0", "13.0", "", True, "CUDA 13.0"),
        ("13.0", "13.1", "", True, "CUDA 13.1"),
        ("13.0", "13.0", "0", False, "KT_REGROUP_CUDA=0"),
    ],
)
def test_setup_builds_cuda_only_where_torch_and_nvcc_agree(torch_cuda, nvcc, env, built, why):
    got, reason = setup_py.cuda_build(torch_cuda, nvcc, env)
    assert got is built
    assert why in reason


def test_setup_reads_the_nvcc_version(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    nvcc = bin_dir / "nvcc"
    nvcc.write_text(
        "#!/bin/sh\necho 'nvcc: NVIDIA (R) Cuda compiler driver'\n"
        "echo 'Cuda compilation tools, release 13.0, V13.0.88'\n"
    )
    nvcc.chmod(0o755)
    assert setup_py.nvcc_version(str(tmp_path)) == "13.0"
    assert setup_py.nvcc_version(str(tmp_path / "missing")) is None
    assert setup_py.nvcc_version(None) is None


def test_setup_finds_the_toolkit_behind_a_symlinked_nvcc(tmp_path):
    toolkit = tmp_path / "cuda-13.0"
    (toolkit / "bin").mkdir(parents=True)
    (toolkit / "include").mkdir()
    (toolkit / "include" / "cuda_runtime.h").write_text("")
    (toolkit / "bin" / "nvcc").write_text("")
    link = tmp_path / "bin" / "nvcc"
    link.parent.mkdir()
    link.symlink_to(toolkit / "bin" / "nvcc")
    assert setup_py.cuda_home({}, str(link)) == str(toolkit)
    # The user's setting wins.
    assert setup_py.cuda_home({"CUDA_HOME": "/opt/cuda"}, str(link)) == "/opt/cuda"
    assert setup_py.cuda_home({"CUDA_PATH": "/opt/cuda-path"}, None) == "/opt/cuda-path"


def test_setup_picks_architectures_only_where_torch_would_find_none():
    assert setup_py.arch_list({}, gpu_visible=False) == setup_py.DEFAULT_ARCHS
    assert setup_py.arch_list({}, gpu_visible=True) is None  # torch builds for the GPUs it sees
    assert setup_py.arch_list({"TORCH_CUDA_ARCH_LIST": "9.0"}, gpu_visible=False) is None


def test_setup_cpu_only_extension_is_the_cpp_sources(monkeypatch):
    # What setup.py compiles where torch has no CUDA: every csrc/*.cpp, nothing of csrc/cuda.
    monkeypatch.chdir(ROOT)
    monkeypatch.setenv("KT_REGROUP_CUDA", "0")
    ext = setup_py.extension()
    assert sorted(ext.sources) == sorted(str(p) for p in pathlib.Path("kt_regroup/csrc").glob("*.cpp"))
    assert ext.extra_compile_args == {"cxx": ["-O3", "-fopenmp"]}
    assert ext.py_limited_api


@pytest.mark.skipif(torch.version.cuda is not None, reason="torch is a CUDA build")
def test_cpu_torch_library_has_no_cuda_kernels():
    # A CPU-only build: the portable kernels serve every non-CPU device, as before.
    assert not _library_has_cuda()


# --- the kernels (a GPU) ------------------------------------------------------------------------

needs_cuda_kernels = pytest.mark.skipif(
    not torch.cuda.is_available() or not _library_has_cuda(),
    reason="needs a GPU and a library built with its CUDA kernels (torch with CUDA, nvcc)",
)


def _isolated(check: str, *args: str) -> None:
    """Runs ``cuda_isolated.CHECK(*args)`` in an interpreter with only torch and the library."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KT_REGROUP")}
    proc = subprocess.run(
        [sys.executable, "-I", str(ISOLATED), kt_regroup.library_path(), check, *args],
        capture_output=True, text=True, timeout=600, env=env,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-6000:]


@needs_cuda_kernels
@pytest.mark.parametrize(
    "check",
    [
        "check_forward",
        "check_many_tensors",
        "check_gaps_and_bad_rows",
        "check_to",
        "check_backward",
        "check_autograd",
        "check_no_host_sync",
        "check_launches",
    ],
)
def test_cuda_kernel(check):
    _isolated(check)


@needs_cuda_kernels
def test_cuda_torchscript_model_in_a_fresh_process(tmp_path):
    # Saved by one process, loaded by another: both with only torch and the library.
    _isolated("save_torchscript", str(tmp_path))
    _isolated("run_torchscript", str(tmp_path))


@needs_cuda_kernels
def test_library_cuda_kernel_serves_where_triton_declines():
    # In this process Triton serves CUDA; where it declines (an integer dtype) the
    # kernel it falls back to is the library's CUDA kernel.
    cuda_isolated = _load_isolated()
    p, i, o, n = cuda_isolated.plan()
    xs = cuda_isolated.inputs(5, torch.int64)
    got = torch.ops.kt_regroup.permute_multi_embedding(xs, p, i, o, n)
    for g, e in zip(got, permute_multi_embedding_reference(xs, p, i, o, n), strict=True):
        assert torch.equal(g, e)


def _load_isolated():
    spec = importlib.util.spec_from_file_location("cuda_isolated", ISOLATED)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@needs_cuda_kernels
@pytest.mark.skipif(shutil.which("cmake") is None, reason="cmake is not installed")
def test_cuda_cpp_predictor_runs_a_cuda_model(tmp_path):
    # examples/cpp_predictor (no Python) runs a TorchScript model that regroups on CUDA.
    _isolated("save_torchscript", str(tmp_path))
    build = tmp_path / "build"
    for cmd in (
        ["cmake", "-S", str(ROOT / "examples" / "cpp_predictor"), "-B", str(build),
         f"-DCMAKE_PREFIX_PATH={torch.utils.cmake_prefix_path}", "-DCMAKE_BUILD_TYPE=Release"],
        ["cmake", "--build", str(build), "-j4"],
    ):
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    cuda_isolated = _load_isolated()
    batch = 13
    widths = [sum(w) for w in cuda_isolated.LENGTHS]
    run = subprocess.run(
        [str(build / "predictor"), str(tmp_path / "on_cuda.pt"), kt_regroup.library_path(),
         *[f"{batch}x{w}" for w in widths]],
        capture_output=True, text=True, timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    # The predictor's inputs (element i = i % 17 - 8) and checksums, computed here.
    inputs = [(torch.arange(batch * w, dtype=torch.float32) % 17 - 8).reshape(batch, w) for w in widths]
    p, i, o, n = cuda_isolated.plan(device=torch.device("cpu"))
    expected = permute_multi_embedding_reference(inputs, p, i, o, n)
    sums = []
    for out in expected:
        weights = torch.arange(out.numel(), dtype=torch.float64) % 101 + 1
        sums.append(int((out.double().flatten() * weights).sum().item()))
    printed = [int(line.split("checksum")[1]) for line in run.stdout.splitlines() if "checksum" in line]
    assert printed == sums
