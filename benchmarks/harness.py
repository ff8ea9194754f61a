"""What every section shares: the benchmark layouts and the interleaved timer."""

from __future__ import annotations

import random
import statistics
from typing import Callable, Dict, List, Optional, Sequence, Union

import torch
from torch.utils.benchmark import Timer

# The seed's sizes (torchrec PR #2128 / FBGEMM #2772): 20 dense keys x 64 + 1000 x 128.
SEED = dict(n_dense=20, dim_dense=64, n_sparse=1000, dim_sparse=128)
QUICK = dict(n_dense=3, dim_dense=8, n_sparse=24, dim_sparse=16)
# CPU serving: one dense key x 64 and 26 sparse keys x 16 (864 segments at B=32).
SERVING = dict(n_dense=1, dim_dense=64, n_sparse=26, dim_sparse=16)


def make_layout(n_dense: int, dim_dense: int, n_sparse: int, dim_sparse: int, *,
                scattered: bool, duplicates: bool, n_groups: int = 2, seed: int = 0):
    """``(keys, lengths, groups)``: a dense and a sparse input, each key sent to a random
    group; ``scattered`` shuffles each group's keys (``seed`` keeps the input order, as
    torchrec's benchmark does); ``duplicates`` adds one random key to each group."""
    keys = [[f"dense_{i}" for i in range(n_dense)], [f"sparse_{i}" for i in range(n_sparse)]]
    lengths = [[dim_dense] * n_dense, [dim_sparse] * n_sparse]
    rng = random.Random(seed)
    flat = keys[0] + keys[1]
    groups: List[List[str]] = [[] for _ in range(n_groups)]
    for i, key in enumerate(flat):  # the first n_groups keys seed every group
        groups[i if i < n_groups else rng.randrange(n_groups)].append(key)
    order = random.Random(seed + 1)
    for group in groups:
        if scattered:
            order.shuffle(group)
        if duplicates:
            group.append(rng.choice(flat))
    return keys, lengths, groups


def interleaved(fns: Dict[str, Callable[[], object]], rounds: int, *,
                number: Union[int, Dict[str, int]] = 1,
                warmup: int = 1, max_rounds: Optional[Dict[str, int]] = None
                ) -> Dict[str, List[float]]:
    """Seconds per call of each ``fns`` entry, A B C A B C ...: each round times
    ``number`` calls (an int, or one per entry) of every entry (``torch.utils.benchmark.Timer.timeit``) after
    ``warmup`` untimed rounds; an entry in ``max_rounds`` stops after that many."""
    limit = max_rounds or {}
    timers = {name: Timer("fn()", globals={"fn": fn}, num_threads=torch.get_num_threads())
              for name, fn in fns.items()}
    samples: Dict[str, List[float]] = {name: [] for name in fns}
    for r in range(warmup + rounds):
        for name, timer in timers.items():
            if r - warmup < limit.get(name, rounds):
                t = timer.timeit(number if isinstance(number, int) else number[name]).mean
                if r >= warmup:
                    samples[name].append(t)
    return samples


def segments(plan) -> int:
    """Contiguous copies a ``RegroupPlan`` makes per batch row: its rows (one per group
    entry) less those that continue the previous one in both input and output."""
    rows = [r for r in plan.rows if r[4] > 0]
    return sum(1 for p, r in zip([None, *rows], rows) if p is None or (r[0], r[1], r[2], r[3])
               != (p[0], p[1], p[2] + p[4], p[3] + p[4]))


def median(xs: Sequence[float]) -> Optional[float]:
    return statistics.median(xs) if xs else None
