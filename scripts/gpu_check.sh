#!/usr/bin/env bash
# GPU check for kt_regroup (issue 11), on one CUDA machine, in under 5 minutes once the
# wheels are downloaded:
#   1. installs the CUDA stack into $VENV (torch, triton, the CUDA fbgemm-gpu, torchrec,
#      kt_regroup built against that torch);
#   2. runs the tests with CUDA cases (the Triton kernels compiled);
#   3. captures one training step (forward + backward + SGD) in a CUDA graph, with CUDA's
#      sync debug mode raising on any host sync, and checks the replay against eager;
#   4. benchmarks the seed layout (B=1024, 20x64 + 1000x128 keys), with and without
#      duplicates, forward and forward+backward: kt_regroup
#      vs FBGEMM's op, torchrec's Triton op where installed, KeyedTensor.regroup and a
#      device copy of the same bytes; P50/P90 from CUDA events, peak memory;
#   5. checks the issue's goals on that table (reported, they do not fail the script).
# Everything goes to $OUT (default gpu_check_results/): gpu_check.md is the report (paste
# it into the issue), bench/table.md the table, one log per step.
#
# Usage: scripts/gpu_check.sh [--dry-run] [--out DIR]
#   --dry-run  no GPU, no install: every step runs its CPU stand-in (the tests under
#              Triton's interpreter, the training step eagerly, a quick CPU bench), so the
#              script itself can be checked on any machine.
# Environment: PYTHON (interpreter for the venv, or the one to use with
#   KT_GPU_CHECK_INSTALL=0, e.g. on a machine without network that has the stack),
#   VENV (default .venv-cuda), OUT.
# Stack (the versions of the CPU stack, CUDA builds): torch==2.13.0 (PyPI's default Linux
# wheel is the CUDA one), triton==3.9.0 unless torch brought its own, fbgemm-gpu==1.8.0,
# torchrec==1.9.2 (--no-deps).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_check_results}
DRY=0
OFFLINE=0
while [ $# -gt 0 ]; do
  case $1 in
    --dry-run) DRY=1 ;;
    --offline) OFFLINE=1 ;;
    --out) OUT=$2; shift ;;
    -h | --help) sed -n '2,27p' "$0"; exit 0 ;;
    *) echo "gpu_check.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
  esac
  shift
done
INSTALL=${KT_GPU_CHECK_INSTALL:-1}
[ "$DRY" = 1 ] && INSTALL=0
VENV=${VENV:-.venv-cuda}
DEVICE=$([ "$DRY" = 1 ] && echo cpu || echo cuda)
mkdir -p "$OUT"
REPORT="$OUT/gpu_check.md"
: >"$REPORT"
status=0
say() { echo "$*" | tee -a "$REPORT"; }
# step NAME SECONDS CMD...: runs CMD with a time limit, logs it, records pass/fail.
step() {
  local name=$1 limit=$2
  shift 2
  local log="$OUT/$name.log" t0=$SECONDS rc
  echo "[gpu_check] $name" >&2
  timeout "$limit" "$@" >"$log" 2>&1
  rc=$?
  say "- $name: $([ $rc -eq 0 ] && echo ok || echo "FAILED (rc $rc)") in $((SECONDS - t0)) s (log: $log)"
  # The last line (pytest's summary, a check's verdict) or the end of a failure.
  tail -n "$([ $rc -eq 0 ] && echo 1 || echo 30)" "$log" | sed 's/^/    /' >>"$REPORT"
  [ $rc -eq 0 ] || status=1
  return $rc
}

say "# kt_regroup GPU check$([ "$DRY" = 1 ] && echo ' (DRY RUN on CPU: no GPU was used)') ($(date -u +%Y-%m-%dT%H:%MZ), commit $(git rev-parse --short HEAD 2>/dev/null))"

