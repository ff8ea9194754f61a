"""The permute plan: where every output column block comes from.

A *layout* is the keys and widths of each input tensor plus the groups the model
wants. :class:`RegroupPlan` turns a layout into the metadata of
``torch.ops.kt_regroup.permute_multi_embedding`` once, and explains what is wrong with
a layout that cannot be regrouped. :func:`get_plan` is the one plan cache.

Permute rows use torchrec's / FBGEMM's format (six int32 columns)::

    [in_tensor, out_tensor, in_offset, out_offset, length, next]

``next`` chains the rows of a duplicated key, as torchrec's ``_kt_regroup_arguments``
does (FBGEMM's backward follows it): the first occurrence holds the index of the
second, later occurrences hold minus the index of the next one, the last minus the
row count; rows of keys used once hold 0.
"""

from __future__ import annotations

import operator
import threading
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode

__all__ = ["MissingKeyError", "PERMUTE_COLUMNS", "RegroupPlan", "get_plan"]

PERMUTE_COLUMNS = 6

Row = Tuple[int, int, int, int, int, int]
Layout = Tuple[Tuple[Tuple[str, ...], ...], Tuple[Tuple[int, ...], ...], Tuple[Tuple[str, ...], ...]]


class MissingKeyError(KeyError, IndexError):
    """A group names a key no input has.

    A ``KeyError`` (what torchrec's Python code raises) and an ``IndexError`` (what
    FBGEMM's and kt_regroup's C++ ops raise), so either ``except`` catches it.
    """

    def __str__(self) -> str:  # the message as written, not KeyError's repr of it
        return str(self.args[0])


def _preview(keys: Sequence[str], limit: int = 8) -> str:
    shown = ", ".join(repr(k) for k in keys[:limit])
    if len(keys) > limit:
        shown += f", ... ({len(keys)} keys)"
    return "[" + shown + "]"


def _normalise(keys, lengths, groups) -> Layout:
    """The layout as nested tuples (hashable), every error named."""
    if len(keys) == 0:
        raise ValueError("kt_regroup: no input tensors given (keys is empty)")
    if len(keys) != len(lengths):
        raise ValueError(
            f"kt_regroup: got keys for {len(keys)} tensors but lengths for {len(lengths)}"
        )
    norm_lengths = []
    for t, (tkeys, tlens) in enumerate(zip(keys, lengths)):
        if len(tkeys) != len(tlens):
            raise ValueError(f"kt_regroup: input {t} has {len(tkeys)} keys but {len(tlens)} lengths")
        widths = []
        for key, width in zip(tkeys, tlens):
            if not isinstance(key, str):
                raise TypeError(
                    f"kt_regroup: key {key!r} of input {t} is a {type(key).__name__}, keys must be str"
                )
            try:
                if isinstance(width, bool):
                    raise TypeError
                width = operator.index(width)
            except TypeError:
                raise TypeError(
                    f"kt_regroup: key {key!r} of input {t} has width {width!r}, a "
                    f"{type(width).__name__}; widths must be int"
                ) from None
            if width < 0:
                raise ValueError(f"kt_regroup: key {key!r} of input {t} has negative width {width}")
            widths.append(width)
        norm_lengths.append(tuple(widths))
    for g, group in enumerate(groups):
        for key in group:
            if not isinstance(key, str):
                raise TypeError(
                    f"kt_regroup: group {g} names {key!r}, a {type(key).__name__}; keys must be str"
                )
    return (
        tuple(tuple(k) for k in keys),
        tuple(norm_lengths),
        tuple(tuple(g) for g in groups),
    )


