"""Timing, memory probes and the round-robin runner.

Providers of one cell are interleaved: round ``r`` runs every provider that still
needs samples, starting from a different provider each round, so machine drift
(frequency, other processes) hits all of them alike.

Each provider gets a time budget per cell: ``clamp(budget_s / t_warm, min_repeats,
repeats)`` samples, so a 3-second FBGEMM call gets ``min_repeats`` samples while a
50-ms copy gets ``repeats``. Slow calls (over ``slow_s``, 1 s) need no separate warmup:
one-time costs (plan building, lazy init: milliseconds) are under 1% of them, so a
first call that slow counts as a sample, and a provider that was that slow in an
earlier cell of this process is not warmed again.
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional

import torch

from kt_regroup.bench.providers import Cell, Provider

__all__ = [
    "MemoryProbe",
    "RssPeakProbe",
    "CudaPeakProbe",
    "NoMemoryProbe",
    "make_memory_probe",
    "percentile",
    "run_cell",
    "run_serving_cell",
]


def percentile(xs: List[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default), without numpy."""
    if not xs:
        return float("nan")
    s = sorted(xs)
    pos = (len(s) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


# --- memory --------------------------------------------------------------------------------


class MemoryProbe:
    method = "none"

    def start(self) -> None: ...

    def stop(self) -> Optional[int]:
        return None


class NoMemoryProbe(MemoryProbe):
    method = "unavailable on this platform (needs Linux /proc/self/clear_refs or CUDA)"


class RssPeakProbe(MemoryProbe):
    """CPU: how far the process RSS high-water mark rose above the RSS before the call.

    Linux resets the high-water mark (VmHWM) to the current RSS when "5" is written to
    /proc/self/clear_refs; reading VmHWM after the call gives the peak resident memory
    during it, allocator caches and page faults included.
    """

    method = "CPU peak RSS growth during the call (VmHWM after - VmRSS before; VmHWM reset via /proc/self/clear_refs)"

    def __init__(self) -> None:
        self._base_kb = 0

    @staticmethod
    def _status_kb() -> Dict[str, int]:
        out = {}
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(("VmHWM:", "VmRSS:")):
                    name, value = line.split(":", 1)
                    out[name] = int(value.split()[0])
        return out

    @classmethod
    def available(cls) -> bool:
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            return "VmHWM" in cls._status_kb()
        except OSError:
            return False

    def start(self) -> None:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        self._base_kb = self._status_kb()["VmRSS"]

    def stop(self) -> Optional[int]:
        return max(0, self._status_kb()["VmHWM"] - self._base_kb) * 1024


class CudaPeakProbe(MemoryProbe):
    method = "CUDA torch.cuda.max_memory_allocated() - memory_allocated() before the call"

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._base = 0

    def start(self) -> None:
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        self._base = torch.cuda.memory_allocated(self.device)

    def stop(self) -> Optional[int]:
        torch.cuda.synchronize(self.device)
        return torch.cuda.max_memory_allocated(self.device) - self._base


def make_memory_probe(device: torch.device) -> MemoryProbe:
    if device.type == "cuda":
        return CudaPeakProbe(device)
    if RssPeakProbe.available():
        return RssPeakProbe()
    return NoMemoryProbe()


# --- timing --------------------------------------------------------------------------------


def _timed(fn: Callable[[], Any], device: torch.device):
    """(result, seconds) of one call; CUDA events on CUDA, perf_counter on CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = fn()
        end.record()
        end.synchronize()
        return out, start.elapsed_time(end) / 1e3
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


def _check(outs: List[torch.Tensor], expected: List[torch.Tensor]) -> str:
    if len(outs) != len(expected):
        return f"mismatch: {len(outs)} outputs, expected {len(expected)}"
    for i, (o, e) in enumerate(zip(outs, expected)):
        if o.shape != e.shape or not torch.equal(o.detach(), e):
            return f"mismatch in group {i}"
    return "ok"


@dataclass(eq=False)
class _State:
    provider: Provider
    fn: Optional[Callable[[], List[torch.Tensor]]] = None
    times: List[float] = field(default_factory=list)
    mems: List[int] = field(default_factory=list)
    estimate: Optional[float] = None
    target: int = 1
    check: str = "not run"
    error: Optional[str] = None
    warmup: str = "none"  # discarded | counted (first call over slow_s) | skipped
    cut: bool = False  # stopped early: its next call would not fit before the deadline


def _target(estimate: float, budget_s: float, min_repeats: int, repeats: int) -> int:
    want = math.ceil(budget_s / max(estimate, 1e-9))
    return max(min(repeats, want), min(min_repeats, repeats))


def run_cell(
    cell: Cell,
    providers: List[Provider],
    *,
    repeats: int,
    min_repeats: int,
    budget_s: float,
    probe: MemoryProbe,
    slow_history: Dict[str, float],
    slow_s: float = 1.0,
    deadline: Optional[float] = None,
    progress=None,
) -> List[Dict[str, Any]]:
    """Times every provider on ``cell``, round-robin; one record per provider.

    ``deadline`` (a ``time.perf_counter()`` value) bounds the cell: every provider gets
    one sample, then a provider takes another turn only while its typical call still
    fits before the deadline, so fast providers keep sampling while slow ones stop. The
    records say which were cut short (``cut_by_time_limit``).
    """
    states = [_State(p) for p in providers if not (cell.backward and p.inference_only)]
    for st in states:
        try:
            st.fn = st.provider.make(cell)
        except Exception as e:  # a peer that cannot run here is reported, not fatal
            st.error = f"{type(e).__name__}: {e}"

    def call(st: _State, measure: bool) -> Optional[float]:
        cell.reset_grads()
        try:
            probe.start()
            outs, seconds = _timed(st.fn, cell.device)
            mem = probe.stop()
            if not measure and seconds >= slow_s:
                measure = True  # a slow first call is a sample too (see module docs)
                st.warmup = "counted"
            if st.check == "not run":
                st.check = _check(outs, cell.expected)
            del outs
        except Exception as e:
            st.error = f"{type(e).__name__}: {e}"
            return None
        finally:
            cell.reset_grads()
        if measure:
            st.times.append(seconds)
            if mem is not None:
                st.mems.append(mem)
        return seconds

    live = [st for st in states if st.error is None]
    # Warm the allocator and the kernel's page supply first (fresh pages, huge pages under
    # THP_MEM_ALLOC_ENABLE=1), so the first provider does not pay for the process's.
    for _ in range(2):
        [t.clone() for t in cell.expected]
    to_warm = {id(st) for st in live if slow_history.get(st.provider.name, 0.0) < slow_s}
    if progress is not None:
        progress.total = (progress.total or 0) + len(to_warm)
        progress.refresh()
    # Warmup (the answer is checked on each provider's first call, warmup or not).
    for st in live:
        if id(st) not in to_warm:
            st.target = min(min_repeats, repeats)
            st.warmup = "skipped"
            continue
        st.warmup = "discarded"
        st.estimate = call(st, measure=False)
        if progress is not None:
            progress.update(1)
        if st.estimate is not None:
            st.target = _target(st.estimate, budget_s, min_repeats, repeats)
    if progress is not None:
        progress.total = (progress.total or 0) + sum(st.target for st in live if st.error is None)
        progress.refresh()

    r = 0
    cut = False
    while True:
        pending = [
            st for st in live if st.error is None and not st.cut and len(st.times) < st.target
        ]
        if not pending:
            break
        if r > 0 and deadline is not None and time.perf_counter() > deadline:
            cut = True
            break
        shift = r % len(live)
        for st in live[shift:] + live[:shift]:
            if st.error is not None or st.cut or len(st.times) >= st.target:
                continue
            if deadline is not None and st.times:
                # Another turn only if the call fits this provider's fair share of the
                # time left: slow providers stop at one sample, fast ones keep going.
                left = deadline - time.perf_counter()
                if percentile(st.times, 50) > left / len(pending):
                    st.cut = True
                    if progress is not None:
                        progress.total -= st.target - len(st.times)
                    continue
            seconds = call(st, measure=True)
            if progress is not None:
                progress.update(1)
            if seconds is not None:
                # the plan follows the typical call, not one slow (first) call
                st.estimate = percentile(st.times, 50)
                new = max(len(st.times), _target(st.estimate, budget_s, min_repeats, repeats))
                if progress is not None and new != st.target:
                    progress.total += new - st.target
                    progress.refresh()
                st.target = new
        r += 1

    records = []
    for st in states:
        if st.times:
            slow_history[st.provider.name] = max(st.times)
        records.append(
            {
                "provider": st.provider.name,
                "family": st.provider.family,
                "samples_s": st.times,
                "n": len(st.times),
                "warmup": st.warmup,
                "p50_s": percentile(st.times, 50),
                "p90_s": percentile(st.times, 90),
                "mem_samples_bytes": st.mems,
                "mem_p90_bytes": percentile([float(m) for m in st.mems], 90) if st.mems else None,
                "check": st.check,
                "error": st.error,
                "target_n": st.target,
                "cut_by_time_limit": st.cut or (cut and st.error is None and len(st.times) < st.target),
            }
        )
    if progress is not None and cut:
        progress.total -= sum(
            max(0, st.target - len(st.times)) for st in live if st.error is None and not st.cut
        )
        progress.refresh()
    return records


def run_serving_cell(
    cell: Cell,
    providers: List[Provider],
    *,
    grad_mode: str,
    repeats: int,
    sample_s: float,
    progress=None,
) -> List[Dict[str, Any]]:
    """Per-call time of a warm provider, many calls per timed sample.

    ``grad_mode`` is ``inference_mode`` (everything under ``torch.inference_mode()``)
    or ``autograd`` (inputs require grad, grad mode on, forward only).
    """

    def ctx():
        if grad_mode == "inference_mode":
            return torch.inference_mode()
        return contextlib.nullcontext()

    states = [
        _State(p) for p in providers if not (grad_mode == "autograd" and p.inference_only)
    ]
    for st in states:
        try:
            with ctx():
                st.fn = st.provider.make(cell)
                outs = None
                for _ in range(3):  # warm: plan built, caches filled
                    outs = st.fn()
                st.check = _check(outs, cell.expected)
                t0 = time.perf_counter()
                for _ in range(10):
                    st.fn()
                per_call = (time.perf_counter() - t0) / 10
            st.target = max(1, min(100_000, math.ceil(sample_s / max(per_call, 1e-7))))
        except Exception as e:
            st.error = f"{type(e).__name__}: {e}"
    live = [st for st in states if st.error is None]
    if progress is not None:
        progress.total = (progress.total or 0) + repeats * len(live)
        progress.refresh()
    for r in range(repeats):
        shift = r % max(1, len(live))
        for st in live[shift:] + live[:shift]:
            if st.error is not None:
                continue
            fn, number = st.fn, st.target
            try:
                with ctx():
                    if cell.device.type == "cuda":
                        torch.cuda.synchronize(cell.device)
                    t0 = time.perf_counter()
                    for _ in range(number):
                        fn()
                    if cell.device.type == "cuda":
                        torch.cuda.synchronize(cell.device)
                    st.times.append((time.perf_counter() - t0) / number)
            except Exception as e:
                st.error = f"{type(e).__name__}: {e}"
            if progress is not None:
                progress.update(1)
    return [
        {
            "provider": st.provider.name,
            "family": st.provider.family,
            "samples_s": st.times,
            "n": len(st.times),
            "calls_per_sample": st.target if st.error is None else None,
            "p50_s": percentile(st.times, 50),
            "p90_s": percentile(st.times, 90),
            "mem_samples_bytes": [],
            "mem_p90_bytes": None,
            "check": st.check,
            "error": st.error,
        }
        for st in states
    ]
