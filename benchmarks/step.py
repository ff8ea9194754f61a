"""The training step: EBC -> regroup -> over-arch -> backward -> SGD step -> grads None.

One ``EmbeddingBagCollection`` per input (one table per key, ``rows`` rows each, one id
per sample and key), so its output ``KeyedTensor`` is the seed's dense or sparse input,
a fresh non-leaf tensor; then each row's regroup, the over-arch (a linear per group and
a mean; or, for ``+sum`` variants, ``sum(out.sum())``: stride-0 gradients), backward,
``SGD.step`` and ``zero_grad(set_to_none=True)``. The tables are small, so the step is
dominated by the regroup-sized tensors. ``no regroup`` feeds the EBC outputs to a linear
each: the same FLOPs and gradient bytes with no regroup; every row's regroup share is its
step minus that one, paired round by round.
"""

from __future__ import annotations

from typing import Callable, Dict, List

import torch

from benchmarks.harness import interleaved, make_layout, median, segments

KT = "kt_regroup.KTRegroupAsDict"
FALLBACK = "torchrec.KTRegroupAsDict [fallback: cat]"
FBGEMM = "torchrec.KTRegroupAsDict [fbgemm]"
KT_REGROUP = "torchrec.KeyedTensor.regroup"
COPY_LIMIT = "limit: copy_ into warm memory"
NONE = "no regroup"
ROWS = (KT, FALLBACK, FBGEMM, KT_REGROUP, COPY_LIMIT, NONE)
SHORT_ROWS = (KT, FALLBACK, COPY_LIMIT, NONE)  # the variants after the first


class OverArch(torch.nn.Module):
    def __init__(self, widths: List[int], hidden: int = 8) -> None:
        super().__init__()
        self.linears = torch.nn.ModuleList(torch.nn.Linear(w, hidden) for w in widths)

    def forward(self, xs: List[torch.Tensor], grad: str) -> torch.Tensor:
        if grad == "sum":
            return torch.stack([x.sum() for x in xs]).sum()
        return torch.stack([lin(x) for lin, x in zip(self.linears, xs)]).mean()


class _CopyLimit(torch.autograd.Function):
    """The regroup's bytes, unpermuted: inputs ``copy_``-ed into a warm buffer viewed as
    the outputs, output gradients into one viewed as the input gradients."""

    @staticmethod
    def forward(ctx, bufs, *values):
        ctx.bufs = bufs
        for view, v in zip(_views(bufs["out"], [v.shape for v in values]), values):
            view.copy_(v.detach())
        return tuple(_views(bufs["out"], bufs["out_shapes"]))

    @staticmethod
    def backward(ctx, *grads):
        for view, g in zip(_views(ctx.bufs["in"], [g.shape for g in grads]), grads):
            view.copy_(g)
        return (None, *_views(ctx.bufs["in"], ctx.bufs["in_shapes"]))


def _views(flat: torch.Tensor, shapes) -> List[torch.Tensor]:
    out, o = [], 0
    for b, w in shapes:
        out.append(flat[o:o + b * w].view(b, w))
        o += b * w
    return out


def _regroups(keys, lengths, groups, batch, rows: List[str]) -> Dict[str, Callable]:
    """Each row's regroup: ``list of KeyedTensor -> list of group tensors``."""
    from torchrec.modules.regroup import KTRegroupAsDict as TorchrecKTRegroupAsDict
    from torchrec.sparse.jagged_tensor import KeyedTensor

    import kt_regroup

    names = [f"group_{i}" for i in range(len(groups))]
    sample = [KeyedTensor(keys=k, length_per_key=w, values=torch.zeros(1, sum(w)))
              for k, w in zip(keys, lengths)]
    fallback = TorchrecKTRegroupAsDict(groups, names)
    fallback._init_regroup(sample)  # its cat path: torchrec takes it where key_dim != 1
    fallback._is_inited = True
    modules = {KT: kt_regroup.KTRegroupAsDict(groups, names), FALLBACK: fallback,
               FBGEMM: TorchrecKTRegroupAsDict(groups, names)}
    out: Dict[str, Callable] = {}
    for row in rows:
        if row in modules:
            out[row] = lambda kts, m=modules[row]: list(m(kts).values())
        elif row == KT_REGROUP:
            out[row] = lambda kts: KeyedTensor.regroup(kts, groups)
        elif row == COPY_LIMIT:
            plan = kt_regroup.get_plan(keys, lengths, groups)
            size = batch * max(sum(plan.in_lengths), sum(plan.out_lengths))
            bufs = {"out": torch.zeros(size), "in": torch.zeros(size),  # warm: touched here
                    "out_shapes": [(batch, w) for w in plan.out_lengths],
                    "in_shapes": [(batch, w) for w in plan.in_lengths]}
            out[row] = lambda kts, b=bufs: list(_CopyLimit.apply(b, *[kt.values() for kt in kts]))
        elif row == NONE:
            out[row] = lambda kts: [kt.values() for kt in kts]
    return out


