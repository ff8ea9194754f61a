"""Fuzzing of every raw op (``torch.ops.kt_regroup.*``) with hostile arguments.

Each case starts from a valid call and mutates it: permute cells, shapes and lengths set
to negatives and int32/int64 extremes, metadata of the wrong dtype or shape, mismatched
lengths, wrong tensor dtypes, ranks and batch sizes, meta tensors, aliasing outputs.
Every case must end in a Python exception, or, where the call keeps the ops' contract
(:func:`contract`, written here from the documented rules, independently of the
library's checks), in the result of the oracle (``tests/reference.py``'s plain slices;
torchrec's own ``_kt_regroup_arguments`` for the plan ops), with its inputs unmodified.
A result for a call that breaks the contract is a defect.

Cases run in child processes, so a crash fails one test instead of killing pytest; the
child prints each case before running it, so a crash names its case. Reproduce one with
``python tests/test_fuzz.py --first SEED --cases 1 -v``. ``scripts/asan.sh`` runs the
same cases against an AddressSanitizer build of the library.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import random
import subprocess
import sys
from collections import Counter

import pytest
import torch

# Cases per pytest child, and children per test run (the CI sample: CHILDREN x CASES).
CASES = 1500
CHILDREN = 2
OPS = (
    "permute_multi_embedding",
    "permute_multi_embedding_to",
    "permute_multi_embedding_into",
    "permute_multi_embedding_backward",
    "kt_regroup_arguments",
    "regroup_keyed_tensor",
    "permute_multi_embedding_vbe",
)
I32, I64 = 2**31, 2**63
EXTREMES = (-1, -2, -I32, -I32 - 1, I32 - 1, I32, 2**32 + 1, -I64, I64 - 1, 2**40, 0, 1, 3)
# Sizes whose allocation fails at once (or whose numel overflows): never a real fill.
HUGE = (2**48, 2**62, I64 - 1)
DATA_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8,
               torch.int64, torch.bool)
META_DTYPES = (torch.int32, torch.int64, torch.int16, torch.uint8, torch.float32, torch.bool)


# --- one case: a valid call, then mutations ------------------------------------------------


def _valid(rng: random.Random):
    from kt_regroup.plan import get_plan

    n_in = rng.randint(1, 3)
    keys = [[f"k{t}_{i}" for i in range(rng.randint(0, 4))] for t in range(n_in)]
    lengths = [[rng.randint(0, 5) for _ in k] for k in keys]
    pool = [k for tk in keys for k in tk]
    groups = [
        [rng.choice(pool) for _ in range(rng.randint(0, 4))] if pool else []
        for _ in range(rng.randint(1, 3))
    ]
    plan = get_plan(keys, lengths, groups)
    meta = plan.tensors()
    batch = rng.choice((0, 1, 2, 3))
    dtype = rng.choice(DATA_DTYPES[:4]) if rng.random() < 0.8 else rng.choice(DATA_DTYPES)
    embs = [torch.randn(batch, w).to(dtype) for w in plan.in_lengths]
    return dict(
        keys=keys, lengths=lengths, groups=groups, embs=embs, batch=batch, dtype=dtype,
        permutes=meta[0].clone(), in_shapes=meta[1].clone(), out_shapes=meta[2].clone(),
        out_lengths=list(plan.out_lengths), in_lengths=list(plan.in_lengths),
    )


def _set_cell(rng, t: torch.Tensor) -> torch.Tensor:
    if t.numel() == 0:
        return t
    flat = t.to(torch.int64).flatten()  # int64 holds every extreme but I64; wrap that one
    flat[rng.randrange(flat.numel())] = max(min(rng.choice(EXTREMES), I64 - 1), -I64)
    return flat.reshape(t.shape).to(t.dtype)


def _reshape(rng, t: torch.Tensor) -> torch.Tensor:
    kind = rng.choice(("flat", "2d", "3d", "drop", "add", "strided", "empty"))
    if kind == "flat":
        return t.flatten()
    if kind == "2d":
        return t.reshape(1, -1) if t.dim() == 1 else t.reshape(-1, 3)[: t.numel() // 3]
    if kind == "3d":
        return t.unsqueeze(0)
    if kind == "drop":
        return t[..., :-1] if t.dim() == 2 else t[:-1]
    if kind == "add":
        extra = torch.full_like(t[..., :1] if t.dim() == 2 else t[:1], rng.choice(EXTREMES[:9]) % 7)
        return torch.cat([t, extra], dim=-1)
    if kind == "strided":  # the same values, other strides: must still work
        return t.t().contiguous().t() if t.dim() == 2 else t.repeat_interleave(2)[::2]
    return t[:0]


def _mutate_list(rng, values: list) -> list:
    values = list(values)
    kind = rng.choice(("cell", "drop", "add"))
    if kind == "cell" and values:
        values[rng.randrange(len(values))] = rng.choice(EXTREMES[:4] + HUGE)
    elif kind == "drop" and values:
        values.pop()
    else:
        values.append(rng.choice((0, 1, 4)))
    return values


def _mutate_tensor(rng, c: dict, name: str) -> None:
    kind = rng.choice(("cell", "cell", "dtype", "shape", "meta"))
    t = c[name]
    if kind == "cell":
        c[name] = _set_cell(rng, t)
    elif kind == "dtype":
        c[name] = t.to(rng.choice(META_DTYPES))
    elif kind == "shape":
        c[name] = _reshape(rng, t)
    else:
        c[name] = t.to("meta")


def _mutate_embs(rng, c: dict) -> None:
    embs = list(c["embs"])
    if not embs:
        return
    kind = rng.choice(("dtype", "rank", "batch", "width", "empty", "strided", "expanded", "meta"))
    i = rng.randrange(len(embs))
    if kind == "dtype":
        embs[i] = embs[i].to(rng.choice(DATA_DTYPES))
    elif kind == "rank":
        embs[i] = embs[i].flatten() if rng.random() < 0.5 else embs[i].unsqueeze(0)
    elif kind == "batch":
        embs[i] = torch.zeros(embs[i].size(0) + 1, embs[i].size(1), dtype=embs[i].dtype)
    elif kind == "width":
        embs[i] = torch.zeros(embs[i].size(0), embs[i].size(1) + 1, dtype=embs[i].dtype)
    elif kind == "empty":
        embs = []
    elif kind == "strided":  # valid: any strides
        embs = [e.t().contiguous().t() for e in embs]
    elif kind == "expanded":  # valid: stride-0 rows
        embs = [e[:1].expand(e.size(0), -1) if e.size(0) else e for e in embs]
    else:
        embs = [e.to("meta") for e in embs]
    c["embs"] = embs


def _grads(rng, c: dict) -> list:
    dtype = c["dtype"] if c["dtype"].is_floating_point else torch.float32
    grads = [torch.randn(c["batch"], n).to(dtype) for n in c["out_lengths"]]
    if rng.random() < 0.3 and grads:
        grads[rng.randrange(len(grads))] = None
    return grads


def _mutate(rng, c: dict) -> None:
    what = rng.choice(("permutes", "permutes", "in_shapes", "out_shapes", "lengths",
                       "embs", "huge", "backward", "into", "plan"))
    c["mutated"].append(what)
    if what in ("permutes", "in_shapes", "out_shapes"):
        _mutate_tensor(rng, c, what)
    elif what == "lengths":
        name = rng.choice(("out_lengths", "in_lengths"))
        c[name] = _mutate_list(rng, c[name])
    elif what == "embs":
        _mutate_embs(rng, c)
    elif what == "huge" and c["out_lengths"]:  # declared and passed alike: passes checks
        j, big = rng.randrange(len(c["out_lengths"])), rng.choice(HUGE)
        c["out_lengths"][j] = big
        c["out_shapes"] = c["out_shapes"].to(torch.int64)
        c["out_shapes"][j] = big
    elif what == "backward":
        kind = rng.choice(("batch", "dtype", "grad_shape", "all_none"))
        if kind == "batch":
            c["batch_size"] = rng.choice(EXTREMES[:4] + HUGE)
        elif kind == "dtype":
            c["grad_dtype"] = rng.choice(DATA_DTYPES)
        elif kind == "grad_shape" and c["grads"]:
            c["grads"][rng.randrange(len(c["grads"]))] = torch.zeros(c["batch"] + 1, 2)
        else:
            c["grads"] = [None] * len(c["grads"])
    elif what == "into" and c["embs"] and c["outs"]:
        kind = rng.choice(("alias_input", "alias_each_other", "strided", "dtype", "width",
                           "expanded", "other_storage", "leaf"))
        j = rng.randrange(len(c["outs"]))
        o = c["outs"][j]
        if kind == "alias_input":
            c["outs"][j] = c["embs"][0]
        elif kind == "expanded":  # stride-0 rows: every row one memory location
            c["outs"][j] = torch.zeros(1, o.size(1), dtype=o.dtype).expand(o.size(0), -1)
        elif kind == "other_storage":  # the memory of an input or out, through another Storage
            src = rng.choice([*c["embs"], *c["outs"]])
            c["outs"][j] = torch.utils.dlpack.from_dlpack(torch.utils.dlpack.to_dlpack(src))
        elif kind == "leaf":
            c["outs"][j] = o.detach().clone().requires_grad_()
        elif kind == "alias_each_other" and len(c["outs"]) > 1:
            c["outs"][j] = c["outs"][j - 1]
        elif kind == "strided":
            c["outs"][j] = torch.zeros(o.size(1), o.size(0), dtype=o.dtype).t()
        elif kind == "dtype":
            c["outs"][j] = o.to(torch.float64 if o.dtype != torch.float64 else torch.float32)
        else:
            c["outs"][j] = torch.zeros(o.size(0), o.size(1) + 1, dtype=o.dtype)
    elif what == "plan":  # layout-level nonsense for the plan ops
        kind = rng.choice(("missing", "negative", "int32", "lengths", "duplicate", "no_keys"))
        if kind == "missing":
            c["groups"] = [*c["groups"], ["nope"]]
        elif kind == "negative" and c["lengths"][0]:
            c["lengths"][0][0] = rng.choice(EXTREMES[:4])
        elif kind == "int32" and c["lengths"][0]:  # no int32 plan holds these
            c["lengths"][0][0] = rng.choice((I32 - 1, I32, 2**32 + 1, 2**40))
        elif kind == "lengths":
            c["lengths"] = [*c["lengths"], [1]]
        elif kind == "duplicate" and len(c["keys"]) > 1 and c["keys"][0]:
            c["keys"][1] = [*c["keys"][1], c["keys"][0][0]]
            c["lengths"][1] = [*c["lengths"][1], 1]
        else:
            c["keys"], c["lengths"] = [], []


def _vbe_inputs(rng, c: dict) -> None:
    """Variable-batch inputs: each input indexed (1-3 rows shared by the samples) or not."""
    c["indices"] = []
    for i, e in enumerate(c["embs"]):
        if rng.random() < 0.3:
            c["indices"].append(None)
            continue
        rows = rng.randint(1, 3)
        c["embs"][i] = torch.randn(rows, e.size(1)).to(e.dtype)
        ix = torch.randint(0, rows, (c["batch"],))
        c["indices"].append(ix.int() if rng.random() < 0.5 else ix)


def _mutate_indices(rng, c: dict) -> None:
    """Bad indices: out of range, wrong dtype, rank or length; a list of the wrong length."""
    given = [i for i, ix in enumerate(c["indices"]) if ix is not None]
    kind = rng.choice(("range", "range", "dtype", "rank", "length", "list", "strided"))
    c["mutated"].append("indices")
    if kind == "list":
        c["indices"] = c["indices"][:-1] if c["indices"] else [torch.zeros(c["batch"], dtype=torch.long)]
        return
    if not given:
        return
    i = rng.choice(given)
    ix = c["indices"][i]
    if kind == "range" and ix.numel():
        c["indices"][i] = _set_cell(rng, ix.to(torch.int64)).to(ix.dtype)
    elif kind == "dtype":
        c["indices"][i] = ix.to(rng.choice(META_DTYPES))
    elif kind == "rank":
        c["indices"][i] = ix.unsqueeze(0)
    elif kind == "length":
        c["indices"][i] = torch.cat([ix, ix[:1] if ix.numel() else torch.zeros(1, dtype=ix.dtype)])
    else:  # valid: a strided index
        c["indices"][i] = torch.stack([ix, ix], 1)[:, 0]


def make_case(seed: int):
    """``(op, args)`` for one seed: a valid call, then 0-3 mutations."""
    rng = random.Random(seed)
    torch.manual_seed(seed)  # the data too: a seed names one case exactly
    c = _valid(rng)
    c["mutated"] = []
    op = OPS[seed % len(OPS)]
    c["grads"] = _grads(rng, c)
    c["grad_dtype"] = next((g.dtype for g in c["grads"] if g is not None), torch.float32)
    c["to_dtype"] = rng.choice((None,) + DATA_DTYPES)
    c["outs"] = [torch.full((c["batch"], n), 7).to(c["dtype"]) for n in c["out_lengths"]]
    if op == "permute_multi_embedding_vbe":
        _vbe_inputs(rng, c)
        if rng.random() < 0.5:
            _mutate_indices(rng, c)
    for _ in range(rng.choice((0, 1, 1, 2, 3))):
        try:
            _mutate(rng, c)
        except (IndexError, RuntimeError, ValueError):  # not applicable to this case
            pass
    meta = (c["permutes"], c["in_shapes"], c["out_shapes"])
    if op == "permute_multi_embedding":
        args = (c["embs"], *meta, c["out_lengths"])
    elif op == "permute_multi_embedding_to":
        args = (c["embs"], *meta, c["out_lengths"], c["to_dtype"])
    elif op == "permute_multi_embedding_into":
        args = (c["embs"], *meta, c["outs"])
    elif op == "permute_multi_embedding_backward":
        args = (c["grads"], *meta, c["in_lengths"], c.get("batch_size", c["batch"]),
                c["grad_dtype"])
    elif op == "permute_multi_embedding_vbe":
        args = (c["embs"], c["indices"], *meta, c["out_lengths"])
    elif op == "kt_regroup_arguments":
        args = (c["embs"][0] if c["embs"] else torch.empty(0), c["keys"], c["lengths"], c["groups"])
    else:
        args = (c["embs"], c["keys"], c["lengths"], c["groups"])
    return op, args, c["mutated"]


# --- the oracle and the comparison ---------------------------------------------------------


class Breach(Exception):
    """The call breaks the ops' contract: the library must raise."""


