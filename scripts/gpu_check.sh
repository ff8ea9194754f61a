#!/usr/bin/env bash
# GPU check for kt_regroup: one command on the lent GPU machine as it is
# (no network; its python3 with torch 2.11.0+cu130, nvcc 13.0), in under 8 minutes
# including the build. The steps, in this order; none of them can stop the report:
#   install      with --offline: the wheels of .whl/ (scripts/gpu_wheels.sh, on a machine
#                with network) go into a target folder, --no-index --no-deps;
#   environment  every version found, each read on its own (a missing attribute or tool
#                reads "unknown (...)"): python, torch, GPU, driver, nvcc, torchrec, ...;
#   build        kt_regroup built in place against that python's torch (setup.py decides on
#                the CUDA kernels and says why); if that build fails, a CPU-only build
#                (KT_REGROUP_CUDA=0), and the report says so;
#   library      kt_regroup loads, whether it has CUDA kernels, one op call on the device;
#   smoke        the kernel checks of tests/test_cuda_kernel.py on the device against the
#                CPU op (at most 60 s), then compute-sanitizer memcheck and racecheck on
#                its reference checks where the toolkit has compute-sanitizer;
#   training_step  forward + backward + SGD through KTRegroupAsDict, captured in a CUDA
#                graph with sync debug mode "error", replay == eager;
#   bench        benchmarks/regroup.py's op section, every cell (the seed layout in
#                float32 and bfloat16 first, narrow bfloat16, then scattered), each cell's tables in the
#                report as soon as it ends: wall time and CUDA-event device time per
#                call; then the goals of issues 21 and 23 (the variable-batch op's modes,
#                a few seconds of each cell's 150 s) read from its records;
#   tests        with the time left: every test with "cuda" in its name (the convention:
#                CUDA-only tests are named *cuda* and skip without CUDA) but the kernel
#                checks a passed smoke ran; `pytest -v` so each outcome line survives a
#                kill, a per-test timeout where pytest-timeout is installed, `-n` where
#                pytest-xdist is.
# Where torchrec does not import, the training step and the bench run at op level
# (kt_regroup's op on plan tensors, against copy_) and the report says what was skipped.
# Where kt_regroup does not load, the training step and bench say SKIPPED; tests still run.
#
# Usage: scripts/gpu_check.sh [--offline] [--dry-run [--build]] [--only STEPS] [--out DIR]
#   --offline  install .whl/*.whl (if any; else "no wheels, skipped install").
#   --dry-run  no GPU: the same steps on CPU (the training step without a graph, a quick
#              bench of two cells), so the script is checked on any machine
#              (tests/test_gpu_check.py); no build unless --build (setuptools rebuilds
#              every source: minutes on 2 cores); the wheels are installed where they fit
#              this python, else only resolved for CPython 3.12.
#   --only     of build,smoke,training_step,bench,tests (the default: all) the ones to run;
#              install, environment and library always run.
# Environment: PYTHON (default python3), OUT (default gpu_check_results; the device tool
#   sets it), KT_GPU_CHECK_BUDGET_S (default 450: every step shares it), MAX_JOBS,
#   KT_GPU_CHECK_BUILD_S (the build's limit, default 300), KT_GPU_CHECK_TESTS_S (the
#   tests' limit, default: the time left), KT_GPU_CHECK_TEST_TIMEOUT_S (per test, default
#   120), KT_GPU_CHECK_TESTS (pytest's paths, default tests), KT_GPU_CHECK_SMOKE_K and
#   KT_GPU_CHECK_SANITIZE_K (the smoke's and the sanitizers' -k), KT_GPU_WHEELS (the wheels'
#   folder, default .whl), KT_GPU_CHECK_NO_TORCHREC=1 (act as if torchrec did not import).
# $OUT gets 4 files: gpu_check.md (the report: paste it), gpu_check.log (every step's
# output), bench.json (every bench record) and bench.md (the bench's tables).
set -uo pipefail
cd "$(dirname "$0")/.."
DRY=0 OFFLINE=0 BUILD=1 ONLY=build,smoke,training_step,bench,tests
while [ $# -gt 0 ]; do
  case $1 in
    --dry-run) DRY=1 BUILD=${BUILD_ASKED:-0} ;;
    --build) BUILD=1 BUILD_ASKED=1 ;;
    --offline) OFFLINE=1 ;;
    --only) ONLY=$2; shift ;;
    --out) OUT=$2; shift ;;
    -h | --help) sed -n '2,48p' "$0"; exit 0 ;;
    *) echo "gpu_check.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
  esac
  shift
