"""The op alone: one regroup (and its backward) per call, providers interleaved.

Inputs are leaf ``KeyedTensor`` s of the seed's sizes, scattered layout, with and without
duplicate keys; forward and forward+backward (``torch.autograd.grad`` with contiguous
``ones`` or stride-0 ``expanded`` upstream gradients, what ``out.sum()`` hands back).
Each provider's first call is untimed and checked against torchrec's cat path. The copy
limits: ``clone`` (fresh memory) and ``copy_`` (warm memory) of the same bytes.
"""

from __future__ import annotations

from typing import Callable, Dict, List

import torch

from benchmarks.harness import QUICK, SEED, interleaved, make_layout, median

KT = "kt_regroup.KTRegroupAsDict"
FBGEMM = "torchrec.KTRegroupAsDict [fbgemm]"
COPY = "limit: copy_"
MODES = ("forward", "forward+backward, ones", "forward+backward, expanded")


def _providers(keys, lengths, groups, kts, expected, backward) -> Dict[str, Callable]:
    from torchrec.modules.regroup import KTRegroupAsDict as TorchrecKTRegroupAsDict
    from torchrec.sparse.jagged_tensor import KeyedTensor, _regroup_keyed_tensors

    import kt_regroup

    names = [f"group_{i}" for i in range(len(groups))]
    plan = kt_regroup.get_plan(keys, lengths, groups)
    tensors, out_lengths = plan.tensors(), list(plan.out_lengths)
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
    if not backward:
        warm = [torch.zeros_like(e) for e in expected]
        detached = [v.detach() for v in values]
        fns["kt_regroup.permute_multi_embedding_into (warm outputs)"] = lambda: (
            op.permute_multi_embedding_into(detached, *tensors, warm), warm)[1]
    src = expected + ([v.detach() for v in values] if backward else [])
    dst = [torch.zeros_like(t) for t in src]
    fns["limit: clone"] = lambda: [t.clone() for t in src][:len(expected)]
    fns[COPY] = lambda: [d.copy_(s) for d, s in zip(dst, src)][:len(expected)]
    return fns


def run(*, quick: bool, seed: int = 0) -> Dict[str, object]:
    from torchrec.sparse.jagged_tensor import KeyedTensor, _regroup_keyed_tensors

    import kt_regroup

    sizes, batch, rounds = (QUICK, 64, 2) if quick else (SEED, 1024, 7)
    records = []
    for dup in (False, True):
        keys, lengths, groups = make_layout(**sizes, scattered=True, duplicates=dup, seed=seed)
        segments = len(kt_regroup.get_plan(keys, lengths, groups).rows)
        gen = torch.Generator().manual_seed(seed)
        base = [torch.randn(batch, sum(w), generator=gen) for w in lengths]
        for mode in MODES:
            backward = mode != "forward"
            values = [v.clone().requires_grad_(backward) for v in base]
            kts = [KeyedTensor(keys=k, length_per_key=w, values=v)
                   for k, w, v in zip(keys, lengths, values)]
            with torch.no_grad():
                expected = [t.contiguous() for t in _regroup_keyed_tensors(kts, groups)]
            ones = [torch.ones(()).expand(e.shape) if mode.endswith("expanded")
                    else torch.ones(e.shape) for e in expected]
            want_grads = (torch.autograd.grad(_regroup_keyed_tensors(kts, groups), values, ones)
                          if backward else None)
            fns = _providers(keys, lengths, groups, kts, expected, backward)

            calls = {n: _with_backward(f, values, ones if backward and not n.startswith(
                "limit") else None) for n, f in fns.items()}
            checks = {n: _check(c(), expected, want_grads) for n, c in calls.items()}
            samples = interleaved(calls, rounds, warmup=0, max_rounds={FBGEMM: 1})
            meds = {n: median(ts) for n, ts in samples.items()}
            for n, ts in samples.items():
                q = torch.tensor(ts, dtype=torch.float64).quantile(
                    torch.tensor([0.5, 0.9], dtype=torch.float64)).tolist()
                records.append({
                    "mode": mode, "layout": "scattered", "duplicates": dup, "batch_size": batch,
                    "segments": segments, "provider": n, "samples_s": ts, "n": len(ts),
                    "p50_s": q[0], "p90_s": q[1], "vs_copy": meds[n] / meds[COPY],
                    "vs_kt_regroup": meds[n] / meds[KT], "check": checks[n]})
            del fns, calls, kts
    return {"records": records, "notes": ["the FBGEMM row (seconds a call on CPU) is timed "
                                          "by one call after its checked first call"]}


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
    if grads is not None:
        try:
            for g, w in zip(grads, want_grads):
                torch.testing.assert_close(g, w)
        except AssertionError:
            return "mismatch: input gradients"
    return "ok" if grads is not None or want_grads is None else "ok (outputs; no gradient)"
