#!/usr/bin/env bash
# Fills .whl/ (gitignored) with the wheels the lent GPU machine lacks, for
# `scripts/gpu_check.sh --offline`: torchrec, tensordict and fbgemm-gpu-cpu built for
# that machine's torch 2.11 / Python 3.12. Run on a machine with network access.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
mkdir -p .whl
common=(--no-deps --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64
        --platform manylinux_2_28_x86_64 --implementation cp -d .whl)
"$PY" -m pip download "${common[@]}" torchrec==1.9.2 tensordict==0.15.3 fbgemm-gpu-cpu==1.6.0 \
    torchmetrics==1.0.3 pyre-extensions==0.0.32 typing-inspect mypy-extensions lightning-utilities
du -sh .whl
total=$(du -sb .whl | cut -f1)
if (( total > 64 * 1024 * 1024 )); then echo "gpu_wheels: .whl is over 64 MiB" >&2; exit 1; fi
ls -l .whl
