"""``torch.ops.kt_regroup``: loads the op library, registers the fake kernels.

Every schema, kernel, argument check and the autograd live in the compiled library
``kt_regroup/_C*.so`` (``kt_regroup/csrc``, built when the package is installed), so a
TorchScript or AOTInductor model runs where only that library is loaded. This module

1. loads the library (``import kt_regroup`` fails with an ``ImportError`` saying how to
   build it where it is missing);
2. registers the fake kernels (``torch.compile``, ``torch.export``): output sizes come
   from the ``SymInt`` arguments, never from data, and they check only what the sizes
   need; the kernels check everything else when they run;
3. offers typed Python wrappers.

The kernels, their dispatch and the schemas: docs/op_library.md.
"""

from __future__ import annotations

import ctypes
import logging
from pathlib import Path
from typing import List, Optional, Tuple

import torch
from torch._subclasses.fake_tensor import FakeTensor

logger = logging.getLogger(__name__)

__all__ = [
    "kt_regroup_arguments",
    "library_path",
    "permute_multi_embedding",
    "permute_multi_embedding_into",
    "permute_multi_embedding_to",
    "regroup_keyed_tensor",
]

_BUILD = "pip install --no-build-isolation .` (or `-e .` in a checkout)"


def _warn_if_outdated(path: Path) -> None:
    built = ctypes.CDLL(str(path)).kt_regroup_built_with_torch
    built.restype = ctypes.c_char_p
    built = built().decode().split("+")[0]
    running = torch.__version__.split("+")[0]
    if built != running:
        logger.warning(
            "kt_regroup: %s was built for torch %s but torch %s is running; reinstall "
            "kt_regroup (`%s) if it misbehaves", path, built, running, _BUILD,
        )
    # A source checkout (editable or in-place build): has the library been rebuilt since
    # the sources were edited? An installed package ships no sources.
    sources = path.parent / "csrc"
    if (path.parent.parent / "setup.py").is_file() and sources.is_dir():
        newest = max((p.stat().st_mtime for p in sources.rglob("*") if p.is_file()), default=0.0)
        if newest > path.stat().st_mtime:
            logger.warning(
                "kt_regroup: %s is older than the sources in %s; rebuild it (`%s)",
                path, sources, _BUILD,
            )


def _load_library() -> Path:
    found = sorted(Path(__file__).resolve().parent.glob("_C*.so"))
    if not found:
        raise ImportError(
            "kt_regroup: the compiled op library kt_regroup/_C*.so is not built; install "
            f"kt_regroup with `{_BUILD}, which compiles it against your torch"
        )
    try:
        torch.ops.load_library(str(found[0]))
    except (OSError, RuntimeError) as exc:
        lines = str(exc).strip().splitlines()
        raise ImportError(
            f"kt_regroup: the op library {found[0]} does not load "
            f"({lines[0] if lines else type(exc).__name__}); rebuild it with `{_BUILD}"
        ) from exc
    _warn_if_outdated(found[0])
    return found[0]


_LIBRARY = _load_library()


def library_path() -> str:
    """The compiled op library, for C++ users (``torch::jit`` / AOTInductor predictors
    load it next to the model).

    Example::

        >>> torch.ops.load_library(kt_regroup.library_path())  # doctest: +SKIP
    """
    return str(_LIBRARY)


# --- fake kernels: sizes only --------------------------------------------------------------


def _one_device(op: str, named) -> None:
    """Meta tensors next to real ones dispatch to the fake kernels too: refused, naming
    one of each, never an uninitialised real result or outputs left unwritten."""
    real = [(label, t) for label, t in named
            if t is not None and not t.is_meta and not isinstance(t, FakeTensor)]
    if real:
        meta = next(label for label, t in named if t is not None and t.is_meta)
        raise ValueError(
            f"kt_regroup.{op}: {real[0][0]} is on {real[0][1].device} but {meta} is on meta; "
            "all must be on one device"
        )


def _gradients_device(grad_outputs, permutes) -> torch.device:
    """The device of a backward's input gradients: the first given gradient's, else the plan's."""
    return next((g.device for g in grad_outputs if g is not None), permutes.device)


