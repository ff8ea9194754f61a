"""The CPU output cache keeps its promises (kt_regroup.cpu_memory / empty_cpu_cache).

empty_cpu_cache() gives the memory back to the system (RSS from /proc/self/statm falls),
it is one locked step (a concurrent limit is never undone), and the environment
variables refuse what they cannot read, naming the variable.
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from conftest import (
    SMALL_LAYOUT,
    assert_same_list,
    make_values,
    needs_cpp_autograd,
    needs_cpu_kernel,
    plan_args,
    random_grads,
)
from reference import (
    permute_multi_embedding_backward_reference,
    permute_multi_embedding_reference,
)

import kt_regroup
from kt_regroup.plan import get_plan

OP = torch.ops.kt_regroup.permute_multi_embedding
MIB = 1 << 20
ROOT = Path(__file__).resolve().parents[1]

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
    pytest.param({"KT_REGROUP_AVX2": "maybe"}, f"{DEFAULT_LIMIT} False", "KT_REGROUP_AVX2",
                 marks=pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"),
                                          reason="read only where there is an AVX2 build")),
    pytest.param({"KT_REGROUP_JIT": "maybe"}, f"{DEFAULT_LIMIT} False", "KT_REGROUP_JIT",
                 marks=pytest.mark.skipif(
                     not torch.ops.kt_regroup._cpu_machine_code([0, 0, 0, 0, 1]).numel(),
                     reason="read only where copy programs run as machine code")),
], ids=["max-mib", "huge-true", "huge-Off", "mib-2^44", "mib-2^63", "mib-2G", "mib-1.5",
        "mib-negative", "huge-maybe", "avx2-maybe", "jit-maybe"])
def test_the_environment_refuses_what_it_cannot_read_naming_the_variable(env, want, warned):
    done = _cpu_memory_in_a_child(env)
    assert done.stdout.strip() == want, (env, done.stdout, done.stderr[-500:])
    if warned is None:
        assert "KT_REGROUP" not in done.stderr, done.stderr[-500:]
    else:
        name, value = next(iter(env.items()))
        assert f"{name}='{value}'" in done.stderr, done.stderr[-2000:]


# --- the output cache -------------------------------------------------------------------

HUGE_PAGE = 2 << 20


def _large_case(batch=8200):
    """SMALL_LAYOUT at a batch whose outputs and input gradients pass 4 MiB (fp32)."""
    values = make_values(SMALL_LAYOUT, batch, requires_grad=True, seed=3)
    return values, plan_args(SMALL_LAYOUT)


def _step(values, args, seed):
    outs = OP(values, *args)
    grads = random_grads(args[3], values[0].size(0), torch.float32, seed=seed)
    torch.autograd.backward(outs, grads)
    plan = get_plan(*SMALL_LAYOUT)
    want = permute_multi_embedding_backward_reference(
        grads, *args[:3], plan.in_lengths, values[0].size(0), torch.float32)
    assert_same_list(outs, permute_multi_embedding_reference(values, *args))
    assert_same_list([v.grad for v in values], want)
    return outs


@needs_cpp_autograd
def test_a_second_step_reuses_the_first_steps_blocks_and_writes_every_column(cpu_memory):
    values, args = _large_case()
    kt_regroup.empty_cpu_cache()
    outs = _step(values, args, seed=4)
    large = [t for t in [*outs, *(v.grad for v in values)] if t.nbytes >= 4 << 20]
    assert len(large) >= 2, [t.nbytes for t in outs]
    for t in large:  # garbage in the blocks the next step gets back
        t.detach().fill_(float("nan"))
    first = cpu_memory()
    del outs, large, t
    for v in values:
        v.grad = None
    assert cpu_memory()["cached_bytes"] > first["cached_bytes"]
    _step(values, args, seed=5)  # zeros where no key writes, the gradients of unused keys
    assert cpu_memory()["hits"] >= first["hits"] + 2


@needs_cpp_autograd
def test_the_cache_never_holds_more_than_its_limit(cpu_memory):
    values, args = _large_case()
    block = OP([v.detach() for v in values], *args)[1].untyped_storage().nbytes()
    cpu_memory(cache_limit=2 * block + block // 2)
    kt_regroup.empty_cpu_cache()
    held = [OP([v.detach() for v in values], *args) for _ in range(4)]
    del held
    state = cpu_memory()
    assert 0 < state["cached_bytes"] <= state["cache_limit"]
    kt_regroup.empty_cpu_cache()
    assert cpu_memory()["cached_bytes"] == 0
    cpu_memory(cache_limit=0)
    before = cpu_memory()["hits"]
    for _ in range(2):
        assert_same_list(OP([v.detach() for v in values], *args),
                         permute_multi_embedding_reference(values, *args))
    assert cpu_memory()["hits"] == before and cpu_memory()["cached_bytes"] == 0
    with pytest.raises(RuntimeError, match="limit must be >= 0"):
        cpu_memory(cache_limit=-1)


@needs_cpp_autograd
def test_huge_pages_give_2mib_aligned_blocks_and_an_ordinary_storage(cpu_memory):
    values, args = _large_case()
    cpu_memory(huge_pages=True)
    kt_regroup.empty_cpu_cache()
    outs = _step(values, args, seed=6)
    large = [t for t in [*outs, *(v.grad for v in values)] if t.nbytes >= 4 << 20]
    assert large and all(t.data_ptr() % HUGE_PAGE == 0 for t in large)
    # An ordinary storage: resizable (its allocator also serves the resize), shareable.
    t = outs[1].detach()
    before = t.clone()
    t.resize_(t.size(0) * 2, t.size(1))
    assert torch.equal(t[: before.size(0)], before)
    t.resize_(3, t.size(1))
    assert torch.equal(t, before[:3])


@needs_cpu_kernel
def test_the_environment_sets_the_cache_and_huge_pages():
    code = (
        "import torch, kt_regroup, sys; sys.path.insert(0, 'tests');"
        "from test_cpu_memory import _large_case, OP, permute_multi_embedding_reference;"
        "from conftest import assert_same_list;"
        "v, a = _large_case(); o = OP([x.detach() for x in v], *a);"
        "assert_same_list(o, permute_multi_embedding_reference(v, *a));"
        "m = kt_regroup.cpu_memory(); print(m['cache_limit'], m['huge_pages'])"
    )
    root = Path(__file__).resolve().parents[1]
    for env, want in [({}, f"{2 << 30} False"),
                      ({"KT_REGROUP_CPU_CACHE_MB": "0", "KT_REGROUP_HUGE_PAGES": "1"}, "0 True"),
                      ({"KT_REGROUP_CPU_CACHE_MB": "64"}, f"{64 << 20} False")]:
        base = {k: v for k, v in os.environ.items() if not k.startswith("KT_REGROUP_")}
        done = subprocess.run([sys.executable, "-c", code], cwd=root, env={**base, **env},
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr[-2000:]
        assert done.stdout.strip() == want, (env, done.stdout)


@needs_cpu_kernel
def test_children_forked_while_a_thread_allocates_can_allocate():
    """No lock of the cache is held across fork(): each child runs a large regroup."""
    import threading

    values, args = _large_case(batch=2100)
    values = [v.detach() for v in values]
    stop = threading.Event()

    def churn():
        while not stop.is_set():
            OP(values, *args)

    thread = threading.Thread(target=churn)
    thread.start()
    try:
        for _ in range(20):
            pid = os.fork()
            if pid == 0:  # the child: exit at once, 0 only if the regroup is right
                try:
                    # As DataLoader workers do: libgomp's thread pool does not survive
                    # fork() (any parallel torch op hangs in it), the cache must.
                    torch.set_num_threads(1)
                    ok = all(torch.equal(a, b) for a, b in zip(
                        OP(values, *args), permute_multi_embedding_reference(values, *args)))
                finally:
                    os._exit(0 if ok else 1)
            _, status = os.waitpid(pid, 0)  # a deadlocked child would hang here (timeout)
            assert os.waitstatus_to_exitcode(status) == 0
    finally:
        stop.set()
        thread.join()
