"""Shared layouts, inputs and oracles for the kt_regroup tests.

A *layout* is ``(keys, lengths, groups)``: the keys and widths of each input tensor
and the keys each output group wants. The random layouts here always use odd widths
(1, 3, 7, 127), duplicate some keys across and inside groups and leave some keys
unused, because those are the cases regroup kernels get wrong.
"""

from __future__ import annotations

import contextlib
import os
import random
from collections.abc import Sequence
from typing import NamedTuple

import pytest
import torch
from hypothesis import HealthCheck, settings

import kt_regroup  # noqa: F401  (registers torch.ops.kt_regroup)

# Hypothesis profiles. `ci` (the default) is fixed-seed and fast; `long` runs thousands of
# examples per property: KT_REGROUP_HYPOTHESIS_PROFILE=long or --hypothesis-profile long.
settings.register_profile(
    "ci", max_examples=25, derandomize=True, deadline=None, print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile(
    "long", max_examples=1000, deadline=None, print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.load_profile(os.environ.get("KT_REGROUP_HYPOTHESIS_PROFILE", "ci"))


@contextlib.contextmanager
def intra_op_threads(n: int):
    """torch's intra-op thread count set to ``n``, restored after."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def pytest_configure(config):
    # pytest-xdist's workers share the cores: each gets its share of intra-op threads.
    # Oversubscribed, every parallel region waits for a core (milliseconds per call on a
    # busy machine). The tests of the multi-threaded paths set their own thread counts.
    workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if workers:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(workers)))

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]
# Dtypes FBGEMM's permute_multi_embedding accepts (it has no float64 kernel).
FBGEMM_DTYPES = [torch.float32, torch.float16, torch.bfloat16]
WIDTHS = (1, 3, 7, 127)
BATCHES = (0, 1, 5)


class Layout(NamedTuple):
    keys: list[list[str]]
    lengths: list[list[int]]
    groups: list[list[str]]

    @property
    def in_widths(self) -> list[int]:
        return [sum(t) for t in self.lengths]

    def used_keys(self) -> set:
        return {k for g in self.groups for k in g}


def random_layout(
    seed: int,
    n_inputs: int = 3,
    keys_per_input: Sequence[int] = (1, 4),
    n_groups: int = 3,
    widths: Sequence[int] = WIDTHS,
) -> Layout:
    """A seeded layout with duplicated keys (across and inside groups) and unused keys."""
    rng = random.Random(seed)
    keys: list[list[str]] = []
    lengths: list[list[int]] = []
    all_keys: list[str] = []
    for t in range(n_inputs):
        n = rng.randint(*keys_per_input)
        tkeys = [f"f{t}_{i}" for i in range(n)]
        keys.append(tkeys)
        lengths.append([rng.choice(widths) for _ in tkeys])
        all_keys += tkeys
    n_skip = max(1, len(all_keys) // 4) if len(all_keys) > 1 else 0
    skipped = set(rng.sample(all_keys, n_skip))
    usable = [k for k in all_keys if k not in skipped]
    rng.shuffle(usable)
    groups: list[list[str]] = [[] for _ in range(n_groups)]
    for i, k in enumerate(usable):  # every usable key lands in some group
        groups[i % n_groups].append(k)
    dup = rng.choice(usable)
    groups[0].append(dup)  # a key used twice in one group ...
    groups[0].append(dup)
    groups[-1].insert(0, rng.choice(usable))  # ... and one shared by two groups
    for g in groups:
        rng.shuffle(g)
    return Layout(keys, lengths, groups)


# A fixed, hand-checked layout: 'b' unused, 'c' used three times, 'e' width 127.
SMALL_LAYOUT = Layout(
    keys=[["a", "b"], ["c", "d", "e"]],
    lengths=[[3, 7], [1, 3, 127]],
    groups=[["c", "a", "c"], ["e", "d", "a"], ["c"]],
)

SEEDS = (0, 1, 2, 3)


def make_values(
    layout: Layout,
    batch: int,
    dtype: torch.dtype = torch.float32,
    noncontiguous: bool = False,
    seed: int = 0,
    requires_grad: bool = False,
) -> list[torch.Tensor]:
    """One ``[batch, width]`` tensor per input; optionally a strided (non-contiguous) view."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for w in layout.in_widths:
        if noncontiguous:
            # A column slice of a wider buffer, transposed storage: strides (1, batch + 2).
            base = torch.randn(w + 3, batch + 2, generator=gen, dtype=torch.float64).to(dtype)
            t = base.t()[1 : 1 + batch, 2 : 2 + w]
            assert not t.is_contiguous() or min(t.shape) <= 1
        else:
            t = torch.randn(batch, w, generator=gen, dtype=torch.float64).to(dtype)
        out.append(t.requires_grad_(requires_grad))
    return out


def key_columns(layout: Layout) -> dict:
    """Each key's place: ``key -> (input, offset, width)``."""
    where = {}
    for t, (tkeys, tlens) in enumerate(zip(layout.keys, layout.lengths)):
        off = 0
        for k, w in zip(tkeys, tlens):
            where[k] = (t, off, w)
            off += w
    return where


def expected_regroup(values: Sequence[torch.Tensor], layout: Layout) -> list[torch.Tensor]:
    """The obvious oracle: slice every key's block and ``torch.cat`` each group."""
    where = key_columns(layout)
    outs = []
    batch, dtype = values[0].size(0), values[0].dtype
    for group in layout.groups:
        blocks = [values[where[k][0]][:, where[k][1] : where[k][1] + where[k][2]] for k in group]
        outs.append(torch.cat(blocks, dim=1) if blocks else torch.empty(batch, 0, dtype=dtype))
    return [o.detach().clone() for o in outs]


def expected_grads(layout: Layout, grads, batch: int, acc_dtype: torch.dtype) -> list:
    """The gradient oracle: every group's gradient added to its keys' columns, in
    ``acc_dtype`` (exact sums in float64 / int64); unused keys stay 0."""
    out = [torch.zeros(batch, w, dtype=acc_dtype) for w in layout.in_widths]
    where = key_columns(layout)
    for g, group in zip(grads, layout.groups):
        off = 0
        for k in group:
            t, in_off, w = where[k]
            out[t][:, in_off : in_off + w] += g[:, off : off + w].to(acc_dtype)
            off += w
    return out


def keyed_tensors(layout: Layout, values: Sequence[torch.Tensor]):
    from torchrec.sparse.jagged_tensor import KeyedTensor

    return [
        KeyedTensor(keys=list(k), length_per_key=list(lens), values=v)
        for k, lens, v in zip(layout.keys, layout.lengths, values)
    ]


def assert_same_list(actual: Sequence[torch.Tensor], expected: Sequence[torch.Tensor]) -> None:
    assert len(actual) == len(expected), (len(actual), len(expected))
    for i, (a, e) in enumerate(zip(actual, expected)):
        # Regrouping only copies: results must be bit-exact, dtype included.
        torch.testing.assert_close(a, e, rtol=0, atol=0, msg=lambda m, i=i: f"output {i}: {m}")


def assert_no_alias(outputs: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor]) -> None:
    for o in outputs:
        if o.numel() == 0:
            continue
        for t in inputs:
            if t.numel() == 0:
                continue
            assert o.untyped_storage().data_ptr() != t.untyped_storage().data_ptr(), (
                "an output shares storage with an input"
            )


@pytest.fixture(autouse=True)
def _seeded():
    """Every test starts from the same global RNG state: failures reproduce exactly."""
    torch.manual_seed(0)


def has_fbgemm_permute() -> bool:
    try:
        import fbgemm_gpu  # noqa: F401
    except ImportError:
        return False
    return hasattr(torch.ops.fbgemm, "permute_multi_embedding")


needs_fbgemm = pytest.mark.skipif(
    not has_fbgemm_permute(), reason="torch.ops.fbgemm.permute_multi_embedding is not available"
)


def clone_all(tensors: Sequence[torch.Tensor | None]) -> list[torch.Tensor | None]:
    return [None if t is None else t.detach().clone() for t in tensors]


def dtype_ids(dtype: torch.dtype) -> str:
    """pytest id of a dtype parameter: ``float32`` rather than ``torch.float32``."""
    return str(dtype).replace("torch.", "")


def _has_kernel(key: str) -> bool:
    return torch._C._dispatch_has_kernel_for_dispatch_key(
        "kt_regroup::permute_multi_embedding", key
    )


needs_cpu_kernel = pytest.mark.skipif(
    not _has_kernel("CPU"), reason="the native CPU kernel is not built/loaded"
)
needs_cpp_autograd = pytest.mark.skipif(
    not (_has_kernel("CPU") and _has_kernel("Autograd")),
    reason="the C++ autograd kernel is not loaded",
)


def plan_args(layout: Layout, index_dtype: torch.dtype = torch.int32) -> tuple:
    """The op's metadata for ``layout``: ``(permutes, in_shapes, out_shapes, out_lengths)``,
    the index tensors in ``index_dtype``."""
    from kt_regroup.plan import get_plan

    plan = get_plan(*layout)
    permutes, in_shapes, out_shapes = plan.tensors()
    return (
        permutes.to(index_dtype),
        in_shapes.to(index_dtype),
        out_shapes.to(index_dtype),
        plan.out_lengths,
    )


def random_grads(out_lengths, batch: int, dtype: torch.dtype, seed: int, none_at=()) -> list:
    """One seeded ``[batch, n]`` upstream gradient per output; ``None`` at ``none_at``."""
    gen = torch.Generator().manual_seed(seed)
    return [
        None if j in none_at
        else torch.randn(batch, n, generator=gen, dtype=torch.float64).to(dtype)
        for j, n in enumerate(out_lengths)
    ]


def group_names(layout: Layout) -> list[str]:
    """``g0``, ``g1``, ...: one name per group of ``layout``."""
    return [f"g{i}" for i in range(len(layout.groups))]


def free_port() -> int:
    """A free TCP port on the loopback interface (for a process group's rendezvous)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wiring_cells(layouts: Sequence[str], dtypes: Sequence[torch.dtype] = DTYPES) -> list:
    """A few ``(name, dtype, batch, noncontiguous)`` cells for the layers above the kernel
    (ops, functional, module, patch), which check what they hand the kernel, not the
    kernel itself: every layout and every dtype once, and every batch (``BATCHES``) with
    contiguous and strided inputs. The kernel's own tests (test_cpu_kernel) run the full
    layout x dtype x batch x contiguity grids."""
    n = max(len(layouts), len(dtypes), 2 * len(BATCHES))
    cells = []
    for i in range(n):
        name, dtype = layouts[i % len(layouts)], dtypes[i % len(dtypes)]
        batch, noncontiguous = BATCHES[i % len(BATCHES)], bool((i // len(BATCHES)) % 2)
        cells.append(pytest.param(
            name, dtype, batch, noncontiguous,
            id=f"{name}-{dtype_ids(dtype)}-b{batch}-{'strided' if noncontiguous else 'contig'}",
        ))
    return cells
