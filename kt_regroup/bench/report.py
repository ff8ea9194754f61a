"""Ratios, the markdown tables, the goal lines, and results.json / results.csv / PNG."""

from __future__ import annotations

import csv
import json
import math
from typing import Any, Dict, Iterable, List, Optional, Tuple

from kt_regroup.bench.providers import (
    CLONE,
    COPY,
    FORWARD,
    FORWARD_BACKWARD,
    KT_REGROUP_BASELINE,
    KT_REGROUP_INTO,
)

__all__ = [
    "SCHEMA",
    "CSV_FIELDS",
    "add_ratios",
    "markdown",
    "goal_lines",
    "write_json",
    "write_csv",
    "write_png",
]

SCHEMA = "kt_regroup.bench/1"

CSV_FIELDS = [
    "suite", "allocator", "mode", "grad_mode", "duplicates", "provider", "family",
    "batch_size", "n_features", "dtype", "device", "device_name", "threads",
    "n", "calls_per_sample", "p50_ms", "p90_ms", "mem_p90_mb", "bytes_moved", "gbps",
    "vs_clone", "vs_copy", "vs_kt_regroup", "check", "error",
    "torch", "fbgemm_gpu", "torchrec", "kt_regroup", "memory_method",
]


def _cell_key(r: Dict[str, Any]) -> Tuple:
    return (r["suite"], r["allocator"], r["mode"], r.get("grad_mode"), r["duplicates"])


def _ratio(a: Optional[float], b: Optional[float]) -> Optional[float]:
    if a is None or b is None or b <= 0 or math.isnan(a) or math.isnan(b):
        return None
    return a / b


def _find(records: Iterable[Dict[str, Any]], key: Tuple, prefix: str) -> Optional[Dict[str, Any]]:
    for r in records:
        if _cell_key(r) == key and r["provider"].startswith(prefix) and r["n"] > 0:
            return r
    return None


def add_ratios(records: List[Dict[str, Any]]) -> None:
    """Adds ms/MB/GB/s fields and P50 ratios vs clone, copy_ and kt_regroup, per cell."""
    for r in records:
        n = r["n"]
        r["p50_ms"] = r["p50_s"] * 1e3 if n else None
        r["p90_ms"] = r["p90_s"] * 1e3 if n else None
        mem = r.get("mem_p90_bytes")
        r["mem_p90_mb"] = mem / 1e6 if mem is not None else None
        r["gbps"] = r["bytes_moved"] / r["p50_s"] / 1e9 if n and r["p50_s"] > 0 else None
    for r in records:
        key = _cell_key(r)
        p50 = r["p50_s"] if r["n"] else None
        for field, prefix in (("vs_clone", CLONE), ("vs_copy", COPY), ("vs_kt_regroup", KT_REGROUP_BASELINE)):
            ref = _find(records, key, prefix)
            r[field] = _ratio(p50, ref["p50_s"] if ref else None)


def _fmt_time(seconds: Optional[float], micro: bool) -> str:
    if seconds is None or math.isnan(seconds):
        return "—"
    if micro:
        return f"{seconds * 1e6:,.1f} us"
    ms = seconds * 1e3
    return f"{ms:,.1f} ms" if ms >= 10 else f"{ms:.2f} ms"


def _fmt(x: Optional[float], spec: str) -> str:
    return "—" if x is None else format(x, spec)


def _title(r: Dict[str, Any]) -> str:
    alloc = "THP_MEM_ALLOC_ENABLE=1" if r["allocator"] == "thp" else "default allocator"
    if r["suite"] == "serving":
        return f"serving, {r['grad_mode']}, {alloc}: per-call time of a warm provider"
    return f"{r['mode']}, {alloc}"


