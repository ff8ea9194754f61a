"""The native CPU kernels (``kt_regroup/csrc``): find, build and load them.

The C++ code registers CPU kernels and a C++ autograd kernel for the ops defined in
``kt_regroup.ops``; it defines no schema, so everything still works without it (on the
portable kernels) where no compiler is available.

:func:`load` uses, in order:

1. an extension prebuilt inside the package (``kt_regroup/_kt_regroup_cpu*.so``);
2. the JIT build cached in ``$KT_REGROUP_CACHE_DIR`` (default
   ``~/.cache/kt_regroup``), in a folder per torch and Python version;
3. a fresh JIT build (``torch.utils.cpp_extension.load``, ninja), once per torch
   version (about a minute).

Build ahead of time (the README's install step)::

    python -m kt_regroup.kernels.cpu
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import logging
import os
import sys
import warnings
from pathlib import Path
from typing import List, Optional

import torch

logger = logging.getLogger(__name__)

__all__ = [
    "CACHE_ENV",
    "EXTENSION_NAME",
    "build",
    "build_directory",
    "built_with_torch",
    "load",
    "loaded_path",
]

EXTENSION_NAME = "kt_regroup_cpu"
CACHE_ENV = "KT_REGROUP_CACHE_DIR"
_PACKAGE_DIR = Path(__file__).resolve().parent.parent
_CSRC = _PACKAGE_DIR / "csrc"
_SOURCES = ("permute_multi_embedding_cpu.cpp", "permute_multi_embedding_autograd.cpp")
_HEADERS = ("permute_multi_embedding.h",)
# at::parallel_for is an inline OpenMP loop: without -fopenmp it would run on one thread.
_CFLAGS = ("-O3", "-fopenmp")
_LDFLAGS = ("-fopenmp",)
_STAMP = "build_info.json"

_loaded: Optional[Path] = None
_failed = False


def _torch_release(version: str) -> str:
    return version.split("+", 1)[0]


def build_directory() -> Path:
    """Where the JIT build of this torch / Python version lives."""
    root = os.environ.get(CACHE_ENV)
    if not root:
        xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        root = os.path.join(xdg, "kt_regroup")
    tag = f"torch-{torch.__version__}-py{sys.version_info[0]}{sys.version_info[1]}"
    return Path(root) / tag


def _fingerprint() -> str:
    h = hashlib.sha256()
    for name in _SOURCES + _HEADERS:
        h.update(name.encode())
        h.update((_CSRC / name).read_bytes())
    h.update(" ".join(_CFLAGS + _LDFLAGS).encode())
    h.update(torch.__version__.encode())
    return h.hexdigest()


def built_with_torch(path: os.PathLike | str) -> Optional[str]:
    """The torch version a (loaded or loadable) extension was compiled against."""
    try:
        fn = ctypes.CDLL(str(path)).kt_regroup_built_with_torch
    except (OSError, AttributeError):
        return None
    fn.restype = ctypes.c_char_p
    return fn().decode()


def _check_version(path: Path) -> None:
    built = built_with_torch(path)
    running = _torch_release(torch.__version__)
    if built is not None and _torch_release(built) != running:
        logger.warning(
            "kt_regroup: the native CPU kernel at %s was built for torch %s but torch %s is "
            "running; rebuild it with `python -m kt_regroup.kernels.cpu` if it misbehaves",
            path, built, running,
        )


def _prebuilt() -> Optional[Path]:
    found = sorted(_PACKAGE_DIR.glob(f"_{EXTENSION_NAME}*.so"))
    return found[0] if found else None


def _cached() -> Optional[Path]:
    """The cached JIT build, if it was built from the current sources."""
    directory = build_directory()
    try:
        info = json.loads((directory / _STAMP).read_text())
        path = Path(info["library"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if info.get("fingerprint") != _fingerprint() or not path.is_file():
        return None
    return path


def build(verbose: bool = False) -> Path:
    """Compiles (if needed) and loads the extension; returns the shared library path."""
    from torch.utils import cpp_extension  # heavy import: only when building

    directory = build_directory()
    directory.mkdir(parents=True, exist_ok=True)
    logger.warning(
        "kt_regroup: building the native CPU kernel for torch %s in %s (once per torch "
        "version, about a minute)", torch.__version__, directory,
    )
    library = cpp_extension.load(
        name=EXTENSION_NAME,
        sources=[str(_CSRC / s) for s in _SOURCES],
        # fresh lists: cpp_extension.load appends its own flags to the lists it is given
        # (which changed the build fingerprint and forced a rebuild in every process)
        extra_cflags=list(_CFLAGS),
        extra_ldflags=list(_LDFLAGS),
        build_directory=str(directory),
        is_python_module=False,
        verbose=verbose,
    )
    path = Path(library)
    stamp = {
        "library": str(path),
        "fingerprint": _fingerprint(),
        "torch": torch.__version__,
        "python": sys.version.split()[0],
    }
    tmp = directory / f"{_STAMP}.{os.getpid()}"
    tmp.write_text(json.dumps(stamp, indent=1))
    tmp.replace(directory / _STAMP)
    return path


def loaded_path() -> Optional[Path]:
    """The shared library loaded by :func:`load`, or ``None``."""
    return _loaded


def load(required: bool = False) -> bool:
    """Loads the native CPU kernels; ``False`` (one warning) if they cannot be had.

    ``required=True`` (``KT_REGROUP_BACKEND=cpp``) raises instead of falling back.
    """
    global _loaded, _failed
    if _loaded is not None:
        return True
    if _failed and not required:
        return False
    path: Optional[Path] = None
    try:
        path = _prebuilt()
        if path is not None:
            torch.ops.load_library(str(path))
        else:
            path = _cached()
            if path is not None:
                torch.ops.load_library(str(path))
            else:
                path = build()
    except Exception as exc:  # a compiler/ninja/linker problem: fall back, say why once
        _failed = True
        if required:
            raise RuntimeError(
                f"kt_regroup: the native CPU kernel is required (KT_REGROUP_BACKEND=cpp) "
                f"but could not be loaded: {exc}"
            ) from exc
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        logger.warning(
            "kt_regroup: native CPU kernel unavailable (%s); using the portable PyTorch "
            "kernel. Run `python -m kt_regroup.kernels.cpu` to see the full build log.",
            first_line,
        )
        return False
    _loaded = path
    _check_version(path)
    return True


def _main(argv: List[str]) -> int:
    import argparse

    parser = argparse.ArgumentParser(
        prog="python -m kt_regroup.kernels.cpu",
        description="Build (if needed) and load kt_regroup's native CPU kernels.",
    )
    parser.add_argument("--quiet", action="store_true", help="no compiler output")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    # `import kt_regroup` (run by -m before this) already tried: use that module's state.
    from kt_regroup.kernels import cpu as module

    path = module.loaded_path()
    if path is None:  # failed or disabled: build again, showing the compiler output
        path = module.build(verbose=not args.quiet)
        module._loaded = path
    print(f"kt_regroup native CPU kernel: {path} (built for torch {built_with_torch(path)})")
    has_cpu = torch._C._dispatch_has_kernel_for_dispatch_key(
        "kt_regroup::permute_multi_embedding", "CPU"
    )
    return 0 if has_cpu else 1


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
else:
    # `python -m kt_regroup.kernels.cpu` imports this module with the package (ops.py
    # loads the kernels) before running it as __main__; runpy's warning about that is
    # harmless here.
    warnings.filterwarnings(
        "ignore",
        message=r"'kt_regroup\.kernels\.cpu' found in sys\.modules",
        category=RuntimeWarning,
    )
