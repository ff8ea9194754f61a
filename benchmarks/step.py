"""The training step: EBC -> regroup -> over-arch -> backward -> SGD step -> grads None.

One ``EmbeddingBagCollection`` per input (one table per key, ``rows`` rows each, one id
per sample and key), so its output ``KeyedTensor`` is the seed's dense or sparse input,
a fresh non-leaf tensor; then each row's regroup, the over-arch (a linear per group and
a mean; or, for ``+sum`` variants, ``sum(out.sum())``: stride-0 gradients), backward,
``SGD.step`` and ``zero_grad(set_to_none=True)``. The tables are small, so the step is
dominated by the regroup-sized tensors. ``no regroup`` feeds the EBC outputs to a linear
each: the same FLOPs and gradient bytes with no regroup; every row's regroup share is its
step minus that one, paired round by round. ``+vbe`` variants (:func:`run_vbe_variant`)
have their own rows: the sparse keys a variable-batch KJT, regrouped by patched torchrec,
today's path, or ``index_select`` + the op. Each row's ``peak_rss_bytes`` is from one
untimed step after the timed rounds (:func:`peak_rss`).
"""

from __future__ import annotations

from typing import Callable, Dict, List, Optional

import torch

from benchmarks.harness import interleaved, make_layout, median, segments

KT = "kt_regroup.KTRegroupAsDict"
FALLBACK = "torchrec.KTRegroupAsDict [fallback: cat]"
FBGEMM = "torchrec.KTRegroupAsDict [fbgemm]"
KT_REGROUP = "torchrec.KeyedTensor.regroup"
COPY_LIMIT = "limit: copy_ into warm memory"
NONE = "no regroup"
# opt-in (--rows): the EBC's per-key outputs regrouped with no cat (issue 23, item 3)
NO_CAT = "kt_regroup.KTRegroupAsDict on per-key EBC outputs (no cat)"
ROWS = (KT, FALLBACK, FBGEMM, KT_REGROUP, COPY_LIMIT, NONE, NO_CAT)
OPT_IN = (KT_REGROUP, NO_CAT)  # run where --rows names them (and in --full / --quick)
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
    modules[NO_CAT] = modules[KT]  # its inputs differ (the step's EBC forward)
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

    from kt_regroup import VariableBatchKeyedTensor

    gen = torch.Generator().manual_seed(0)
    values = [torch.randn(batch, sum(w), generator=gen) for w in lengths]
    results = {r: "not checked (not a regroup)" for r in (COPY_LIMIT, NONE)}
    ref = None
    for row in (FALLBACK, *[r for r in regroups if r not in (FALLBACK, *results)]):
        leaves = [v.clone().requires_grad_() for v in values]
        outs = regroups[row]([  # NO_CAT: per-key tensors, as forward_rows makes them
            VariableBatchKeyedTensor(k, w, list(v.split(w, 1)), [None] * len(k))
            if row == NO_CAT else KeyedTensor(keys=k, length_per_key=w, values=v)
            for k, w, v in zip(keys, lengths, leaves)])
        over(outs, grad).backward()
        got = [o.detach() for o in outs] + [v.grad for v in leaves]
        ref = ref or got
        results[row] = _compare(got, ref, len(outs), reference=row == FALLBACK)
    over.zero_grad(set_to_none=True)
    return results


def _compare(got, ref, n_outs: int, reference: bool) -> str:
    """A row's check: its ``n_outs`` outputs bit-exact, then its gradients to rounding."""
    try:
        assert len(got) == len(ref) and all(torch.equal(a, b) for a, b in
                                            zip(got[:n_outs], ref)), "outputs differ"
        torch.testing.assert_close(got[n_outs:], ref[n_outs:])
        return "ok (reference)" if reference else "ok"
    except AssertionError as e:
        return f"mismatch: {str(e).splitlines()[0][:120]}"