def markdown(records: List[Dict[str, Any]], meta: Dict[str, Any]) -> str:
    """One table per (suite, allocator, mode): no-dup rows, then the ``_dup`` rows."""
    lines: List[str] = []
    dev = meta["device"]
    lines.append(
        f"kt_regroup benchmark: {dev['type']} ({dev['name']}), {meta['threads']} threads, "
        f"torch {meta['versions']['torch']}, fbgemm_gpu {meta['versions']['fbgemm_gpu']}, "
        f"torchrec {meta['versions']['torchrec']}, kt_regroup {meta['versions']['kt_regroup']}"
    )
    lines.append(f"memory: {meta['memory_method']}")
    tables: Dict[Tuple, List[Dict[str, Any]]] = {}
    for r in records:
        tables.setdefault(_cell_key(r)[:4], []).append(r)
    for key, rows in tables.items():
        micro = key[0] == "serving"
        first = rows[0]
        lines.append("")
        lines.append(
            f"### {_title(first)} — B={first['batch_size']}, F={first['n_features']}, {first['dtype']}"
        )
        if micro:
            lines.append(
                "| provider | B | F | device | Runtime (P50) | Runtime (P90) | / clone | / kt_regroup | calls x n |"
            )
            lines.append("|---|---:|---:|---|---:|---:|---:|---:|---:|")
        else:
            lines.append(
                "| provider | B | F | device | Runtime (P50) | Runtime (P90) | Memory (P90) MB "
                "| GB/s | / clone | / copy_ | / kt_regroup | n |"
            )
            lines.append("|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|")
        for dup in (False, True):
            for r in rows:
                if r["duplicates"] != dup:
                    continue
                name = r["provider"] + ("_dup" if dup else "")
                if r.get("error"):
                    name += f" (error: {r['error'][:80]})"
                elif r.get("check") not in ("ok", None):
                    name += f" ({r['check']})"
                common = f"| {name} | {r['batch_size']} | {r['n_features']} | {r['device']} "
                t50 = _fmt_time(r["p50_s"] if r["n"] else None, micro)
                t90 = _fmt_time(r["p90_s"] if r["n"] else None, micro)
                if micro:
                    calls = f"{r.get('calls_per_sample') or 0} x {r['n']}"
                    lines.append(
                        common + f"| {t50} | {t90} | {_fmt(r['vs_clone'], '.2f')} "
                        f"| {_fmt(r['vs_kt_regroup'], '.2f')} | {calls} |"
                    )
                else:
                    lines.append(
                        common + f"| {t50} | {t90} | {_fmt(r['mem_p90_mb'], '.1f')} "
                        f"| {_fmt(r['gbps'], '.1f')} | {_fmt(r['vs_clone'], '.2f')} "
                        f"| {_fmt(r['vs_copy'], '.2f')} | {_fmt(r['vs_kt_regroup'], '.2f')} "
                        f"| {r['n']}{'*' if r.get('cut_by_time_limit') else ''} |"
                    )
    lines.append("")
    lines.append(
        "Columns: Runtime P50/P90 over n timed samples (serving: per call, calls x n); "
        "Memory = peak extra memory during the call; GB/s = (bytes read + written by a regroup) "
        "/ P50; ratios = this row's P50 / that row's P50 in the same table and dup setting; "
        f"kt_regroup = the {KT_REGROUP_BASELINE} row; limit: clone = fresh copy of the output "
        "bytes (+ of the input bytes in forward+backward), limit: copy_ = the same bytes into "
        "existing buffers. n* = fewer samples than planned: the cell reached its share of "
        "--time_limit_s."
    )
    for note in meta.get("notes", []):
        lines.append(f"Note: {note}")
    return "\n".join(lines)


def _p50(records, suite, allocator, mode, dup, prefix, grad_mode=None) -> Optional[float]:
    r = _find(records, (suite, allocator, mode, grad_mode, dup), prefix)
    return r["p50_s"] if r else None