def _rows(layout: Layout) -> Tuple[List[List[int]], List[int], List[int]]:
    """torchrec's permute rows (one per group entry), input widths, output widths."""
    keys, lengths, groups = layout
    where: Dict[str, Tuple[int, int, int]] = {}
    in_lengths = []
    for t, (tkeys, tlens) in enumerate(zip(keys, lengths)):
        offset = 0
        for key, width in zip(tkeys, tlens):
            if key in where:
                raise ValueError(
                    f"kt_regroup: key {key!r} appears in input {where[key][0]} and input {t}; "
                    "a key must name exactly one column block (ambiguous)"
                )
            where[key] = (t, offset, width)
            offset += width
        in_lengths.append(offset)
    total = sum(len(g) for g in groups)
    rows: List[List[int]] = []
    out_lengths: List[int] = []
    last_seen: Dict[str, int] = {}
    for out_t, group in enumerate(groups):
        out_off = 0
        for key in group:
            if key not in where:
                raise MissingKeyError(
                    f"kt_regroup: group {out_t} asks for key {key!r}, which is in none of the "
                    f"{len(keys)} inputs (looked in: "
                    + "; ".join(f"input {t}: {_preview(k)}" for t, k in enumerate(keys))
                    + ")"
                )
            in_t, in_off, width = where[key]
            idx = len(rows)
            nxt = 0
            if key in last_seen:
                prev = last_seen[key]
                if prev >= 0:
                    rows[prev][5] = idx
                else:
                    rows[-prev][5] = -idx
                last_seen[key] = -idx
                nxt = -total
            else:
                last_seen[key] = idx
            rows.append([in_t, out_t, in_off, out_off, width, nxt])
            out_off += width
        out_lengths.append(out_off)
    return rows, in_lengths, out_lengths


def _coalesce(rows: Sequence[Sequence[int]], chains: bool) -> List[List[int]]:
    """Merges adjacent rows that continue each other in input and output.

    With ``chains``, rows of duplicated keys (``next != 0``) are kept as they are and
    their ``next`` links renumbered, so the result is still a valid torchrec-format plan;
    without, everything mergeable is merged and ``next`` is dropped (zero-width rows too).
    """
    out: List[List[int]] = []
    new_index: List[int] = []
    for in_t, out_t, in_off, out_off, length, nxt in rows:
        chained = chains and nxt != 0
        if not chained and out:
            p = out[-1]
            if (
                (not chains or p[5] == 0)
                and p[0] == in_t
                and p[1] == out_t
                and p[2] + p[4] == in_off
                and p[3] + p[4] == out_off
            ):
                p[4] += length
                new_index.append(len(out) - 1)
                continue
        if length == 0 and not chained:
            new_index.append(-1)
            continue
        new_index.append(len(out))
        out.append([in_t, out_t, in_off, out_off, length, nxt if chains else 0])
    total = len(rows)
    for row in out:
        nxt = row[5]
        if nxt > 0:
            row[5] = new_index[nxt]
        elif nxt == -total:
            row[5] = -len(out)
        elif nxt < 0:
            row[5] = -new_index[-nxt]
    return out


def _tensors_on(rows, in_lengths, out_lengths, device) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    permutes = torch.tensor(rows, dtype=torch.int32).reshape(-1, PERMUTE_COLUMNS)
    in_shapes = torch.tensor(in_lengths, dtype=torch.int32)
    out_shapes = torch.tensor(out_lengths, dtype=torch.int32)
    if device is not None and torch.device(device).type != "cpu":
        permutes, in_shapes, out_shapes = (t.to(device) for t in (permutes, in_shapes, out_shapes))
    return permutes, in_shapes, out_shapes


def _memoisable() -> bool:
    # Under fake / proxy modes (compile, export) tensors are made afresh so the tracer
    # owns them; real tensors are memoised.
    return not torch.compiler.is_compiling() and _get_current_dispatch_mode() is None