done
PY=${PYTHON:-python3}
DEVICE=$([ "$DRY" = 1 ] && echo cpu || echo cuda)
OUT=${OUT:-gpu_check_results}
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)
rm -f "$OUT"/gpu_check.md "$OUT"/gpu_check.log "$OUT"/bench.json "$OUT"/bench.md
WORK=$(mktemp -d "${TMPDIR:-/tmp}/gpu_check.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
REPORT=$OUT/gpu_check.md LOG=$OUT/gpu_check.log
BUDGET=${KT_GPU_CHECK_BUDGET_S:-450}
FAILED=()
export PYTHONUNBUFFERED=1 DEVICE
say() { echo "$*" | tee -a "$REPORT"; }
wanted() { [[ ",$ONLY," == *",$1,"* ]]; }
# step NAME SECONDS CMD...: runs CMD under min(SECONDS, what is left of the budget),
# appends its output to the log, records ok/FAILED and the output's last line.
step() {
  local name=$1 limit=$2 t0=$SECONDS rc left
  shift 2
  left=$((BUDGET - SECONDS))
  ((left < limit)) && limit=$left
  if ((limit < 5)); then
    say "- $name: SKIPPED (the ${BUDGET} s budget is spent)"
    FAILED+=("$name")
    return 1
  fi
  echo "[gpu_check] $name (limit $limit s)" >&2
  timeout -k 10 "$limit" "$@" >"$WORK/$name.log" 2>&1
  rc=$?
  { echo "===== $name (rc $rc, $((SECONDS - t0)) s)"; cat "$WORK/$name.log"; } >>"$LOG"
  say "- $name: $([ $rc -eq 0 ] && echo ok || echo "FAILED (rc $rc$( ((rc == 124 || rc == 137)) \
    && echo ", killed at its $limit s limit"))") in $((SECONDS - t0)) s"
  # Its summary line, or the end of a failure.
  grep -v '^\s*$' "$WORK/$name.log" | tail -n "$([ $rc -eq 0 ] && echo 1 || echo 25)" \
    | sed 's/^/    /' >>"$REPORT"
  [ $rc -eq 0 ] || FAILED+=("$name")
  return $rc
}

say "# kt_regroup GPU check$([ "$DRY" = 1 ] && echo ' (DRY RUN on CPU: no GPU was used)') ($(date -u +%Y-%m-%dT%H:%MZ), commit $(git rev-parse --short HEAD 2>/dev/null || echo '?'))"
say ""
say "Command: scripts/gpu_check.sh$([ "$OFFLINE" = 1 ] && echo ' --offline')$([ "$DRY" = 1 ] && echo ' --dry-run'); python: $PY; budget ${BUDGET} s"
say ""

# --- install: the carried wheels, no network ---------------------------------------------
WHEELS=${KT_GPU_WHEELS:-.whl}
wheels=("$WHEELS"/*.whl)
[ -e "${wheels[0]}" ] || wheels=()
if [ "$OFFLINE" = 0 ]; then
  say "- install: not asked (no --offline): the environment of $PY as it is"
elif [ ${#wheels[@]} = 0 ]; then
  say "- install: no wheels, skipped install ($WHEELS/ is empty: scripts/gpu_wheels.sh fills .whl/)"
else
  say "- install: ${#wheels[@]} wheels: $(cd "$WHEELS" && ls ./*.whl | sed 's|^\./||' | tr '\n' ' ')"
  TARGET=$WORK/site
  fits=$("$PY" -c 'import sys; print(int(sys.version_info[:2] == (3, 12)))' 2>/dev/null)
  if [ "$DRY" = 1 ] && [ "$fits" != 1 ]; then  # the machine's CPython 3.12, resolved only
    step install 120 "$PY" -m pip install --dry-run --no-index --no-deps --only-binary=:all: \
      --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 \
      --target "$TARGET" "${wheels[@]}"
  else
    step install 120 "$PY" -m pip install -q --no-index --no-deps --no-compile \
      --no-cache-dir --target "$TARGET" "${wheels[@]}" && \
      export PYTHONPATH="$TARGET${PYTHONPATH:+:$PYTHONPATH}"
  fi
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

# --- environment: every version found, each on its own -----------------------------------
step environment 60 "$PY" - <<'EOF'
import importlib, logging, os, platform, subprocess, sys

logging.disable(logging.WARNING)  # fbgemm_gpu 1.6.0 warns at import that it lacks 2.11 in its table


def probe(label, read):
    """One line; a missing attribute, module or tool reads "unknown (...)"."""
    try:
        value = read()
    except Exception as e:  # noqa: BLE001  (reported, never raised)
        value = f"unknown ({type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''})"
    print(label, value, flush=True)


def run(*cmd):
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    return out.stdout.strip() if out.returncode == 0 else None


probe("python", lambda: f"{platform.python_version()} {sys.executable}")
try:
    import torch
except Exception as e:  # noqa: BLE001
    print("torch unavailable:", type(e).__name__, e)
    raise SystemExit(1)
probe("torch", lambda: f"{torch.__version__} {os.path.dirname(torch.__file__)}")
probe("torch CUDA", lambda: torch.version.cuda)
probe("torch commit", lambda: torch.version.git_version)
probe("cuDNN", lambda: torch.backends.cudnn.version())


def gpu():
    if not torch.cuda.is_available():
        return "none (torch.cuda.is_available() is False)"
    p = torch.cuda.get_device_properties(0)
    return (f"{p.name}, {p.multi_processor_count} SMs, sm_{p.major}{p.minor}, "
            f"{p.total_memory / 2**30:.0f} GiB; {torch.cuda.device_count()} device(s)")


def driver():
    # no torch API for it in 2.11 (torch._C._cuda_getDriverVersion is gone): nvidia-smi,
    # then the driver library itself
    found = []
    try:
        smi = run("nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader")
        if smi:
            found.append(smi.splitlines()[0])
    except (OSError, subprocess.TimeoutExpired):
        pass
    try:
        import ctypes

        version = ctypes.c_int()
        if ctypes.CDLL("libcuda.so.1").cuDriverGetVersion(ctypes.byref(version)) == 0:
            found.append(f"CUDA {version.value // 1000}.{version.value % 1000 // 10}")
    except (OSError, AttributeError):
        pass
    return ", ".join(found) or "none found (no nvidia-smi, no libcuda.so.1)"


probe("GPU", gpu)
probe("driver", driver)
probe("nvcc", lambda: (run("nvcc", "--version") or "not found on PATH").splitlines()[-1])
probe("CUDA_HOME", lambda: os.environ.get("CUDA_HOME", "unset"))
for name in ("fbgemm_gpu", "tensordict", "torchmetrics", "torchrec", "xdist", "pytest_timeout"):
    if name == "torchrec" and os.environ.get("KT_GPU_CHECK_NO_TORCHREC") == "1":
        print("torchrec unavailable: KT_GPU_CHECK_NO_TORCHREC=1")
        continue
    try:
        module = importlib.import_module(name)
        print(name, getattr(module, "__version__", "?"), os.path.dirname(module.__file__))
    except Exception as e:  # noqa: BLE001  (reported; the steps that need it fall back or say so)
        print(name, "unavailable:", type(e).__name__, str(e).splitlines()[0] if str(e) else "")
print("every version found:")
EOF
# (a failed step's report already holds its output's end)
grep -q '^every version found:$' "$WORK/environment.log" 2>/dev/null && grep -v '^\s*$' "$WORK/environment.log" \
  | grep -v '^every version found:$' | sed 's/^/    /' >>"$REPORT"
TORCHREC=1
if ! grep -q '^torchrec [0-9]' "$WORK/environment.log" 2>/dev/null; then
  TORCHREC=0
  say "- torchrec does not import: SKIPPED everything that needs it (the module, torchrec's"
  say "  providers, tests that import torchrec); the training step and the bench run at op level"
fi
export TORCHREC

# --- build: against this python's torch; CPU-only if the CUDA build fails ------------------
if ! wanted build; then
  say "- build: not asked (--only $ONLY): the library as built"
elif [ "$BUILD" = 0 ]; then
  say "- build: skipped (dry run: a CPU build takes minutes on 2 cores; --build builds): the library as built"
else
  build_cmd=(env MAX_JOBS="${MAX_JOBS:-$(nproc)}" "$PY" setup.py build_ext --inplace)
  cuda_line() {  # setup.py's one line on the CUDA kernels (built, or why not)
    say "  setup.py: $(grep -m1 -o 'kt_regroup: .*CUDA kernels.*' "$WORK/$1.log" 2>/dev/null \
      || echo 'no word on the CUDA kernels')"
  }
  step build "${KT_GPU_CHECK_BUILD_S:-300}" "${build_cmd[@]}"
  rc=$?
  cuda_line build
  if [ $rc != 0 ]; then
    say "  the build FAILED: falling back to a CPU-only build (KT_REGROUP_CUDA=0); on CUDA the"
    say "  ops then run the portable kernel"
    step build_cpu_only "${KT_GPU_CHECK_BUILD_S:-300}" env KT_REGROUP_CUDA=0 "${build_cmd[@]}"
    rc=$?
    cuda_line build_cpu_only
    [ $rc = 0 ] || say "  the CPU-only build FAILED too: the library as it was, if any"
  fi
fi

# --- library: kt_regroup loads, its kernels, one call on the device ------------------------
LIBRARY=0
step library 60 "$PY" - <<'EOF' && LIBRARY=1
import ctypes, os
import torch
import kt_regroup

path = kt_regroup.library_path()
print("kt_regroup", kt_regroup.__version__, "library", path)
# Built with CUDA: a kernel for the CUDA dispatch key (the portable kernel has none), else
# the symbol the CUDA sources export; each read defensively.
has_kernel = getattr(torch._C, "_dispatch_has_kernel_for_dispatch_key", None)
try:
    built = bool(has_kernel("kt_regroup::permute_multi_embedding", "CUDA")) if has_kernel \
        else hasattr(ctypes.CDLL(path), "kt_regroup_built_with_cuda")
except Exception as e:  # noqa: BLE001
    built = f"unknown ({type(e).__name__}: {e})"
print("kt_regroup CUDA kernels:", {True: "yes", False: "no (CPU-only build)"}.get(built, built))
dev = torch.device(os.environ["DEVICE"])
emb = [torch.arange(12.0, device=dev).view(2, 6), torch.arange(4.0, device=dev).view(2, 2)]
keys, lengths, groups = [["a", "b"], ["c"]], [[4, 2], [2]], [["c", "b"], ["a"]]
plan = kt_regroup.get_plan(keys, lengths, groups)
got = kt_regroup.permute_multi_embedding(emb, *plan.tensors(dev), list(plan.out_lengths))
want = [torch.cat([emb[1], emb[0][:, 4:]], 1), emb[0][:, :4]]
for g, w in zip(got, want):
    assert torch.equal(g, w), "kt_regroup's op disagrees with torch.cat"
print(f"one op call on {dev}: equals torch.cat")
if dev.type == "cuda" and built is not True:
    raise SystemExit("the library has no CUDA kernels: on CUDA the ops ran the portable kernel")
EOF
# A library that loads but lacks its CUDA kernels still runs the rest (the portable kernel).
grep -q '^one op call on' "$WORK/library.log" 2>/dev/null && LIBRARY=1
grep -E '^kt_regroup ' "$WORK/library.log" 2>/dev/null | sed 's/^/    /' >>"$REPORT"
needs_library() {  # NAME: whether kt_regroup loads; else the step is reported SKIPPED
  [ "$LIBRARY" = 1 ] && return 0
  say "- $1: SKIPPED (kt_regroup does not load: see the library step)"
  FAILED+=("$1")
  return 1
}

# --- smoke: the kernel checks the emulation runs, on the device against the CPU op ---------
# tests/test_cuda_kernel.py's checks of the `kernel` fixture (marked kernel_check): on a
# GPU the compiled kernels, elsewhere the emulation. Then compute-sanitizer's memcheck
# and racecheck (shared memory) on the reference checks, where the toolkit has it.
SANITIZER=$(command -v compute-sanitizer \
  || ls "$(dirname "$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)")/compute-sanitizer" \
     /usr/local/cuda/bin/compute-sanitizer 2>/dev/null | head -n 1)
kernel_checks() {  # [-k EXPRESSION] -> CHECKS (an array)
  CHECKS=("$PY" -m pytest -q -p no:cacheprovider -rfE tests/test_cuda_kernel.py -m kernel_check)
  if [ -n "$1" ]; then CHECKS+=(-k "$1"); fi
}
# The tests step's -k: every *cuda* test, less the kernel checks a passed smoke ran
# ($1: passed or not, $2: the smoke's -k). -k matches marks too.
tests_k() {  # SMOKE_OUTCOME [SMOKE_K] -> K
  K=cuda
  if [ "$1" = passed ]; then K="cuda and not (kernel_check${2:+ and ($2)})"; fi
}
SMOKE=not-run
if ! wanted smoke; then
  say "- smoke: not asked (--only $ONLY)"
elif needs_library smoke; then
  kernel_checks "${KT_GPU_CHECK_SMOKE_K:-}"
  step smoke "$([ "$DRY" = 1 ] && echo 240 || echo 60)" "${CHECKS[@]}" && SMOKE=passed
  kernel_checks "${KT_GPU_CHECK_SANITIZE_K:-forward_equals_reference or backward_equals_reference or vbe_forward_equals or vbe_backward_equals}"
  for tool in memcheck racecheck; do
    if [ "$DRY" = 1 ]; then
      say "- $tool: skipped (dry run: no GPU)"
    elif [ -z "$SANITIZER" ]; then
      say "- $tool: skipped (no compute-sanitizer next to nvcc or on PATH)"
    else  # the caching allocator off, so memcheck sees each allocation's bounds
      step "$tool" 45 env PYTORCH_NO_CUDA_MEMORY_CACHING=1 "$SANITIZER" --tool "$tool" \
        --error-exitcode 99 --target-processes all "${CHECKS[@]}" -x
    fi
  done
fi

# --- one training step: no host sync, captured in a CUDA graph, replayed ---------------------
if ! wanted training_step; then
  say "- training_step: not asked (--only $ONLY)"
elif needs_library training_step; then
  step training_step 90 "$PY" - <<'EOF'
import os
import torch
import kt_regroup

torch.manual_seed(0)
dev = torch.device(os.environ["DEVICE"])
B, keys = 256, [[f"d{i}" for i in range(4)], [f"s{i}" for i in range(16)]]
lengths = [[64] * 4, [128] * 16]
groups = [keys[0] + keys[1][:8], keys[1][8:] + [keys[0][0]]]  # one duplicated key
names = ["user", "item"]
emb = [torch.randn(B, sum(w), device=dev, requires_grad=True) for w in lengths]
if os.environ["TORCHREC"] == "1":
    from torchrec.sparse.jagged_tensor import KeyedTensor

    module = kt_regroup.KTRegroupAsDict(groups=groups, keys=names).to(dev)
    level = "KTRegroupAsDict on torchrec KeyedTensors"

    def regroup():
        return module([KeyedTensor(keys=k, length_per_key=w, values=e)
                       for k, w, e in zip(keys, lengths, emb)])
else:  # op level: the plan's tensors are made once, outside the step
    plan = kt_regroup.get_plan(keys, lengths, groups)
    meta = plan.tensors(dev)
    level = "op level (torchrec missing): kt_regroup.permute_multi_embedding"

    def regroup():
        return dict(zip(names, kt_regroup.permute_multi_embedding(
            emb, *meta, list(plan.out_lengths))))

towers = torch.nn.ModuleDict({
    "user": torch.nn.Linear(sum(lengths[0]) + 8 * 128, 1),
    "item": torch.nn.Linear(8 * 128 + 64, 1),
}).to(dev)
params = list(towers.parameters()) + emb
opt = torch.optim.SGD(params, lr=0.1)


def step():
    loss = sum(towers[k](v).square().mean() for k, v in regroup().items())
    opt.zero_grad(set_to_none=False)
    loss.backward()
    opt.step()
    return loss


def restore(state):
    with torch.no_grad():
        for t, s in zip(params, state):
            t.copy_(s)


print("device:", dev, "|", level)
if dev.type == "cuda":
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):  # compile kernels, build the plan, warm the allocator
            step()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.set_sync_debug_mode("error")  # any host sync in a step raises from here on
    step()
    torch.cuda.set_sync_debug_mode("default")
else:
    for _ in range(2):
        step()
state = [t.detach().clone() for t in params]
if dev.type == "cuda":
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_loss = step()
    restore(state)  # the capture did not run the step
    graph.replay()
else:  # dry run: no graph; the step must still be repeatable from one state
    static_loss = step()
replayed = [t.detach().clone() for t in params]
restore(state)
eager_loss = step()
if dev.type == "cuda":
    torch.cuda.synchronize()
torch.testing.assert_close(static_loss, eager_loss)  # cuBLAS may pick other kernels
for a, b in zip(replayed, params):
    torch.testing.assert_close(a, b)
assert all(torch.isfinite(e.grad).all() for e in emb)
print("one training step (" + level + ") " + (
    "captured in a CUDA graph; replay equals eager; no host sync" if dev.type == "cuda"
    else "run twice from one state on CPU (dry run: no graph)"))
EOF
fi

# --- the benchmark: every cell, wall and device time -----------------------------------------
# The one place that names the benchmark's command line: benchmarks/regroup.py's op section,
# once per layout and dtype, each writing results.json and results.md into the folder given.
bench_command() {  # LAYOUT DTYPE OUTPUT_DIR -> BENCH (an array)
  # every mode, with and without duplicate keys, then the VBE modes: estimated (not yet
  # measured on a GPU) at about 5 s of each cell's 150 s, most of it the index_select row's
  # forward+backward (some 3,000 launches a call, about 120 calls)
  local args=(--device cuda --full)
  [ "$DRY" = 1 ] && args=(--device cpu --quick)
  BENCH=("$PY" -m benchmarks.regroup --section ops "${args[@]}" --ops-layout "$1"
         --ops-dtype "$2" --output "$3")
}
# the seed layout first (fp32, then bf16), narrow bf16; each cell also runs the VBE modes
BENCH_CELLS="seed:float32 seed:bfloat16 narrow:bfloat16 scattered:bfloat16 scattered:float32"
[ "$DRY" = 1 ] && BENCH_CELLS="seed:float32 scattered:bfloat16"
if ! wanted bench; then
  say "- bench: not asked (--only $ONLY)"
elif ! needs_library bench; then
  :
elif [ "$TORCHREC" = 1 ]; then
  for cell in $BENCH_CELLS; do  # each cell's tables in the report as soon as it ends
    bench_command "${cell%:*}" "${cell#*:}" "$WORK/bench_${cell/:/_}"
    step "bench_${cell/:/_}" 150 "${BENCH[@]}"
    md="$WORK/bench_${cell/:/_}/results.md"
    if [ -f "$md" ]; then
      cat "$md" >>"$OUT/bench.md"
      { echo; echo "## Benchmark, ${cell%:*} layout, ${cell#*:}"; echo; cat "$md"; } >>"$REPORT"
    fi
  done
  "$PY" - "$OUT/bench.json" "$WORK"/bench_*/results.json <<'EOF2'
import json, sys
records = []
for path in sys.argv[2:]:
    records += json.load(open(path))["sections"]["ops"]["records"]
json.dump({"records": records}, open(sys.argv[1], "w"), indent=1)
EOF2
else  # op level: kt_regroup's op against copy_ of the same bytes, the bench's timers
  step bench_op_level 150 "$PY" - "$OUT/bench.json" <<'EOF'
import json, os, sys
import torch
import kt_regroup
from benchmarks.harness import QUICK, SEED, device_interleaved, interleaved, make_layout, median

dev = torch.device(os.environ["DEVICE"])
cuda = dev.type == "cuda"
sizes, B, rounds = (SEED, 1024, 7) if cuda else (QUICK, 64, 2)
records = []
for layout in ("seed", "scattered"):
    for dtype in ("float32", "bfloat16"):
        for dup in (False, True):
            keys, lengths, groups = make_layout(**sizes, scattered=layout == "scattered",
                                                duplicates=dup)
            emb = [torch.randn(B, sum(w)).to(dev, getattr(torch, dtype)).requires_grad_()
                   for w in lengths]
            plan = kt_regroup.get_plan(keys, lengths, groups)
            meta, out_lengths = plan.tensors(dev), list(plan.out_lengths)
            col = {k: (i, sum(lengths[i][:keys[i].index(k)]), lengths[i][keys[i].index(k)])
                   for i in range(2) for k in keys[i]}
            want = [torch.cat([emb[col[k][0]][:, col[k][1]:col[k][1] + col[k][2]] for k in g],
                              1) for g in groups]
            grads = [torch.randn_like(w) for w in want]
            want_grads = torch.autograd.grad(want, emb, grads)
            want = [w.detach() for w in want]
            op = lambda xs: kt_regroup.permute_multi_embedding(xs, *meta, out_lengths)
            plain = [e.detach() for e in emb]  # the forward alone records no graph
            dst, grad_dst = [torch.empty_like(w) for w in want], [torch.empty_like(e) for e in emb]
            # forward+backward: the forward's copy, then one of the input gradients' bytes
            modes = {"forward": (lambda: op(plain), lambda: [d.copy_(w) for d, w in zip(dst, want)]),
                     "forward+backward": (
                         lambda: torch.autograd.grad(op(emb), emb, grads),
                         lambda: ([d.copy_(w) for d, w in zip(dst, want)],
                                  [g.copy_(e) for g, e in zip(grad_dst, want_grads)]))}
            for got, exp in zip(op(plain), want):
                assert torch.equal(got, exp), "kt_regroup's op disagrees with torch.cat"
            for got, exp in zip(modes["forward+backward"][0](), want_grads):
                torch.testing.assert_close(got, exp, msg="kt_regroup's backward disagrees")
            for mode, (fn, limit) in modes.items():
                fns = {"kt_regroup.permute_multi_embedding": fn, "limit: copy_": limit}
                wall = interleaved(fns, rounds)
                eager, graph, errors = (device_interleaved(fns, rounds, batch=10) if cuda
                                        else ({}, {}, {}))
                med = {n: (median(wall[n]), median(eager.get(n, [])), median(graph.get(n, [])))
                       for n in fns}
                ratio = lambda i: (med["kt_regroup.permute_multi_embedding"][i]
                                   / med["limit: copy_"][i] if med["limit: copy_"][i] else None)
                for n in fns:
                    records.append(dict(
                        mode=mode, layout=layout, dtype=dtype, duplicates=dup, batch_size=B,
                        device=str(dev), provider=n, n=len(wall[n]), check="ok",
                        p50_s=med[n][0], device_batch=10 if cuda else None,
                        device_p50_s=med[n][1], graph_p50_s=med[n][2],
                        graph_error=errors.get(n), vs_copy=ratio(0), vs_copy_device=ratio(1),
                        vs_copy_graph=ratio(2)))
                print(f"{layout} {dtype} dup={dup} {mode}: op / copy_ wall {ratio(0):.2f}, "
                      f"device {ratio(1) or float('nan'):.2f}, graph "
                      f"{ratio(2) or float('nan'):.2f}")
json.dump({"records": records, "level": "op (torchrec missing)"}, open(sys.argv[1], "w"),
          indent=1)
print(f"op-level bench: {len(records) // 2} cells (forward and forward+backward; torchrec's "
      "providers SKIPPED)")
EOF
fi

# --- the issue's goals, read from the benchmark's records ----------------------------------
if [ -f "$OUT/bench.json" ]; then
  "$PY" - "$OUT/bench.json" >"$WORK/goals.md" 2>&1 <<'EOF'
import json, sys
OP, MOD, COPY = ("kt_regroup.permute_multi_embedding", "kt_regroup.KTRegroupAsDict",
                 "limit: copy_")
VBE, VBE_INDEX = ("kt_regroup.permute_multi_embedding_vbe",
                  "index_select per key -> kt_regroup.permute_multi_embedding")
rows = [r for r in json.load(open(sys.argv[1]))["records"] if r["n"] > 0]
cells = {}
for r in rows:
    cells.setdefault((r["layout"], r["dtype"], r["mode"], r["duplicates"]), {})[r["provider"]] = r
x = lambda v: "n/a" if v is None else f"{v:.2f}"


def met(op, goal):  # judged on graph, else device time; n/a off CUDA
    judged = op.get("vs_copy_graph") or op.get("vs_copy_device")
    return "n/a" if judged is None else ("yes" if judged <= goal else "**NO**")


print("Each ratio is one provider's median over copy_'s of the same bytes, in one run. "
      "wall: host synced around each call (launch overhead included); device: CUDA events "
      "around calls queued without a sync; graph: CUDA events around replays of a CUDA "
      "graph (kernel time). The goal is judged on graph, else device; n/a off CUDA.\n")
print("| layout | dtype | mode | dup | op wall | op device | op graph "
      "| module device | goal | met |")
print("|---|---|---|---|---:|---:|---:|---:|---|---|")
for (layout, dtype, mode, dup), rs in cells.items():
    op, mod = rs.get(OP), rs.get(MOD) or {}
    if op is None or COPY not in rs:
        continue
    goal = 1.05 if mode == "forward" else 1.11
    print(f"| {layout} | {dtype} | {mode} | {dup} | {x(op.get('vs_copy'))} "
          f"| {x(op.get('vs_copy_device'))} | {x(op.get('vs_copy_graph'))} "
          f"| {x(mod.get('vs_copy_device'))} | <= {goal} | {met(op, goal)} |")
print("\n## Goals (issue 23: the variable-batch op / copy_ of the bytes it must move)\n")
print("copy_ of the outputs' bytes twice (their rows read, the outputs written), in "
      "forward+backward also of the upstream gradient and the input gradients; the "
      "index_select path: index_select per key, then permute_multi_embedding.\n")
print("| layout | dtype | mode | op wall | op device | op graph | index_select path device "
      "| goal | met |")
print("|---|---|---|---:|---:|---:|---:|---|---|")
for (layout, dtype, mode, dup), rs in cells.items():
    op, index = rs.get(VBE), rs.get(VBE_INDEX) or {}
    if op is None or COPY not in rs:
        continue
    print(f"| {layout} | {dtype} | {mode} | {x(op.get('vs_copy'))} "
          f"| {x(op.get('vs_copy_device'))} | {x(op.get('vs_copy_graph'))} "
          f"| {x(index.get('vs_copy_device'))} | <= 1.15 | {met(op, 1.15)} |")
EOF
  { echo; echo "## Goals (issue 21: op / copy_ of the same bytes)"; echo; cat "$WORK/goals.md"; } >>"$REPORT"
fi

# --- tests: every *cuda* test, with the time left -------------------------------------------
if ! wanted tests; then
  say "- tests: not asked (--only $ONLY)"
else
  tests_k "$SMOKE" "${KT_GPU_CHECK_SMOKE_K:-}"
  pytest_args=(-v -p no:cacheprovider -rA --continue-on-collection-errors -k "$K")
  "$PY" -c 'import pytest_timeout' 2>/dev/null \
    && pytest_args+=(--timeout "${KT_GPU_CHECK_TEST_TIMEOUT_S:-120}")
  workers=$(( $(nproc) / 2 > 8 ? 8 : $(nproc) / 2 ))
  "$PY" -c 'import xdist' 2>/dev/null && ((workers >= 2)) && pytest_args+=(-n "$workers")
  # shellcheck disable=SC2086  # KT_GPU_CHECK_TESTS: paths, split on spaces
  step tests "${KT_GPU_CHECK_TESTS_S:-$BUDGET}" "$PY" -m pytest "${pytest_args[@]}" \
    ${KT_GPU_CHECK_TESTS:-tests}
  rc=$?
  say "  command: pytest $(printf '%q ' "${pytest_args[@]}")${KT_GPU_CHECK_TESTS:-tests}"
  ((rc == 124 || rc == 137)) && say "  killed during: $(grep -v '^\s*$' "$WORK/tests.log" | tail -n 1)"
  # Each test by name with its outcome, from -v's lines (plain, or xdist's "[gw0] [ 5%]
  # PASSED id"), up to the summary; a kill leaves every line written before it.
  sed -n -E '/short test summary info/q
    s/^\[gw[0-9]+\] \[ *[0-9]+%\] (PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS) (.*::.*)$/\1 \2/p
    s/^(\S.*::.*) (PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)( .*)?$/\2 \1/p' \
    "$WORK/tests.log" 2>/dev/null | awk '!seen[$0]++' >"$WORK/outcomes.txt"
  say "  outcomes: $( (awk '{ n[$1]++ } END { for (o in n) printf "%s %d, ", o, n[o] }' \
    "$WORK/outcomes.txt" | sed 's/, $//'; [ -s "$WORK/outcomes.txt" ] || echo none) \
    | tr -d '\n')"
  head -n 80 "$WORK/outcomes.txt" | sed 's/^/    /' >>"$REPORT"
fi

files=$(find "$OUT" -type f | wc -l)
say ""
say "Result: $([ ${#FAILED[@]} -eq 0 ] && echo 'all steps passed' || echo "SOME STEPS FAILED: ${FAILED[*]}") (total $SECONDS s, $files files in $OUT)$([ "$DRY" = 1 ] && echo '; DRY RUN: nothing was measured on a GPU')"
echo "[gpu_check] report: $REPORT" >&2
[ ${#FAILED[@]} -eq 0 ]
