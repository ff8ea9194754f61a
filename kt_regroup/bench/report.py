"""Ratios, the markdown tables, and results.json / results.csv / runtime.png."""

from __future__ import annotations

import csv
import json
import math
from typing import Any, Dict, Iterable, List, Optional, Tuple

from kt_regroup.bench.providers import CLONE, COPY, KT_REGROUP_BASELINE

__all__ = ["SCHEMA", "CSV_FIELDS", "add_ratios", "markdown", "write_json", "write_csv",
           "write_png"]

SCHEMA = "kt_regroup.bench/2"

CSV_FIELDS = [
    "suite", "allocator", "layout", "segments", "mode", "grad", "grad_mode", "duplicates",
    "provider", "family", "batch_size", "n_features", "dtype", "device", "device_name",
    "threads", "n", "calls_per_sample", "p50_ms", "p90_ms", "mem_peak_mb", "bytes_moved",
    "gbps", "vs_clone", "vs_copy", "vs_kt_regroup", "check", "error",
    "torch", "fbgemm_gpu", "torchrec", "kt_regroup", "memory_method",
]


def _table_key(r: Dict[str, Any]) -> Tuple:
    return (r["suite"], r["allocator"], r["layout"], r["mode"], r.get("grad"), r.get("grad_mode"))


def _cell_key(r: Dict[str, Any]) -> Tuple:
    return _table_key(r) + (r["duplicates"],)


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
        mem = r.get("mem_peak_bytes")
        r["mem_peak_mb"] = mem / 1e6 if mem is not None else None
        r["gbps"] = r["bytes_moved"] / r["p50_s"] / 1e9 if n and r["p50_s"] > 0 else None
    for r in records:
        key = _cell_key(r)
        p50 = r["p50_s"] if r["n"] else None
        for field, prefix in (("vs_clone", CLONE), ("vs_copy", COPY),
                              ("vs_kt_regroup", KT_REGROUP_BASELINE)):
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
    shape = f"B={r['batch_size']}, F={r['n_features']}, {r['dtype']}"
    if r["suite"] == "serving":
        return f"serving, {r['grad_mode']}, {alloc}: per-call time of a warm provider — {shape}"
    mode = r["mode"] + (f", {r['grad']} gradients" if r.get("grad") else "")
    return f"{mode}, {r['layout']} layout ({r['segments']} segments), {alloc} — {shape}"


# torchrec's benchmark table (provider | B | F | device | Runtime ...), more columns after
_HEAD = "| provider | B | F | device | Runtime (P50) | Runtime (P90) "
_MAIN_HEAD = (_HEAD + "| Memory (peak) MB | GB/s | / clone | / copy_ | / kt_regroup | n |\n"
              "|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|")
_SERVING_HEAD = (_HEAD + "| / clone | / kt_regroup | calls x n |\n"
                 "|---|---:|---:|---|---:|---:|---:|---:|---:|")


def markdown(records: List[Dict[str, Any]], meta: Dict[str, Any]) -> str:
    """One table per (suite, allocator, layout, mode, gradients): no-dup rows, then ``_dup``."""
    dev, v = meta["device"], meta["versions"]
    lines = [
        f"kt_regroup benchmark: {dev['type']} ({dev['name']}), {meta['threads']} threads, "
        f"torch {v['torch']}, fbgemm_gpu {v['fbgemm_gpu']}, torchrec {v['torchrec']}, "
        f"kt_regroup {v['kt_regroup']}"
        + (", load average {:.1f} at start, {:.1f} at end".format(*meta["load_average"])
           if None not in meta.get("load_average", [None]) else ""),
        f"kt_regroup backend on {dev['type']}: {meta['backend']}"
        + (f" ({meta['library']})" if meta.get("library") else ""),
        f"memory: {meta['memory_method']}",
    ]
    tables: Dict[Tuple, List[Dict[str, Any]]] = {}
    for r in records:
        tables.setdefault(_table_key(r), []).append(r)
    for key, rows in tables.items():
        micro = key[0] == "serving"
        lines += ["", f"### {_title(rows[0])}", _SERVING_HEAD if micro else _MAIN_HEAD]
        for r in sorted(rows, key=lambda r: r["duplicates"]):  # stable: no-dup rows first
            name = r["provider"] + ("_dup" if r["duplicates"] else "")
            if r.get("error"):
                name += f" (error: {r['error'][:80]})"
            elif r.get("check") != "ok":
                name += f" ({r['check']})"
            t50 = _fmt_time(r["p50_s"] if r["n"] else None, micro)
            t90 = _fmt_time(r["p90_s"] if r["n"] else None, micro)
            row = f"| {name} | {r['batch_size']} | {r['n_features']} | {r['device']} | {t50} | {t90} "
            if micro:
                calls = f"{r.get('calls_per_sample') or 0} x {r['n']}"
                lines.append(row + f"| {_fmt(r['vs_clone'], '.2f')} "
                             f"| {_fmt(r['vs_kt_regroup'], '.2f')} | {calls} |")
            else:
                lines.append(
                    row + f"| {_fmt(r['mem_peak_mb'], '.1f')} "
                    f"| {_fmt(r['gbps'], '.1f')} | {_fmt(r['vs_clone'], '.2f')} "
                    f"| {_fmt(r['vs_copy'], '.2f')} | {_fmt(r['vs_kt_regroup'], '.2f')} "
                    f"| {r['n']} |"
                )
    lines += [
        "",
        "Columns: Runtime P50/P90 over n timed samples after one untimed warmup call "
        "(serving: per call, calls x n); Memory = peak memory in use above the level before "
        "the timed calls; GB/s = (bytes a regroup must read + write) / P50; ratios = this "
        "row's P50 / that row's P50 in the same table and dup setting; kt_regroup = the "
        f"{KT_REGROUP_BASELINE} row; limit: clone = a fresh copy of the output bytes (+ of "
        "the input bytes in forward+backward), limit: copy_ = the same bytes into existing "
        "buffers; segments = contiguous column runs the layout needs copied.",
    ]
    lines += [f"Note: {note}" for note in meta.get("notes", [])]
    return "\n".join(lines)


def write_json(path: str, meta: Dict[str, Any], records: List[Dict[str, Any]]) -> None:
    with open(path, "w") as f:
        json.dump({"schema": SCHEMA, **meta, "records": records}, f, indent=1, default=str)


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
        panels.setdefault(_table_key(r), []).append(r)
    keys = list(panels)
    heights = [0.25 * len({r["provider"] for r in panels[k]}) + 0.9 for k in keys]
    fig, axes = plt.subplots(len(keys), 1, figsize=(10, sum(heights)), squeeze=False,
                             gridspec_kw={"height_ratios": heights})
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
        ax.set_title(_title(rows[0]).split(" — ")[0], fontsize=9)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=72)
    plt.close(fig)
    return None
