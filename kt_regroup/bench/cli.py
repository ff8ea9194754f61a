"""``python -m kt_regroup.bench``: kt_regroup vs torchrec, FBGEMM and the copy limit.

Size options follow torchrec's ``jagged_tensor_benchmark.py``; defaults are the seed's
sizes (B=1024, 20 dense keys x 64 + 1000 sparse keys x 128, 2 groups, fp32).
"""

from __future__ import annotations

import argparse
import contextlib
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
_SIZES = ("batch_size", "n_dense", "dim_dense", "n_sparse", "dim_sparse", "n_groups")
_DUPS = {"true": [True], "false": [False], "both": [False, True]}
_FBGEMM_OP_ROWS = ("fbgemm.permute_multi_embedding", "fbgemm.regroup_keyed_tensor")


def _choices(allowed, what: str, files: bool = False):
    """argparse type of a comma-separated list of ``allowed`` names (or .json files)."""

    def parse(text: str) -> List[str]:
        items = [x.strip() for x in text.split(",") if x.strip()]
        bad = [x for x in items if x not in allowed and not (files and x.endswith(".json"))]
        if bad or not items:
            raise argparse.ArgumentTypeError(
                f"{what}: expected a comma-separated list of {', '.join(allowed)}"
                f"{' or FILE.json' if files else ''}; got {text!r}"
            )
        return items

    return parse