def _require(ok: bool, what: str) -> None:
    if not ok:
        raise Breach(what)


def _ints(t: torch.Tensor, name: str, dim: int) -> list:
    _require(t.dtype in (torch.int32, torch.int64) and t.dim() == dim, f"{name}: int32/64 {dim}-D")
    return t.tolist()


def _rows_in_bounds(permutes, in_widths, out_widths) -> None:
    rows = _ints(permutes, "permutes", 2)
    _require(permutes.size(1) == 6, "permutes: 6 columns")
    for in_t, out_t, in_off, out_off, length, _ in rows:
        _require(0 <= in_t < len(in_widths) and 0 <= out_t < len(out_widths), "row tensors")
        _require(min(in_off, out_off, length) >= 0, "row offsets")
        _require(in_off + length <= in_widths[in_t] and out_off + length <= out_widths[out_t],
                 "row in bounds")


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.numel() == 0 or b.numel() == 0:
        return False
    span = lambda t: (t.data_ptr(), t.data_ptr() + t.element_size() * (1 + sum(  # noqa: E731
        (n - 1) * st for n, st in zip(t.shape, t.stride()))))
    (alo, ahi), (blo, bhi) = span(a), span(b)
    return alo < bhi and blo < ahi


def _forward(embs, permutes, in_shapes, out_shapes, out_lengths, same_dtype=True) -> None:
    _require(len(embs) > 0 and all(e.dim() == 2 for e in embs), "pooled_embs: 2-D, not empty")
    first = embs[0]
    for e in embs:
        _require(e.size(0) == first.size(0) and e.device == first.device, "one batch, device")
        _require(not same_dtype or e.dtype == first.dtype, "one dtype")
    _require(all(n >= 0 for n in out_lengths), "out_lengths >= 0")
    _require(_ints(in_shapes, "in_shapes", 1) == [e.size(1) for e in embs], "in_shapes")
    _require(_ints(out_shapes, "out_shapes", 1) == list(out_lengths), "out_shapes")
    _rows_in_bounds(permutes, [e.size(1) for e in embs], list(out_lengths))


