"""The permute plan of a layout, as Python values: :class:`RegroupPlan`, :func:`get_plan`.

A *layout* is the keys and widths of each input tensor plus the groups the model
wants. The plan is built by the op library's ``kt_regroup_arguments`` (one builder, in
C++, with its checks and errors); this module keeps the result as tuples, in a bounded
cache, for the module and the fake kernels.

Permute rows use torchrec's / FBGEMM's format (six int32 columns)::

    [in_tensor, out_tensor, in_offset, out_offset, length, next]

``next`` chains the rows of a duplicated key, as torchrec's ``_kt_regroup_arguments``
does: the first occurrence holds the index of the second, later occurrences hold minus
the index of the next one, the last minus the row count; rows of keys used once hold 0.
"""

from __future__ import annotations

import functools
from contextlib import nullcontext
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import torch
from torch.utils._python_dispatch import _disable_current_modes

__all__ = ["RegroupPlan", "arguments", "get_plan"]

Names = Tuple[Tuple[str, ...], ...]


@dataclass(frozen=True)
class RegroupPlan:
    """Permute metadata for one (keys, lengths, groups) layout. Immutable.

    Example::

        >>> plan = get_plan([["a", "b"], ["c"]], [[2, 3], [4]], [["c", "a"], ["b"]])
        >>> plan.out_lengths
        (6, 3)
        >>> plan.tensors()[0].tolist()  # torchrec's format: one row per group entry
        [[1, 0, 0, 0, 4, 0], [0, 0, 0, 4, 2, 0], [0, 1, 2, 0, 3, 0]]
    """

    keys: Names
    lengths: Tuple[Tuple[int, ...], ...]
    groups: Names
    rows: Tuple[Tuple[int, ...], ...]
    in_lengths: Tuple[int, ...]
    out_lengths: Tuple[int, ...]

    def tensors(
        self, device: torch.device | str | None = None
    ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(permutes, in_shapes, out_shapes)``, int32, torchrec's format (what
        ``kt_regroup_arguments`` returns). Fresh tensors on every call: the caller's own."""
        permutes = torch.tensor(self.rows, dtype=torch.int32, device=device).reshape(-1, 6)
        in_shapes = torch.tensor(self.in_lengths, dtype=torch.int32, device=device)
        out_shapes = torch.tensor(self.out_lengths, dtype=torch.int32, device=device)
        return permutes, in_shapes, out_shapes

    def view_specs(self) -> List[Optional[Tuple[int, int, int]]]:
        """Per output: ``(input, offset, width)`` when the whole output is one contiguous
        run of columns of one input (it could be returned as a view), else ``None``."""
        specs: List[Optional[Tuple[int, int, int]]] = []
        for j, width in enumerate(self.out_lengths):
            rows = [r for r in self.rows if r[1] == j and r[4] > 0]
            contiguous = width > 0 and all(
                r[0] == rows[0][0] and r[2] == p[2] + p[4] for p, r in zip(rows, rows[1:])
            )
            specs.append((rows[0][0], rows[0][2], width) if contiguous else None)
        return specs

    def restricted(self, outputs: Sequence[int]) -> "RegroupPlan":
        """The plan of the given outputs only, in the order given."""
        return get_plan(self.keys, self.lengths, [self.groups[j] for j in outputs])


@torch.jit.unused
def arguments(
    embs: torch.Tensor, keys: List[List[str]], lengths: List[List[int]], groups: List[List[str]]
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, List[int]]:
    """``kt_regroup_arguments``; a key the schema cannot take (not UTF-8: a lone
    surrogate) is a ``ValueError`` naming it instead of the schema's type error."""
    try:
        return torch.ops.kt_regroup.kt_regroup_arguments(embs, keys, lengths, groups)
    except RuntimeError:
        for what, names in (("input", keys), ("group", groups)):
            for i, ks in enumerate(names):
                for key in ks:
                    if isinstance(key, str) and not key.isascii():
                        try:
                            key.encode()
                        except UnicodeEncodeError:
                            raise ValueError(
                                f"kt_regroup: {what} {i} has key {key!r}, which is not valid "
                                "UTF-8; keys must be UTF-8 strings"
                            ) from None
        raise


@functools.lru_cache(maxsize=128)  # no lock of ours: safe across threads and fork()
def _cached(keys: Names, lengths: Tuple[Tuple[int, ...], ...], groups: Names) -> RegroupPlan:
    # Real tensors whatever mode is active (fake kernels build plans under FakeTensorMode).
    # Entered only under a mode: it imports inside, and an import lock held by another
    # thread at fork() would never be released in the child.
    modes = _disable_current_modes() if torch._C._len_torch_dispatch_stack() else nullcontext()
    with modes:
        permutes, in_shapes, out_shapes, out_lengths = arguments(
            torch.empty(0), [list(k) for k in keys], [list(n) for n in lengths],
            [list(g) for g in groups],
        )
        rows = tuple(map(tuple, permutes.tolist()))
        in_lengths = tuple(in_shapes.tolist())
    return RegroupPlan(keys, lengths, groups, rows, in_lengths, tuple(out_lengths))


def get_plan(
    keys: Sequence[Sequence[str]],
    lengths: Sequence[Sequence[int]],
    groups: Sequence[Sequence[str]],
) -> RegroupPlan:
    """The :class:`RegroupPlan` of a layout, from a bounded cache keyed by the layout's
    values. Errors are the library's (``ValueError``, ``IndexError`` for a missing key,
    ``TypeError``/``RuntimeError`` for arguments of the wrong type)."""
    return _cached(
        tuple(map(tuple, keys)), tuple(map(tuple, lengths)), tuple(map(tuple, groups))
    )
