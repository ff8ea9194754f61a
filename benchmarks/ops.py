"""The op alone: one regroup (and its backward) per call, providers interleaved.

Inputs are leaf ``KeyedTensor`` s of the seed's sizes, scattered layout, with and without
duplicate keys; forward and forward+backward (``torch.autograd.grad`` with contiguous
``ones`` or stride-0 ``expanded`` upstream gradients, what ``out.sum()`` hands back).
Each provider's first call is untimed and checked against torchrec's cat path. The copy
limits: ``clone`` (fresh memory) and ``copy_`` (warm memory) of the same bytes. ``--full``
and ``--quick`` then time the variable-batch op (``VBE_MODES``, :func:`_vbe_cells`).

Wall time (``p50_s``) syncs the host before and after each call: on a GPU it holds the
launch overhead. On CUDA each row also has GPU time from CUDA events
(:func:`benchmarks.harness.device_interleaved`): ``device_p50_s``, calls queued without a
sync (kernel time, plus launch gaps where the host is the slower), and ``graph_p50_s``,
replays of a CUDA graph of one call (kernel time alone); elsewhere they are None.
"""

from __future__ import annotations

import sys
from itertools import chain
from typing import Callable, Dict, Iterator, List, NamedTuple, Optional

import torch

from benchmarks.harness import (
    NARROW,
    QUICK,
    SEED,
    device_interleaved,
    interleaved,
    make_layout,
    median,
    segments,
)
from benchmarks.step import VBE_UNIQUE  # unique rows of each sparse key

KT = "kt_regroup.KTRegroupAsDict"
FBGEMM = "torchrec.KTRegroupAsDict [fbgemm]"
COPY = "limit: copy_"
MODES = ("forward", "forward+backward, ones", "forward+backward, expanded")
# the variable-batch op (--full and --quick): per-key inputs, sparse keys read by index
VBE_MODES = ("vbe forward", "vbe forward+backward")
VBE_OP = "kt_regroup.permute_multi_embedding_vbe"
VBE_INDEX = "index_select per key -> kt_regroup.permute_multi_embedding"
DEVICE_BATCH = 10  # calls (or graph replays) between two CUDA events


def _providers(keys, lengths, groups, kts, expected, backward, every) -> Dict[str, Callable]:
    from torchrec.modules.regroup import KTRegroupAsDict as TorchrecKTRegroupAsDict
    from torchrec.sparse.jagged_tensor import KeyedTensor, _regroup_keyed_tensors

    import kt_regroup

    names = [f"group_{i}" for i in range(len(groups))]
    plan = kt_regroup.get_plan(keys, lengths, groups)
    tensors, out_lengths = plan.tensors(expected[0].device), list(plan.out_lengths)
    values = [kt.values() for kt in kts]
    module, peer = kt_regroup.KTRegroupAsDict(groups, names), TorchrecKTRegroupAsDict(groups, names)
    op = torch.ops.kt_regroup
    fns = {
        KT: lambda: list(module(kts).values()),
        "kt_regroup.permute_multi_embedding": lambda: op.permute_multi_embedding(
            values, *tensors, out_lengths),
        "torchrec._regroup_keyed_tensors": lambda: _regroup_keyed_tensors(kts, groups),
        "torchrec.KeyedTensor.regroup": lambda: KeyedTensor.regroup(kts, groups),
        FBGEMM: lambda: list(peer(kts).values()),
    }
    if not every:  # the default run: seconds a call on CPU; FBGEMM's op is the step's row
        del fns["torchrec.KeyedTensor.regroup"], fns[FBGEMM]
    if not backward:  # its outputs are touched here, before any timing
        warm = [torch.zeros_like(e) for e in expected]
        detached = [v.detach() for v in values]
        fns["kt_regroup.permute_multi_embedding_into (warm outputs)"] = lambda: (
            op.permute_multi_embedding_into(detached, *tensors, warm), warm)[1]
    src = expected + ([v.detach() for v in values] if backward else [])
    fns["limit: clone"] = lambda: [t.clone() for t in src][:len(expected)]
    fns[COPY] = _copy_limit(expected, src[len(expected):])
    return fns


