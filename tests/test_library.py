"""The compiled op library: required, built at install time, loaded at import (never
compiled there), and ``import kt_regroup`` changes nothing of torch's or torchrec's."""

from __future__ import annotations

import ctypes
import json
import os
import pathlib
import shutil
import subprocess
import sys
import textwrap
import venv

import pytest
import torch

import kt_regroup

PACKAGE = pathlib.Path(kt_regroup.__file__).resolve().parent
REPO = PACKAGE.parent
SCHEMAS = {
    "permute_multi_embedding", "permute_multi_embedding_backward", "permute_multi_embedding_to",
    "permute_multi_embedding_into", "kt_regroup_arguments", "regroup_keyed_tensor",
    "_cpu_memory", "_cpu_copy_program", "_cpu_machine_code", "permute_multi_embedding_vbe",
    "permute_multi_embedding_vbe_backward",
}


def run_python(code: str, cwd=None, python=sys.executable, **env) -> subprocess.CompletedProcess:
    return subprocess.run(
        [python, "-c", textwrap.dedent(code)],
        capture_output=True, text=True, env={**os.environ, **env}, timeout=300, cwd=cwd,
    )


def test_library_defines_every_schema():
    proc = run_python("""
        import json, torch, kt_regroup  # every op is the library's: none defined in Python
        print(json.dumps(sorted(s.name for s in torch._C._jit_get_all_schemas()
                                if s.name.startswith("kt_regroup::"))))
    """)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.splitlines()[-1]) == sorted(f"kt_regroup::{n}" for n in SCHEMAS)


def test_fbgemm_schemas_are_kept():
    pytest.importorskip("fbgemm_gpu")
    for name in ("permute_multi_embedding", "kt_regroup_arguments", "regroup_keyed_tensor"):
        ours = str(getattr(torch.ops.kt_regroup, name).default._schema)
        theirs = str(getattr(torch.ops.fbgemm, name).default._schema)
        assert ours.split("::")[1] == theirs.split("::")[1], name


def test_import_compiles_nothing_and_writes_nothing(tmp_path):
    # A fresh process with an unwritable home: importing must not build, cache or write.
    proc = run_python(
        """
        import json, sys, torch, kt_regroup
        x = torch.ones(2, 3)
        out = kt_regroup.regroup_keyed_tensor([x], [["a", "b"]], [[1, 2]], [["b"]])
        print(json.dumps([out[0].shape[1], "torch.utils.cpp_extension" in sys.modules,
                          "triton" in sys.modules, torch.cuda.is_initialized()]))
        """,
        cwd=tmp_path, HOME="/nonexistent", XDG_CACHE_HOME="/nonexistent",
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.splitlines()[-1]) == [2, False, False, False]
    assert list(tmp_path.iterdir()) == []
    assert "warning" not in proc.stderr.lower(), proc.stderr


STATE = """
    import json, torch, torch.utils._pytree as pytree
    import torchrec.modules.regroup as tr_regroup
    from torchrec.sparse.jagged_tensor import KeyedTensor

    def state():
        node = pytree.SUPPORTED_NODES.get(KeyedTensor)
        serial = pytree.SUPPORTED_SERIALIZED_TYPES.get(KeyedTensor)
        return {
            "pytree node": repr(node),
            "pytree serializer": repr(serial),
            "safe globals": repr(torch.serialization.get_safe_globals()),
            "KeyedTensor.regroup": repr(KeyedTensor.__dict__["regroup"]),
            "KeyedTensor.regroup_as_dict": repr(KeyedTensor.__dict__["regroup_as_dict"]),
            "torchrec KTRegroupAsDict": repr(tr_regroup.KTRegroupAsDict),
            "jit type store": id(torch.jit._recursive.concrete_type_store),
        }

    before = state()
    import kt_regroup
    # The lazy torchrec-facing API too: the module, the functions, the IR serializer.
    kt_regroup.KTRegroupAsDict, kt_regroup.regroup, kt_regroup.patch_torchrec
    import kt_regroup.torchrec_ir, kt_regroup.keyed_tensor_pytree
    after = state()
    kt_regroup.patch_torchrec()
    patched = state()
    print(json.dumps([before, after, patched]))
"""


def test_import_changes_no_torch_or_torchrec_state():
    proc = run_python(STATE)
    assert proc.returncode == 0, proc.stderr
    before, after, patched = json.loads(proc.stdout.splitlines()[-1])
    assert after == before
    # patch_torchrec() is where the registrations happen (the pytree node's keys
    # function, safe globals) and the regroups are rebound.
    changed = {k for k in before if patched[k] != before[k]}
    assert {"pytree node", "safe globals", "KeyedTensor.regroup"} <= changed, changed
    assert "jit type store" not in changed


def test_library_records_the_torch_it_was_built_with():
    built = ctypes.CDLL(kt_regroup.library_path()).kt_regroup_built_with_torch
    built.restype = ctypes.c_char_p
    assert built().decode().split("+")[0] == torch.__version__.split("+")[0]