def _layout(keys, lengths, groups) -> None:
    _require(len(keys) > 0 and len(keys) == len(lengths), "keys per input")
    seen = set()
    for tkeys, tlens in zip(keys, lengths):
        _require(len(tkeys) == len(tlens) and all(0 <= n < 2**31 for n in tlens), "widths")
        _require(sum(tlens) < 2**31 and not seen & set(tkeys), "widths, unique keys")
        seen |= set(tkeys)
    _require(all(k in seen for g in groups for k in g), "groups name known keys")
    width = {k: n for tk, tl in zip(keys, lengths) for k, n in zip(tk, tl)}
    _require(all(sum(width[k] for k in g) < 2**31 for g in groups), "group widths")


def contract(op: str, args):
    """The expected result of a call that keeps the ops' contract; ``Breach`` otherwise."""
    import reference as ref
    from torchrec.sparse.jagged_tensor import _kt_regroup_arguments

    if any(t.is_meta for t in _tensors(args)):
        raise Breach("meta tensors: the fake kernel's shapes, no values")
    if op in ("kt_regroup_arguments", "regroup_keyed_tensor"):
        embs, keys, lengths, groups = args
        _layout(keys, lengths, groups)
        value = embs if op == "kt_regroup_arguments" else torch.empty(0)
        rows = list(_kt_regroup_arguments(value, keys, lengths, groups))
        rows[0] = rows[0].reshape(-1, 6)  # torchrec's is 1-D when there are no rows
        if op == "kt_regroup_arguments":
            return rows
        _require(len(embs) == len(keys), "a tensor per input")
        _forward(embs, *rows)
        return ref.permute_multi_embedding_reference(embs, *rows)
    if op == "permute_multi_embedding_vbe":
        embs, indices, permutes, in_shapes, out_shapes, out_lengths = args
        _require(len(embs) > 0 and all(e.dim() == 2 for e in embs), "pooled_embs: 2-D, not empty")
        _require(len(indices) in (0, len(embs)), "an index per input, or none")
        indices = indices or [None] * len(embs)
        for e, ix in zip(embs, indices):
            _require(e.dtype == embs[0].dtype and e.device == embs[0].device, "one dtype, device")
            if ix is not None:
                _require(ix.dtype in (torch.int32, torch.int64) and ix.dim() == 1, "index: int 1-D")
                _require(all(0 <= v < e.size(0) for v in ix.tolist()), "index in range")
        expanded = [e if ix is None else e.index_select(0, ix) for e, ix in zip(embs, indices)]
        _forward(expanded, permutes, in_shapes, out_shapes, out_lengths)
        return ref.permute_multi_embedding_reference(expanded, permutes, in_shapes, out_shapes,
                                                     out_lengths)
    if op == "permute_multi_embedding_backward":
        grads, permutes, in_shapes, out_shapes, in_lengths, batch, dtype = args
        defined = [g for g in grads if g is not None]
        out_widths = _ints(out_shapes, "out_shapes", 1)
        _require(batch >= 0 and len(grads) == len(out_widths), "batch_size, one grad per output")
        for g, n in zip(grads, out_widths):
            _require(g is None or (g.dim() == 2 and tuple(g.shape) == (batch, n)), "grad shape")
            _require(g is None or (g.dtype == defined[0].dtype and torch.can_cast(g.dtype, dtype)),
                     "grad dtype")
        _require(_ints(in_shapes, "in_shapes", 1) == list(in_lengths), "in_shapes")
        _rows_in_bounds(permutes, list(in_lengths), out_widths)
        return ref.permute_multi_embedding_backward_reference(*args)
    if op == "permute_multi_embedding_into":
        embs, permutes, in_shapes, out_shapes, outs = args
        _forward(embs, permutes, in_shapes, out_shapes, [o.size(-1) for o in outs])
        for j, o in enumerate(outs):
            _require(o.dim() == 2 and o.size(0) == embs[0].size(0) and o.dtype == embs[0].dtype,
                     "outs shape, dtype")
            _require(o.size(1) <= 1 or o.stride(1) == 1, "outs unit column stride")
            _require(o.size(0) <= 1 or o.size(1) == 0 or o.stride(0) >= o.size(1),
                     "outs rows do not overlap each other")
            _require(not (o.is_leaf and o.requires_grad and torch.is_grad_enabled()),
                     "outs: no leaf that requires grad")
            _require(not any(_overlap(o, t) for t in [*embs, *outs[:j]]), "outs overlap")
        outs = [o.clone() for o in outs]
        ref.permute_multi_embedding_into_reference(embs, permutes, in_shapes, out_shapes, outs)
        return outs
    dtype = args[5] if op == "permute_multi_embedding_to" else None
    _forward(*args[:5], same_dtype=dtype is None)
    return ref.permute_multi_embedding_to_reference(*args[:5], dtype)