def _check_sizes(op: str, name: str, tensors, sizes, sizes_name="out_lengths", **metadata) -> torch.Tensor:
    _one_device(op, [(f"{name}[{i}]", t) for i, t in enumerate(tensors)] + list(metadata.items()))
    first = next((t for t in tensors if t is not None), None)
    if first is None:
        raise ValueError(f"kt_regroup.{op}: {name} is empty")
    if first.dim() != 2:
        raise ValueError(
            f"kt_regroup.{op}: {name} must be 2-D [batch, width], got shape {tuple(first.shape)}"
        )
    for j, n in enumerate(sizes):
        if isinstance(n, int) and n < 0:
            raise ValueError(f"kt_regroup.{op}: {sizes_name}[{j}] is negative ({n})")
    return first


@torch.library.register_fake("kt_regroup::permute_multi_embedding")
def _(pooled_embs, permutes, in_shapes, out_shapes, out_lengths):
    first = _check_sizes("permute_multi_embedding", "pooled_embs", pooled_embs, out_lengths,
                         permutes=permutes, in_shapes=in_shapes, out_shapes=out_shapes)
    return [first.new_empty(first.size(0), n) for n in out_lengths]


@torch.library.register_fake("kt_regroup::permute_multi_embedding_to")
def _(pooled_embs, permutes, in_shapes, out_shapes, out_lengths, dtype=None):
    first = _check_sizes("permute_multi_embedding_to", "pooled_embs", pooled_embs, out_lengths,
                         permutes=permutes, in_shapes=in_shapes, out_shapes=out_shapes)
    return [first.new_empty(first.size(0), n, dtype=dtype or first.dtype) for n in out_lengths]


@torch.library.register_fake("kt_regroup::permute_multi_embedding_into")
def _(pooled_embs, permutes, in_shapes, out_shapes, outs):
    # Meta inputs next to real outs land here: refused, never left unwritten.
    _check_sizes("permute_multi_embedding_into", "pooled_embs", pooled_embs, (),
                 permutes=permutes, in_shapes=in_shapes, out_shapes=out_shapes,
                 **{f"outs[{j}]": o for j, o in enumerate(outs)})


@torch.library.register_fake("kt_regroup::permute_multi_embedding_backward")
def _(grad_outputs, permutes, in_shapes, out_shapes, in_lengths, batch_size, dtype):
    op = "permute_multi_embedding_backward"
    if all(g is None for g in grad_outputs):  # sizes from the arguments: only devices to check
        _check_sizes(op, "permutes", [permutes], in_lengths, "in_lengths", in_shapes=in_shapes,
                     out_shapes=out_shapes)
    else:
        _check_sizes(op, "grad_outputs", grad_outputs, in_lengths, "in_lengths", permutes=permutes,
                     in_shapes=in_shapes, out_shapes=out_shapes)
    device = _gradients_device(grad_outputs, permutes)
    return [torch.empty(batch_size, n, dtype=dtype, device=device) for n in in_lengths]


@torch.library.register_fake("kt_regroup::kt_regroup_arguments")
def _(embs, keys, lengths, groups):
    from kt_regroup.plan import get_plan  # the plan is built by the library's own op

    plan = get_plan(keys, lengths, groups)
    return (
        embs.new_empty(len(plan.rows), 6, dtype=torch.int32),
        embs.new_empty(len(plan.in_lengths), dtype=torch.int32),
        embs.new_empty(len(plan.out_lengths), dtype=torch.int32),
        list(plan.out_lengths),
    )


# --- typed wrappers ------------------------------------------------------------------------


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
        >>> p, i, o, n = kt_regroup_arguments(x, [["a", "b"]], [[1, 3]], [["b"]])
        >>> permute_multi_embedding_to([x], p, i, o, n, torch.bfloat16)[0].dtype
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


# --- the CPU kernels' output memory ------------------------------------------------------------


