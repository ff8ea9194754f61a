#!/usr/bin/env bash
# Creates ./.venv with the pinned CPU stack and installs kt_regroup into it (editable),
# which compiles the op library kt_regroup/_C.so. Re-running is cheap: it skips the
# install while this script, the requirement files, the build files and the C++ sources
# are unchanged (a change to how it installs reinstalls an existing .venv too).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
stamp=.venv/.kt_regroup_installed
want=$(find scripts/setup_env.sh requirements/cpu.txt requirements/constraints.txt pyproject.toml setup.py kt_regroup/csrc -type f | sort | xargs cat | sha256sum | cut -d' ' -f1)

if [ ! -x .venv/bin/python ]; then
  echo "[kt_regroup] creating .venv"
  "$PYTHON" -m venv .venv
fi
# shellcheck disable=SC1091
. .venv/bin/activate

if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "[kt_regroup] installing the pinned CPU stack into .venv (torch 2.13.0, fbgemm-gpu-cpu 1.8.0, torchrec 1.9.2)"
  python -m pip install -q --upgrade pip
  # --no-compile, then compileall on every core: pip compiles one file at a time (~40 s on
  # 2 cores against ~12 s). The bytecode is written here, not left to the first import:
  # under PYTHONDONTWRITEBYTECODE (set on our CI machine) every process would parse
  # torch and torchrec again (`import torchrec` 10.7 s against 2.9 s).
  python -m pip install -q --no-compile -c requirements/constraints.txt -r requirements/cpu.txt
  python -m pip install -q --no-compile --no-deps torchrec==1.9.2
  # torch ships one test file in Python 3.12 syntax (-x skips it); any other failure stops setup.
  python -m compileall -q -j 0 -x 'torch/testing/_internal/py312_intrinsics\.py$' \
    "$(python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
  echo "[kt_regroup] building and installing kt_regroup (compiles kt_regroup/_C.so, 1-3 minutes)"
  python -m pip install -q -c requirements/constraints.txt --no-build-isolation --no-deps -e .
  echo "$want" >"$stamp"
fi

# The benchmark's step section also runs under jemalloc and tcmalloc (LD_PRELOAD). Best
# effort: without root (or password-less sudo) or apt-get, the benchmark reports them missing.
if ! ldconfig -p 2>/dev/null | grep -q 'libjemalloc.so.2 ' ||
   ! ldconfig -p 2>/dev/null | grep -q 'libtcmalloc_minimal.so.4 '; then
  sudo=""
  if [ "$(id -u)" -ne 0 ]; then sudo="sudo -n"; fi
  pkgs="libjemalloc2 libtcmalloc-minimal4"
  if command -v apt-get >/dev/null && { [ -z "$sudo" ] || command -v sudo >/dev/null; }; then
    echo "[kt_regroup] installing $pkgs (optional: the benchmark's allocators)"
    # shellcheck disable=SC2086  # $pkgs: two words
    { $sudo apt-get install -y -q $pkgs || { $sudo apt-get update -q && $sudo apt-get install -y -q $pkgs; }; } \
      >/dev/null 2>&1 || echo "[kt_regroup] could not install $pkgs: the benchmark reports them missing"
  fi
fi
