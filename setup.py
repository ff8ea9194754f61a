"""Builds kt_regroup's op library (``kt_regroup/_C*.so``) when the package is installed.

Install the torch you use first, then this package without build isolation, so the
library is compiled against that torch (an isolated build would fetch another one)::

    pip install --no-build-isolation .        # or -e . for development

The library defines every ``torch.ops.kt_regroup`` schema and kernel in C++
(``kt_regroup/csrc``). It links only libtorch, not Python, so a C++ predictor can load
it with ``dlopen`` / ``torch::jit`` next to a TorchScript or AOTInductor model; Python
loads it with ``torch.ops.load_library`` (``kt_regroup.library_path()``).

The CUDA kernels (``kt_regroup/csrc/cuda``) are compiled when the installed torch is a
CUDA build and an ``nvcc`` of the same CUDA major is found: ``$CUDA_HOME`` (or
``$CUDA_PATH``); else the toolkit of the ``nvcc`` on ``PATH``, ``/usr/local/cuda``, or the
one pip installs next to torch (``pip install nvidia-cuda-nvcc==13.0.*`` for torch's CUDA
13.0: ``site-packages/nvidia/cu13``; CUDA 12's ``nvidia-cuda-nvcc-cu12`` ships only
``ptxas``), the first of these whose major matches torch's. Otherwise the library is
CPU-only and says why. ``KT_REGROUP_CUDA=0`` forces a CPU-only build. The GPU
architectures: ``TORCH_CUDA_ARCH_LIST`` (e.g. ``"9.0"``), else the visible GPUs', else
``DEFAULT_ARCHS``.
"""

import os
import re
import shutil
import site
import subprocess
import sys
from pathlib import Path
from typing import Callable, Iterable, List, Optional, Sequence, Tuple

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


def pip_toolkits(site_dirs: Iterable[str], torch_cuda: Optional[str]) -> List[Path]:
    """Where pip's nvcc packages for torch's CUDA major put a toolkit: ``nvidia-cuda-nvcc``
    (CUDA 13 on: ``nvidia/cu13/bin/nvcc``, beside the runtime headers and libraries torch's
    own ``nvidia-*`` packages put there) and the CUDA 12 form ``nvidia-cuda-nvcc-cu12``
    (``nvidia/cuda_nvcc``)."""
    if not torch_cuda:
        return []
    major = torch_cuda.split(".")[0]
    return [Path(d) / "nvidia" / sub for d in site_dirs for sub in (f"cu{major}", "cuda_nvcc")]


def cuda_home(
    environ,
    nvcc_on_path: Optional[str],
    torch_cuda: Optional[str] = None,
    site_dirs: Sequence[str] = (),
    version: Callable[[Optional[str]], Optional[str]] = nvcc_version,
) -> Optional[str]:
    """The CUDA toolkit to build with: ``$CUDA_HOME`` / ``$CUDA_PATH`` (the user's choice);
    else, of the toolkit holding the real ``nvcc`` on ``PATH`` (through symlinks),
    ``/usr/local/cuda`` and pip's toolkits (:func:`pip_toolkits`), those with ``nvcc`` and
    the runtime headers, the first whose CUDA major is torch's, else the first; else the
    folder above ``nvcc``. (torch takes the folder above ``nvcc`` as it is found, so a
    wrapper such as ``/usr/local/bin/nvcc`` would make it look for ``libcudart`` in
    ``/usr/local/lib64``.)"""
    for name in ("CUDA_HOME", "CUDA_PATH"):
        if environ.get(name):
            return environ[name]
    candidates = [Path(os.path.realpath(nvcc_on_path)).parent.parent] if nvcc_on_path else []
    candidates += [Path("/usr/local/cuda"), *pip_toolkits(site_dirs, torch_cuda)]
    found = [
        str(home) for home in candidates
        if (home / "include" / "cuda_runtime.h").is_file() and (home / "bin" / "nvcc").is_file()
    ]  # fmt: skip
    for home in found if torch_cuda else ():
        v = version(home)
        if v and v.split(".")[0] == torch_cuda.split(".")[0]:
            return home
    if found:
        return found[0]
    return str(Path(nvcc_on_path).parent.parent) if nvcc_on_path else None


