"""``python -m kt_regroup.bench``: kt_regroup vs torchrec, FBGEMM and the copy limit.

Option names follow torchrec's ``jagged_tensor_benchmark.py``; defaults are the seed's
layout (B=1024, 20 dense keys x 64 + 1000 sparse keys x 128, 2 groups, fp32).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import subprocess
import sys
import time
from typing import Any, Dict, List, Optional

import torch

THP_ENV = "THP_MEM_ALLOC_ENABLE"
_DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m kt_regroup.bench",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    lay = p.add_argument_group("layout (torchrec jagged_tensor_benchmark names; default: the seed)")
    lay.add_argument("--device_type", choices=["cpu", "cuda"], default="cpu")
    lay.add_argument("--batch_size", type=int, default=None, help="B (seed: 1024)")
    lay.add_argument("--n_dense", type=int, default=None, help="dense keys (seed: 20)")
    lay.add_argument("--dim_dense", type=int, default=None, help="dense width (seed: 64)")
    lay.add_argument("--n_sparse", type=int, default=None, help="sparse keys (seed: 1000)")
    lay.add_argument("--dim_sparse", type=int, default=None, help="sparse width (seed: 128)")
    lay.add_argument("--n_groups", type=int, default=None, help="output groups (seed: 2)")
    lay.add_argument(
        "--run_backward", nargs="?", const="true", default="both",
        choices=["true", "false", "both"],
        help="time forward+backward ('true' or the bare flag), forward only ('false'), or both",
    )
    lay.add_argument(
        "--duplicates", choices=["true", "false", "both"], default="both",
        help="groups with one duplicated key per group (torchrec's build_groups), without, or both",
    )
    lay.add_argument("--dtype", choices=list(_DTYPES), default="float32")
    lay.add_argument("--layout", metavar="FILE.json", default=None,
                     help='your layout: {"keys": [[..]], "lengths": [[..]], "groups": [[..]], '
                     '"batch_size": B}')
    lay.add_argument("--seed", type=int, default=0, help="seed of the key-to-group allocation")

    run = p.add_argument_group("run")
    run.add_argument("--preset", choices=["seed", "quick", "serving"], default="seed",
                     help="seed: the seed layout (+ serving table); quick: tiny layout for CI; "
                     "serving: only the small serving table")
    run.add_argument("--quick", action="store_const", const="quick", dest="preset",
                     help="alias of --preset quick")
    run.add_argument("--repeats", type=int, default=None,
                     help="max timed samples per provider and cell (default 10; quick 3)")
    run.add_argument("--min_repeats", type=int, default=2,
                     help="min timed samples per provider and cell, however slow it is")
    run.add_argument("--budget_s", type=float, default=None,
                     help="seconds of timed calls per provider and cell: slow providers get "
                     "fewer samples (default 3; quick 0.05)")
    run.add_argument("--time_limit_s", type=float, default=None,
                     help="soft limit for the whole run, THP subprocess included: cells end "
                     "after the round that passes their share (every provider keeps >= 1 "
                     "sample); 0 = none (default 540; quick: none)")
    run.add_argument("--providers", default=None,
                     help="comma-separated substrings of provider names (or a family: "
                     "kt_regroup, torchrec, fbgemm, limit) to run; default all")
    run.add_argument("--skip", default=None, help="comma-separated substrings/families to skip")
    run.add_argument("--allocator", choices=["both", "default", "thp"], default="both",
                     help=f"CPU allocator settings: 'both' reruns in a subprocess with {THP_ENV}=1")
    run.add_argument("--thp_all", action="store_true",
                     help="include the FBGEMM-backed and reference-kernel rows in the THP run "
                     "(slow: ~+2 min)")
    run.add_argument("--no_serving", action="store_true", help="skip the serving table")
    run.add_argument("--serving_repeats", type=int, default=None,
                     help="timed samples per serving row (default 10; quick 3)")
    run.add_argument("--serving_sample_s", type=float, default=None,
                     help="seconds per serving sample (many calls each; default 0.04)")
    run.add_argument("--output", metavar="DIR", default="bench_results",
                     help="where results.json, results.csv, runtime.png and table.md go")
    run.add_argument("--no_progress", action="store_true", help="no tqdm progress bar")
    run.add_argument("--_child", action="store_true", help=argparse.SUPPRESS)
    return p


def _split(s: Optional[str]) -> List[str]:
    return [x.strip() for x in s.split(",") if x.strip()] if s else []


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _versions() -> Dict[str, str]:
    import kt_regroup

    out = {"torch": torch.__version__, "kt_regroup": kt_regroup.__version__,
           "python": platform.python_version()}
    for name in ("fbgemm_gpu", "torchrec"):
        try:
            out[name] = __import__(name).__version__
        except Exception:  # noqa: BLE001  (absent or broken: reported, not fatal)
            out[name] = "not installed"
    return out


def _progress(disable: bool):
    try:
        from tqdm import tqdm

        return tqdm(total=0, unit="call", disable=disable, file=sys.stderr, dynamic_ncols=True)
    except ImportError:
        class _Null:
            total = 0

            def update(self, n=1): ...

            def refresh(self): ...

            def set_description(self, s): ...

            def close(self): ...

        return _Null()


def _layouts(args, dtype: torch.dtype):
    from kt_regroup.bench.layout import PRESETS, layout_from_flags, layout_from_json

    if args.layout:
        return [layout_from_json(args.layout, args.batch_size, dtype)]
    base = dict(PRESETS["quick" if args.preset == "quick" else "seed"])
    for k in base:
        if getattr(args, k) is not None:
            base[k] = getattr(args, k)
    dups = {"true": [True], "false": [False], "both": [False, True]}[args.duplicates]
    return [
        layout_from_flags(**base, duplicates=d, seed=args.seed, dtype=dtype, name=args.preset)
        for d in dups
    ]


def _serving_layouts(args, dtype: torch.dtype):
    from kt_regroup.bench.layout import PRESETS, layout_from_flags

    base = dict(PRESETS["serving"])
    if args.preset == "serving":  # flags may reshape the serving layout itself
        for k in base:
            if getattr(args, k) is not None:
                base[k] = getattr(args, k)
    dups = {"true": [True], "false": [False], "both": [False, True]}[args.duplicates]
    return [
        layout_from_flags(**base, duplicates=d, seed=args.seed, dtype=dtype, name="serving")
        for d in dups
    ]


def _common(layout, device, device_name, threads, allocator, suite, mode, grad_mode=None):
    from kt_regroup.bench.providers import FORWARD_BACKWARD

    moved = 2 * layout.out_bytes
    if mode == FORWARD_BACKWARD:
        moved += layout.out_bytes + layout.in_bytes
    return {
        "suite": suite, "allocator": allocator, "mode": mode, "grad_mode": grad_mode,
        "duplicates": layout.has_duplicates, "batch_size": layout.batch_size,
        "n_features": layout.n_features, "dtype": str(layout.dtype).replace("torch.", ""),
        "device": device.type, "device_name": device_name, "threads": threads,
        "bytes_moved": moved, "layout": layout.describe(),
    }


def _run_thp_child(argv: List[str], args, out_dir: str, time_limit_s: float) -> Dict[str, Any]:
    child_dir = os.path.join(out_dir, "thp")
    os.makedirs(child_dir, exist_ok=True)
    skip = _split(args.skip) + ([] if args.thp_all else ["fbgemm", "reference kernel"])
    cmd = [sys.executable, "-m", "kt_regroup.bench", *argv, "--allocator", "thp", "--no_serving",
           "--output", child_dir, "--_child", "--time_limit_s", f"{time_limit_s:.0f}"]
    if skip:
        cmd += ["--skip", ",".join(skip)]
    env = dict(os.environ, **{THP_ENV: "1"})
    with open(os.path.join(child_dir, "stdout.txt"), "w") as log:
        proc = subprocess.run(cmd, env=env, stdout=log, stderr=None)
    if proc.returncode != 0:
        raise RuntimeError(f"the {THP_ENV}=1 run failed (exit {proc.returncode}); see {child_dir}")
    with open(os.path.join(child_dir, "results.json")) as f:
        return json.load(f)


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    t_start = time.perf_counter()
    if args.device_type == "cuda" and not torch.cuda.is_available():
        print(
            "kt_regroup.bench: --device_type cuda asked, but this torch "
            f"({torch.__version__}) sees no CUDA device "
            f"(torch.version.cuda={torch.version.cuda}). Run on a CUDA machine with a CUDA "
            "build of torch (and fbgemm_gpu for the FBGEMM rows), or use --device_type cpu.",
            file=sys.stderr,
        )
        return 2

    import kt_regroup
    from kt_regroup.bench import report
    from kt_regroup.bench.harness import make_memory_probe, run_cell, run_serving_cell
    from kt_regroup.bench.providers import (
        FORWARD,
        FORWARD_BACKWARD,
        Cell,
        make_providers,
        select,
    )

    quick = args.preset == "quick"
    repeats = args.repeats or (3 if quick else 10)
    budget_s = args.budget_s if args.budget_s is not None else (0.05 if quick else 3.0)
    serving_repeats = args.serving_repeats or (3 if quick else 10)
    serving_sample_s = args.serving_sample_s or (0.01 if quick else 0.04)
    time_limit_s = args.time_limit_s if args.time_limit_s is not None else (0 if quick else 540)
    device = torch.device(args.device_type)
    dtype = _DTYPES[args.dtype]
    allocator = "thp" if os.environ.get(THP_ENV) == "1" else "default"
    if args.allocator == "thp" and allocator != "thp" and device.type == "cpu":
        # asked for THP only: run in a subprocess with the variable set
        args.allocator = "thp"
    threads = torch.get_num_threads()
    device_name = _device_name(device)
    probe = make_memory_probe(device)
    providers = select(make_providers(device), _split(args.providers), _split(args.skip))
    if not providers:
        print("kt_regroup.bench: --providers/--skip left no provider to run", file=sys.stderr)
        return 2
    os.makedirs(args.output, exist_ok=True)
    notes: List[str] = []
    if "fbgemm" not in {p.family for p in make_providers(device)}:
        notes.append("fbgemm_gpu's permute_multi_embedding ops are not available: FBGEMM rows skipped")

    progress = _progress(args.no_progress)
    records: List[Dict[str, Any]] = []
    modes = {"true": [FORWARD_BACKWARD], "false": [FORWARD], "both": [FORWARD, FORWARD_BACKWARD]}[
        args.run_backward
    ]
    run_here = args.allocator in ("both", "default") or allocator == "thp"
    if device.type != "cpu" and args.allocator != "default":
        args.allocator = "default"  # THP_MEM_ALLOC_ENABLE is a CPU allocator setting
    slow_history: Dict[str, float] = {}
    main_layouts = [] if args.preset == "serving" else _layouts(args, dtype)
    serving = not args.no_serving and not args._child
    thp_child = (device.type == "cpu" and not args._child and bool(main_layouts)
                 and (args.allocator == "both" or (args.allocator == "thp" and allocator != "thp")))
    # Time plan: serving is bounded by its repeats; the main cells share what is left
    # with the THP subprocess (fewer rows, no serving), forward+backward weighing double.
    end = t_start + time_limit_s if time_limit_s > 0 else None
    main_end = None
    if end is not None:
        main_end = end - (serving_repeats * serving_sample_s * 4 * len(providers) * 1.3 if serving else 0)
        if thp_child:
            main_end = t_start + (main_end - t_start) * 0.62
    cells = [(mode, layout) for mode in modes for layout in main_layouts] if run_here else []
    # forward+backward calls cost ~2x; the first cell also pays every provider's warmup
    weights = [(1.6 if mode == FORWARD_BACKWARD else 1.0) + (0.5 if i == 0 else 0.0)
               for i, (mode, _) in enumerate(cells)]
    if run_here:
        for i, (mode, layout) in enumerate(cells):
            progress.set_description(
                f"{allocator} {mode} {'dup' if layout.has_duplicates else 'no-dup'}"
            )
            deadline = None
            if main_end is not None:
                now = time.perf_counter()
                deadline = now + max(0.0, main_end - now) * weights[i] / sum(weights[i:])
            cell = Cell(layout, device, mode, seed=args.seed)
            recs = run_cell(
                cell, providers, repeats=repeats, min_repeats=args.min_repeats,
                budget_s=budget_s, probe=probe, slow_history=slow_history, deadline=deadline,
                progress=progress,
            )
            common = _common(layout, device, device_name, threads, allocator, "main", mode)
            records += [{**common, **r} for r in recs]
            del cell
            gc.collect()
        if serving:
            # autograd first: its plan tensors are ordinary tensors, usable in both modes
            for grad_mode in ("autograd", "inference_mode"):
                for layout in _serving_layouts(args, dtype):
                    progress.set_description(
                        f"serving {grad_mode} {'dup' if layout.has_duplicates else 'no-dup'}"
                    )
                    cell = Cell(layout, device, FORWARD, seed=args.seed,
                                requires_grad=grad_mode == "autograd")
                    recs = run_serving_cell(
                        cell, providers, grad_mode=grad_mode, repeats=serving_repeats,
                        sample_s=serving_sample_s, progress=progress,
                    )
                    common = _common(layout, device, device_name, threads, allocator,
                                     "serving", FORWARD, grad_mode)
                    records += [{**common, **r} for r in recs]
                    del cell
    progress.close()

    child_meta = None
    if thp_child:
        left = (end - time.perf_counter()) if end is not None else 0.0
        child = _run_thp_child(list(argv), args, args.output, max(60.0, left) if end else 0.0)
        records += child["records"]
        child_meta = {k: child.get(k) for k in ("memory_method", "wall_s")}
        if not args.thp_all:
            notes.append(
                f"the {THP_ENV}=1 run skips the FBGEMM-backed and reference-kernel rows to fit "
                "the time limit (--thp_all includes them)"
            )

    meta: Dict[str, Any] = {
        "versions": _versions(),
        "device": {"type": device.type, "name": device_name},
        "threads": threads,
        "backend": kt_regroup.backend(device),
        "memory_method": probe.method,
        "args": vars(args),
        "argv": argv,
        "layouts": [lay.describe() for lay in main_layouts],
        "notes": notes,
        "thp_child": child_meta,
    }
    report.add_ratios(records)
    out_bytes = main_layouts[0].out_bytes if main_layouts and not main_layouts[0].has_duplicates else None
    goals = report.goal_lines(records, out_bytes) if not args._child else []
    meta["wall_s"] = time.perf_counter() - t_start
    table = report.markdown(records, meta) + (report.format_goals(goals) if goals else "")
    png_note = report.write_png(os.path.join(args.output, "runtime.png"), records) if records else None
    if png_note:
        notes.append(png_note)
    meta["wall_s"] = time.perf_counter() - t_start
    report.write_json(os.path.join(args.output, "results.json"), meta, records, goals)
    report.write_csv(os.path.join(args.output, "results.csv"), meta, records)
    with open(os.path.join(args.output, "table.md"), "w") as f:
        f.write(table + "\n")
    print(table)
    print(f"\nwall time {meta['wall_s']:.0f} s; results in {args.output}/ "
          "(results.json, results.csv, runtime.png, table.md)")
    return 0