def _copy_limit(expected: List[torch.Tensor], extra: List[torch.Tensor]) -> Callable:
    """``copy_`` into warm buffers of the outputs and ``extra``; returns the outputs."""
    src = expected + extra
    dst = [torch.zeros_like(t) for t in src]
    return lambda: [d.copy_(s) for d, s in zip(dst, src)][:len(expected)]


class Cell(NamedTuple):
    """One table: its providers' calls (the first checked, then timed) and reference."""
    mode: str
    duplicates: bool
    segments: int
    calls: Dict[str, Callable]
    expected: List[torch.Tensor]  # the outputs
    want_grads: Optional[tuple]  # the inputs' gradients (None: forward only)
    moved: int  # bytes the op must move
    ref: str  # the provider of the "/ kt_regroup" column


def run(*, quick: bool, full: bool = False, seed: int = 0, device: str = "cpu",
        layout: str = "scattered", dtype: str = "float32") -> Dict[str, object]:
    """The op table; the default run: no duplicates, forward and forward+backward (ones),
    5 rounds, no ``KeyedTensor.regroup`` or FBGEMM row (seconds a call on CPU; FBGEMM's op
    has its row in the step table); ``full`` and ``quick``: every mode and row, with and
    without duplicate keys, 7 rounds, then the variable-batch op's ``VBE_MODES``."""
    sizes, batch, rounds = (QUICK, 64, 2) if quick else (SEED, 1024, 7 if full else 5)
    if layout == "narrow":  # many narrow keys at a small batch: bound by launches and plans
        sizes, batch = NARROW, 32
    cuda = torch.device(device).type == "cuda"
    records, notes = [], {}
    every = quick or full
    # torchrec's cat path: a second or more a call on CPU; 3 rounds in the default run
    slow = {} if every else {"torchrec._regroup_keyed_tensors": 3}
    args = (sizes, batch, layout, seed, device, getattr(torch, dtype))
    cells = chain(_cells(*args, every), _vbe_cells(*args) if every else ())
    for cell in cells:
        print(f"[bench] ops: {cell.mode}{', duplicates' if cell.duplicates else ''}",
              file=sys.stderr, flush=True)
        calls, expected = cell.calls, cell.expected
        checks, peaks = {}, {}
        for n, c in calls.items():  # the checked first call; on CUDA its peak memory
            if cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                before = torch.cuda.memory_allocated()
            try:
                checks[n] = _check(c(), expected, cell.want_grads)
            except Exception as e:  # noqa: BLE001  (a peer without a kernel here)
                checks[n] = f"error: {type(e).__name__}: {str(e).splitlines()[0][:120]}"
            peaks[n] = torch.cuda.max_memory_allocated() - before if cuda else None
        timed = {n: c for n, c in calls.items() if not checks[n].startswith("error")}
        samples = interleaved(timed, rounds, warmup=0,
                              max_rounds=None if cuda else {FBGEMM: 1, **slow})
        samples.update({n: [] for n in calls if n not in samples})
        meds = {n: median(ts) for n, ts in samples.items()}
        # On CUDA, GPU time beside the wall time (which syncs the host before and
        # after each call, so it holds the launch overhead too): events around a
        # batch of calls queued without a sync, and around replays of a CUDA graph.
        eager, graph, graph_errors = (device_interleaved(timed, rounds, batch=DEVICE_BATCH)
                                      if cuda else ({}, {}, {}))
        dmeds = {n: median(eager.get(n, [])) for n in calls}
        gmeds = {n: median(graph.get(n, [])) for n in calls}
        for n, e in graph_errors.items():
            notes.setdefault(f"{n}: no CUDA graph ({e}): its graph ms is empty", None)

        def ratio(a, b):
            return a / b if a and b else None

        for n, ts in samples.items():
            q = torch.tensor(ts, dtype=torch.float64).quantile(torch.tensor(
                [0.5, 0.9], dtype=torch.float64)).tolist() if ts else [None, None]
            records.append({
                "mode": cell.mode, "layout": layout, "dtype": dtype,
                "duplicates": cell.duplicates, "batch_size": batch,
                "device": str(device), "threads": torch.get_num_threads(),
                "segments": cell.segments, "provider": n,
                "samples_s": ts, "n": len(ts), "p50_s": q[0], "p90_s": q[1],
                "bytes_moved": cell.moved, "gbps": ratio(cell.moved / 1e9, q[0]),
                "mem_peak_bytes": peaks[n], "vs_copy": ratio(meds[n], meds[COPY]),
                "vs_kt_regroup": ratio(meds[n], meds[cell.ref]), "check": checks[n],
                # CUDA only (None elsewhere): seconds per call from CUDA events
                "device_batch": DEVICE_BATCH if cuda else None,
                "device_samples_s": eager.get(n) if cuda else None,
                "device_p50_s": dmeds[n], "vs_copy_device": ratio(dmeds[n], dmeds[COPY]),
                "graph_samples_s": graph.get(n) if cuda else None,
                "graph_p50_s": gmeds[n], "vs_copy_graph": ratio(gmeds[n], gmeds[COPY]),
                "graph_error": graph_errors.get(n)})
        del cell, calls, expected
    return {"records": records, "notes": list(notes) if cuda else [
        "the FBGEMM row (seconds a call on CPU) is timed by one call after its checked one"
        if every else "no FBGEMM row (seconds a call on CPU; see the step table or --full); "
        "torchrec._regroup_keyed_tensors timed by 3 calls"]}


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _cells(sizes, batch, layout, seed, device, dtype, every) -> Iterator[Cell]:
    """``permute_multi_embedding``'s tables: leaf ``KeyedTensor`` s, every provider."""
    from torchrec.sparse.jagged_tensor import KeyedTensor, _regroup_keyed_tensors

    import kt_regroup

    for dup in (False, True) if every else (False,):
        keys, lengths, groups = make_layout(**sizes, scattered=layout != "seed",
                                            duplicates=dup, seed=seed)
        n_segments = segments(kt_regroup.get_plan(keys, lengths, groups))
        gen = torch.Generator().manual_seed(seed)
        base = [torch.randn(batch, sum(w), generator=gen).to(device, dtype) for w in lengths]
        for mode in MODES if every else MODES[:2]:
            backward = mode != "forward"
            values = [v.clone().requires_grad_(backward) for v in base]
            kts = [KeyedTensor(keys=k, length_per_key=w, values=v)
                   for k, w, v in zip(keys, lengths, values)]
            with torch.no_grad():
                expected = [t.contiguous() for t in _regroup_keyed_tensors(kts, groups)]
            expanded = mode.endswith("expanded")
            # in the outputs' dtype: autograd would cast (and so materialize) any other
            ones = [torch.ones((), device=device, dtype=e.dtype).expand(e.shape) if expanded
                    else torch.ones(e.shape, device=device, dtype=e.dtype) for e in expected]
            want_grads = (torch.autograd.grad(_regroup_keyed_tensors(kts, groups), values, ones)
                          if backward else None)
            fns = _providers(keys, lengths, groups, kts, expected, backward, every)
            calls = {n: _with_backward(f, values, ones if backward and not n.startswith(
                "limit") else None) for n, f in fns.items()}
            out_bytes = _nbytes(expected)
            # bytes a regroup must move: outputs written and read; in forward+backward also
            # the upstream gradient read (one element when expanded), the input's written
            moved = 2 * out_bytes + (((0 if expanded else out_bytes) + _nbytes(values))
                                     if backward else 0)
            yield Cell(mode, dup, n_segments, calls, expected, want_grads, moved, KT)
            del fns, calls, kts