def build_parser() -> argparse.ArgumentParser:
    from kt_regroup.bench.layout import ALLOCATIONS
    from kt_regroup.bench.providers import GRADS

    p = argparse.ArgumentParser(
        prog="python -m kt_regroup.bench",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    lay = p.add_argument_group("what is regrouped")
    lay.add_argument("--device_type", choices=["cpu", "cuda"], default="cpu")
    lay.add_argument(
        "--layout", type=_choices(ALLOCATIONS, "--layout", files=True), default=None,
        metavar="{seed,scattered,FILE.json}[,...]",
        help="layouts of the main tables. seed: keys sent to random groups, each group in "
        "input order (torchrec's benchmark); scattered: the same, each group in random "
        'order; FILE.json: {"keys": [[..]], "lengths": [[..]], "groups": [[..]], '
        '"batch_size": B}. Default: scattered (CUDA: seed)',
    )
    for name, seed_value in (("batch_size", 1024), ("n_dense", 20), ("dim_dense", 64),
                             ("n_sparse", 1000), ("dim_sparse", 128), ("n_groups", 2)):
        lay.add_argument(f"--{name}", type=int, default=None, help=f"seed: {seed_value}")
    lay.add_argument(
        "--run_backward", nargs="?", const="true", default="both",
        choices=["true", "false", "both"],
        help="time forward+backward ('true' or the bare flag), forward only ('false'), or both",
    )
    lay.add_argument(
        "--grad", type=_choices(GRADS, "--grad"), default=["ones", "expanded"],
        metavar="{ones,expanded,randn}[,...]",
        help="upstream gradients of forward+backward: contiguous ones; expanded = "
        "torch.ones(()).expand(B, n), the stride-0 tensor loss = out.sum() hands back; "
        "contiguous random",
    )
    lay.add_argument(
        "--duplicates", choices=["true", "false", "both"], default="both",
        help="groups with one duplicated key per group (torchrec's build_groups), without, or both",
    )
    lay.add_argument("--dtype", choices=list(_DTYPES), default="float32")
    lay.add_argument("--seed", type=int, default=0, help="seed of the key-to-group allocation")

    run = p.add_argument_group("run")
    run.add_argument("--preset", choices=["default", "quick", "serving"], default="default",
                     help="default: main tables + serving table + THP run; quick: tiny sizes "
                     "and short timing (CI smoke run); serving: only the serving table")
    run.add_argument("--quick", action="store_const", const="quick", dest="preset",
                     help="alias of --preset quick")
    run.add_argument("--min_run_time", type=float, default=None,
                     help="seconds of timed calls per provider and cell, at least one call "
                     "(torch.utils.benchmark's blocked_autorange; default 1, CUDA 0.5; "
                     "quick 0.01)")
    run.add_argument("--serving_min_run_time", type=float, default=None,
                     help="the same for each serving row (default 0.3; quick 0.01)")
    run.add_argument("--time_limit_s", type=float, default=None,
                     help="soft limit for the whole run, THP subprocess included: a main-table "
                     "cell that starts behind its share times each provider by one call; "
                     "0 = none (default 480; quick: none)")
    run.add_argument("--all_fbgemm_rows", action="store_true",
                     help="on CPU, also time fbgemm.permute_multi_embedding and "
                     "fbgemm.regroup_keyed_tensor in the main tables (by default only the "
                     "serving table has them: they run the same CPU kernel as "
                     "torchrec.KTRegroupAsDict [fbgemm], seconds a call)")
    run.add_argument("--providers", default=None,
                     help="comma-separated substrings of provider names (or a family: "
                     "kt_regroup, torchrec, fbgemm, limit) to run; default all")
    run.add_argument("--skip", default=None, help="comma-separated substrings/families to skip")
    run.add_argument("--allocator", choices=["both", "default", "thp"], default="both",
                     help=f"CPU allocator settings: 'both' reruns in a subprocess with {THP_ENV}=1")
    run.add_argument("--thp_all", action="store_true",
                     help="the THP run repeats every layout, gradient, duplicate setting and "
                     "provider (default: the first layout and gradient mode, no duplicates, no "
                     "FBGEMM rows)")
    run.add_argument("--no_serving", action="store_true", help="skip the serving table")
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
    for name in ("fbgemm_gpu", "torchrec", "triton"):
        try:
            out[name] = __import__(name).__version__
        except Exception:  # noqa: BLE001  (absent or broken: reported, not fatal)
            out[name] = "not installed"
    return out


def _progress(disable: bool, total: int):
    try:
        from tqdm import tqdm
    except ImportError:
        disable = True
    if disable:
        return contextlib.nullcontext(None)
    return tqdm(total=total, unit="row", file=sys.stderr, dynamic_ncols=True)


def _sizes(args, preset: str) -> Dict[str, int]:
    from kt_regroup.bench.layout import PRESETS

    sizes = dict(PRESETS[preset])
    sizes.update({k: getattr(args, k) for k in _SIZES if getattr(args, k) is not None})
    return sizes


def _layouts(args, dtype: torch.dtype, device: torch.device):
    """The main tables' layouts: each named one in every duplicate setting asked for."""
    from kt_regroup.bench.layout import layout_from_flags, layout_from_json

    names = args.layout or (["seed"] if device.type == "cuda" else ["scattered"])
    sizes = _sizes(args, "quick" if args.preset == "quick" else "seed")
    out = []
    for name in names:
        if name.endswith(".json"):
            out.append(layout_from_json(name, args.batch_size, dtype))
            continue
        out += [layout_from_flags(**sizes, duplicates=d, seed=args.seed, dtype=dtype,
                                  allocation=name) for d in _DUPS[args.duplicates]]
    return out


def _serving_layouts(args, dtype: torch.dtype):
    from kt_regroup.bench.layout import PRESETS, layout_from_flags

    # --preset serving: the size flags reshape the serving layout itself
    sizes = _sizes(args, "serving") if args.preset == "serving" else dict(PRESETS["serving"])
    return [layout_from_flags(**sizes, duplicates=d, seed=args.seed, dtype=dtype, name="serving")
            for d in _DUPS[args.duplicates]]


def _common(layout, device, device_name, threads, allocator, suite, mode, grad=None,
            grad_mode=None) -> Dict[str, Any]:
    from kt_regroup.bench.providers import FORWARD_BACKWARD

    moved = 2 * layout.out_bytes  # read + write every output byte
    if mode == FORWARD_BACKWARD:
        # + read the output gradient (an expanded one is a single element) + write the input's
        moved += (0 if grad == "expanded" else layout.out_bytes) + layout.in_bytes
    return {
        "suite": suite, "allocator": allocator, "layout": layout.name,
        "segments": layout.segments, "mode": mode, "grad": grad, "grad_mode": grad_mode,
        "duplicates": layout.has_duplicates, "batch_size": layout.batch_size,
        "n_features": layout.n_features, "dtype": str(layout.dtype).replace("torch.", ""),
        "device": device.type, "device_name": device_name, "threads": threads,
        "bytes_moved": moved,
    }


def _thp_child_args(args) -> List[str]:
    """What the THP run repeats (see --thp_all)."""
    if args.thp_all:
        return []
    return ["--layout", (args.layout or ["scattered"])[0], "--grad", args.grad[0],
            "--duplicates", "false", "--skip", ",".join(_split(args.skip) + ["fbgemm"])]


def _run_thp_child(argv: List[str], args, out_dir: str, time_limit_s: float) -> Dict[str, Any]:
    child_dir = os.path.join(out_dir, "thp")
    os.makedirs(child_dir, exist_ok=True)
    cmd = [sys.executable, "-m", "kt_regroup.bench", *argv, "--allocator", "thp", "--no_serving",
           "--output", child_dir, "--_child", "--no_progress", *_thp_child_args(args),
           "--time_limit_s", f"{time_limit_s:.0f}"]
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
    load_at_start = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
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
    from kt_regroup.bench.harness import NoMemoryProbe, make_memory_probe, measure
    from kt_regroup.bench.providers import (
        FORWARD,
        FORWARD_BACKWARD,
        Cell,
        make_providers,
        select,
        serving_kernel,
    )

    quick = args.preset == "quick"
    if args.min_run_time is not None:
        min_run_time = args.min_run_time
    else:  # CUDA calls take a millisecond: half a second is hundreds of them
        min_run_time = 0.01 if quick else (0.5 if args.device_type == "cuda" else 1.0)
    time_limit_s = args.time_limit_s if args.time_limit_s is not None else (0 if quick else 480)
    serving_min_run_time = (args.serving_min_run_time if args.serving_min_run_time is not None
                            else (0.01 if quick else 0.3))
    device = torch.device(args.device_type)
    dtype = _DTYPES[args.dtype]
    allocator = "thp" if os.environ.get(THP_ENV) == "1" else "default"
    threads = torch.get_num_threads()
    device_name = _device_name(device)
    probe = make_memory_probe(device)
    every = make_providers(device)
    providers = select(every, _split(args.providers), _split(args.skip))
    if not providers:
        print("kt_regroup.bench: --providers/--skip left no provider to run", file=sys.stderr)
        return 2
    os.makedirs(args.output, exist_ok=True)
    notes: List[str] = []
    families = {p.family for p in every}
    if "fbgemm" not in families:
        notes.append(f"fbgemm_gpu's permute_multi_embedding has no {device.type} kernel here: "
                     "FBGEMM rows skipped")
    if device.type == "cuda" and not any("triton" in p.name for p in every):
        notes.append("torchrec's Triton permute_multi_embedding is not importable (needs "
                     "triton): its row is skipped")

    # The THP allocator is a CPU setting: on CPU, 'both' reruns the main tables in a child
    # process with the variable set, 'thp' runs only that child.
    thp_child = (device.type == "cpu" and not args._child and args.preset != "serving"
                 and (args.allocator == "both" or (args.allocator == "thp" and allocator != "thp")))
    run_here = not (args.allocator == "thp" and allocator != "thp" and device.type == "cpu")
    modes = {"true": [FORWARD_BACKWARD], "false": [FORWARD], "both": [FORWARD, FORWARD_BACKWARD]}[
        args.run_backward]
    main_layouts = [] if args.preset == "serving" else _layouts(args, dtype, device)
    cells = []  # (layout, mode, grad): tables by layout, mode, gradients; no-dup then dup
    for name in dict.fromkeys(lay.name for lay in main_layouts):
        for mode in modes:
            for grad in (args.grad if mode == FORWARD_BACKWARD else [None]):
                cells += [(lay, mode, grad) for lay in main_layouts if lay.name == name]
    serving = [] if (args.no_serving or args._child) else _serving_layouts(args, dtype)
    if not run_here:
        cells, serving = [], []

    def rows(inference_only_too: bool, main: bool) -> List:
        # FBGEMM's op rows run the CPU kernel of torchrec's module row: serving table only
        short = main and device.type == "cpu" and not args.all_fbgemm_rows
        return [p for p in providers if (inference_only_too or not p.inference_only)
                and not (short and p.name in _FBGEMM_OP_ROWS)]

    grad_modes = ("autograd", "no_grad", "inference_mode") if serving else ()
    total = (sum(len(rows(m == FORWARD, True)) for _, m, _ in cells)
             + sum(len(rows(g == "inference_mode", False)) * len(serving) for g in grad_modes))
    records: List[Dict[str, Any]] = []
    behind: List[str] = []
    with _progress(args.no_progress, total) as bar:
        # Serving first: bounded by its min_run_time, so the main cells get what is left.
        for grad_mode in grad_modes:  # autograd first: its plan tensors serve both modes
            inference = grad_mode == "inference_mode"
            context = {"autograd": contextlib.nullcontext, "no_grad": torch.no_grad,
                       "inference_mode": torch.inference_mode}[grad_mode]
            for layout in serving:
                cell = Cell(layout, device, FORWARD, seed=args.seed, requires_grad=not inference)
                common = _common(layout, device, device_name, threads, allocator, "serving",
                                 FORWARD, grad_mode=grad_mode)
                for p in rows(inference, False):
                    if bar is not None:
                        bar.set_description(f"serving {grad_mode}")
                        bar.update(1)
                    records.append({**common, **measure(
                        cell, p, min_run_time=serving_min_run_time, probe=NoMemoryProbe(),
                        context=context)})
        # Time plan: each cell gets a share of what is left, by weight (forward+backward
        # ~1.3x a forward; the THP run's cells ~0.6x, its calls being faster). A cell that
        # starts later than the middle of its share times each provider by one call.
        weights = [1.3 if m == FORWARD_BACKWARD else 1.0 for _, m, _ in cells]
        thp_weight = 0.0
        if thp_child:
            child = build_parser().parse_args(argv + _thp_child_args(args))
            n_child = len(_layouts(child, dtype, device)) * (
                (len(child.grad) if FORWARD_BACKWARD in modes else 0) + (FORWARD in modes))
            thp_weight = 0.6 * 1.15 * n_child
        t_main = time.perf_counter()
        left = t_start + time_limit_s - t_main if time_limit_s > 0 else None
        for i, (layout, mode, grad) in enumerate(cells):
            budget = min_run_time
            if left is not None:
                due = t_main + left * (sum(weights[:i]) + weights[i] / 2) / (
                    sum(weights) + thp_weight)
                if time.perf_counter() > due:
                    budget = 0.0
                    behind.append(f"{layout.name} {mode} {grad or ''}".strip())
            cell = Cell(layout, device, mode, grad, seed=args.seed)
            common = _common(layout, device, device_name, threads, allocator, "main", mode, grad)
            for p in rows(mode == FORWARD, True):
                if bar is not None:
                    bar.set_description(f"{layout.name} {mode} {grad or ''}"[:40])
                    bar.update(1)
                records.append({**common, **measure(cell, p, min_run_time=budget, probe=probe)})
            del cell
            gc.collect()
    if behind:
        notes.append(f"{len(behind)} cell(s) started behind the --time_limit_s plan and timed "
                     f"each provider by one call (n = 1): {', '.join(dict.fromkeys(behind))}")
    if device.type == "cpu" and not args.all_fbgemm_rows and cells:
        notes.append("main CPU tables time FBGEMM's kernel once, as torchrec.KTRegroupAsDict "
                     f"[fbgemm]; {' and '.join(_FBGEMM_OP_ROWS)} (the same kernel) are in the "
                     "serving table (--all_fbgemm_rows adds them)")

    child_meta = None
    if thp_child:
        left = t_start + time_limit_s - time.perf_counter() if time_limit_s > 0 else 0
        child = _run_thp_child(argv, args, args.output, max(60.0, left) if time_limit_s else 0)
        records += child["records"]
        child_meta = {k: child.get(k) for k in ("memory_method", "wall_s", "argv")}
        if not args.thp_all:
            notes.append(f"the {THP_ENV}=1 run repeats the first layout and gradient mode, "
                         "without duplicates or FBGEMM rows (--thp_all repeats everything)")

    meta: Dict[str, Any] = {
        "versions": _versions(),
        "device": {"type": device.type, "name": device_name},
        "threads": threads,
        # other jobs on the machine: 1-minute load average when the run started and ended
        "load_average": [load_at_start, os.getloadavg()[0] if load_at_start is not None else None],
        "backend": serving_kernel(device),
        # the compiled library the ops came from (None: portable kernels only)
        "library": (getattr(kt_regroup, "library_path", None) or (lambda: None))(),
        "memory_method": probe.method,
        "args": vars(args),
        "argv": argv,
        "layouts": [lay.describe() for lay in main_layouts],
        "notes": notes,
        "thp_child": child_meta,
    }
    records.sort(key=lambda r: (r["suite"] == "serving", r["allocator"] == "thp"))  # stable
    report.add_ratios(records)
    png_note = report.write_png(os.path.join(args.output, "runtime.png"), records) if records else None
    if png_note:
        notes.append(png_note)
    table = report.markdown(records, meta)
    meta["wall_s"] = time.perf_counter() - t_start
    report.write_json(os.path.join(args.output, "results.json"), meta, records)
    report.write_csv(os.path.join(args.output, "results.csv"), meta, records)
    with open(os.path.join(args.output, "table.md"), "w") as f:
        f.write(table + "\n")
    print(table)
    print(f"\nwall time {meta['wall_s']:.0f} s; results in {args.output}/ "
          "(results.json, results.csv, runtime.png, table.md)")
    return 0
