#!/usr/bin/env bash
# GPU check for kt_regroup (issue 11): CUDA stack, CUDA tests, CUDA-graph capture of one
# training step, and the benchmark table, written to $OUT (default gpu_check_results/).
# Target: under 5 minutes on one GPU once the wheels are downloaded.
#
# DRAFT (phase 1 of issue 11). Assumptions, to check or finish in phase 2:
#  * Linux x86_64, an NVIDIA GPU and a driver for the CUDA 12 wheels that PyPI's
#    torch==2.13.0 is built with; python3.10+.
#  * Stack: torch==2.13.0 (PyPI's default Linux wheel is the CUDA build), the CUDA
#    fbgemm-gpu==1.8.0 (same release as the CPU stack's fbgemm-gpu-cpu), torchrec==1.9.2
#    (--no-deps, its other needs from requirements/cpu.txt), triton==3.9.0 unless torch
#    brought its own (the version torch pins wins; it is printed).
#  * No network on the machine (as on the lent device machines): set PYTHON to an
#    interpreter that already has that stack, and KT_GPU_CHECK_INSTALL=0.
#  * Phase 2 provides: the Triton backend behind torch.ops.kt_regroup.* on CUDA
#    (KT_REGROUP_BACKEND=triton|fbgemm|auto, kt_regroup.backend("cuda") == "triton"),
#    CUDA cases in the op/module tests, and `python -m kt_regroup.bench --device_type cuda`
#    (FBGEMM's op, torchrec's Triton op if present, KeyedTensor.regroup, a device copy of
#    the same bytes; P50/P90 from CUDA events, peak memory).
#  * TODO(phase 2): the test list and bench flags below; paste $OUT/gpu_check.md into the
#    closing note of issue 11.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_check_results}
INSTALL=${KT_GPU_CHECK_INSTALL:-1}
VENV=${VENV:-.venv-cuda}
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

say "# kt_regroup GPU check ($(date -u +%Y-%m-%dT%H:%MZ), commit $(git rev-parse --short HEAD 2>/dev/null))"

# --- 1. the CUDA stack --------------------------------------------------------------------
if [ "$INSTALL" = 1 ]; then
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

step environment 60 "$PY" -c '
import torch, kt_regroup
assert torch.cuda.is_available(), "no CUDA device"
print(torch.cuda.get_device_name(), "torch", torch.__version__, "cuda", torch.version.cuda)
for name in ("triton", "fbgemm_gpu", "torchrec"):
    try:
        print(name, __import__(name).__version__)
    except Exception as e:  # reported, the steps that need it fail on their own
        print(name, "unavailable:", e)
print("kt_regroup.backend(cuda) =", kt_regroup.backend("cuda"))
' || { tail -n 30 "$OUT/environment.log"; exit 1; }
head -n -1 "$OUT/environment.log" | sed 's/^/    /' >>"$REPORT"

# --- 2. tests on CUDA (no TRITON_INTERPRET: the kernels are compiled and run) ---------------
# TODO(phase 2): add the op/module test files once they have CUDA cases.
step tests 150 env -u TRITON_INTERPRET "$PY" -m pytest -q -x -p no:cacheprovider \
  tests/test_triton.py

# --- 3. one training step: no host sync, captured in a CUDA graph, replayed ---------------
step cuda_graph 60 "$PY" - <<'EOF'
import torch
from torchrec.sparse.jagged_tensor import KeyedTensor
import kt_regroup

torch.manual_seed(0)
dev = torch.device("cuda")
B, keys = 256, [[f"d{i}" for i in range(4)], [f"s{i}" for i in range(16)]]
lengths = [[64] * 4, [128] * 16]
groups = [keys[0] + keys[1][:8], keys[1][8:] + [keys[0][0]]]  # one duplicated key
regroup = kt_regroup.KTRegroupAsDict(groups=groups, keys=["user", "item"]).to(dev)
towers = torch.nn.ModuleDict({
    "user": torch.nn.Linear(sum(lengths[0]) + 8 * 128, 1),
    "item": torch.nn.Linear(8 * 128 + 64, 1),
}).to(dev)
emb = [torch.randn(B, sum(w), device=dev, requires_grad=True) for w in lengths]
opt = torch.optim.SGD(list(towers.parameters()) + emb, lr=0.1)

def step():
    kts = [KeyedTensor(keys=k, length_per_key=w, values=e) for k, w, e in zip(keys, lengths, emb)]
    out = regroup(kts)
    loss = sum(towers[k](v).square().mean() for k, v in out.items())
    opt.zero_grad(set_to_none=False)
    loss.backward()
    opt.step()
    return loss

side = torch.cuda.Stream()
side.wait_stream(torch.cuda.current_stream())
with torch.cuda.stream(side):
    for _ in range(3):  # compile kernels, build the plan, warm the allocator
        step()
torch.cuda.current_stream().wait_stream(side)
torch.cuda.set_sync_debug_mode("error")  # any host sync in a step raises from here on
step()
torch.cuda.set_sync_debug_mode("default")
state = [t.detach().clone() for t in list(towers.parameters()) + emb]
graph = torch.cuda.CUDAGraph()
with torch.cuda.graph(graph):
    static_loss = step()
# The capture did not run the step: restore, replay once, compare with one eager step.
with torch.no_grad():
    for t, s in zip(list(towers.parameters()) + emb, state):
        t.copy_(s)
graph.replay()
replayed = [t.detach().clone() for t in list(towers.parameters()) + emb]
with torch.no_grad():
    for t, s in zip(list(towers.parameters()) + emb, state):
        t.copy_(s)
eager_loss = step()
torch.cuda.synchronize()
torch.testing.assert_close(static_loss, eager_loss)  # cuBLAS may pick other kernels
for a, b in zip(replayed, list(towers.parameters()) + emb):
    torch.testing.assert_close(a, b)
print("one training step captured in a CUDA graph; replay equals eager; no host sync")
EOF

# --- 4. the benchmark (seed layout, both duplicate settings, fwd and fwd+bwd) --------------
# TODO(phase 2): flags once --device_type cuda lands (time limit, providers).
step bench 170 "$PY" -m kt_regroup.bench --device_type cuda --output "$OUT/bench" \
  --time_limit_s 150 --no_progress
if [ -f "$OUT/bench/table.md" ]; then
  { echo; echo "## Benchmark"; echo; cat "$OUT/bench/table.md"; } >>"$REPORT"
fi

say ""
say "Result: $([ $status -eq 0 ] && echo 'all steps passed' || echo 'SOME STEPS FAILED') (total $SECONDS s)"
echo "[gpu_check] report: $REPORT" >&2
exit $status
