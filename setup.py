"""Builds kt_regroup's op library (``kt_regroup/_C*.so``) when the package is installed.

Install the torch you use first, then this package without build isolation, so the
library is compiled against that torch (an isolated build would fetch another one)::

    pip install --no-build-isolation .        # or -e . for development

The library defines every ``torch.ops.kt_regroup`` schema and kernel in C++
(``kt_regroup/csrc``). It links only libtorch, not Python, so a C++ predictor can load
it with ``dlopen`` / ``torch::jit`` next to a TorchScript or AOTInductor model; Python
loads it with ``torch.ops.load_library`` (``kt_regroup.library_path()``).

The CUDA kernels (``kt_regroup/csrc/cuda``) are compiled when the installed torch is a
CUDA build and ``nvcc`` (``$CUDA_HOME/bin/nvcc``) has the same CUDA major version;
otherwise the library is CPU-only and says why. ``KT_REGROUP_CUDA=0`` forces a CPU-only
build; ``TORCH_CUDA_ARCH_LIST`` (e.g. ``"9.0"``) picks the GPU architectures (default: the
visible GPUs, else ``DEFAULT_ARCHS``).
"""

import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Optional, Tuple

CSRC = Path("kt_regroup") / "csrc"


def nvcc_version(cuda_home: Optional[str]) -> Optional[str]:
    """``"13.0"`` from ``$cuda_home/bin/nvcc --version``; None without a working nvcc."""
    if not cuda_home:
        return None
    try:
        out = subprocess.run(
            [str(Path(cuda_home) / "bin" / "nvcc"), "--version"],
            capture_output=True, text=True, check=True,
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    found = re.search(r"release (\d+\.\d+)", out)
    return found.group(1) if found else None


def cuda_home(environ, nvcc_on_path: Optional[str]) -> Optional[str]:
    """The CUDA toolkit: ``$CUDA_HOME`` / ``$CUDA_PATH``; else the toolkit holding the real
    ``nvcc`` on ``PATH`` (through symlinks) or ``/usr/local/cuda``, whichever has the
    headers; else the folder above ``nvcc``. (torch takes the folder above ``nvcc`` as it
    is found, so a wrapper such as ``/usr/local/bin/nvcc`` would make it look for
    ``libcudart`` in ``/usr/local/lib64``.)"""
    for name in ("CUDA_HOME", "CUDA_PATH"):
        if environ.get(name):
            return environ[name]
    candidates = [Path(os.path.realpath(nvcc_on_path)).parent.parent] if nvcc_on_path else []
    candidates.append(Path("/usr/local/cuda"))
    for home in candidates:
        if (home / "include" / "cuda_runtime.h").is_file() and (home / "bin" / "nvcc").is_file():
            return str(home)
    return str(Path(nvcc_on_path).parent.parent) if nvcc_on_path else None


def cuda_build(torch_cuda: Optional[str], nvcc: Optional[str], env: str = "") -> Tuple[bool, str]:
    """Whether to compile the CUDA kernels, and why (or why not).

    ``torch_cuda``: ``torch.version.cuda`` (None for a CPU build of torch); ``nvcc``: its
    version (None where there is none); ``env``: ``$KT_REGROUP_CUDA`` ("0" forces CPU-only).
    """
    if env == "0":
        return False, "KT_REGROUP_CUDA=0"
    if not torch_cuda:
        return False, "torch is a CPU build (torch.version.cuda is None)"
    if not nvcc:
        return False, f"torch is built with CUDA {torch_cuda} but no nvcc was found (set CUDA_HOME)"
    if torch_cuda.split(".")[0] != nvcc.split(".")[0]:
        return False, (
            f"nvcc is CUDA {nvcc} but torch is built with CUDA {torch_cuda}; their major "
            "versions must match"
        )
    return True, f"CUDA {nvcc} for torch's CUDA {torch_cuda}"


# Built for where no GPU is visible and TORCH_CUDA_ARCH_LIST is unset (torch 2.11 then
# finds no architecture at all): A100, H100/H200, and PTX for newer GPUs.
DEFAULT_ARCHS = "8.0;9.0+PTX"


def arch_list(environ, gpu_visible: bool) -> Optional[str]:
    """The ``TORCH_CUDA_ARCH_LIST`` to set, or None to leave torch's choice (the user's
    setting, else the visible GPUs)."""
    if environ.get("TORCH_CUDA_ARCH_LIST") or gpu_visible:
        return None
    return DEFAULT_ARCHS


def extension():
    import torch
    from torch.utils import cpp_extension

    sources = sorted(str(p) for p in CSRC.glob("*.cpp"))
    # at::parallel_for is an inline OpenMP loop: without -fopenmp one thread.
    cxx = ["-O3", "-fopenmp"]
    with_cuda, why = cuda_build(
        torch.version.cuda, nvcc_version(cpp_extension.CUDA_HOME),
        os.environ.get("KT_REGROUP_CUDA", ""),
    )
    print(f"kt_regroup: {'building' if with_cuda else 'not building'} the CUDA kernels: {why}")
    kind = cpp_extension.CUDAExtension if with_cuda else cpp_extension.CppExtension
    extra = {"cxx": cxx}
    if with_cuda:
        archs = arch_list(os.environ, torch.cuda.is_available())
        if archs:
            print(f"kt_regroup: no GPU visible and TORCH_CUDA_ARCH_LIST unset: building for {archs}")
            os.environ["TORCH_CUDA_ARCH_LIST"] = archs
        sources += sorted(str(p) for p in (CSRC / "cuda").glob("*.cu"))
        extra["nvcc"] = ["-O3"]
    return kind(
        "kt_regroup._C",
        sources,
        extra_compile_args=extra,
        extra_link_args=["-fopenmp"],
        # No libtorch_python and no Python symbols: loadable outside Python.
        py_limited_api=True,
    )


if __name__ == "__main__":  # setuptools runs this file as __main__; tests import it
    from setuptools import setup

    # Before torch.utils.cpp_extension reads it (at import).
    _home = cuda_home(os.environ, shutil.which("nvcc"))
    if _home:
        os.environ["CUDA_HOME"] = _home

    try:
        from torch.utils.cpp_extension import BuildExtension
    except ImportError:  # an isolated build: pip made a fresh environment without torch
        raise SystemExit(
            "kt_regroup compiles against the torch you have installed: install torch first, "
            "then kt_regroup with `pip install --no-build-isolation .`"
        ) from None

    setup(
        ext_modules=[extension()],
        cmdclass={"build_ext": BuildExtension.with_options(no_python_abi_suffix=True)},
        options={"bdist_wheel": {"py_limited_api": "cp310"}},
    )
