"""``torch.ops.kt_regroup``: the Python side of the op library.

The ops, their schemas, kernels and autograd live in the compiled library
``kt_regroup/_C*.so`` (``kt_regroup/csrc``, built when the package is installed), so a
TorchScript or AOTInductor model runs where only that library is loaded. This module

1. loads the library (``KT_REGROUP_BACKEND=reference`` skips it), or, where it is
   absent, defines the same schemas here with the portable Python kernels and a Python
   autograd, after one warning;
2. registers the fake kernels (compile, export), whose output sizes come from the
   ``SymInt`` arguments, never from data;
3. registers the backends that replace a device's kernels (``triton`` on CUDA by
   default, ``fbgemm`` on request; see :func:`backend`), importing their modules on
   first use;
4. offers typed Python wrappers.

Ops (FBGEMM's schemas where FBGEMM has the op)::

    permute_multi_embedding(Tensor[] pooled_embs, Tensor permutes, Tensor in_shapes,
        Tensor out_shapes, SymInt[] out_lengths) -> Tensor[]
    permute_multi_embedding_backward(Tensor?[] grad_outputs, Tensor permutes,
        Tensor in_shapes, Tensor out_shapes, SymInt[] in_lengths, SymInt batch_size,
        ScalarType dtype) -> Tensor[]
    permute_multi_embedding_to(..., SymInt[] out_lengths, ScalarType? dtype=None)
        -> Tensor[]                                  (the regroup with a fused cast)
    permute_multi_embedding_into(..., Tensor(a!)[] outs) -> ()  (preallocated outputs)
    kt_regroup_arguments(Tensor embs, str[][] keys, int[][] lengths, str[][] groups)
        -> (Tensor, Tensor, Tensor, int[])
    regroup_keyed_tensor(Tensor[] pooled_embs, str[][] keys, int[][] lengths,
        str[][] groups) -> Tensor[]
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import threading
import warnings
from pathlib import Path
from typing import List, Optional, Tuple

import torch

from kt_regroup.kernels import reference
from kt_regroup.kernels.validation import check_into_outputs, check_structure
from kt_regroup.plan import PERMUTE_COLUMNS, get_plan

logger = logging.getLogger(__name__)

__all__ = [
    "BACKEND_ENV",
    "SCHEMAS",
    "backend",
    "kt_regroup_arguments",
    "library_path",
    "permute_multi_embedding",
    "permute_multi_embedding_into",
    "permute_multi_embedding_to",
    "regroup_keyed_tensor",
    "requested_backend",
]

NAMESPACE = "kt_regroup"
BACKEND_ENV = "KT_REGROUP_BACKEND"
_BACKENDS = ("auto", "reference", "cpp", "triton", "fbgemm")

# The schemas of csrc/ops.cpp, defined here only where the library is absent (a test
# checks that both sets are identical).
SCHEMAS = {
    "permute_multi_embedding": "(Tensor[] pooled_embs, Tensor permutes, Tensor in_shapes, "
    "Tensor out_shapes, SymInt[] out_lengths) -> Tensor[]",
    "permute_multi_embedding_backward": "(Tensor?[] grad_outputs, Tensor permutes, "
    "Tensor in_shapes, Tensor out_shapes, SymInt[] in_lengths, SymInt batch_size, "
    "ScalarType dtype) -> Tensor[]",
    "permute_multi_embedding_to": "(Tensor[] pooled_embs, Tensor permutes, Tensor in_shapes, "
    "Tensor out_shapes, SymInt[] out_lengths, ScalarType? dtype=None) -> Tensor[]",
    "permute_multi_embedding_into": "(Tensor[] pooled_embs, Tensor permutes, Tensor in_shapes, "
    "Tensor out_shapes, Tensor(a!)[] outs) -> ()",
    "kt_regroup_arguments": "(Tensor embs, str[][] keys, int[][] lengths, str[][] groups) "
    "-> (Tensor, Tensor, Tensor, int[])",
    "regroup_keyed_tensor": "(Tensor[] pooled_embs, str[][] keys, int[][] lengths, "
    "str[][] groups) -> Tensor[]",
}


# --- 1. the compiled library ---------------------------------------------------------------


def requested_backend() -> str:
    """``KT_REGROUP_BACKEND``: ``auto`` (default: the compiled library; Triton on CUDA
    where it imports), ``reference`` (skip the compiled library: the portable Python
    kernels everywhere), ``cpp`` (the library is required; no Triton), ``triton`` (Triton
    on CUDA, and on CPU tensors too under ``TRITON_INTERPRET=1``) or ``fbgemm``
    (FBGEMM's op on each device it has a kernel for). See :func:`backend`."""
    value = os.environ.get(BACKEND_ENV, "auto").strip().lower() or "auto"
    if value not in _BACKENDS:
        raise ValueError(f"{BACKEND_ENV}={value!r}: expected one of {', '.join(_BACKENDS)}")
    return value


def _built_with_torch(path: Path) -> Optional[str]:
    try:
        fn = ctypes.CDLL(str(path)).kt_regroup_built_with_torch
    except (OSError, AttributeError):
        return None
    fn.restype = ctypes.c_char_p
    return fn().decode()


def _warn_if_outdated(path: Path) -> None:
    built = _built_with_torch(path)
    running = torch.__version__.split("+")[0]
    if built is not None and built.split("+")[0] != running:
        logger.warning(
            "kt_regroup: %s was built for torch %s but torch %s is running; reinstall "
            "kt_regroup (pip install --no-build-isolation .) if it misbehaves",
            path, built, running,
        )
    sources = path.parent / "csrc"
    if sources.is_dir():  # a source checkout: has the library been rebuilt since edits?
        newest = max((p.stat().st_mtime for p in sources.iterdir()), default=0.0)
        if newest > path.stat().st_mtime:
            logger.warning(
                "kt_regroup: %s is older than the sources in %s; rebuild it "
                "(pip install --no-build-isolation -e . or python setup.py build_ext --inplace)",
                path, sources,
            )


def _load_library() -> Optional[Path]:
    wanted = requested_backend()
    if wanted == "reference":
        return None
    found = sorted(Path(__file__).resolve().parent.glob("_C*.so"))
    problem = "is not built (no kt_regroup/_C*.so)"
    if found:
        try:
            torch.ops.load_library(str(found[0]))
        except (OSError, RuntimeError) as exc:
            lines = str(exc).strip().splitlines()
            problem = f"at {found[0]} does not load ({lines[0] if lines else type(exc).__name__})"
        else:
            _warn_if_outdated(found[0])
            return found[0]
    if wanted == "cpp":
        raise RuntimeError(f"kt_regroup: {BACKEND_ENV}=cpp but the compiled op library {problem}")
    logger.warning(
        "kt_regroup: the compiled op library %s; using the portable PyTorch kernels "
        "(`pip install --no-build-isolation .` builds it)",
        problem,
    )
    return None


_LIBRARY = _load_library()


def library_path() -> Optional[str]:
    """The compiled op library in use, for C++ users (``torch::jit`` / AOTInductor
    predictors load it next to the model), or ``None`` when there is none.

    Example::

        >>> torch.ops.load_library(kt_regroup.library_path())  # doctest: +SKIP
    """
    return None if _LIBRARY is None else str(_LIBRARY)


# --- 2. without the library: schemas, portable kernels and autograd defined here ----------


def _kt_regroup_arguments_reference(embs, keys, lengths, groups):
    plan = get_plan(keys, lengths, groups)
    return (*plan.tensors(embs.device), list(plan.out_lengths))


def _regroup_keyed_tensor_reference(pooled_embs, keys, lengths, groups):
    if len(pooled_embs) != len(keys):
        raise ValueError(
            f"kt_regroup.regroup_keyed_tensor: {len(pooled_embs)} tensors but keys for {len(keys)}"
        )
    plan = get_plan(keys, lengths, groups)
    return torch.ops.kt_regroup.permute_multi_embedding(
        pooled_embs, *plan.coalesced_tensors(pooled_embs[0].device), list(plan.out_lengths)
    )


# The Python autograd mirrors csrc/autograd.cpp: Autograd kernels around
# torch.autograd.Functions whose forward redispatches below autograd.


class _Permute(torch.autograd.Function):
    """permute_multi_embedding and, with ``cast``, permute_multi_embedding_to."""

    @staticmethod
    def forward(ctx, permutes, in_shapes, out_shapes, out_lengths, dtype, cast, *pooled_embs):
        # Index tensors nothing modifies: attributes rather than saved tensors, so plans
        # made under torch.inference_mode() train too.
        ctx.plan_tensors = (permutes, in_shapes, out_shapes)
        ctx.in_lengths = [t.size(1) for t in pooled_embs]
        ctx.batch_size = pooled_embs[0].size(0) if pooled_embs else 0
        # Gradients in the widest input dtype; autograd casts each to its input's dtype.
        ctx.dtype = functools.reduce(torch.promote_types, (t.dtype for t in pooled_embs)) if pooled_embs else None
        with torch._C._AutoDispatchBelowAutograd():
            if cast:
                return tuple(torch.ops.kt_regroup.permute_multi_embedding_to(
                    list(pooled_embs), permutes, in_shapes, out_shapes, out_lengths, dtype
                ))
            return tuple(torch.ops.kt_regroup.permute_multi_embedding(
                list(pooled_embs), permutes, in_shapes, out_shapes, out_lengths
            ))

    @staticmethod
    def backward(ctx, *grads):
        grad_inputs = torch.ops.kt_regroup.permute_multi_embedding_backward(
            list(grads), *ctx.plan_tensors, ctx.in_lengths, ctx.batch_size, ctx.dtype
        )
        return (None,) * 6 + tuple(grad_inputs)


def _permute_autograd(pooled_embs, permutes, in_shapes, out_shapes, out_lengths):
    return list(_Permute.apply(permutes, in_shapes, out_shapes, out_lengths, None, False,
                               *pooled_embs))


def _permute_to_autograd(pooled_embs, permutes, in_shapes, out_shapes, out_lengths, dtype=None):
    return list(_Permute.apply(permutes, in_shapes, out_shapes, out_lengths, dtype, True,
                               *pooled_embs))


class _PermuteBackward(torch.autograd.Function):
    """The backward op: its gradient is the forward permute, cast back to the output
    gradients' dtype. The defined gradients come as separate arguments (``positions``
    says where they go): autograd sees no tensor inside a list."""

    @staticmethod
    def forward(ctx, positions, n_out, permutes, in_shapes, out_shapes, in_lengths, batch_size,
                dtype, *defined):
        grads = [None] * n_out
        for k, j in enumerate(positions):
            grads[j] = defined[k]
        ctx.plan_tensors = (permutes, in_shapes, out_shapes)
        ctx.positions = positions
        ctx.widths = [None if g is None else g.size(1) for g in grads]
        ctx.grad_dtype = defined[0].dtype if defined else dtype
        with torch._C._AutoDispatchBelowAutograd():
            return tuple(torch.ops.kt_regroup.permute_multi_embedding_backward(
                grads, permutes, in_shapes, out_shapes, in_lengths, batch_size, dtype
            ))

    @staticmethod
    def backward(ctx, *grad_grads):
        widths = ctx.widths
        if None in widths:  # a None gradient: its width is only in out_shapes
            declared = ctx.plan_tensors[2].tolist()
            widths = [declared[j] if w is None else w for j, w in enumerate(widths)]
        like = next(g for g in grad_grads if g is not None)
        inputs = [torch.zeros_like(like) if g is None else g for g in grad_grads]
        outs = torch.ops.kt_regroup.permute_multi_embedding_to(
            inputs, *ctx.plan_tensors, widths, ctx.grad_dtype
        )
        return (None,) * 8 + tuple(outs[j] for j in ctx.positions)


def _permute_backward_autograd(grad_outputs, permutes, in_shapes, out_shapes, in_lengths,
                               batch_size, dtype):
    positions = [j for j, g in enumerate(grad_outputs) if g is not None]
    return list(_PermuteBackward.apply(
        positions, len(grad_outputs), permutes, in_shapes, out_shapes, in_lengths, batch_size,
        dtype, *(grad_outputs[j] for j in positions),
    ))


def _define_without_library() -> torch.library.Library:
    lib = torch.library.Library(NAMESPACE, "DEF")
    for name, schema in SCHEMAS.items():
        lib.define(name + schema)
    for name, kernel in (
        ("permute_multi_embedding", reference.permute_multi_embedding_reference),
        ("permute_multi_embedding_to", reference.permute_multi_embedding_to_reference),
        ("permute_multi_embedding_into", reference.permute_multi_embedding_into_reference),
        ("permute_multi_embedding_backward", reference.permute_multi_embedding_backward_reference),
        ("kt_regroup_arguments", _kt_regroup_arguments_reference),
    ):
        lib.impl(name, kernel, "CompositeExplicitAutograd")
    lib.impl("regroup_keyed_tensor", _regroup_keyed_tensor_reference, "CompositeImplicitAutograd")
    lib.impl("permute_multi_embedding", _permute_autograd, "Autograd")
    lib.impl("permute_multi_embedding_to", _permute_to_autograd, "Autograd")
    lib.impl("permute_multi_embedding_backward", _permute_backward_autograd, "Autograd")
    return lib


if _LIBRARY is None:
    _lib = _define_without_library()


# --- 3. fake kernels -------------------------------------------------------------------------


@torch.library.register_fake(f"{NAMESPACE}::permute_multi_embedding")
def _(pooled_embs, permutes, in_shapes, out_shapes, out_lengths):
    return _permute_to_fake(pooled_embs, permutes, in_shapes, out_shapes, out_lengths)


@torch.library.register_fake(f"{NAMESPACE}::permute_multi_embedding_to")
def _permute_to_fake(pooled_embs, permutes, in_shapes, out_shapes, out_lengths, dtype=None):
    check_structure("permute_multi_embedding", "pooled_embs", pooled_embs, permutes, in_shapes,
                    out_shapes, len(pooled_embs), out_lengths, same_dtype=dtype is None)
    first = pooled_embs[0]
    return [first.new_empty(first.size(0), n, dtype=dtype or first.dtype) for n in out_lengths]


@torch.library.register_fake(f"{NAMESPACE}::permute_multi_embedding_into")
def _(pooled_embs, permutes, in_shapes, out_shapes, outs):
    check_structure("permute_multi_embedding_into", "pooled_embs", pooled_embs, permutes,
                    in_shapes, out_shapes, len(pooled_embs), [o.size(-1) for o in outs])
    # Meta inputs next to real outs land here too: the outs are checked, not skipped.
    check_into_outputs("permute_multi_embedding_into", pooled_embs, outs, overlap=False)


@torch.library.register_fake(f"{NAMESPACE}::permute_multi_embedding_backward")
def _(grad_outputs, permutes, in_shapes, out_shapes, in_lengths, batch_size, dtype):
    check_structure("permute_multi_embedding_backward", "grad_outputs", grad_outputs, permutes,
                    in_shapes, out_shapes, len(in_lengths), in_lengths, allow_none=True)
    device = next((g.device for g in grad_outputs if g is not None), None)
    if device is None:  # no gradients: metadata on meta makes meta results, never real ones
        meta = any(t.is_meta for t in (permutes, in_shapes, out_shapes))
        device = torch.device("meta") if meta else permutes.device
    return [torch.empty(batch_size, n, dtype=dtype, device=device) for n in in_lengths]


@torch.library.register_fake(f"{NAMESPACE}::kt_regroup_arguments")
def _(embs, keys, lengths, groups):
    plan = get_plan(keys, lengths, groups)
    empty = lambda *size: torch.empty(*size, dtype=torch.int32, device=embs.device)  # noqa: E731
    return (
        empty(len(plan.rows), PERMUTE_COLUMNS),
        empty(len(plan.in_lengths)),
        empty(len(plan.out_lengths)),
        list(plan.out_lengths),
    )


# --- 4. backends: what serves each device ----------------------------------------------------
#
# The compiled library registers the portable kernel for every device
# (CompositeExplicitAutograd) and the native one for CPU. A backend adds a kernel for one
# dispatch key (CPU, CUDA) in Python that calls its own kernels and, for what they do not
# take (they return NotImplemented), the kernel that served that key before, fetched with
# torch.library.get_kernel before the registration. The autograd kernels above it
# redispatch to it, so the backward and double backward use it too. Its module (and
# Triton, fbgemm_gpu) is imported on the first call, never at `import kt_regroup`.

_DEVICE_OPS = (
    "permute_multi_embedding",
    "permute_multi_embedding_to",
    "permute_multi_embedding_into",
    "permute_multi_embedding_backward",
)


def _triton_kernels(key: str) -> dict:
    from kt_regroup.kernels import triton as kernels

    return {
        "permute_multi_embedding": functools.partial(
            kernels.permute_multi_embedding_to_triton, op="permute_multi_embedding"
        ),
        "permute_multi_embedding_to": kernels.permute_multi_embedding_to_triton,
        "permute_multi_embedding_into": kernels.permute_multi_embedding_into_triton,
        "permute_multi_embedding_backward": kernels.permute_multi_embedding_backward_op_triton,
    }


def _fbgemm_kernels(key: str) -> dict:
    from kt_regroup.kernels import fbgemm as kernels

    if not kernels.has_kernel(key):
        raise RuntimeError(f"the installed fbgemm_gpu has no {key} kernel")
    return {
        "permute_multi_embedding": kernels.permute_multi_embedding_fbgemm,
        "permute_multi_embedding_to": kernels.permute_multi_embedding_to_fbgemm,
        "permute_multi_embedding_backward": kernels.permute_multi_embedding_backward_fbgemm,
    }


class _Backend:
    """Kernels of backend ``name`` registered for dispatch key ``key``; loaded on first
    use; where they cannot load, one warning and the previous kernels from then on."""

    def __init__(self, name: str, key: str, load, fallback_name: str) -> None:
        self.name, self.key, self._load, self.fallback_name = name, key, load, fallback_name
        self._kernels: Optional[dict] = None
        self._lock = threading.Lock()  # first calls from several threads: one load, one warning
        self._fallback = {
            op: torch.library.get_kernel(f"{NAMESPACE}::{op}", key) for op in _DEVICE_OPS
        }

    def kernels(self) -> dict:
        if self._kernels is not None:
            return self._kernels
        with self._lock:
            if self._kernels is not None:
                return self._kernels
            try:
                self._kernels = self._load(self.key)
            except Exception as exc:  # ImportError, a broken install: reported, not fatal
                self._kernels = {}
                logger.warning(
                    "kt_regroup: the %s backend is unavailable for %s tensors (%s: %s); "
                    "using the %s kernel",
                    self.name, self.key, type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "",
                    self.fallback_name,
                )
        return self._kernels

    def serving(self) -> str:
        return self.name if self.kernels() else self.fallback_name

    def register(self, lib: torch.library.Library) -> None:
        with warnings.catch_warnings():  # replacing the CPU kernel is the point: no warning
            warnings.filterwarnings("ignore", "Warning only once for all operators")
            for op in _DEVICE_OPS:
                lib.impl(op, functools.partial(self._call, op), self.key, with_keyset=True)

    def _call(self, op, keyset, *args, **kwargs):
        kernel = self.kernels().get(op)
        result = NotImplemented if kernel is None else kernel(*args, **kwargs)
        if result is NotImplemented:
            return self._fallback[op].call_boxed(keyset, *args, **kwargs)
        return result


def _native_backend(key: str) -> str:
    """What the compiled library (or the Python fallback) serves ``key`` with."""
    native = torch._C._dispatch_has_kernel_for_dispatch_key(
        f"{NAMESPACE}::permute_multi_embedding", key
    )
    return "cpp" if native else "reference"


def _install_backends(wanted: str) -> dict:
    chosen = {}
    if wanted in ("auto", "triton"):
        chosen["CUDA"] = ("triton", _triton_kernels)
        if wanted == "triton" and os.environ.get("TRITON_INTERPRET") == "1":
            chosen["CPU"] = ("triton", _triton_kernels)  # Triton's interpreter: CPU tensors
    elif wanted == "fbgemm":
        chosen = {key: ("fbgemm", _fbgemm_kernels) for key in ("CPU", "CUDA")}
    if not chosen:
        return {}
    backends = {key: _Backend(name, key, load, _native_backend(key)) for key, (name, load) in chosen.items()}
    lib = torch.library.Library(NAMESPACE, "IMPL")
    for b in backends.values():
        b.register(lib)
    backends["_lib"] = lib  # kept alive: dropping it would unregister the kernels
    return backends


_SERVING = _install_backends(requested_backend())


def backend(device: torch.device | str = "cpu") -> str:
    """The kernels that serve ``torch.ops.kt_regroup.*`` on ``device``: ``triton``,
    ``fbgemm``, ``cpp`` (the native CPU kernel) or ``reference`` (the portable kernel:
    in C++ where the library is loaded, else in Python). Asking for a device whose
    backend is not loaded yet loads it (Triton, fbgemm_gpu), with its warning if it
    cannot.

    Example::

        >>> kt_regroup.backend("cpu")  # doctest: +SKIP
        'cpp'
    """
    key = {"cpu": "CPU", "cuda": "CUDA"}.get(torch.device(device).type)
    if key is None:
        return "reference"
    if key in _SERVING:
        return _SERVING[key].serving()
    return _native_backend(key)


# --- 5. typed wrappers -------------------------------------------------------------------------


def permute_multi_embedding(
    pooled_embs: List[torch.Tensor],
    permutes: torch.Tensor,
    in_shapes: torch.Tensor,
    out_shapes: torch.Tensor,
    out_lengths: List[int],
) -> List[torch.Tensor]:
    """Copies the column segments that ``permutes`` names into fresh outputs."""
    return torch.ops.kt_regroup.permute_multi_embedding(
        pooled_embs, permutes, in_shapes, out_shapes, out_lengths
    )


def permute_multi_embedding_to(
    pooled_embs: List[torch.Tensor],
    permutes: torch.Tensor,
    in_shapes: torch.Tensor,
    out_shapes: torch.Tensor,
    out_lengths: List[int],
    dtype: Optional[torch.dtype] = None,
) -> List[torch.Tensor]:
    """:func:`permute_multi_embedding` with the outputs cast to ``dtype`` in the same
    pass; gradients come back in the inputs' dtype.

    Example::

        >>> x = torch.randn(2, 4)
        >>> p, i, o = RegroupPlan.build([["a", "b"]], [[1, 3]], [["b"]]).tensors()
        >>> permute_multi_embedding_to([x], p, i, o, [3], torch.bfloat16)[0].dtype
        torch.bfloat16
    """
    return torch.ops.kt_regroup.permute_multi_embedding_to(
        pooled_embs, permutes, in_shapes, out_shapes, out_lengths, dtype
    )


def permute_multi_embedding_into(
    pooled_embs: List[torch.Tensor],
    permutes: torch.Tensor,
    in_shapes: torch.Tensor,
    out_shapes: torch.Tensor,
    outs: List[torch.Tensor],
) -> None:
    """Writes the regroup into caller-owned ``outs`` (inference; no autograd). Each is
    overwritten in full; they must not overlap the inputs or each other."""
    torch.ops.kt_regroup.permute_multi_embedding_into(
        pooled_embs, permutes, in_shapes, out_shapes, outs
    )


def kt_regroup_arguments(
    embs: torch.Tensor,
    keys: List[List[str]],
    lengths: List[List[int]],
    groups: List[List[str]],
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, List[int]]:
    """``(permutes, in_shapes, out_shapes, out_lengths)`` of a layout, on ``embs``'s
    device, in torchrec's format."""
    return torch.ops.kt_regroup.kt_regroup_arguments(embs, keys, lengths, groups)


def regroup_keyed_tensor(
    pooled_embs: List[torch.Tensor],
    keys: List[List[str]],
    lengths: List[List[int]],
    groups: List[List[str]],
) -> List[torch.Tensor]:
    """Regroups the column blocks of ``pooled_embs`` into one tensor per group.

    Example::

        >>> a, b = torch.randn(2, 5), torch.randn(2, 4)
        >>> outs = regroup_keyed_tensor([a, b], [["x", "y"], ["z"]], [[2, 3], [4]],
        ...                             [["z", "x"], ["y"]])
        >>> [o.shape[1] for o in outs]
        [6, 3]
    """
    return torch.ops.kt_regroup.regroup_keyed_tensor(pooled_embs, keys, lengths, groups)