def cudart_link(home: Optional[str]) -> Optional[str]:
    """The linker flag for ``libcudart`` where the toolkit lacks the unversioned
    ``libcudart.so`` that torch's ``-lcudart`` needs (pip's ``nvidia-cuda-runtime`` ships
    only ``lib/libcudart.so.13``); None where it has one."""
    if not home:
        return None
    libs = [Path(home) / d for d in ("lib64", "lib")]
    if any((d / "libcudart.so").exists() for d in libs):
        return None
    versioned = sorted(p.name for d in libs if d.is_dir() for p in d.glob("libcudart.so.*"))
    return f"-l:{min(versioned, key=len)}" if versioned else None


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
        major = torch_cuda.split(".")[0]
        pip = (
            f"`pip install nvidia-cuda-nvcc=={torch_cuda}.*`" if int(major) >= 13 else
            f"install the CUDA {major} toolkit (pip's nvidia-cuda-nvcc-cu{major} has no nvcc)"
        )  # fmt: skip
        return False, (
            f"torch is built with CUDA {torch_cuda} but no nvcc was found: set CUDA_HOME, put "
            f"nvcc on PATH, or {pip}"
        )
    if torch_cuda.split(".")[0] != nvcc.split(".")[0]:
        return False, (
            f"nvcc is CUDA {nvcc} but torch is built with CUDA {torch_cuda}; their major "
            "versions must match"
        )
    return True, f"CUDA {nvcc} for torch's CUDA {torch_cuda}"


# Built for where no GPU is visible and TORCH_CUDA_ARCH_LIST is unset (torch 2.11 then
# finds no architecture at all): A100, H100/H200, and PTX for newer GPUs.
DEFAULT_ARCHS = "8.0;9.0+PTX"


def arch_list(environ, capabilities: Sequence[Tuple[int, int]]) -> Tuple[str, str]:
    """The ``TORCH_CUDA_ARCH_LIST`` to build for, and why: the user's setting, else the
    visible GPUs' (``capabilities``: ``torch.cuda.get_device_capability`` of each), else
    ``DEFAULT_ARCHS``."""
    if environ.get("TORCH_CUDA_ARCH_LIST"):
        return environ["TORCH_CUDA_ARCH_LIST"], "TORCH_CUDA_ARCH_LIST"
    if capabilities:
        return ";".join(sorted({f"{a}.{b}" for a, b in capabilities})), "the visible GPUs"
    return DEFAULT_ARCHS, "no GPU visible and TORCH_CUDA_ARCH_LIST unset"


def site_dirs() -> List[str]:
    """Where pip puts packages for this interpreter (for :func:`pip_toolkits`)."""
    dirs = [*site.getsitepackages(), site.getusersitepackages(), *sys.path]
    return list(dict.fromkeys(d for d in dirs if d and os.path.isdir(d)))


def extension():
    import torch
    from torch.utils import cpp_extension

    sources = sorted(str(p) for p in CSRC.glob("*.cpp"))
    # at::parallel_for is an inline OpenMP loop: without -fopenmp one thread. -g0 drops the
    # debug info Python's own CFLAGS (-g) would add: a third of the build time and most of
    # the library's size (scripts/asan.sh builds its own library, with -g).
    cxx = ["-O3", "-fopenmp", "-g0"]
    with_cuda, why = cuda_build(
        torch.version.cuda, nvcc_version(cpp_extension.CUDA_HOME),
        os.environ.get("KT_REGROUP_CUDA", ""),
    )
    print(f"kt_regroup: {'building' if with_cuda else 'not building'} the CUDA kernels: {why}")
    kind = cpp_extension.CUDAExtension if with_cuda else cpp_extension.CppExtension
    extra = {"cxx": cxx}
    link = ["-fopenmp"]
    if with_cuda:
        gpus = [torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())]
        archs, why = arch_list(os.environ, gpus)
        print(f"kt_regroup: CUDA kernels for {archs} ({why}), nvcc of {cpp_extension.CUDA_HOME}")
        os.environ["TORCH_CUDA_ARCH_LIST"] = archs
        sources += sorted(str(p) for p in (CSRC / "cuda").glob("*.cu"))
        extra["nvcc"] = ["-O3"]
    ext = kind(
        "kt_regroup._C",
        sources,
        extra_compile_args=extra,
        extra_link_args=link,
        # No libtorch_python and no Python symbols: loadable outside Python.
        py_limited_api=True,
    )
    cudart = cudart_link(cpp_extension.CUDA_HOME) if with_cuda else None
    if cudart and "cudart" in ext.libraries:
        ext.libraries.remove("cudart")
        link.append(cudart)
    return ext


def _torch_cuda() -> Optional[str]:
    """``torch.version.cuda``; None without torch. (``import torch`` leaves
    ``torch.utils.cpp_extension``, which reads ``CUDA_HOME`` at import, unimported.)"""
    try:
        import torch
    except ImportError:
        return None
    return torch.version.cuda


if __name__ == "__main__":  # setuptools runs this file as __main__; tests import it
    from setuptools import setup

    # Before torch.utils.cpp_extension reads it (at import).
    _home = cuda_home(os.environ, shutil.which("nvcc"), _torch_cuda(), site_dirs())
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
