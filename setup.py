"""Builds kt_regroup's op library (``kt_regroup/_C*.so``) when the package is installed.

Install the torch you use first, then this package without build isolation, so the
library is compiled against that torch (an isolated build would fetch another one)::

    pip install --no-build-isolation .        # or -e . for development

The library defines every ``torch.ops.kt_regroup`` schema and kernel in C++
(``kt_regroup/csrc``). It links only libtorch, not Python, so a C++ predictor can load
it with ``dlopen`` / ``torch::jit`` next to a TorchScript or AOTInductor model; Python
loads it with ``torch.ops.load_library`` (``kt_regroup.library_path()``).
"""

from pathlib import Path

from setuptools import setup

try:
    from torch.utils.cpp_extension import BuildExtension, CppExtension
except ImportError:  # an isolated build: pip made a fresh environment without torch
    raise SystemExit(
        "kt_regroup compiles against the torch you have installed: install torch first, "
        "then kt_regroup with `pip install --no-build-isolation .`"
    ) from None

CSRC = Path("kt_regroup") / "csrc"


setup(
    ext_modules=[
        CppExtension(
            "kt_regroup._C",
            sorted(str(p) for p in CSRC.glob("*.cpp")),
            extra_compile_args={
                # at::parallel_for is an inline OpenMP loop: without -fopenmp one thread.
                "cxx": ["-O3", "-fopenmp"],
            },
            extra_link_args=["-fopenmp"],
            # No libtorch_python and no Python symbols: loadable outside Python.
            py_limited_api=True,
        )
    ],
    cmdclass={"build_ext": BuildExtension.with_options(no_python_abi_suffix=True)},
    options={"bdist_wheel": {"py_limited_api": "cp310"}},
)