def goal_lines(records: List[Dict[str, Any]], out_bytes: Optional[int]) -> List[Dict[str, Any]]:
    """The ratios issue 4 sets goals on, computed from this run (None: not measured)."""
    kt = KT_REGROUP_BASELINE
    F, FB = FORWARD, FORWARD_BACKWARD
    g: List[Tuple[str, Optional[float], float]] = []

    def add(label, a, b, goal):
        g.append((label, _ratio(a, b), goal))

    add("forward: kt_regroup / clone", _p50(records, "main", "default", F, False, kt),
        _p50(records, "main", "default", F, False, CLONE), 1.15)
    add("forward: kt_regroup / torchrec _regroup_keyed_tensors",
        _p50(records, "main", "default", F, False, kt),
        _p50(records, "main", "default", F, False, "torchrec._regroup_keyed_tensors"), 0.8)
    add("forward: kt_regroup / fbgemm permute_multi_embedding",
        _p50(records, "main", "default", F, False, kt),
        _p50(records, "main", "default", F, False, "fbgemm.permute_multi_embedding"), 0.15)
    add("forward: kt_regroup dup / no dup", _p50(records, "main", "default", F, True, kt),
        _p50(records, "main", "default", F, False, kt), 1.1)
    add("forward+backward: kt_regroup / two clones",
        _p50(records, "main", "default", FB, False, kt),
        _p50(records, "main", "default", FB, False, CLONE), 1.3)
    add("forward+backward: kt_regroup / torchrec _regroup_keyed_tensors",
        _p50(records, "main", "default", FB, False, kt),
        _p50(records, "main", "default", FB, False, "torchrec._regroup_keyed_tensors"), 0.6)
    add("THP forward: kt_regroup / clone", _p50(records, "main", "thp", F, False, kt),
        _p50(records, "main", "thp", F, False, CLONE), 1.3)
    add("THP forward: kt_regroup into preallocated outputs / copy_",
        _p50(records, "main", "thp", F, False, KT_REGROUP_INTO),
        _p50(records, "main", "thp", F, False, COPY), 1.5)
    for gm, goal in (("inference_mode", 0.15), ("autograd", 0.35)):
        add(f"serving {gm}: kt_regroup module / torchrec _regroup_keyed_tensors",
            _p50(records, "serving", "default", F, False, kt, gm),
            _p50(records, "serving", "default", F, False, "torchrec._regroup_keyed_tensors", gm), goal)
    mem = _find(records, ("main", "default", F, None, False), kt)
    if mem is not None and mem.get("mem_p90_bytes") is not None and out_bytes:
        # "equals the output bytes": 2% slack for page rounding of the RSS measurement
        g.append(("forward: kt_regroup peak extra memory / output bytes",
                  mem["mem_p90_bytes"] / out_bytes, 1.02))
    return [
        {"ratio": label, "value": value, "goal_max": goal,
         "met": None if value is None else value <= goal * 1.0}
        for label, value, goal in g
    ]


def format_goals(goals: List[Dict[str, Any]]) -> str:
    lines = ["", "### Ratios named by issue 4 (P50; kt_regroup = its KTRegroupAsDict row)"]
    for g in goals:
        if g["value"] is None:
            lines.append(f"- {g['ratio']}: not measured in this run (goal <= {g['goal_max']})")
        else:
            verdict = "met" if g["met"] else "missed"
            lines.append(f"- {g['ratio']}: {g['value']:.2f} (goal <= {g['goal_max']}: {verdict})")
    return "\n".join(lines)


def write_json(path: str, meta: Dict[str, Any], records: List[Dict[str, Any]], goals) -> None:
    with open(path, "w") as f:
        json.dump({"schema": SCHEMA, **meta, "goals": goals, "records": records}, f, indent=1,
                  default=str)


def write_csv(path: str, meta: Dict[str, Any], records: List[Dict[str, Any]]) -> None:
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=CSV_FIELDS, extrasaction="ignore")
        w.writeheader()
        for r in records:
            row = {**r, **meta["versions"], "memory_method": meta["memory_method"]}
            w.writerow({k: ("" if row.get(k) is None else row.get(k)) for k in CSV_FIELDS})


def write_png(path: str, records: List[Dict[str, Any]]) -> Optional[str]:
    """Horizontal bars of P50 runtime per provider, no-dup and dup side by side."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed: no chart (pip install matplotlib)"
    panels: Dict[Tuple, List[Dict[str, Any]]] = {}
    for r in records:
        panels.setdefault(_cell_key(r)[:4], []).append(r)
    keys = list(panels)
    fig, axes = plt.subplots(len(keys), 1, figsize=(10, 0.45 * 12 * len(keys) + 1), squeeze=False)
    for ax, key in zip(axes[:, 0], keys):
        rows = panels[key]
        micro = key[0] == "serving"
        names = list(dict.fromkeys(r["provider"] for r in rows))
        scale = 1e6 if micro else 1e3
        for j, (dup, color) in enumerate(((False, "tab:blue"), (True, "tab:orange"))):
            vals = []
            for n in names:
                hit = [r for r in rows if r["provider"] == n and r["duplicates"] == dup and r["n"]]
                vals.append(hit[0]["p50_s"] * scale if hit else 0.0)
            ys = [i + (0.2 if j else -0.2) for i in range(len(names))]
            ax.barh(ys, vals, height=0.4, color=color, label="dup" if dup else "no dup")
        ax.set_yticks(range(len(names)))
        ax.set_yticklabels(names, fontsize=8)
        ax.invert_yaxis()
        ax.set_xscale("log")
        ax.set_xlabel("P50 per call (us)" if micro else "P50 runtime (ms, log scale)")
        ax.set_title(_title(rows[0]), fontsize=10)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return None