def _package_copy(tmp_path, library: bytes | None, checkout: bool = False) -> pathlib.Path:
    """The package in a folder of its own, with no library or a given one; ``checkout``
    adds the sources and a setup.py beside it, as in a source tree."""
    copy = tmp_path / "site"
    shutil.copytree(
        PACKAGE, copy / "kt_regroup",
        ignore=shutil.ignore_patterns("_C*.so", "__pycache__", *(() if checkout else ("csrc",))),
    )
    if checkout:
        (copy / "setup.py").write_text("")
    if library is not None:
        (copy / "kt_regroup" / "_C.so").write_bytes(library)
    return copy


@pytest.mark.parametrize("library", [None, b"not an ELF file"], ids=["absent", "unloadable"])
def test_without_a_usable_library_import_fails_saying_how_to_build_it(tmp_path, library):
    site = _package_copy(tmp_path, library)
    proc = run_python("import kt_regroup", cwd=tmp_path, PYTHONPATH=str(site))
    assert proc.returncode != 0
    assert "ImportError: kt_regroup: " in proc.stderr, proc.stderr
    assert ("is not built" if library is None else "does not load") in proc.stderr
    assert "pip install --no-build-isolation ." in proc.stderr


PROBE = """
    import torch, kt_regroup
    out = kt_regroup.regroup_keyed_tensor([torch.arange(5.0).view(1, 5)], [["x", "y"]],
                                          [[2, 3]], [["y", "x"]])
    assert out[0].tolist() == [[2.0, 3.0, 4.0, 0.0, 1.0]], out
    print("ok")
"""


@pytest.mark.parametrize("checkout", [True, False], ids=["source-tree", "installed"])
def test_outdated_library_is_reported_only_in_a_source_tree(tmp_path, checkout):
    site = _package_copy(tmp_path, pathlib.Path(kt_regroup.library_path()).read_bytes(), checkout)
    library = site / "kt_regroup" / "_C.so"
    os.utime(library, (1_000_000, 1_000_000))  # built long before its sources changed
    proc = run_python(PROBE, cwd=tmp_path, PYTHONPATH=str(site))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["ok"]
    assert (f"{library} is older than the sources" in proc.stderr) is checkout, proc.stderr


def test_wheel_installs_into_a_fresh_venv_and_imports_silently(tmp_path):
    # The README's "own environment" install, as a user runs it: a wheel of this checkout
    # in a fresh venv (torch and torchrec from the test environment, via a .pth path).
    dist = tmp_path / "dist"
    build = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-build-isolation", "--no-deps", "-q",
         "-w", str(dist), str(REPO)],
        capture_output=True, text=True, timeout=900, cwd=tmp_path,
    )
    assert build.returncode == 0, build.stderr[-3000:]
    (wheel,) = dist.glob("kt_regroup-*.whl")
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=False)
    site = next(env_dir.glob("lib/python*/site-packages"))
    deps = next(p for p in map(pathlib.Path, sys.path) if p.name == "site-packages" and p.is_dir())
    (site / "deps.pth").write_text(f"{deps}\n")
    python = str(env_dir / "bin" / "python")
    # Without the test's PYTHONPATH: a checkout on it (with the kt_regroup.egg-info that
    # setuptools < 84 writes there) would be "already installed".
    install = subprocess.run(
        [sys.executable, "-m", "pip", "--python", python, "install", "--no-deps", "-q",
         str(wheel)], capture_output=True, text=True, timeout=300,
        env={**os.environ, "PYTHONPATH": ""},
    )
    assert install.returncode == 0, install.stderr[-3000:]
    code = textwrap.dedent(PROBE) + "print(kt_regroup.__file__)\n"
    proc = run_python(code, cwd=tmp_path, python=python, PYTHONPATH="")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split()[0] == "ok"
    assert proc.stdout.split()[1].startswith(str(site)), proc.stdout
    assert proc.stderr == "", proc.stderr


# --- setup.py: whether and how the CUDA kernels are built (any machine) ------------------------