def _vbe_cells(sizes, batch, layout, seed, device, dtype) -> Iterator[Cell]:
    """``permute_multi_embedding_vbe``'s tables: the dense keys one input at full batch,
    each sparse key its own input of ``VBE_UNIQUE`` rows read through a random ``[B]``
    index; the fused op against today's expansion (``index_select`` per key, then
    ``permute_multi_embedding``) and ``copy_`` of the bytes the fused op must move."""
    from torchrec.sparse.jagged_tensor import KeyedTensor, _regroup_keyed_tensors

    import kt_regroup

    keys, lengths, groups = make_layout(**sizes, scattered=layout != "seed",
                                        duplicates=False, seed=seed)
    keys, lengths = [keys[0]] + [[k] for k in keys[1]], [lengths[0]] + [[w] for w in lengths[1]]
    unique = min(VBE_UNIQUE, batch)
    gen = torch.Generator().manual_seed(seed)
    base = [torch.randn(batch if i == 0 else unique, sum(w), generator=gen).to(device, dtype)
            for i, w in enumerate(lengths)]
    indices = [None] + [torch.randint(unique, (batch,), generator=gen).to(device)
                        for _ in lengths[1:]]
    plan = kt_regroup.kt_regroup_arguments(base[0], keys, lengths, groups)
    n_segments = segments(kt_regroup.get_plan(keys, lengths, groups))
    op = torch.ops.kt_regroup
    for mode in VBE_MODES:
        backward = mode != VBE_MODES[0]
        pooled = [p.clone().requires_grad_(backward) for p in base]

        def rows(pooled=pooled):  # today's expansion: every sample's row, one input per key
            return [p if i is None else p.index_select(0, i) for p, i in zip(pooled, indices)]

        def reference():  # torchrec's cat path on the expanded rows
            return _regroup_keyed_tensors([KeyedTensor(keys=k, length_per_key=w, values=v)
                                           for k, w, v in zip(keys, lengths, rows())], groups)

        with torch.no_grad():
            expected = [t.contiguous() for t in reference()]
        ones = [torch.ones_like(e) for e in expected]
        want_grads = torch.autograd.grad(reference(), pooled, ones) if backward else None
        # bytes the fused op must move: outputs written and their rows read; in
        # forward+backward also the upstream gradient read, the input gradients written
        out_bytes, in_bytes = _nbytes(expected), _nbytes(pooled)
        moved = 2 * out_bytes + ((out_bytes + in_bytes) if backward else 0)
        # the copy limit: the outputs, then a flat buffer of (out + in) / 2 bytes
        extra = [expected[0].new_zeros((out_bytes + in_bytes) // 2 // expected[0].element_size())
                 ] if backward else []
        fns = {VBE_OP: lambda p=pooled: op.permute_multi_embedding_vbe(p, indices, *plan),
               VBE_INDEX: lambda: op.permute_multi_embedding(rows(), *plan),
               COPY: _copy_limit(expected, extra)}
        calls = {n: _with_backward(f, pooled, ones if backward and n != COPY else None)
                 for n, f in fns.items()}
        yield Cell(mode, False, n_segments, calls, expected, want_grads, moved, VBE_OP)
        del fns, calls


def _with_backward(forward: Callable, values, grads) -> Callable:
    """``forward`` and, given upstream ``grads``, ``torch.autograd.grad`` of the inputs."""
    def call():
        outs = forward()
        if grads is None:
            return outs, None
        return outs, torch.autograd.grad(outs, values, grads, allow_unused=True,
                                         materialize_grads=True)
    return call


def _check(result, expected: List[torch.Tensor], want_grads) -> str:
    outs, grads = result
    if len(outs) != len(expected) or not all(torch.equal(o.detach(), e)
                                             for o, e in zip(outs, expected)):
        return "mismatch: outputs"
    if grads is not None and not all(torch.equal(g, w) for g, w in zip(grads, want_grads)):
        try:  # bit-equal is the rule without duplicates; summed duplicates may round apart
            for g, w in zip(grads, want_grads):
                torch.testing.assert_close(g, w)
        except AssertionError:
            return "mismatch: input gradients"
    return "ok" if grads is not None or want_grads is None else "ok (outputs; no gradient)"