def run_variant(variant: str, *, sizes: dict, batch: int, rounds: int, warmup: int,
                rows: List[str], fbgemm_steps: int, table_rows: int, seed: int) -> List[dict]:
    """Records of one variant, ``LAYOUT[+dup][+sum][+vbe]`` (e.g. ``scattered+dup``);
    ``+vbe`` runs :func:`run_vbe_variant` (its own rows)."""
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor

    layout, *flags = variant.split("+")
    if "vbe" in flags:
        return run_vbe_variant(variant, sizes=sizes, batch=batch, rounds=rounds,
                               warmup=warmup, table_rows=table_rows, seed=seed)
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

    from kt_regroup.vbe import forward_rows  # the EBC without its cat

    def make_step(regroup, head, ebc_forward):
        def step():
            kts = [ebc_forward(ebc, kjt) for ebc, kjt in zip(ebcs, kjts)]
            head(regroup(kts), grad).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        return step

    steps = {r: make_step(regroups[r], over_none if r == NONE else over,
                          forward_rows if r == NO_CAT else EmbeddingBagCollection.__call__)
             for r in rows}
    samples = interleaved(steps, rounds, warmup=warmup, max_rounds={FBGEMM: fbgemm_steps})
    peaks = {r: peak_rss(s) for r, s in steps.items() if r != FBGEMM}  # FBGEMM: seconds
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
                        "peak_rss_bytes": peaks.get(row), "check": checks[row]})
    return records


def add_ratios(records: List[dict]) -> None:
    """Regroup share of each row over the fallback's and over the copy limit's; step time
    over the reference row's (the fallback; for ``+vbe``, today's path) and, for ``+vbe``,
    over the ``index_select`` row's: medians of the ratios of one round's samples."""
    for r in records:
        same = {q["provider"]: q for q in records
                if (q["variant"], q.get("allocator"), q.get("env")) ==
                (r["variant"], r.get("allocator"), r.get("env"))}
        for field, ref in (("share_vs_fallback", FALLBACK), ("share_vs_copy_limit", COPY_LIMIT)):
            base = same.get(ref, {}).get("share_s")
            r[field] = (r["share_s"] / base if base and base > 0 and r["provider"] != NONE
                        and r["share_s"] is not None else None)
        vbe = "vbe" in r["variant"].split("+")
        for field, ref in (("step_vs_ref", VBE_TODAY if vbe else FALLBACK),
                           ("step_vs_index_select", VBE_INDEX if vbe else None)):
            base = same.get(ref, {}).get("samples_s") if ref else None
            r[field] = median([t / b for t, b in zip(r["samples_s"], base)]) if base else None


# --- peak memory of one step ----------------------------------------------------------------


def _release_free_memory() -> None:
    """Hands the free memory back to the OS (kt_regroup's output cache, then glibc
    ``malloc_trim``, jemalloc's ``arena.<all>.purge`` or tcmalloc's
    ``MallocExtension_ReleaseFreeMemory``), so that a step's peak is measured from the
    same clean state whatever ran before it."""
    import ctypes

    import kt_regroup

    kt_regroup.empty_cpu_cache()
    libc = ctypes.CDLL(None)
    if hasattr(libc, "MallocExtension_ReleaseFreeMemory"):
        libc.MallocExtension_ReleaseFreeMemory()
    elif hasattr(libc, "mallctl"):
        libc.mallctl(b"arena.4096.purge", None, None, None, ctypes.c_size_t(0))
    elif hasattr(libc, "malloc_trim"):
        libc.malloc_trim(ctypes.c_size_t(0))


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(ln.split()[1]) for ln in f if ln.startswith(field + ":"))


def peak_rss(step: Callable[[], None]) -> Optional[int]:
    """Bytes of resident memory one call of ``step`` adds at its peak: the allocator's free
    memory released, ``VmHWM`` reset to the current RSS (``/proc/self/clear_refs`` value
    5), the step run, ``VmHWM`` less the RSS before. None where /proc cannot do it."""
    _release_free_memory()
    try:
        before = _status_kib("VmRSS")
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return None
    step()
    return max(0, _status_kib("VmHWM") - before) * 1024


# --- the variable-batch (VBE) step: ``LAYOUT+vbe`` --------------------------------------------