def _tensors(x):
    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, (list, tuple)):
        for y in x:
            yield from _tensors(y)


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        if a.dtype != b.dtype or a.shape != b.shape or a.device != b.device:
            return False
        return a.is_meta or torch.equal(a, b)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def _clone(x):
    if isinstance(x, torch.Tensor):
        return x.clone()
    if isinstance(x, (list, tuple)):
        return type(x)(_clone(y) for y in x)
    return x


# What an error of the variable-batch op names, by what the case changed: the argument
# (its index where it is a list), or the rule between two arguments by either name.
NAMES = {
    "permutes": ("permutes",),
    "in_shapes": ("in_shapes",),
    "out_shapes": ("out_shapes",),
    "lengths": ("out_lengths", "out_shapes", "output"),
    "huge": ("out_lengths", "out_shapes", "allocate"),
    "embs": ("pooled_embs", "in_shapes", "input"),
    "indices": ("indices",),
}


def _names_the_culprit(op: str, message: str, mutated: list) -> bool:
    """An error of ours (``kt_regroup.<op>:``, or ``kt_regroup:`` from the Python layer)
    or the allocator's for a huge output; for the variable-batch op, naming an argument
    the case changed."""
    if "can't allocate memory" in message and "huge" in mutated:  # the allocator, at once
        return True
    if op != "permute_multi_embedding_vbe":
        return message.startswith(("kt_regroup.", "kt_regroup:"))
    if not message.startswith(f"kt_regroup.{op}: "):
        return False
    names = [n for what in mutated for n in NAMES.get(what, ())]
    return any(n in message for n in names) or not names