# --- 1. the CUDA stack --------------------------------------------------------------------
if [ "$OFFLINE" = 1 ]; then
  # The lent machine as it is: its own python3/torch/triton; the carried wheels of
  # scripts/gpu_wheels.sh go into a target folder (no network, --no-index); kt_regroup is
  # built in place against the machine's torch.
  PY=${PYTHON:-python3}
  TARGET=${TARGET:-$PWD/.gpu_site}
  step install 240 bash -c "
    set -e
    $PY -m pip install -q --no-index --no-deps --target '$TARGET' .whl/*.whl
    MAX_JOBS=\${MAX_JOBS:-16} $PY setup.py build_ext --inplace
  " || { tail -n 30 "$OUT/install.log"; exit 1; }
  export PYTHONPATH="$PWD:$TARGET${PYTHONPATH:+:$PYTHONPATH}"
elif [ "$INSTALL" = 1 ]; then
  [ -x "$VENV/bin/python" ] || "${PYTHON:-python3}" -m venv "$VENV"
  PY="$VENV/bin/python"
  step install 240 bash -c "
    set -e
    $PY -m pip install -q --upgrade pip
    $PY -m pip install -q torch==2.13.0
    $PY -c 'import triton' 2>/dev/null || $PY -m pip install -q triton==3.9.0
    $PY -m pip install -q fbgemm-gpu==1.8.0 tensordict==0.15.3 torchmetrics==1.0.3 \
      tqdm==4.70.1 pyre-extensions==0.0.32 numpy pytest hypothesis ninja setuptools wheel
    $PY -m pip install -q --no-deps torchrec==1.9.2
    $PY -m pip install -q --no-build-isolation --no-deps -e .
  " || { tail -n 30 "$OUT/install.log"; exit 1; }
else
  PY=${PYTHON:-python3}
fi

step environment 60 env DEVICE="$DEVICE" "$PY" -c '
import os, torch, kt_regroup
device = os.environ["DEVICE"]
assert device == "cpu" or torch.cuda.is_available(), "no CUDA device"
name = torch.cuda.get_device_name() if device == "cuda" else "CPU (dry run)"
print(name, "torch", torch.__version__, "cuda", torch.version.cuda)
for module in ("triton", "fbgemm_gpu", "torchrec"):
    try:
        print(module, __import__(module).__version__)
    except Exception as e:  # reported; the steps that need it fail on their own
        print(module, "unavailable:", e)
print("kt_regroup", kt_regroup.__version__, "library", kt_regroup.library_path())
import importlib.util
print("CUDA kernel:", "triton" if torch.cuda.is_available() and importlib.util.find_spec("triton") else "the portable kernel of the library")
' || { tail -n 30 "$OUT/environment.log"; exit 1; }
head -n -1 "$OUT/environment.log" | sed 's/^/    /' >>"$REPORT"

# --- 2. tests with CUDA cases (the kernels compiled, not interpreted) ------------------------
if [ "$DRY" = 1 ]; then  # the same files, the Triton kernels in the interpreter
  step tests 300 env TRITON_INTERPRET=1 "$PY" -m pytest -q -x \
    -p no:cacheprovider tests/test_triton.py -k "register or match_reference"
else
  step tests 200 env -u TRITON_INTERPRET "$PY" -m pytest -q -x -p no:cacheprovider \
    tests/test_triton.py
fi

# --- 3. one training step: no host sync, captured in a CUDA graph, replayed ---------------
step training_step 90 env DEVICE="$DEVICE" "$PY" - <<'EOF'
import os
import torch
from torchrec.sparse.jagged_tensor import KeyedTensor
import kt_regroup

torch.manual_seed(0)
dev = torch.device(os.environ["DEVICE"])
B, keys = 256, [[f"d{i}" for i in range(4)], [f"s{i}" for i in range(16)]]
lengths = [[64] * 4, [128] * 16]
groups = [keys[0] + keys[1][:8], keys[1][8:] + [keys[0][0]]]  # one duplicated key
regroup = kt_regroup.KTRegroupAsDict(groups=groups, keys=["user", "item"]).to(dev)
towers = torch.nn.ModuleDict({
    "user": torch.nn.Linear(sum(lengths[0]) + 8 * 128, 1),
    "item": torch.nn.Linear(8 * 128 + 64, 1),
}).to(dev)
emb = [torch.randn(B, sum(w), device=dev, requires_grad=True) for w in lengths]
params = list(towers.parameters()) + emb
opt = torch.optim.SGD(params, lr=0.1)

def step():
    kts = [KeyedTensor(keys=k, length_per_key=w, values=e) for k, w, e in zip(keys, lengths, emb)]
    out = regroup(kts)
    loss = sum(towers[k](v).square().mean() for k, v in out.items())
    opt.zero_grad(set_to_none=False)
    loss.backward()
    opt.step()
    return loss

def restore(state):
    with torch.no_grad():
        for t, s in zip(params, state):
            t.copy_(s)

print("device:", dev)
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
# The unused key of no group: KTRegroupAsDict uses every key here; its gradient is finite.
assert all(torch.isfinite(e.grad).all() for e in emb)
print("one training step " + ("captured in a CUDA graph; replay equals eager; no host sync"
      if dev.type == "cuda" else "run twice from one state on CPU (dry run: no graph)"))
EOF

# --- 4. the benchmark (seed layout, both duplicate settings, fwd and fwd+bwd) --------------
if [ "$DRY" = 1 ]; then
  BENCH_ARGS=(--device_type cpu --preset quick --allocator default --all_fbgemm_rows)
else
  BENCH_ARGS=(--device_type cuda --min_run_time 0.5 --time_limit_s 120)
fi
step bench 170 "$PY" -m kt_regroup.bench "${BENCH_ARGS[@]}" --layout seed --duplicates both \
  --run_backward both --grad ones --no_serving --output "$OUT/bench" --no_progress
if [ -f "$OUT/bench/table.md" ]; then
  { echo; echo "## Benchmark"; echo; cat "$OUT/bench/table.md"; } >>"$REPORT"
fi

# --- 5. the issue's goals, read from the table's rows ------------------------------------
if [ -f "$OUT/bench/results.json" ]; then
  "$PY" - "$OUT/bench/results.json" >"$OUT/goals.md" 2>&1 <<'EOF'
import json, sys
rows = [r for r in json.load(open(sys.argv[1]))["records"]
        if r["suite"] == "main" and r["allocator"] == "default" and r["n"] > 0]
def find(mode, dup, prefix):
    return next((r for r in rows if r["mode"] == mode and r["duplicates"] == dup
                 and r["provider"].startswith(prefix)), None)
print("| cell | kt_regroup GB/s | >= 90% of copy_ | <= FBGEMM time | peak <= FBGEMM |")
print("|---|---|---|---|---|")
verdict = lambda ok: "n/a" if ok is None else ("yes" if ok else "**NO**")
gbps = {}
for mode in dict.fromkeys(r["mode"] for r in rows):
    for dup in (False, True):
        kt = find(mode, dup, "kt_regroup.permute_multi_embedding [")
        if kt is None:
            continue
        copy, fb = find(mode, dup, "limit: copy_"), find(mode, dup, "fbgemm.permute_multi_embedding")
        bw = kt["bytes_moved"] / kt["p50_s"] / 1e9
        gbps[(mode, dup)] = bw
        print(f"| {mode} {'dup' if dup else 'no dup'} | {bw:.0f} "
              f"| {verdict(copy and kt['p50_s'] <= copy['p50_s'] / 0.9)} "
              f"| {verdict(fb and kt['p50_s'] <= fb['p50_s'])} "
              f"| {verdict(fb and None not in (kt['mem_peak_bytes'], fb['mem_peak_bytes']) and kt['mem_peak_bytes'] <= fb['mem_peak_bytes'])} |")
for mode in dict.fromkeys(m for m, _ in gbps):
    if (mode, False) in gbps and (mode, True) in gbps:
        print(f"\n{mode}: duplicates cost no more than no duplicates (GB/s, P50): "
              f"{verdict(gbps[(mode, True)] >= 0.95 * gbps[(mode, False)])} "
              f"({gbps[(mode, True)]:.0f} vs {gbps[(mode, False)]:.0f})")
EOF
  { echo; echo "## Goals (issue 11)"; echo; cat "$OUT/goals.md"; } >>"$REPORT"
fi

say ""
say "Result: $([ $status -eq 0 ] && echo 'all steps passed' || echo 'SOME STEPS FAILED') (total $SECONDS s)$([ "$DRY" = 1 ] && echo '; DRY RUN: nothing was measured on a GPU')"
echo "[gpu_check] report: $REPORT" >&2
exit $status