def cpu_memory(cache_limit: Optional[int] = None, huge_pages: Optional[bool] = None) -> dict:
    """The CPU kernels' output cache: applies the settings given, returns the state.

    Outputs and gradients of 4 MiB or more come from a cache of freed blocks, so a
    training step reuses the last step's pages instead of faulting in fresh ones (glibc
    maps every allocation past 32 MiB anew). The cache holds only freed blocks, at most
    ``cache_limit`` bytes (default 2 GiB, ``KT_REGROUP_CPU_CACHE_MB``; 0 turns it off),
    oldest released first. ``huge_pages`` (default off, ``KT_REGROUP_HUGE_PAGES=1``):
    new blocks are ``madvise(MADV_HUGEPAGE)``d 2 MiB pages.

    Returns ``{"cached_bytes", "cache_limit", "huge_pages", "hits", "misses"}``.
    """
    cached, limit, huge, hits, misses = torch.ops.kt_regroup._cpu_memory(cache_limit, huge_pages)
    return {"cached_bytes": cached, "cache_limit": limit, "huge_pages": bool(huge),
            "hits": hits, "misses": misses}


def empty_cpu_cache() -> None:
    """Releases every block the CPU output cache holds (tensors in use keep theirs) and
    returns their memory to the system; the limit stays."""
    torch.ops.kt_regroup._cpu_memory(empty=True)


# --- variable-batch (VBE) regroup: permute_multi_embedding_vbe (csrc/vbe.cpp) ----------------
# Its backward returns the input gradients flattened into one tensor, input after input.


def _vbe_batch(op: str, tensors, indices, **metadata) -> int:
    _one_device(op, [(f"pooled_embs[{i}]", t) for i, t in enumerate(tensors)]
                + [(f"indices[{i}]", t) for i, t in enumerate(indices)] + list(metadata.items()))
    given = [ix for ix in indices if ix is not None]
    if given:
        return given[0].size(0)
    first = next((t for t in tensors if t is not None), None)
    if first is None or first.dim() != 2:
        raise ValueError(f"kt_regroup.{op}: needs a 2-D input or an index to size the batch")
    return first.size(0)


@torch.library.register_fake("kt_regroup::permute_multi_embedding_vbe")
def _(pooled_embs, indices, permutes, in_shapes, out_shapes, out_lengths):
    if len(pooled_embs) == 0:
        raise ValueError("kt_regroup.permute_multi_embedding_vbe: pooled_embs is empty")
    batch = _vbe_batch("permute_multi_embedding_vbe", pooled_embs, indices, permutes=permutes,
                       in_shapes=in_shapes, out_shapes=out_shapes)
    return [pooled_embs[0].new_empty(batch, n) for n in out_lengths]


@torch.library.register_fake("kt_regroup::permute_multi_embedding_vbe_backward")
def _(grad_outputs, indices, permutes, in_shapes, out_shapes, in_lengths, in_rows, dtype):
    _one_device(
        "permute_multi_embedding_vbe_backward",
        [(f"grad_outputs[{j}]", g) for j, g in enumerate(grad_outputs)]
        + [(f"indices[{i}]", t) for i, t in enumerate(indices)]
        + [("permutes", permutes), ("in_shapes", in_shapes), ("out_shapes", out_shapes)],
    )
    device = _gradients_device(grad_outputs, permutes)
    return torch.empty(sum(r * n for r, n in zip(in_rows, in_lengths)), dtype=dtype, device=device)


def permute_multi_embedding_vbe(
    pooled_embs: List[torch.Tensor],
    indices: List[Optional[torch.Tensor]],
    permutes: torch.Tensor,
    in_shapes: torch.Tensor,
    out_shapes: torch.Tensor,
    out_lengths: List[int],
) -> List[torch.Tensor]:
    """:func:`permute_multi_embedding` of inputs whose rows are shared by several samples:
    sample ``b`` reads row ``indices[i][b]`` of ``pooled_embs[i]`` (``None``: row ``b``).
    The backward sums each row's samples deterministically; unused rows get zeros.

    Example::

        >>> rows = torch.randn(2, 3)  # two unique rows of one feature
        >>> p, i, o, n = kt_regroup_arguments(rows, [["f"]], [[3]], [["f"]])
        >>> idx = torch.tensor([1, 1, 0])
        >>> permute_multi_embedding_vbe([rows], [idx], p, i, o, n)[0].shape
        torch.Size([3, 3])
    """
    return torch.ops.kt_regroup.permute_multi_embedding_vbe(
        pooled_embs, indices, permutes, in_shapes, out_shapes, out_lengths
    )