def run_case(seed: int) -> str:
    """``ok`` or ``raised <Type>``; anything else is a defect, described."""
    op, args, mutated = make_case(seed)
    before = _clone(args)
    try:
        result = getattr(torch.ops.kt_regroup, op)(*args)
        raised = None
    except Exception as exc:  # noqa: BLE001  (every Python exception is an acceptable end)
        raised = exc
    mutable = 4 if op == "permute_multi_embedding_into" else None  # outs, written on purpose
    for k, (now, was) in enumerate(zip(args, before)):
        if k != mutable and not _same(now, was):
            return f"DEFECT {op}: argument {k} was modified"
    if raised is not None:
        if not _names_the_culprit(op, str(raised), mutated):
            return f"DEFECT {op}: the error does not name what changed ({mutated}): {raised}"
        return f"raised {type(raised).__name__}"
    try:
        expected = contract(op, args)  # the calls' own tensors: their strides, memory, leaves
    except Breach as breach:
        data = [t for t in _tensors(args) if t is not None]
        if any(t.is_meta for t in data) and all(t.is_meta for t in _tensors(result)):
            return "ok meta"  # shapes only, from the fake kernel
        return f"DEFECT {op}: returned a result for a call that breaks the contract ({breach})"
    if op == "permute_multi_embedding_into":
        result = args[4]
    if not _same(result, expected):
        return f"DEFECT {op}: result differs from the reference"
    return "ok"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--first", type=int, default=0)
    parser.add_argument("--cases", type=int, default=CASES)
    parser.add_argument("-v", action="store_true", help="print each case's arguments")
    opts = parser.parse_args(argv)
    import kt_regroup  # noqa: F401

    outcomes = Counter()
    for seed in range(opts.first, opts.first + opts.cases):
        print(f"case {seed}", flush=True)  # names the case if the next line never comes
        if opts.v:
            print(make_case(seed), flush=True)
        outcome = run_case(seed)
        outcomes[outcome.split(":")[0]] += 1
        if outcome.startswith("DEFECT"):
            print(f"case {seed} {outcome}", flush=True)
    print(f"outcomes {dict(outcomes)}", flush=True)
    print(f"library {kt_regroup.library_path()}", flush=True)
    return 0


