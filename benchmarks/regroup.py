"""``python -m benchmarks.regroup``: kt_regroup where users run it (``make bench``).

Sections: ``step`` (a training step), ``serving`` (a deployed model per request), ``ops``
(the op alone), at the seed's sizes. The default run takes about 5 minutes on 2 cores:
the step under glibc, one variant; serving eager and AOTInductor; the op forward and
forward+backward. ``--full`` (about 30 minutes) adds every allocator and variant, the
duplicate-key and stride-0 cases, TorchScript and the C++ predictor; ``--quick`` is the
smoke run of ``make test`` (toy sizes). See benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import ctypes.util
import json
import os
import platform
import subprocess
import sys
import time
from typing import Dict, List, Optional

import torch

SCHEMA = "benchmarks.regroup/1"
SECTIONS = ("step", "serving", "ops")
# name -> (library ctypes finds, extra env): as torch.backends.xeon.run_cpu preloads them
ALLOCATORS = {
    "glibc": (None, {}),
    "jemalloc": ("jemalloc", {"MALLOC_CONF": "oversize_threshold:1,background_thread:true,"
                                             "metadata_thp:auto"}),
    "tcmalloc": ("tcmalloc_minimal", {}),
}


def _csv(text: str) -> List[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def _csv_of(allowed):
    def parse(text: str) -> List[str]:
        bad = [x for x in _csv(text) if x not in allowed]
        if bad or not _csv(text):
            raise argparse.ArgumentTypeError(f"{text!r}: expected a comma-separated list of "
                                             f"{', '.join(allowed)}")
        return _csv(text)
    return parse


def _variants(text: str) -> List[str]:
    for v in _csv(text):
        layout, *flags = v.split("+")
        if layout not in ("scattered", "seed") or not set(flags) <= {"dup", "sum", "vbe"}:
            raise argparse.ArgumentTypeError(f"{v!r}: expected LAYOUT[+dup][+sum][+vbe], "
                                             "LAYOUT one of scattered, seed")
    return _csv(text)


def _env_var(text: str) -> str:
    if "=" not in text or not text.split("=", 1)[0]:
        raise argparse.ArgumentTypeError(f"{text!r}: expected NAME=VALUE")
    return text


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.regroup", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--section", type=_csv_of(SECTIONS), default=list(SECTIONS),
                   help="comma-separated, of: step, serving, ops (default: all)")
    size = p.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true",
                      help="small sizes and few samples: the smoke run of make test")
    size.add_argument("--full", action="store_true",
                      help="every allocator, variant and form (TorchScript, C++): ~30 min")
    p.add_argument("--output", default="bench_results", help="directory of results.json, "
                   "results.md and step.png (default bench_results)")
    p.add_argument("--seed", type=int, default=0, help="seed of the key-to-group draw")
    p.add_argument("--threads", type=int, default=None,
                   help="torch.set_num_threads for every section, the step's children and "
                   "the C++ predictor (OMP_NUM_THREADS) included (default: torch's)")
    p.add_argument("--device", default="cpu", help="device of the ops section (cuda: the "
                   "op table on a GPU; the other sections run on CPU)")
    p.add_argument("--ops-layout", choices=["scattered", "seed", "narrow"], default="scattered",
                   help="layout of the ops section: the seed's keys in input order or "
                   "scattered, or narrow (100 keys of 8-16 columns at batch 32) "
                   "(default scattered)")
    p.add_argument("--ops-dtype", choices=["float32", "bfloat16"], default="float32",
                   help="dtype of the ops section's inputs (default float32)")
    s = p.add_argument_group("step section")
    s.add_argument("--batch-size", type=int, default=None, help="default 1024 (quick 64)")
    s.add_argument("--variants", type=_variants, default=None,
                   help="LAYOUT[+dup][+sum][+vbe], comma-separated; LAYOUT = scattered (keys "
                   "in random order in each group) or seed (input order); +dup: one duplicate "
                   "key per group; +sum: loss = sum(out.sum()) (stride-0 gradients) instead "
                   "of the linear over-arch; +vbe: the sparse keys a variable-batch KJT of "
                   "256 unique rows each, its own rows (patched torchrec, today's path, "
                   "index_select + op, no regroup) (default: scattered; full: scattered,seed,"
                   "scattered+dup,scattered+sum; quick: scattered,scattered+dup+sum,scattered+vbe), under "
                   "the first allocator; the others run the first variant")
    s.add_argument("--rows", type=_csv, default=None, help="step rows to run (substrings "
                   "of the row names; default all but KeyedTensor.regroup and the no-cat row; "
                   "full and quick: all)")
    s.add_argument("--steps", type=int, default=None, help="timed steps per row, interleaved, "
                   "each after two untimed steps of its row (torch.utils.benchmark's warm-up) "
                   "(default 4; full 7; quick 2)")
    s.add_argument("--fbgemm-steps", type=int, default=None,
                   help="timed steps of the FBGEMM row, seconds each on CPU, in the first "
                   "variant under the first allocator only (default and quick 1; full 3; "
                   "0 = none)")
    s.add_argument("--table-rows", type=int, default=16, help="rows of each embedding table")
    s.add_argument("--allocators", type=_csv_of(ALLOCATORS), default=None,
                   help="glibc, jemalloc, tcmalloc (LD_PRELOAD): one child process each "
                   "(default glibc; full and quick: all; a missing library is reported and "
                   "skipped)")
    s.add_argument("--child-env", action="append", default=[], metavar="NAME=VALUE",
                   type=_env_var,
                   help="extra environment of the step's child processes, e.g. "
                   "KT_REGROUP_HUGE_PAGES=0 (repeatable)")
    s.add_argument("--_child", choices=["first", "other"], help=argparse.SUPPRESS)
    return p


def _machine() -> Dict[str, object]:
    import kt_regroup

    name = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            name = next(ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name"))
    except (OSError, StopIteration):
        pass
    versions = {"torch": torch.__version__, "kt_regroup": kt_regroup.__version__}
    for mod in ("fbgemm_gpu", "torchrec"):
        try:
            versions[mod] = __import__(mod).__version__
        except Exception as e:  # noqa: BLE001  (absent or broken: reported)
            versions[mod] = f"unavailable ({type(e).__name__})"
    return {"cpu": name, "threads": torch.get_num_threads(), "versions": versions,
            "copy_program": torch.ops.kt_regroup._cpu_copy_program(),
            "load_average": os.getloadavg()[0]}


def _allocator_loaded() -> str:
    """The malloc replacement mapped into this process (from LD_PRELOAD), or glibc."""
    with open("/proc/self/maps") as f:
        maps = f.read()
    return next((n for n, (lib, _) in ALLOCATORS.items() if lib and f"lib{lib}" in maps), "glibc")


def _step_child(args) -> List[dict]:
    from benchmarks import harness, step

    sizes = harness.QUICK if args.quick else harness.SEED
    variants = args.variants or (["scattered", "scattered+dup+sum", "scattered+vbe"]
                                 if args.quick else
                                 ["scattered", "seed", "scattered+dup", "scattered+sum"]
                                 if args.full else ["scattered"])
    if args._child != "first":  # allocators after the first: the headline variant
        variants = variants[:1]
    rows = [r for r in step.ROWS if any(s in r for s in args.rows)] if args.rows else [
        r for r in step.ROWS if args.quick or args.full or r not in step.OPT_IN]
    fbgemm = args.fbgemm_steps if args.fbgemm_steps is not None else (3 if args.full else 1)
    records = []
    for i, variant in enumerate(variants):  # the first variant: every row; then SHORT_ROWS
        print(f"[bench] step {variant}", file=sys.stderr, flush=True)
        records += step.run_variant(
            variant, sizes=sizes, batch=args.batch_size or (64 if args.quick else 1024),
            rounds=args.steps or (2 if args.quick else 7 if args.full else 4), warmup=0,
            rows=rows if i == 0 else [r for r in rows if r in step.SHORT_ROWS],
            fbgemm_steps=fbgemm if i == 0 and args._child == "first" else 0,
            table_rows=args.table_rows, seed=args.seed)
    # what this process sees of --child-env: proof that it arrived
    env = " ".join(f"{k}={os.environ.get(k)}" for k in (kv.split("=", 1)[0] for kv in args.child_env))
    for r in records:
        r.update(allocator=_allocator_loaded(), env=env, threads=torch.get_num_threads())
    return records


def run_step_section(args, argv: List[str], out_dir: str) -> Dict[str, object]:
    """The step section in one child process per allocator (``LD_PRELOAD``)."""
    records, notes = [], []
    extra = dict(kv.split("=", 1) for kv in args.child_env)
    allocators = args.allocators or (list(ALLOCATORS) if args.quick or args.full else ["glibc"])
    for i, name in enumerate(allocators):
        lib, lib_env = ALLOCATORS[name]
        env = {**os.environ, **extra}
        if lib:
            found = ctypes.util.find_library(lib)
            if found is None:
                notes.append(f"{name}: lib{lib}.so not found (Debian: apt-get install "
                             f"{'libjemalloc2' if name == 'jemalloc' else 'libtcmalloc-minimal4'}"
                             "; scripts/setup_env.sh tries): skipped")
                continue
            env["LD_PRELOAD"] = " ".join(filter(None, [found, env.get("LD_PRELOAD")]))
            env.update({k: v for k, v in lib_env.items() if k not in os.environ})
        path = os.path.join(out_dir, f"step_{name}.json")
        cmd = [sys.executable, "-m", "benchmarks.regroup", *argv, "--section", "step",
               "--_child", "other" if i else "first", "--output", path]
        print(f"[bench] step section under {name}: {' '.join(cmd[1:])}", file=sys.stderr)
        proc = subprocess.run(cmd, env=env)
        if proc.returncode != 0:
            notes.append(f"{name}: the step child failed (exit {proc.returncode})")
            continue
        with open(path) as f:
            got = json.load(f)
        if got and got[0]["allocator"] != name:
            notes.append(f"{name}: asked for, but the child ran with {got[0]['allocator']}")
        records += got
    from benchmarks import step

    step.add_ratios(records)
    return {"records": records, "notes": notes}


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args._child:  # one step section, its records to --output (a file)
        with open(args.output, "w") as f:
            json.dump(_step_child(args), f)
        return 0
    from benchmarks import report

    os.makedirs(args.output, exist_ok=True)
    t0 = time.perf_counter()
    results: Dict[str, object] = {"schema": SCHEMA, "argv": argv, "machine": _machine(),
                                  "sections": {}}
    from benchmarks import ops, serving

    run = {"step": lambda: run_step_section(args, argv, args.output),
           "serving": lambda: serving.run(quick=args.quick, full=args.full, out_dir=args.output),
           "ops": lambda: ops.run(quick=args.quick, full=args.full, seed=args.seed,
                                  device=args.device, layout=args.ops_layout,
                                  dtype=args.ops_dtype)}
    todo = [s for s in SECTIONS if s in args.section]
    for i, section in enumerate(todo):
        t = time.perf_counter()
        print(f"[bench] section {i + 1}/{len(todo)}: {section} ({t - t0:.0f} s in; "
              f"{'about 30 min' if args.full else 'seconds' if args.quick else 'about 5 min'}"
              " in all)", file=sys.stderr, flush=True)
        results["sections"][section] = {**run[section](), "wall_s": time.perf_counter() - t}
    results["wall_s"] = time.perf_counter() - t0
    results["machine"]["load_average_end"] = os.getloadavg()[0]
    text = report.markdown(results)
    with open(os.path.join(args.output, "results.json"), "w") as f:
        json.dump(results, f, indent=1)
    with open(os.path.join(args.output, "results.md"), "w") as f:
        f.write(text + "\n")
    png = os.path.join(args.output, "step.png")
    note = report.step_png(results, png)
    print(text + (f"\n{note}" if note else ""))
    print(f"\nwall time {results['wall_s']:.0f} s (" + ", ".join(
        f"{k} {v['wall_s']:.0f} s" for k, v in results["sections"].items()) + ")")
    print(f"results: {os.path.join(args.output, 'results.json')} (JSON), "
          f"{os.path.join(args.output, 'results.md')} (these tables)"
          + ("" if note or "step" not in results["sections"] else f", {png} (step chart)"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