def _setup_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("kt_regroup_setup", REPO / "setup.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # not __main__: defines the helpers, builds nothing
    return module


setup_py = _setup_module()


@pytest.mark.parametrize(
    "torch_cuda, nvcc, env, built, why",
    [
        (None, "13.0", "", False, "CPU build"),
        ("13.0", None, "", False, "`pip install nvidia-cuda-nvcc==13.0.*`"),
        ("12.8", None, "", False, "install the CUDA 12 toolkit"),
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


def _fake_nvcc(home: pathlib.Path, release: str = "13.0", headers: bool = True) -> pathlib.Path:
    (home / "bin").mkdir(parents=True)
    nvcc = home / "bin" / "nvcc"
    nvcc.write_text(
        "#!/bin/sh\necho 'nvcc: NVIDIA (R) Cuda compiler driver'\n"
        f"echo 'Cuda compilation tools, release {release}, V{release}.88'\n"
    )
    nvcc.chmod(0o755)
    if headers:
        (home / "include").mkdir()
        (home / "include" / "cuda_runtime.h").write_text("")
    return nvcc


def test_setup_reads_the_nvcc_version(tmp_path):
    _fake_nvcc(tmp_path)
    assert setup_py.nvcc_version(str(tmp_path)) == "13.0"
    assert setup_py.nvcc_version(str(tmp_path / "missing")) is None
    assert setup_py.nvcc_version(None) is None


def test_setup_finds_the_toolkit_behind_a_symlinked_nvcc(tmp_path):
    toolkit = tmp_path / "cuda-13.0"
    _fake_nvcc(toolkit)
    link = tmp_path / "bin" / "nvcc"
    link.parent.mkdir()
    link.symlink_to(toolkit / "bin" / "nvcc")
    assert setup_py.cuda_home({}, str(link)) == str(toolkit)
    # The user's setting wins.
    assert setup_py.cuda_home({"CUDA_HOME": "/opt/cuda"}, str(link)) == "/opt/cuda"
    assert setup_py.cuda_home({"CUDA_PATH": "/opt/cuda-path"}, None) == "/opt/cuda-path"


def test_setup_finds_the_nvcc_pip_installs_for_torchs_cuda_major(tmp_path):
    # nvidia-cuda-nvcc (CUDA 13 on) puts nvcc in site-packages/nvidia/cu13/bin, next to
    # the runtime headers of torch's nvidia-cuda-runtime; the cu12 form (if it had nvcc)
    # in nvidia/cuda_nvcc.
    site = tmp_path / "site-packages"
    cu13 = site / "nvidia" / "cu13"
    _fake_nvcc(cu13, "13.0")
    cu12 = site / "nvidia" / "cuda_nvcc"
    _fake_nvcc(cu12, "12.8")
    sites = [str(tmp_path / "elsewhere"), str(site)]
    assert setup_py.pip_toolkits(sites, None) == []
    assert setup_py.pip_toolkits([str(site)], "13.0") == [cu13, site / "nvidia" / "cuda_nvcc"]
    no_local = lambda home: None if home == "/usr/local/cuda" else setup_py.nvcc_version(home)  # noqa: E731
    assert setup_py.cuda_home({}, None, "13.0", sites, no_local) == str(cu13)
    assert setup_py.cuda_home({}, None, "12.8", sites, no_local) == str(cu12)
    # A toolkit on PATH of torch's major comes first; one of another major does not.
    path_kit = tmp_path / "cuda-path"
    _fake_nvcc(path_kit, "13.2")
    assert setup_py.cuda_home({}, str(path_kit / "bin" / "nvcc"), "13.0", sites, no_local) == str(path_kit)
    assert setup_py.cuda_home({}, str(path_kit / "bin" / "nvcc"), "12.8", sites, no_local) == str(cu12)
    # Without nvcc or without the runtime headers a folder is no toolkit.
    bare = tmp_path / "bare" / "nvidia" / "cu13"
    _fake_nvcc(bare, headers=False)
    assert setup_py.pip_toolkits([str(tmp_path / "bare")], "13.0")[0] == bare
    missing = setup_py.cuda_home({}, None, "13.0", [str(tmp_path / "bare")], lambda h: None)
    assert missing in (None, "/usr/local/cuda")  # never the headerless folder


def test_setup_links_the_versioned_cudart_of_a_pip_toolkit(tmp_path):
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "libcudart.so.13").write_text("")
    assert setup_py.cudart_link(str(tmp_path)) == "-l:libcudart.so.13"
    (tmp_path / "lib64").mkdir()
    (tmp_path / "lib64" / "libcudart.so").write_text("")
    assert setup_py.cudart_link(str(tmp_path)) is None  # a full toolkit: torch's -lcudart
    assert setup_py.cudart_link(None) is None


def test_setup_builds_for_the_users_list_else_the_visible_gpus():
    assert setup_py.arch_list({"TORCH_CUDA_ARCH_LIST": "9.0"}, [(8, 0)]) == ("9.0", "TORCH_CUDA_ARCH_LIST")
    assert setup_py.arch_list({}, [(9, 0), (9, 0), (8, 6)]) == ("8.6;9.0", "the visible GPUs")
    assert setup_py.arch_list({}, [])[0] == setup_py.DEFAULT_ARCHS


def test_setup_cpu_only_extension_is_the_cpp_sources(monkeypatch):
    # What setup.py compiles where torch has no CUDA: every csrc/*.cpp, nothing of csrc/cuda.
    monkeypatch.chdir(REPO)
    monkeypatch.setenv("KT_REGROUP_CUDA", "0")
    ext = setup_py.extension()
    assert sorted(ext.sources) == sorted(str(p) for p in pathlib.Path("kt_regroup/csrc").glob("*.cpp"))
    assert ext.extra_compile_args == {"cxx": ["-O3", "-fopenmp", "-g0"]}
    assert ext.py_limited_api
