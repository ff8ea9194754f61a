#!/usr/bin/env bash
# Creates ./.venv with the pinned CPU stack, installs kt_regroup into it (editable) and
# builds the native CPU kernel. Re-running is cheap: it skips the install while the
# requirement files and pyproject.toml are unchanged.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
stamp=.venv/.kt_regroup_installed
want=$(cat requirements/cpu.txt requirements/constraints.txt pyproject.toml | sha256sum | cut -d' ' -f1)

if [ ! -x .venv/bin/python ]; then
  echo "[kt_regroup] creating .venv"
  "$PYTHON" -m venv .venv
fi
# shellcheck disable=SC1091
. .venv/bin/activate

if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "[kt_regroup] installing the pinned CPU stack into .venv (torch 2.13.0, fbgemm-gpu-cpu 1.8.0, torchrec 1.9.2)"
  python -m pip install -q --upgrade pip
  python -m pip install -q -c requirements/constraints.txt -r requirements/cpu.txt
  python -m pip install -q --no-deps torchrec==1.9.2
  python -m pip install -q -c requirements/constraints.txt --no-build-isolation --no-deps -e .
  echo "$want" >"$stamp"
fi

# Build (or reuse the cached build of) the native CPU kernel; the package works
# without it (portable kernel, one warning), so a failed build is not fatal here.
python -m kt_regroup.kernels.cpu || echo "[kt_regroup] native CPU kernel not built; using the portable kernel"