def _check(regroups, keys, lengths, batch, over, grad) -> Dict[str, str]:
    """Outputs bit-exact and input gradients to rounding, against the fallback row."""
    from torchrec.sparse.jagged_tensor import KeyedTensor

    gen = torch.Generator().manual_seed(0)
    values = [torch.randn(batch, sum(w), generator=gen) for w in lengths]
    results = {r: "not checked (not a regroup)" for r in (COPY_LIMIT, NONE)}
    ref = None
    for row in (FALLBACK, *[r for r in regroups if r not in (FALLBACK, *results)]):
        leaves = [v.clone().requires_grad_() for v in values]
        outs = regroups[row]([KeyedTensor(keys=k, length_per_key=w, values=v)
                              for k, w, v in zip(keys, lengths, leaves)])
        over(outs, grad).backward()
        got = [o.detach() for o in outs] + [v.grad for v in leaves]
        ref = ref or got
        try:
            assert len(got) == len(ref) and all(torch.equal(a, b) for a, b in
                                                zip(got[:len(outs)], ref)), "outputs differ"
            torch.testing.assert_close(got[len(outs):], ref[len(outs):])
            results[row] = "ok (reference)" if row == FALLBACK else "ok"
        except AssertionError as e:
            results[row] = f"mismatch: {str(e).splitlines()[0][:120]}"
    over.zero_grad(set_to_none=True)
    return results


def run_variant(variant: str, *, sizes: dict, batch: int, rounds: int, warmup: int,
                rows: List[str], fbgemm_steps: int, table_rows: int, seed: int) -> List[dict]:
    """Records of one variant, ``LAYOUT[+dup][+sum]`` (e.g. ``scattered+dup``)."""
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor

    layout, *flags = variant.split("+")
    grad = "sum" if "sum" in flags else "linear"
    keys, lengths, groups = make_layout(**sizes, scattered=layout == "scattered",
                                        duplicates="dup" in flags, seed=seed)
    gen = torch.Generator().manual_seed(seed)
    ebcs, kjts = [], []
    for ks, ws in zip(keys, lengths):
        ebcs.append(EmbeddingBagCollection(tables=[
            EmbeddingBagConfig(name=f"t_{k}", embedding_dim=w, num_embeddings=table_rows,
                               feature_names=[k]) for k, w in zip(ks, ws)]))
        kjts.append(KeyedJaggedTensor.from_lengths_sync(
            keys=ks, values=torch.randint(table_rows, (len(ks) * batch,), generator=gen),
            lengths=torch.ones(len(ks) * batch, dtype=torch.int64)))
    if fbgemm_steps <= 0:
        rows = [r for r in rows if r != FBGEMM]
    regroups = _regroups(keys, lengths, groups, batch, [FALLBACK, *rows])  # the reference
    import kt_regroup

    plan = kt_regroup.get_plan(keys, lengths, groups)
    over = OverArch(list(plan.out_lengths))
    over_none = OverArch(list(plan.in_lengths))
    params = [p for m in (*ebcs, over, over_none) for p in m.parameters()]
    opt = torch.optim.SGD(params, lr=1e-3)
    checks = _check(regroups, keys, lengths, min(batch, 64), over, grad)

    def make_step(regroup, head):
        def step():
            kts = [ebc(kjt) for ebc, kjt in zip(ebcs, kjts)]
            head(regroup(kts), grad).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        return step

    steps = {r: make_step(regroups[r], over_none if r == NONE else over) for r in rows}
    samples = interleaved(steps, rounds, warmup=warmup, max_rounds={FBGEMM: fbgemm_steps})
    base = samples.get(NONE, [])
    common = {"variant": variant, "layout": layout, "duplicates": "dup" in flags,
              "grad": grad, "batch_size": batch, "segments": segments(plan),
              "out_bytes": 4 * batch * sum(plan.out_lengths)}
    records = []
    for row, ts in samples.items():
        shares = [t - b for t, b in zip(ts, base)] if row != NONE else []
        records.append({**common, "provider": row, "samples_s": ts, "n": len(ts),
                        "step_s": median(ts), "share_samples_s": shares,
                        "share_s": median(shares) if row != NONE else 0.0,
                        "check": checks[row]})
    return records


def add_ratios(records: List[dict]) -> None:
    """Regroup share of each row over the fallback's and over the copy limit's."""
    for r in records:
        same = {q["provider"]: q for q in records
                if (q["variant"], q.get("allocator"), q.get("env")) ==
                (r["variant"], r.get("allocator"), r.get("env"))}
        for field, ref in (("share_vs_fallback", FALLBACK), ("share_vs_copy_limit", COPY_LIMIT)):
            base = same.get(ref, {}).get("share_s")
            r[field] = (r["share_s"] / base if base and base > 0 and r["provider"] != NONE
                        and r["share_s"] is not None else None)