VBE_FUSED = "patched torchrec: EBC rows -> kt_regroup.KTRegroupAsDict"
VBE_TODAY = "today: torchrec EBC (expand + cat) -> kt_regroup.KTRegroupAsDict"
VBE_INDEX = "index_select per key -> kt_regroup op (no cat)"
VBE_REFERENCE = "torchrec unpatched: EBC (expand + cat) -> torchrec.KTRegroupAsDict [fallback: cat]"
VBE_ROWS = (VBE_FUSED, VBE_TODAY, VBE_INDEX, NONE)
VBE_UNIQUE = 256  # unique rows of each sparse key


def vbe_kjt(keys: List[str], batch: int, unique: int, table_rows: int, gen: torch.Generator):
    """A variable-batch KJT: each key ``unique`` rows of one id, each sample one of them
    (``stride_per_key_per_rank`` and ``inverse_indices``)."""
    from torchrec import KeyedJaggedTensor

    return KeyedJaggedTensor(
        keys=keys, values=torch.randint(table_rows, (len(keys) * unique,), generator=gen),
        lengths=torch.ones(len(keys) * unique, dtype=torch.int64),
        stride_per_key_per_rank=[[unique]] * len(keys),
        inverse_indices=(keys, torch.randint(unique, (len(keys), batch), generator=gen)))


class _NoRegroup(torch.autograd.Function):
    """No regroup at all: the outputs are warm buffers of the regroup's output shapes and
    the pooled rows' gradients views of a warm buffer (no copy, no allocation)."""

    @staticmethod
    def forward(ctx, bufs, *pooled):
        ctx.bufs = bufs
        return tuple(_views(bufs["out"], bufs["out_shapes"]))

    @staticmethod
    def backward(ctx, *grads):
        return (None, *_views(ctx.bufs["in"], ctx.bufs["in_shapes"]))


def _vbe_forwards(ebcs, keys, lengths, groups, batch, unique) -> Dict[str, Callable]:
    """Each VBE row's forward, ``list of KJT -> list of group tensors``, on ``ebcs``."""
    from torchrec.modules.regroup import KTRegroupAsDict as TorchrecKTRegroupAsDict
    from torchrec.sparse.jagged_tensor import KeyedTensor

    import kt_regroup

    names = [f"group_{i}" for i in range(len(groups))]
    # one module per row: a module fed pooled rows and expanded values in turn would
    # rebuild its plan every call
    fused, today = (kt_regroup.KTRegroupAsDict(groups, names) for _ in range(2))
    reference = TorchrecKTRegroupAsDict(groups, names)  # its cat path, as in _regroups
    reference._init_regroup([KeyedTensor(keys=k, length_per_key=w, values=torch.zeros(1, sum(w)))
                             for k, w in zip(keys, lengths)])
    reference._is_inited = True
    # the index_select row's plan: the dense values, then one input per sparse key
    flat_keys = [keys[0]] + [[k] for k in keys[1]]
    flat_lengths = [lengths[0]] + [[w] for w in lengths[1]]
    plan = kt_regroup.kt_regroup_arguments(torch.zeros(0), flat_keys, flat_lengths, groups)
    out_lengths = plan[3]
    in_shapes = [(n, sum(w)) for n, w in ((batch, lengths[0]),)] + [
        (unique, w) for w in lengths[1]]
    bufs = {"out": torch.zeros(batch * sum(out_lengths)),
            "in": torch.zeros(sum(n * w for n, w in in_shapes)),
            "out_shapes": [(batch, w) for w in out_lengths], "in_shapes": in_shapes}

    def patched(kjts):
        with kt_regroup.patch_torchrec():
            return [ebc(kjt) for ebc, kjt in zip(ebcs, kjts)]

    def index_select(kjts):
        dense, rows = patched(kjts)
        values = [dense.values()] + [p.index_select(0, ix) for p, ix in zip(rows.pooled, rows.indices)]
        return kt_regroup.permute_multi_embedding(values, *plan)

    def none(kjts):
        dense, rows = patched(kjts)
        return list(_NoRegroup.apply(bufs, dense.values(), *rows.pooled))

    unpatched = lambda kjts: [ebc(kjt) for ebc, kjt in zip(ebcs, kjts)]  # noqa: E731
    return {VBE_REFERENCE: lambda kjts: list(reference(unpatched(kjts)).values()),
            VBE_FUSED: lambda kjts: list(fused(patched(kjts)).values()),
            VBE_TODAY: lambda kjts: list(today(unpatched(kjts)).values()),
            VBE_INDEX: index_select, NONE: none}


