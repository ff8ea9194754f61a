"""Benchmark layouts: which keys, of which widths, in which inputs and groups.

A :class:`BenchLayout` is built from torchrec-style sizes (one dense and one sparse
``KeyedTensor``) and an allocation of keys to groups, or from a JSON file a user brings.

Allocations (:data:`ALLOCATIONS`), both seeded:

* ``seed``: each key goes to a random group and groups keep the input order of their
  keys, as torchrec's benchmark utilities (and the seed's numbers) do. Neighbouring keys
  of one group are often neighbours in the input too, so about half of the group entries
  merge into longer contiguous segments.
* ``scattered``: the same random allocation, then each group lists its keys in a random
  order, as a model that groups features by meaning does: almost every key is a
  segment of its own.

``duplicates`` appends one random key to each group (torchrec's ``build_groups``). The
JSON form::

    {"keys": [["a", "b"], ["c"]], "lengths": [[4, 8], [16]],
     "groups": [["c", "a"], ["b"]], "batch_size": 512}
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence

import torch

__all__ = ["ALLOCATIONS", "BenchLayout", "PRESETS", "layout_from_flags", "layout_from_json"]

ALLOCATIONS = ("seed", "scattered")

# sizes: name -> (batch_size, n_dense, dim_dense, n_sparse, dim_sparse, n_groups)
PRESETS: Dict[str, Dict[str, int]] = {
    # The seed's layout (torchrec PR #2128 / FBGEMM #2772): F = 1020 keys.
    "seed": dict(batch_size=1024, n_dense=20, dim_dense=64, n_sparse=1000, dim_sparse=128, n_groups=2),
    # CPU inference serving: small batch, where per-call overhead decides.
    "serving": dict(batch_size=32, n_dense=1, dim_dense=64, n_sparse=26, dim_sparse=16, n_groups=2),
    # CI: every code path, seconds not minutes.
    "quick": dict(batch_size=64, n_dense=3, dim_dense=8, n_sparse=24, dim_sparse=16, n_groups=2),
}


@dataclass(frozen=True)
class BenchLayout:
    """Keys and widths of each input tensor, the groups, and the batch size."""

    keys: List[List[str]]
    lengths: List[List[int]]
    groups: List[List[str]]
    batch_size: int
    name: str = "custom"
    duplicates: bool = False
    dtype: torch.dtype = torch.float32
    extra: Dict[str, Any] = field(default_factory=dict)

    @property
    def n_features(self) -> int:
        """``F`` in the table: the number of distinct input keys."""
        return sum(len(k) for k in self.keys)

    @property
    def in_width(self) -> int:
        return sum(sum(widths) for widths in self.lengths)

    @property
    def out_lengths(self) -> List[int]:
        width = {k: w for ks, ws in zip(self.keys, self.lengths) for k, w in zip(ks, ws)}
        return [sum(width[k] for k in g) for g in self.groups]

    @property
    def element_size(self) -> int:
        return torch.empty(0, dtype=self.dtype).element_size()

    @property
    def in_bytes(self) -> int:
        return self.batch_size * self.in_width * self.element_size

    @property
    def out_bytes(self) -> int:
        return self.batch_size * sum(self.out_lengths) * self.element_size

    @property
    def has_duplicates(self) -> bool:
        flat = [k for g in self.groups for k in g]
        return len(flat) != len(set(flat))

    @property
    def segments(self) -> int:
        """Contiguous copies a regroup needs: runs of group entries that are also
        neighbours, in the same order, in one input."""
        where = {}
        for t, (ks, ws) in enumerate(zip(self.keys, self.lengths)):
            off = 0
            for k, w in zip(ks, ws):
                where[k] = (t, off, w)
                off += w
        n = 0
        for group in self.groups:
            end = None
            for key in group:
                t, off, w = where[key]
                if w and end != (t, off):
                    n += 1
                if w:
                    end = (t, off + w)
        return n

    def describe(self) -> Dict[str, Any]:
        return {
            "name": self.name,
            "batch_size": self.batch_size,
            "n_features": self.n_features,
            "n_inputs": len(self.keys),
            "n_groups": len(self.groups),
            "group_entries": sum(len(g) for g in self.groups),
            "segments": self.segments,
            "duplicates": self.has_duplicates,
            "dtype": str(self.dtype).replace("torch.", ""),
            "in_width": self.in_width,
            "out_lengths": self.out_lengths,
            "in_bytes": self.in_bytes,
            "out_bytes": self.out_bytes,
            **self.extra,
        }

    def make_inputs(self, device: torch.device, requires_grad: bool, seed: int = 0):
        """One ``KeyedTensor`` per input, each over a single fresh ``randn`` buffer.

        Built without a ``cat`` so building leaves no transient peak behind (the CPU
        memory probe measures RSS high-water marks).
        """
        from torchrec.sparse.jagged_tensor import KeyedTensor

        gen = torch.Generator(device="cpu").manual_seed(seed)
        kts = []
        for keys, widths in zip(self.keys, self.lengths):
            values = torch.randn(self.batch_size, sum(widths), generator=gen, dtype=torch.float32)
            values = values.to(device=device, dtype=self.dtype)
            values.requires_grad_(requires_grad)
            kts.append(KeyedTensor(keys=list(keys), length_per_key=list(widths), values=values))
        return kts


def _random_groups(
    all_keys: Sequence[str], n_groups: int, duplicates: bool, rng: random.Random,
    scattered: bool = False,
) -> List[List[str]]:
    # Random allocation of every key to a group; redrawn until no group is empty.
    while True:
        allocation = [rng.randrange(n_groups) for _ in all_keys]
        groups: List[List[str]] = [[] for _ in range(n_groups)]
        for key, g in zip(all_keys, allocation):
            groups[g].append(key)
        if all(groups) or len(all_keys) < n_groups:
            break
    if scattered:
        # One draw either way, so the duplicated layout stays the plain one + one key per group.
        order = random.Random(rng.getrandbits(64))
        for group in groups:
            order.shuffle(group)
    if duplicates:
        for group in groups:
            group.append(rng.choice(list(all_keys)))
    return groups


def layout_from_flags(
    batch_size: int,
    n_dense: int,
    dim_dense: int,
    n_sparse: int,
    dim_sparse: int,
    n_groups: int,
    duplicates: bool,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    name: Optional[str] = None,
    allocation: str = "seed",
) -> BenchLayout:
    """torchrec's benchmark layout: a dense and a sparse ``KeyedTensor``, random groups.

    ``allocation`` is ``seed`` or ``scattered`` (module docs). Groups depend only on
    ``seed`` and ``allocation``: the duplicated layout is the non-duplicated one plus
    one extra key per group.
    """
    if allocation not in ALLOCATIONS:
        raise ValueError(f"allocation must be one of {ALLOCATIONS}, got {allocation!r}")
    if n_groups < 1:
        raise ValueError(f"--n_groups must be >= 1, got {n_groups}")
    if n_dense + n_sparse < 1:
        raise ValueError("need at least one key (--n_dense + --n_sparse >= 1)")
    keys: List[List[str]] = []
    lengths: List[List[int]] = []
    if n_dense > 0:
        keys.append([f"dense_{i}" for i in range(n_dense)])
        lengths.append([dim_dense] * n_dense)
    if n_sparse > 0:
        keys.append([f"sparse_{i}" for i in range(n_sparse)])
        lengths.append([dim_sparse] * n_sparse)
    all_keys = [k for ks in keys for k in ks]
    groups = _random_groups(all_keys, n_groups, duplicates, random.Random(seed),
                            scattered=allocation == "scattered")
    return BenchLayout(keys, lengths, groups, batch_size, name or allocation, duplicates, dtype)


def layout_from_json(
    path: str, batch_size: Optional[int] = None, dtype: torch.dtype = torch.float32
) -> BenchLayout:
    """A user's layout: ``{"keys": [[..]], "lengths": [[..]], "groups": [[..]]}``.

    ``batch_size`` in the file wins over the default but not over an explicit flag.
    The layout is validated by kt_regroup's planner, which says what is wrong with it.
    """
    with open(path) as f:
        spec = json.load(f)
    missing = [k for k in ("keys", "lengths", "groups") if k not in spec]
    if missing:
        raise ValueError(f"{path}: layout file lacks {missing}; expected keys, lengths, groups")
    from kt_regroup import get_plan

    get_plan(spec["keys"], spec["lengths"], spec["groups"])  # raises with a reason
    bs = batch_size if batch_size is not None else int(spec.get("batch_size", 1024))
    layout = BenchLayout(
        keys=[list(k) for k in spec["keys"]],
        lengths=[[int(w) for w in ws] for ws in spec["lengths"]],
        groups=[list(g) for g in spec["groups"]],
        batch_size=bs,
        name=spec.get("name", path),
        dtype=dtype,
    )
    return BenchLayout(
        layout.keys, layout.lengths, layout.groups, bs, layout.name, layout.has_duplicates, dtype
    )
