"""What every section shares: the benchmark layouts and the interleaved timers (wall
time on any device, CUDA events on a GPU)."""

from __future__ import annotations

import random
import statistics
from typing import Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch
from torch.utils.benchmark import Timer

# The seed's sizes (torchrec PR #2128 / FBGEMM #2772): 20 dense keys x 64 + 1000 x 128.
SEED = dict(n_dense=20, dim_dense=64, n_sparse=1000, dim_sparse=128)
QUICK = dict(n_dense=3, dim_dense=8, n_sparse=24, dim_sparse=16)
# CPU serving: one dense key x 64 and 26 sparse keys x 16 (864 segments at B=32).
SERVING = dict(n_dense=1, dim_dense=64, n_sparse=26, dim_sparse=16)
# Narrow keys: 4 dense keys x 16 and 96 sparse keys x 8 (3,200 segments at B=32).
NARROW = dict(n_dense=4, dim_dense=16, n_sparse=96, dim_sparse=8)


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
    ``number`` calls (an int, or one per entry) of every entry after ``warmup`` untimed
    rounds; an entry in ``max_rounds`` stops after that many. ``Timer.timeit`` (torch.utils.
    benchmark) runs ``max(number // 100, 2)`` untimed calls of the same entry before each
    sample, so a timed call always follows calls of its own entry (as a training step
    follows the previous one)."""
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


def device_interleaved(fns: Dict[str, Callable[[], object]], rounds: int, *, batch: int = 10
                       ) -> Tuple[Dict[str, List[float]], Dict[str, List[float]], Dict[str, str]]:
    """GPU seconds per call of each ``fns`` entry (its work on the current CUDA device),
    from CUDA events, A B C A B C ... like :func:`interleaved`, with no host sync between
    the calls the events enclose. Returns ``(eager, graph, errors)``:

    - ``eager``: events around ``batch`` calls queued back to back: kernel time, plus the
      gaps where the host launches slower than the GPU runs (eager training's throughput);
    - ``graph``: events around ``batch`` replays of a CUDA graph of one call: kernel time
      alone. An entry that cannot be captured (a host sync, a pageable copy) has its
      error in ``errors`` and no ``graph`` samples.

    Each graph is warmed up on a side stream and captured (``torch.cuda.graph``) before
    the first timed round, after which one untimed eager round refills the allocator's
    cache that capturing empties."""
    graphs, errors = {}, {}
    for name, fn in fns.items():
        stream = torch.cuda.current_stream()
        side = torch.cuda.Stream()
        side.wait_stream(stream)
        with torch.cuda.stream(side):
            fn()
        stream.wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph):
                fn()
            graphs[name] = graph
        except Exception as e:  # noqa: BLE001  (reported: the row keeps its eager time)
            torch.cuda.set_stream(stream)  # a failed capture_end leaves its stream current
            errors[name] = f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
    eager: Dict[str, List[float]] = {name: [] for name in fns}
    replay: Dict[str, List[float]] = {name: [] for name in graphs}
    for r in range(1 + rounds):
        for name, fn in fns.items():
            t = _events(fn, batch)
            if r:
                eager[name].append(t)
                if name in graphs:
                    replay[name].append(_events(graphs[name].replay, batch))
    torch.cuda.synchronize()
    return eager, replay, errors


def _events(fn: Callable[[], object], n: int) -> float:
    """Seconds per call of ``n`` calls of ``fn`` between two CUDA events on the current
    stream, synchronized once after the last."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(n):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e-3 / n


def segments(plan) -> int:
    """Contiguous copies a ``RegroupPlan`` makes per batch row: its rows (one per group
    entry) less those that continue the previous one in both input and output."""
    rows = [r for r in plan.rows if r[4] > 0]
    return sum(1 for p, r in zip([None, *rows], rows) if p is None or (r[0], r[1], r[2], r[3])
               != (p[0], p[1], p[2] + p[4], p[3] + p[4]))


def median(xs: Sequence[float]) -> Optional[float]:
    return statistics.median(xs) if xs else None