def _check_vbe(forwards, params, kjts, over, grad) -> Dict[str, str]:
    """Outputs bit-exact and the parameters' gradients to rounding, against unpatched
    torchrec (its EBC, then its ``KTRegroupAsDict`` on the cat path)."""
    results = {NONE: "not checked (not a regroup)"}
    ref = None
    for row in (VBE_REFERENCE, VBE_FUSED, VBE_TODAY, VBE_INDEX):
        outs = forwards[row](kjts)
        got = [o.detach() for o in outs] + list(torch.autograd.grad(over(outs, grad), params))
        ref = ref or got
        results[row] = _compare(got, ref, len(outs), reference=row == VBE_REFERENCE)
    return results


def run_vbe_variant(variant: str, *, sizes: dict, batch: int, rounds: int, warmup: int,
                    table_rows: int, seed: int, unique: int = VBE_UNIQUE) -> List[dict]:
    """Records of one ``LAYOUT+vbe[+dup][+sum]`` variant: the dense keys at full batch, the
    sparse keys a variable-batch KJT of ``unique`` rows each (``VBE_ROWS``)."""
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor

    import kt_regroup

    layout, *flags = variant.split("+")
    grad = "sum" if "sum" in flags else "linear"
    keys, lengths, groups = make_layout(**sizes, scattered=layout == "scattered",
                                        duplicates="dup" in flags, seed=seed)
    unique = min(unique, batch)
    gen = torch.Generator().manual_seed(seed)
    ebcs = [EmbeddingBagCollection(tables=[
        EmbeddingBagConfig(name=f"t_{k}", embedding_dim=w, num_embeddings=table_rows,
                           feature_names=[k]) for k, w in zip(ks, ws)])
        for ks, ws in zip(keys, lengths)]

    def kjts_of(b, u):
        dense = KeyedJaggedTensor.from_lengths_sync(
            keys=keys[0], values=torch.randint(table_rows, (len(keys[0]) * b,), generator=gen),
            lengths=torch.ones(len(keys[0]) * b, dtype=torch.int64))
        return [dense, vbe_kjt(keys[1], b, u, table_rows, gen)]

    plan = kt_regroup.get_plan(keys, lengths, groups)
    over = OverArch(list(plan.out_lengths))
    params = [p for m in (*ebcs, over) for p in m.parameters()]
    opt = torch.optim.SGD(params, lr=1e-3)
    check_batch = min(batch, 64)
    check_unique = min(unique, 16)
    checks = _check_vbe(_vbe_forwards(ebcs, keys, lengths, groups, check_batch, check_unique),
                        params, kjts_of(check_batch, check_unique), over, grad)
    forwards = _vbe_forwards(ebcs, keys, lengths, groups, batch, unique)
    kjts = kjts_of(batch, unique)

    def make_step(forward):
        def step():
            over(forward(kjts), grad).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        return step

    steps = {r: make_step(forwards[r]) for r in VBE_ROWS}
    samples = interleaved(steps, rounds, warmup=warmup)
    peaks = {r: peak_rss(s) for r, s in steps.items()}
    base = samples[NONE]
    common = {"variant": variant, "layout": layout, "duplicates": "dup" in flags,
              "grad": grad, "batch_size": batch, "segments": segments(plan),
              "out_bytes": 4 * batch * sum(plan.out_lengths), "unique_rows": unique}
    records = []
    for row, ts in samples.items():
        shares = [t - b for t, b in zip(ts, base)] if row != NONE else []
        records.append({**common, "provider": row, "samples_s": ts, "n": len(ts),
                        "step_s": median(ts), "share_samples_s": shares,
                        "share_s": median(shares) if row != NONE else 0.0,
                        "peak_rss_bytes": peaks[row], "check": checks[row]})
    return records