@dataclass(frozen=True)
class RegroupPlan:
    """Permute metadata for one (keys, lengths, groups) layout, built once.

    Immutable: the tensors it hands out are memoised per device and never modified.

    Example::

        >>> plan = RegroupPlan.build([["a", "b"], ["c"]], [[2, 3], [4]], [["c", "a"], ["b"]])
        >>> plan.out_lengths
        (6, 3)
        >>> plan.tensors()[0].tolist()  # torchrec's format: one row per group entry
        [[1, 0, 0, 0, 4, 0], [0, 0, 0, 4, 2, 0], [0, 1, 2, 0, 3, 0]]
    """

    keys: Tuple[Tuple[str, ...], ...]
    lengths: Tuple[Tuple[int, ...], ...]
    groups: Tuple[Tuple[str, ...], ...]
    rows: Tuple[Row, ...]  # torchrec's format, one per group entry
    coalesced_rows: Tuple[Row, ...]  # the same copy in fewer rows, chains kept
    in_lengths: Tuple[int, ...]
    out_lengths: Tuple[int, ...]
    _tensors: Dict[Tuple[str, bool], Tuple[torch.Tensor, ...]] = field(
        default_factory=dict, compare=False, repr=False
    )

    @staticmethod
    def build(
        keys: Sequence[Sequence[str]],
        lengths: Sequence[Sequence[int]],
        groups: Sequence[Sequence[str]],
    ) -> "RegroupPlan":
        """The plan of a layout; ``KeyError``/``ValueError``/``TypeError`` name what is wrong."""
        layout = _normalise(keys, lengths, groups)
        rows, in_lengths, out_lengths = _rows(layout)
        return RegroupPlan(
            keys=layout[0],
            lengths=layout[1],
            groups=layout[2],
            rows=tuple(tuple(r) for r in rows),
            coalesced_rows=tuple(tuple(r) for r in _coalesce(rows, chains=True)),
            in_lengths=tuple(in_lengths),
            out_lengths=tuple(out_lengths),
        )

    def tensors(
        self, device: torch.device | str | None = None
    ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(permutes, in_shapes, out_shapes)``, int32, torchrec's format (what
        ``kt_regroup_arguments`` returns; interchangeable with FBGEMM's)."""
        return self._tensors_on(device, coalesced=False)

    def coalesced_tensors(
        self, device: torch.device | str | None = None
    ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Like :meth:`tensors`, with adjacent rows of keys used once merged: fewer,
        longer copies. Duplicate chains are kept, so FBGEMM's ops accept it too."""
        return self._tensors_on(device, coalesced=True)

    def _tensors_on(self, device, coalesced: bool):
        rows = self.coalesced_rows if coalesced else self.rows
        if not _memoisable():
            return _tensors_on(rows, self.in_lengths, self.out_lengths, device)
        key = (str(torch.device(device or "cpu")), coalesced)
        hit = self._tensors.get(key)
        if hit is None:
            hit = self._tensors[key] = _tensors_on(rows, self.in_lengths, self.out_lengths, device)
        return hit

    def view_specs(self) -> List[Optional[Tuple[int, int, int]]]:
        """Per output: ``(input, offset, width)`` when the whole output is one contiguous
        run of columns of one input (it could be returned as a view), else ``None``."""
        specs: List[Optional[Tuple[int, int, int]]] = [None] * len(self.out_lengths)
        runs: Dict[int, List[List[int]]] = {}
        for row in _coalesce(self.rows, chains=False):
            runs.setdefault(row[1], []).append(row)
        for j, width in enumerate(self.out_lengths):
            rows = runs.get(j, [])
            if width > 0 and len(rows) == 1 and rows[0][3] == 0 and rows[0][4] == width:
                specs[j] = (rows[0][0], rows[0][2], width)
        return specs

    def restricted(self, outputs: Sequence[int]) -> "RegroupPlan":
        """The plan of the given outputs only, in the order given."""
        return get_plan(self.keys, self.lengths, [self.groups[j] for j in outputs])


# --- the plan cache ------------------------------------------------------------------------

_plans: Dict[Layout, RegroupPlan] = {}
_plans_lock = threading.Lock()
MAX_PLANS = 128


def get_plan(
    keys: Sequence[Sequence[str]],
    lengths: Sequence[Sequence[int]],
    groups: Sequence[Sequence[str]],
) -> RegroupPlan:
    """The :class:`RegroupPlan` of a layout, from a bounded cache keyed by the layout.

    Keyed by value, so an evicted plan can never be mistaken for another layout's; safe
    to call from many threads (only a miss takes the lock).
    """
    layout = _normalise(keys, lengths, groups)
    if torch.compiler.is_compiling():  # dynamo traces no lock: build, share nothing
        return RegroupPlan.build(*layout)
    plan = _plans.get(layout)
    if plan is None:
        built = RegroupPlan.build(*layout)
        with _plans_lock:
            plan = _plans.setdefault(layout, built)
            while len(_plans) > MAX_PLANS:
                del _plans[next(iter(_plans))]
    return plan