# --- pytest: chunks of cases in child processes --------------------------------------------


def run_child(first: int, cases: int, env=None, timeout=600) -> subprocess.CompletedProcess:
    here = pathlib.Path(__file__).resolve()
    full_env = dict(os.environ if env is None else env)
    full_env["PYTHONPATH"] = os.pathsep.join(
        filter(None, [str(here.parents[1]), full_env.get("PYTHONPATH")])
    )
    return subprocess.run(
        [sys.executable, str(here), "--first", str(first), "--cases", str(cases)],
        env=full_env, capture_output=True, text=True, timeout=timeout,
    )


def check_child(proc: subprocess.CompletedProcess) -> dict:
    lines = proc.stdout.splitlines()
    started = [ln for ln in lines if ln.startswith("case ") and len(ln.split()) == 2]
    last = started[-1] if started else "before the first case"
    assert proc.returncode == 0, (
        f"child exited with {proc.returncode} during {last} "
        f"(reproduce: python tests/test_fuzz.py --first {last.split()[-1]} --cases 1 -v)\n"
        + proc.stderr[-3000:]
    )
    defects = [ln for ln in lines if "DEFECT" in ln]
    assert not defects, "\n".join(defects[:20])
    summary = next(ln for ln in lines if ln.startswith("outcomes "))
    return eval(summary[len("outcomes "):])  # a dict literal printed by main()


