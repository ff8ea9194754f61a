"""The compiled op library: built at install time, loaded at import (never compiled
there), the same schemas as the Python fallback, and a clear fallback without it."""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch

import kt_regroup
from kt_regroup import ops

PACKAGE = pathlib.Path(kt_regroup.__file__).resolve().parent
needs_library = pytest.mark.skipif(
    kt_regroup.library_path() is None, reason="the compiled op library is not loaded"
)


def run_python(code: str, cwd=None, **env) -> subprocess.CompletedProcess:
    full_env = dict(os.environ)
    full_env.pop("KT_REGROUP_BACKEND", None)
    full_env.update(env)
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True, text=True, env=full_env, timeout=300, cwd=cwd,
    )


SCHEMAS = """
    import json, torch, kt_regroup
    names = sorted(s.name for s in torch._C._jit_get_all_schemas() if s.name.startswith("kt_regroup::"))
    print(json.dumps({
        "library": kt_regroup.library_path(),
        "schemas": {n: str(getattr(torch.ops.kt_regroup, n.split("::")[1]).default._schema) for n in names},
    }))
"""


@needs_library
def test_library_schemas_equal_the_python_fallback_schemas():
    with_library = json.loads(run_python(SCHEMAS).stdout.splitlines()[-1])
    fallback = json.loads(run_python(SCHEMAS, KT_REGROUP_BACKEND="reference").stdout.splitlines()[-1])
    assert with_library["library"] is not None and fallback["library"] is None
    assert with_library["schemas"] == fallback["schemas"]
    assert sorted(with_library["schemas"]) == sorted(f"kt_regroup::{n}" for n in ops.SCHEMAS)


@needs_library
def test_fbgemm_schemas_are_kept():
    fbgemm = pytest.importorskip("fbgemm_gpu")  # noqa: F841
    for name in ("permute_multi_embedding", "kt_regroup_arguments", "regroup_keyed_tensor"):
        ours = str(getattr(torch.ops.kt_regroup, name).default._schema)
        theirs = str(getattr(torch.ops.fbgemm, name).default._schema)
        assert ours.split("::")[1] == theirs.split("::")[1], name


@needs_library
def test_import_compiles_nothing_and_writes_nothing(tmp_path):
    # A fresh process with an unwritable home: importing must not build, cache or write.
    proc = run_python(
        """
        import sys, torch, kt_regroup
        x = torch.ones(2, 3)
        out = kt_regroup.regroup_keyed_tensor([x], [["a", "b"]], [[1, 2]], [["b"]])
        print(json.dumps([kt_regroup.library_path(), kt_regroup.backend("cpu"), out[0].shape[1],
              "torch.utils.cpp_extension" in sys.modules, torch.cuda.is_initialized()]))
        """.replace("import sys", "import json, sys"),
        cwd=tmp_path, HOME="/nonexistent", XDG_CACHE_HOME="/nonexistent",
    )
    assert proc.returncode == 0, proc.stderr
    # No cpp_extension import (nothing can compile), no CUDA initialisation.
    assert json.loads(proc.stdout.splitlines()[-1]) == [kt_regroup.library_path(), "cpp", 2, False, False]
    assert list(tmp_path.iterdir()) == []
    assert "warning" not in proc.stderr.lower(), proc.stderr


@needs_library
def test_library_records_the_torch_it_was_built_with():
    built = ops._built_with_torch(pathlib.Path(kt_regroup.library_path()))
    assert built == torch.__version__.split("+")[0]


def _package_copy(tmp_path, library: bytes | None) -> pathlib.Path:
    """The package in a folder of its own, with no library or a given one."""
    copy = tmp_path / "site"
    shutil.copytree(PACKAGE, copy / "kt_regroup", ignore=shutil.ignore_patterns("_C*.so", "__pycache__"))
    if library is not None:
        (copy / "kt_regroup" / "_C.so").write_bytes(library)
    return copy


PROBE = """
    import json, torch, kt_regroup
    a = torch.randn(2, 5, requires_grad=True)
    outs = kt_regroup.regroup_keyed_tensor([a], [["x", "y"]], [[2, 3]], [["y", "x"], ["x"]])
    sum(o.sum() for o in outs).backward()
    print(json.dumps({
        "library": kt_regroup.library_path(),
        "backend": kt_regroup.backend("cpu"),
        "widths": [o.shape[1] for o in outs],
        "grad_row": a.grad[0].tolist(),
    }))
"""


@pytest.mark.parametrize("library", [None, b"not an ELF file"], ids=["absent", "unloadable"])
def test_without_a_usable_library_one_warning_and_the_python_fallback(tmp_path, library):
    site = _package_copy(tmp_path, library)
    proc = run_python(PROBE, cwd=tmp_path, PYTHONPATH=str(site))
    assert proc.returncode == 0, proc.stderr
    info = json.loads(proc.stdout.splitlines()[-1])
    assert info == {
        "library": None,
        "backend": "reference",
        "widths": [5, 2],
        "grad_row": [2.0, 2.0, 1.0, 1.0, 1.0],
    }
    assert proc.stderr.count("kt_regroup: the compiled op library") == 1, proc.stderr
    assert ("is not built" if library is None else "does not load") in proc.stderr
    assert "using the portable PyTorch kernels" in proc.stderr


def test_required_library_raises_when_absent(tmp_path):
    site = _package_copy(tmp_path, None)
    proc = run_python("import kt_regroup", cwd=tmp_path, PYTHONPATH=str(site), KT_REGROUP_BACKEND="cpp")
    assert proc.returncode != 0
    assert "KT_REGROUP_BACKEND=cpp but the compiled op library is not built" in proc.stderr


def test_unknown_backend_is_named():
    proc = run_python("import kt_regroup", KT_REGROUP_BACKEND="cuda-magic")
    assert proc.returncode != 0
    assert "KT_REGROUP_BACKEND='cuda-magic'" in proc.stderr


@needs_library
def test_outdated_library_is_reported(tmp_path):
    site = _package_copy(tmp_path, pathlib.Path(kt_regroup.library_path()).read_bytes())
    library = site / "kt_regroup" / "_C.so"
    source = site / "kt_regroup" / "csrc" / "ops.cpp"
    os.utime(library, (1_000_000, 1_000_000))  # built long before its sources changed
    proc = run_python(PROBE, cwd=tmp_path, PYTHONPATH=str(site))
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.splitlines()[-1])["backend"] == "cpp"
    assert f"{library} is older than the sources" in proc.stderr
    assert source.exists()
