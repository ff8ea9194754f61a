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
    "_cpu_memory", "_check_permute_args",
}


def run_python(code: str, cwd=None, python=sys.executable, **env) -> subprocess.CompletedProcess:
    return subprocess.run(
        [python, "-c", textwrap.dedent(code)],
        capture_output=True, text=True, env={**os.environ, **env}, timeout=300, cwd=cwd,
    )


def test_library_defines_every_schema():
    proc = run_python("""
        import json, torch, kt_regroup
        from torch._library.custom_ops import OPDEFS  # Python's own: the Triton triton_ops
        print(json.dumps(sorted(s.name for s in torch._C._jit_get_all_schemas()
                                if s.name.startswith("kt_regroup::") and s.name not in OPDEFS)))
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
