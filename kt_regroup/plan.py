"""The permute plan: where every output column block comes from.

A *layout* is the list of keys and widths of each input tensor plus the groups the
model wants. :class:`RegroupPlan` turns a layout into the metadata consumed by
``torch.ops.kt_regroup.permute_multi_embedding``, once, and explains what is wrong
with a layout that cannot be regrouped.

The permute rows use FBGEMM's / torchrec's format (int32, six columns)::

    [in_tensor, out_tensor, in_offset, out_offset, length, next]

``next`` is the duplicate-chain column FBGEMM's CUDA backward uses; kt_regroup's kernels
ignore it but :func:`kt_regroup_arguments_rows` fills it exactly like torchrec's
``_kt_regroup_arguments`` so the tensors are interchangeable with FBGEMM's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import torch

__all__ = [
    "RegroupPlan",
    "PERMUTE_COLUMNS",
    "kt_regroup_arguments_rows",
    "coalesce_rows",
]

# [in_tensor, out_tensor, in_offset, out_offset, length, next]
PERMUTE_COLUMNS = 6


def _check_layout(
    keys: Sequence[Sequence[str]],
    lengths: Sequence[Sequence[int]],
    groups: Sequence[Sequence[str]],
) -> Dict[str, Tuple[int, int, int]]:
    """Validates a layout; returns ``key -> (tensor, offset, width)``."""
    if len(keys) == 0:
        raise ValueError("kt_regroup: no input tensors given (keys is empty)")
    if len(keys) != len(lengths):
        raise ValueError(
            f"kt_regroup: got keys for {len(keys)} tensors but lengths for {len(lengths)}"
        )
    where: Dict[str, Tuple[int, int, int]] = {}
    for t, (tkeys, tlens) in enumerate(zip(keys, lengths)):
        if len(tkeys) != len(tlens):
            raise ValueError(
                f"kt_regroup: input {t} has {len(tkeys)} keys but {len(tlens)} lengths"
            )
        offset = 0
        for key, width in zip(tkeys, tlens):
            if not isinstance(key, str):
                raise TypeError(
                    f"kt_regroup: key {key!r} of input {t} is a {type(key).__name__}, "
                    "keys must be str"
                )
            width = int(width)
            if width < 0:
                raise ValueError(f"kt_regroup: key {key!r} of input {t} has negative width {width}")
            if key in where:
                other = where[key][0]
                raise ValueError(
                    f"kt_regroup: key {key!r} appears in input {other} and input {t}; "
                    "a key must name exactly one column block (ambiguous)"
                )
            where[key] = (t, offset, width)
            offset += width
    for g, group in enumerate(groups):
        for key in group:
            if not isinstance(key, str):
                raise TypeError(
                    f"kt_regroup: group {g} names {key!r}, a {type(key).__name__}; keys must be str"
                )
            if key not in where:
                raise KeyError(
                    f"kt_regroup: group {g} asks for key {key!r}, which is in none of the "
                    f"{len(keys)} inputs (looked in: "
                    + "; ".join(f"input {t}: {_preview(k)}" for t, k in enumerate(keys))
                    + ")"
                )
    return where


def _preview(keys: Sequence[str], limit: int = 8) -> str:
    shown = ", ".join(repr(k) for k in keys[:limit])
    if len(keys) > limit:
        shown += f", ... ({len(keys)} keys)"
    return "[" + shown + "]"


def kt_regroup_arguments_rows(
    keys: Sequence[Sequence[str]],
    lengths: Sequence[Sequence[int]],
    groups: Sequence[Sequence[str]],
) -> Tuple[List[List[int]], List[int], List[int]]:
    """Permute rows (one per group entry, torchrec format), input widths, output widths."""
    where = _check_layout(keys, lengths, groups)
    total = sum(len(g) for g in groups)
    rows: List[List[int]] = []
    out_lengths: List[int] = []
    # Duplicate chains: the first occurrence of a key points (column 5) to its second,
    # later occurrences carry -total (a chain stop) and the previous link is negated,
    # the convention of torchrec's _kt_regroup_arguments.
    last_seen: Dict[str, int] = {}
    for out_t, group in enumerate(groups):
        out_off = 0
        for key in group:
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
    in_lengths = [sum(int(w) for w in t) for t in lengths]
    return rows, in_lengths, out_lengths


def coalesce_rows(rows: Sequence[Sequence[int]]) -> List[List[int]]:
    """Merges adjacent rows that copy one contiguous run into one contiguous run.

    Zero-width rows are dropped. The result describes the same copy with fewer,
    larger segments; its ``next`` column is 0 (kt_regroup's kernels do not use it).
    """
    out: List[List[int]] = []
    for in_t, out_t, in_off, out_off, length, _ in rows:
        if length == 0:
            continue
        if out:
            p = out[-1]
            if (
                p[0] == in_t
                and p[1] == out_t
                and p[2] + p[4] == in_off
                and p[3] + p[4] == out_off
            ):
                p[4] += length
                continue
        out.append([in_t, out_t, in_off, out_off, length, 0])
    return out


@dataclass(frozen=True)
class RegroupPlan:
    """Permute metadata for one (keys, lengths, groups) layout, built once.

    Example::

        >>> plan = RegroupPlan.build([["a", "b"], ["c"]], [[2, 3], [4]], [["c", "a"], ["b"]])
        >>> plan.out_lengths
        [6, 3]
    """

    keys: Tuple[Tuple[str, ...], ...]
    lengths: Tuple[Tuple[int, ...], ...]
    groups: Tuple[Tuple[str, ...], ...]
    rows: Tuple[Tuple[int, ...], ...]  # torchrec format, one per group entry
    coalesced_rows: Tuple[Tuple[int, ...], ...]
    in_lengths: List[int]
    out_lengths: List[int]

    @staticmethod
    def build(
        keys: Sequence[Sequence[str]],
        lengths: Sequence[Sequence[int]],
        groups: Sequence[Sequence[str]],
    ) -> "RegroupPlan":
        rows, in_lengths, out_lengths = kt_regroup_arguments_rows(keys, lengths, groups)
        return RegroupPlan(
            keys=tuple(tuple(k) for k in keys),
            lengths=tuple(tuple(int(w) for w in t) for t in lengths),
            groups=tuple(tuple(g) for g in groups),
            rows=tuple(tuple(r) for r in rows),
            coalesced_rows=tuple(tuple(r) for r in coalesce_rows(rows)),
            in_lengths=in_lengths,
            out_lengths=out_lengths,
        )

    def view_specs(self) -> List[Optional[Tuple[int, int, int]]]:
        """Per output: ``(input, offset, width)`` when the whole output is one contiguous
        run of columns of one input (it could be returned as a view), else ``None``."""
        rows_of: Dict[int, List[Tuple[int, ...]]] = {}
        for row in self.coalesced_rows:
            rows_of.setdefault(row[1], []).append(row)
        specs: List[Optional[Tuple[int, int, int]]] = []
        for j, width in enumerate(self.out_lengths):
            rows = rows_of.get(j, [])
            if width > 0 and len(rows) == 1 and rows[0][3] == 0 and rows[0][4] == width:
                specs.append((rows[0][0], rows[0][2], width))
            else:
                specs.append(None)
        return specs

    def restricted(self, outputs: Sequence[int]) -> "RegroupPlan":
        """The plan of the given outputs only (renumbered in the order given).

        Its ``next`` column is 0: duplicate chains do not survive the cut.
        """
        new_index = {j: k for k, j in enumerate(outputs)}

        def keep(rows: Tuple[Tuple[int, ...], ...]) -> Tuple[Tuple[int, ...], ...]:
            return tuple(
                (r[0], new_index[r[1]], r[2], r[3], r[4], 0) for r in rows if r[1] in new_index
            )

        rows = keep(self.rows)
        coalesced = keep(self.coalesced_rows)
        return RegroupPlan(
            keys=self.keys,
            lengths=self.lengths,
            groups=tuple(self.groups[j] for j in outputs),
            rows=rows,
            coalesced_rows=coalesced,
            in_lengths=list(self.in_lengths),
            out_lengths=[self.out_lengths[j] for j in outputs],
        )

    def tensors(
        self, device: torch.device | str | None = None, coalesced: bool = True
    ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(permutes, in_shapes, out_shapes)`` as int32 tensors on ``device``."""
        rows = self.coalesced_rows if coalesced else self.rows
        permutes = torch.tensor(list(rows), dtype=torch.int32).reshape(-1, PERMUTE_COLUMNS)
        in_shapes = torch.tensor(self.in_lengths, dtype=torch.int32)
        out_shapes = torch.tensor(self.out_lengths, dtype=torch.int32)
        if device is not None and torch.device(device).type != "cpu":
            permutes, in_shapes, out_shapes = (
                t.to(device) for t in (permutes, in_shapes, out_shapes)
            )
        return permutes, in_shapes, out_shapes