def test_fuzz_every_op_in_child_processes():
    total = Counter()
    for i in range(CHILDREN):
        total.update(check_child(run_child(i * CASES, CASES)))
    # Every case ran, both ways of ending occurred, and no op was left out.
    assert sum(total.values()) == CHILDREN * CASES
    assert total["ok"] > 0.1 * CHILDREN * CASES, total
    assert sum(v for k, v in total.items() if k.startswith("raised")) > 0.3 * CHILDREN * CASES
    print(f"fuzz cases: {sum(total.values())} {dict(total)}")


def test_into_with_meta_inputs_and_real_outs_raises():
    # Fuzz case 566: meta inputs dispatch to the fake kernel, which returns without a
    # word: the caller's real outs are never written.
    import kt_regroup  # noqa: F401

    x = torch.empty(2, 3, device="meta")
    permutes = torch.tensor([[0, 0, 0, 0, 3, 0]], dtype=torch.int32)
    shapes = torch.tensor([3], dtype=torch.int32)
    outs = [torch.full((2, 3), 7.0)]
    match = r"permutes is on cpu but pooled_embs\[0\] is on meta; all must be on one device"
    with pytest.raises(ValueError, match=match):
        torch.ops.kt_regroup.permute_multi_embedding_into([x], permutes, shapes, shapes, outs)


def test_backward_with_meta_metadata_and_no_gradients_gives_no_uninitialised_memory():
    # Fuzz case 6213: out_shapes on meta dispatches to the fake kernel, which returns
    # torch.empty on the CPU (permutes' device): uninitialised gradients, no error.
    import kt_regroup  # noqa: F401

    permutes = torch.tensor([[0, 0, 0, 0, 3, 0]], dtype=torch.int32)
    shapes = torch.tensor([3], dtype=torch.int32)
    try:
        (grad,) = torch.ops.kt_regroup.permute_multi_embedding_backward(
            [None], permutes, shapes, shapes.to("meta"), [3], 2, torch.float32
        )
    except (ValueError, RuntimeError):
        return  # an error is a correct answer
    assert grad.is_meta or torch.equal(grad, torch.zeros(2, 3))


def test_backward_into_an_integer_dtype_raises_without_rows_too():
    # Fuzz case 22023: float gradients and an int64 dtype; every row empty. Found as a
    # result for a call that breaks the contract; now a TypeError naming the gradient.
    import kt_regroup  # noqa: F401

    permutes = torch.tensor([[0, 0, 0, 0, 0, 0]], dtype=torch.int32)
    with pytest.raises(TypeError, match=r"grad_outputs\[0\] is Double"):
        torch.ops.kt_regroup.permute_multi_embedding_backward(
            [torch.zeros(2, 0, dtype=torch.float64)], permutes,
            torch.tensor([5, 10], dtype=torch.int32), torch.tensor([0], dtype=torch.int32),
            [5, 10], 2, torch.int64,
        )


def test_fuzz_cases_cover_every_op():
    assert {make_case(seed)[0] for seed in range(len(OPS))} == set(OPS)


if __name__ == "__main__":
    sys.exit(main())
