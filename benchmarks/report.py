"""Markdown tables of every section and the step chart."""

from __future__ import annotations

from typing import Callable, Dict, List, Optional, Tuple


def _ms(s: Optional[float]) -> str:
    return "—" if s is None else f"{s * 1e3:,.1f}" if abs(s) >= 0.01 else f"{s * 1e3:.3g}"


def _us(s: Optional[float]) -> str:
    return "—" if s is None else f"{s * 1e6:,.1f}"


def _mib(b: Optional[int]) -> str:
    return "—" if b is None else f"{b / 2**20:,.0f}"


def _x(r: Optional[float]) -> str:
    return "—" if r is None else f"{r:.2f}"


def _dev(r: dict, fmt: Callable[[Optional[float]], str], key: str) -> str:
    """A CUDA-event figure: "n/a" where the row ran off CUDA (no such figure)."""
    return "n/a" if r.get("device_batch") is None else fmt(r.get(key))


# section -> (title of a table, columns: (header, cell))
Columns = List[Tuple[str, Callable[[dict], str]]]
TABLES: Dict[str, Tuple[Callable[[dict], str], Columns]] = {
    "step": (lambda r: f"training step, {r['variant']} ({r['segments']} segments, "
             f"{r['grad']} gradients), B={r['batch_size']}, {r['allocator']}, "
             f"{r['threads']} threads"
             + (f", {r['env']}" if r["env"] else ""),
             [("row", lambda r: r["provider"]), ("step ms", lambda r: _ms(r["step_s"])),
              ("regroup share ms", lambda r: _ms(r["share_s"])),
              ("share / fallback", lambda r: _x(r["share_vs_fallback"])),
              ("share / copy limit", lambda r: _x(r["share_vs_copy_limit"])),
              ("step / ref", lambda r: _x(r.get("step_vs_ref"))),
              ("step / index_select", lambda r: _x(r.get("step_vs_index_select"))),
              ("peak MiB", lambda r: _mib(r.get("peak_rss_bytes"))),
              ("n", lambda r: str(r["n"])), ("check", lambda r: r["check"])]),
    "serving": (lambda r: f"serving, {r['form']}, {r.get('layout', 'serving')} layout, "
                f"B={r['batch_size']} "
                f"({r['keys']} keys, {r['segments']} segments), {r['threads']} threads",
                [("row", lambda r: r["provider"]), ("per call us", lambda r: _us(r["call_s"])),
                 ("/ clone", lambda r: _x(r["vs_clone"])), ("calls x n", lambda r: r["calls"]),
                 ("check", lambda r: r["check"])]),
    "ops": (lambda r: f"op alone, {r['mode']}, {r['layout']}{'+dup' if r['duplicates'] else ''}"
            f" ({r['segments']} segments), B={r['batch_size']}, {r['device']}, "
            f"{r['threads']} threads",
            [("provider", lambda r: r["provider"]), ("P50 ms", lambda r: _ms(r["p50_s"])),
             ("P90 ms", lambda r: _ms(r["p90_s"])), ("GB/s", lambda r: _x(r["gbps"])),
             ("/ copy_", lambda r: _x(r["vs_copy"])),
             ("/ kt_regroup", lambda r: _x(r["vs_kt_regroup"])),
             # GPU time from CUDA events (CUDA only): calls queued, graph replays
             ("device ms", lambda r: _dev(r, _ms, "device_p50_s")),
             ("graph ms", lambda r: _dev(r, _ms, "graph_p50_s")),
             ("/ copy_ device", lambda r: _dev(r, _x, "vs_copy_device")),
             ("/ copy_ graph", lambda r: _dev(r, _x, "vs_copy_graph")),
             ("n", lambda r: str(r["n"])), ("check", lambda r: r["check"])]),
}
# step columns only some tables fill: step / ref is the fallback's (today's path for +vbe),
# step / index_select the +vbe tables' only; peak MiB every row but FBGEMM's
OPTIONAL = {"step / ref", "step / index_select", "peak MiB"}


def markdown(results: dict) -> str:
    m = results["machine"]
    v = m["versions"]
    lines = [f"kt_regroup benchmark: {m['cpu']}, {m['threads']} threads, "
             f"CPU copy programs: {m.get('copy_program', 'not recorded')}, "
             + ", ".join(f"{k} {x}" for k, x in v.items())
             + f"; load average {m['load_average']:.1f} at start, "
             f"{m.get('load_average_end', float('nan')):.1f} at end"]
    for section, data in results["sections"].items():
        title, cols = TABLES[section]
        tables: Dict[str, List[dict]] = {}
        for r in data["records"]:
            tables.setdefault(title(r), []).append(r)
        for name, rows in tables.items():
            # a column of OPTIONAL that no row of this table fills is left out
            shown = [(h, c) for h, c in cols
                     if h not in OPTIONAL or any(c(r) != "—" for r in rows)]
            lines += ["", f"### {name}", "| " + " | ".join(h for h, _ in shown) + " |",
                      "|---|" + "---:|" * (len(shown) - 2) + "---|"]
            lines += ["| " + " | ".join(cell(r) for _, cell in shown) + " |" for r in rows]
        lines += [f"Note ({section}): {n}" for n in data.get("notes", [])]
    return "\n".join(lines)


def step_png(results: dict, path: str) -> Optional[str]:
    """One bar per step row of the first variant under each allocator: the regroup
    share and the rest of the step. Returns a note when no chart was drawn."""
    step = results["sections"].get("step")
    if not step or not step["records"]:
        return None
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed: no step.png"
    first = step["records"][0]["variant"]
    rows = [r for r in step["records"] if r["variant"] == first and r["step_s"] is not None]
    labels = [f"{r['allocator']}: {r['provider']}" for r in rows]
    share = [max(r["share_s"], 0.0) * 1e3 for r in rows]
    rest = [r["step_s"] * 1e3 - s for r, s in zip(rows, share)]
    fig, ax = plt.subplots(figsize=(10, 0.3 * len(rows) + 1.2))
    ax.barh(labels, rest, color="tab:gray", label="rest of the step")
    ax.barh(labels, share, left=rest, color="tab:orange", label="regroup share")
    ax.invert_yaxis()
    ax.set_xlabel("median step time (ms)")
    ax.set_title(f"training step, {first}, B={rows[0]['batch_size']}", fontsize=9)
    ax.tick_params(axis="y", labelsize=7)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=72)
    plt.close(fig)
    return None
