"""Timing (``torch.utils.benchmark``) and peak-memory probes.

Each provider of a cell is timed on its own:

* **Warmup.** The first call is timed but not counted: it builds plans, fills lazy
  caches, and its answer is checked against the oracle.
* **Samples.** ``Timer.blocked_autorange(min_run_time)`` then times calls until they
  add up to ``min_run_time`` seconds (at least one; its block-size estimate makes one
  more untimed call). Calls shorter than ``min_run_time / 1000`` are timed in blocks of
  10^k calls; a sample is then the mean of a block. On CUDA each call is a sample
  instead, timed by a pair of CUDA events on the current stream around it (one
  synchronisation at the end): P50/P90 are per-call device times, launch gaps included.
* **Slow calls (CPU).** A provider whose warmup took ``2 * min_run_time`` or longer is
  not called again: that call is its one sample (its one-time costs, plan building, are
  milliseconds, lost in it; the factor 2 keeps one slow warmup of a fast provider from
  standing for it). ``min_run_time=0`` thus times every CPU provider by one call. On CUDA, where first calls compile and autotune kernels, every provider is
  warmed and then timed.
* **Fresh memory, as users pay it.** Every call allocates its outputs (and input
  gradients) and frees them before the next, as a training step does. Whether those
  pages come back warm is the allocator's business, as in the user's process: on Linux
  with glibc, blocks over 32 MiB (the seed's 265 MB outputs) are ``mmap``-ed and
  unmapped on free, so every call pays its first-touch page faults. ``limit: copy_``
  shows the same bytes without them.
* **Memory.** The peak memory in use during the counted calls above the level before
  them.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any, Callable, ContextManager, Dict, Optional

import torch

from kt_regroup.bench.providers import Cell, Provider

__all__ = [
    "CudaPeakProbe",
    "MemoryProbe",
    "NoMemoryProbe",
    "RssPeakProbe",
    "make_memory_probe",
    "measure",
]


# --- memory --------------------------------------------------------------------------------


class MemoryProbe:
    method = "none"

    def start(self) -> None: ...

    def stop(self) -> Optional[int]:
        return None


class NoMemoryProbe(MemoryProbe):
    method = "unavailable on this platform (needs Linux /proc/self/clear_refs or CUDA)"


class RssPeakProbe(MemoryProbe):
    """CPU: how far the process RSS high-water mark rose above the RSS at ``start``.

    Linux resets the high-water mark (VmHWM) to the current RSS when "5" is written to
    /proc/self/clear_refs; VmHWM read at ``stop`` is the peak resident memory since,
    allocator caches and page faults included.
    """

    method = "CPU peak RSS growth (VmHWM after - VmRSS before; VmHWM reset via /proc/self/clear_refs)"

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
    method = "CUDA torch.cuda.max_memory_allocated() - memory_allocated() before"

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


def cuda_event_times(fn: Callable[[], Any], min_run_time: float, max_calls: int = 10_000) -> list:
    """Seconds of each call of ``fn`` between two CUDA events on the current stream;
    calls until ``min_run_time`` seconds of host time have passed (at least one)."""
    pairs = []
    deadline = time.perf_counter() + min_run_time
    while not pairs or (time.perf_counter() < deadline and len(pairs) < max_calls):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        pairs.append((start, end))
    torch.cuda.synchronize()
    return [a.elapsed_time(b) / 1e3 for a, b in pairs]


def measure(
    cell: Cell,
    provider: Provider,
    *,
    min_run_time: float,
    probe: MemoryProbe,
    context: Callable[[], ContextManager] = contextlib.nullcontext,
) -> Dict[str, Any]:
    """One record: ``provider`` on ``cell``, timed as the module docs say.

    ``context`` wraps every call (e.g. ``torch.inference_mode``). A provider that
    cannot run here (a peer without a kernel for this device, say) gets its error in
    the record instead of samples.
    """
    from torch.utils.benchmark import Timer, timer

    wall = timer()
    rec: Dict[str, Any] = {
        "provider": provider.name, "family": provider.family, "samples_s": [], "n": 0,
        "calls_per_sample": None, "warmup": "discarded", "p50_s": float("nan"),
        "p90_s": float("nan"), "mem_peak_bytes": None, "check": "not run", "error": None,
        "wall_s": None,  # this row's seconds, warmup and check included
    }
    try:
        with context():
            fn = provider.make(cell)
            probe.start()
            start = timer()  # synchronises the device, as Timer does
            result = fn()
            seconds = timer() - start
            mem = probe.stop()
            rec["check"] = cell.check(result)
            del result
            if seconds >= 2 * min_run_time and cell.device.type == "cpu":
                times, number = [seconds], 1
                rec["warmup"] = "counted"
            elif cell.device.type == "cuda":
                probe.start()
                times, number = cuda_event_times(fn, min_run_time), 1
                mem = probe.stop()
            else:
                probe.start()
                m = Timer("fn()", globals={"fn": fn}, num_threads=torch.get_num_threads(),
                          description=provider.name).blocked_autorange(min_run_time=min_run_time)
                mem = probe.stop()
                times, number = m.times, m.number_per_run
    except Exception as e:  # a peer that cannot run here is reported, not fatal
        rec.update(error=f"{type(e).__name__}: {e}", wall_s=timer() - wall)
        return rec
    q = torch.tensor(times, dtype=torch.float64).quantile(torch.tensor([0.5, 0.9], dtype=torch.float64))
    rec.update(samples_s=times, n=len(times), calls_per_sample=number, p50_s=q[0].item(),
               p90_s=q[1].item(), mem_peak_bytes=mem, wall_s=timer() - wall)
    return rec
