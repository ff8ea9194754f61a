#!/usr/bin/env bash
# Fills .whl/ (gitignored) with the wheels the lent GPU machine lacks, for
# `scripts/gpu_check.sh --offline`. Run it on a machine that reaches PyPI.
#
# The machine (Python 3.12, torch 2.11.0+cu130, triton 3.6.0) has no torchrec, fbgemm_gpu
# or tensordict. The set is FBGEMM's release for torch 2.11 and the torchrec that imports
# with it: torchrec 1.9.2 (and 1.7, 1.8) import fbgemm_gpu.tbe.monitoring, which
# fbgemm-gpu-cpu 1.6.0 lacks, and fbgemm-gpu-cpu 1.7.0 does not load on torch 2.11.
# torchrec goes in with --no-deps: its metadata asks for the CUDA fbgemm-gpu, which the
# CPU build replaces (its CPU ops are what torchrec needs to import).
#
# Then it checks that the set is complete: every requirement of a carried wheel (markers
# read for CPython 3.12 on Linux) is carried, or is on the machine (the device notes'
# package list, below), or is one this set replaces on purpose.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
WHEELS=(torchrec==1.6.1 tensordict==0.15.3 fbgemm-gpu-cpu==1.6.0 torchmetrics==1.0.3
        pyvers==0.2.3)
# What the machine's image has that the wheels above need (/work/.library/device/KINDS.md).
ON_MACHINE="torch numpy cloudpickle packaging lightning-utilities tqdm pyre-extensions
            typing-extensions typing-inspect mypy-extensions"
# fbgemm-gpu: replaced by fbgemm-gpu-cpu. iopath: only torchrec.datasets imports it.
REPLACED="fbgemm-gpu iopath"

rm -rf .whl
mkdir -p .whl
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d .whl "${WHEELS[@]}"

"$PY" - "$ON_MACHINE" "$REPLACED" .whl/*.whl <<'EOF'
import re, sys, zipfile
try:
    from packaging.requirements import Requirement
except ImportError:
    from pip._vendor.packaging.requirements import Requirement

norm = lambda name: re.sub(r"[-_.]+", "-", name).lower()
on_machine = {norm(n) for n in sys.argv[1].split()}
replaced = {norm(n) for n in sys.argv[2].split()}
env = {"python_version": "3.12", "python_full_version": "3.12.3", "sys_platform": "linux",
       "platform_system": "Linux", "platform_machine": "x86_64", "extra": ""}
carried, needs = set(), {}
for path in sys.argv[3:]:
    with zipfile.ZipFile(path) as whl:
        meta = next(n for n in whl.namelist() if n.endswith(".dist-info/METADATA"))
        lines = whl.read(meta).decode().splitlines()
    name = norm(next(line.split(":", 1)[1].strip() for line in lines if line.startswith("Name:")))
    carried.add(name)
    for line in lines:
        if line.startswith("Requires-Dist:"):
            req = Requirement(line.split(":", 1)[1])
            if req.marker is None or req.marker.evaluate(env):
                needs.setdefault(norm(req.name), []).append(name)
missing = {n: by for n, by in needs.items() if n not in carried | on_machine | replaced}
if missing:
    sys.exit("gpu_wheels: incomplete, neither carried nor on the machine: "
             + ", ".join(f"{n} (needed by {', '.join(by)})" for n, by in sorted(missing.items())))
print(f"gpu_wheels: complete: {len(carried)} wheels; from the machine: "
      + ", ".join(sorted(n for n in needs if n in on_machine - carried))
      + "; replaced on purpose: " + ", ".join(sorted(n for n in needs if n in replaced)))
EOF
total=$(du -cb .whl/*.whl | tail -1 | cut -f1)
ls -l .whl
echo "gpu_wheels: $(ls .whl | wc -l) wheels, $((total / 1024)) KiB"
if ((total > 60 * 1024 * 1024)); then
  echo "gpu_wheels: over 60 MiB: the device tool carries 64 MiB with the working tree" >&2
  exit 1
fi
