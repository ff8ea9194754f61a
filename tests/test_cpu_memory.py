"""The CPU output cache keeps its promises (kt_regroup.cpu_memory / empty_cpu_cache).

empty_cpu_cache() gives the memory back to the system (RSS from /proc/self/statm falls),
it is one locked step (a concurrent limit is never undone), and the environment
variables refuse what they cannot read, naming the variable.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

import kt_regroup

OP = torch.ops.kt_regroup.permute_multi_embedding
MIB = 1 << 20
ROOT = Path(__file__).resolve().parents[1]

needs_cpu_kernel = pytest.mark.skipif(
    not torch._C._dispatch_has_kernel_for_dispatch_key(
        "kt_regroup::permute_multi_embedding", "CPU"),
    reason="the native CPU kernel is not built/loaded")
needs_statm = pytest.mark.skipif(not os.path.exists("/proc/self/statm"),
                                 reason="RSS is read from /proc/self/statm (Linux)")


@pytest.fixture
def cpu_memory():
    """The cache's settings, restored after the test."""
    before = kt_regroup.cpu_memory()
    yield kt_regroup.cpu_memory
    kt_regroup.cpu_memory(before["cache_limit"], before["huge_pages"])


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _regroup(batch: int, width: int = 1024) -> torch.Tensor:
    """One [batch, width] float32 output of the op (the whole input, one key)."""
    x = torch.ones(batch, width)
    permutes = torch.tensor([[0, 0, 0, 0, width, 0]], dtype=torch.int32)
    shapes = torch.tensor([width], dtype=torch.int32)
    return OP([x], permutes, shapes, shapes, [width])[0]


@needs_cpu_kernel
@needs_statm
def test_empty_cpu_cache_gives_the_memory_back_to_the_system(cpu_memory):
    cpu_memory(cache_limit=4 << 30)
    kt_regroup.empty_cpu_cache()
    # A freed 28 MiB block first: glibc then raises its mmap threshold, and serves the
    # next blocks of 4-28 MiB from its heap, where a free() keeps the pages.
    _regroup(7 * 1024)  # freed at once
    kt_regroup.empty_cpu_cache()
    # ~600 MiB of outputs of 4-28 MiB (sizes apart, so none reuses another's block),
    # every page written, held at once, then freed into the cache.
    outs = [_regroup(1024 + 150 * i) for i in range(40)]
    total = sum(o.untyped_storage().nbytes() for o in outs)
    assert all(o.eq(1).all() for o in outs)
    del outs
    assert cpu_memory()["cached_bytes"] >= total
    before = _rss_bytes()
    kt_regroup.empty_cpu_cache()
    after = _rss_bytes()
    assert cpu_memory()["cached_bytes"] == 0
    # Every cached page is returned (other threads may allocate a little meanwhile).
    assert before - after >= 0.9 * total, (before / MIB, after / MIB, total / MIB)


@needs_cpu_kernel
def test_empty_cpu_cache_never_undoes_a_concurrent_limit(cpu_memory):
    """empty_cpu_cache() is one locked step: a limit set meanwhile stays set."""
    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as the interpreter can
    stop = threading.Event()

    def empty_in_a_loop():
        while not stop.is_set():
            kt_regroup.empty_cpu_cache()

    thread = threading.Thread(target=empty_in_a_loop)
    thread.start()
    undone = []
    try:
        for i in range(3000):
            limit = (i % 7 + 1) * MIB
            cpu_memory(cache_limit=limit)
            got = cpu_memory()["cache_limit"]
            if got != limit:
                undone.append((limit, got))
    finally:
        stop.set()
        thread.join()
        sys.setswitchinterval(switch)
    assert undone == []


def _cpu_memory_in_a_child(env: dict) -> subprocess.CompletedProcess:
    code = ("import warnings, kt_regroup; warnings.simplefilter('always');"
            "m = kt_regroup.cpu_memory(); print(m['cache_limit'], m['huge_pages'])")
    base = {k: v for k, v in os.environ.items() if not k.startswith("KT_REGROUP_")}
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env={**base, **env},
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return done


DEFAULT_LIMIT = 2 << 30


@needs_cpu_kernel
@pytest.mark.parametrize("env, want, warned", [
    # values it reads
    ({"KT_REGROUP_CPU_CACHE_MB": "8796093022207"}, f"{8796093022207 << 20} False", None),
    ({"KT_REGROUP_HUGE_PAGES": "true"}, f"{DEFAULT_LIMIT} True", None),
    ({"KT_REGROUP_HUGE_PAGES": "Off"}, f"{DEFAULT_LIMIT} False", None),
    # values it refuses: the default stays, with a warning naming the variable
    ({"KT_REGROUP_CPU_CACHE_MB": str(2**44)}, f"{DEFAULT_LIMIT} False", "KT_REGROUP_CPU_CACHE_MB"),
    ({"KT_REGROUP_CPU_CACHE_MB": str(2**63)}, f"{DEFAULT_LIMIT} False", "KT_REGROUP_CPU_CACHE_MB"),
    ({"KT_REGROUP_CPU_CACHE_MB": "2G"}, f"{DEFAULT_LIMIT} False", "KT_REGROUP_CPU_CACHE_MB"),
    ({"KT_REGROUP_CPU_CACHE_MB": "1.5"}, f"{DEFAULT_LIMIT} False", "KT_REGROUP_CPU_CACHE_MB"),
    ({"KT_REGROUP_CPU_CACHE_MB": "-1"}, f"{DEFAULT_LIMIT} False", "KT_REGROUP_CPU_CACHE_MB"),
    ({"KT_REGROUP_HUGE_PAGES": "maybe"}, f"{DEFAULT_LIMIT} False", "KT_REGROUP_HUGE_PAGES"),
], ids=["max-mib", "huge-true", "huge-Off", "mib-2^44", "mib-2^63", "mib-2G", "mib-1.5",
        "mib-negative", "huge-maybe"])
def test_the_environment_refuses_what_it_cannot_read_naming_the_variable(env, want, warned):
    done = _cpu_memory_in_a_child(env)
    assert done.stdout.strip() == want, (env, done.stdout, done.stderr[-500:])
    if warned is None:
        assert "KT_REGROUP" not in done.stderr, done.stderr[-500:]
    else:
        name, value = next(iter(env.items()))
        assert f"{name}='{value}'" in done.stderr, done.stderr[-2000:]
