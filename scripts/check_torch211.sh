#!/usr/bin/env bash
# The suite against torch 2.11 (the lent GPU machine's torch), apart from ./.venv and its
# torch 2.13 build: a venv of its own (requirements/torch211.txt, torchrec 1.6.1), the
# sources copied to build/torch211/src and the library built there in place. Not part of
# `make test` (CI): the venv is a ~3 GB download, the build and suite take 15-25 minutes
# on 2 cores.
#
# Usage: scripts/check_torch211.sh [PYTEST ARGS...]    (make test-torch211)
# Environment: VENV (default .venv-torch211; an existing one is reused as it is), MAX_JOBS.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv-torch211}
PY=$VENV/bin/python
if [ ! -x "$PY" ]; then
  echo "[torch211] creating $VENV (torch 2.11.0, fbgemm-gpu-cpu 1.6.0, torchrec 1.6.1)"
  python3 -m venv "$VENV"
  "$PY" -m pip install -q --upgrade pip
  "$PY" -m pip install -q -r requirements/torch211.txt
  "$PY" -m pip install -q --no-deps torchrec==1.6.1
fi
PY=$(cd "$VENV" && pwd)/bin/python
"$PY" -c 'import torch; v = torch.__version__; assert v.startswith("2.11."), v'

# torch 2.11 from PyPI is a CUDA build: its CMake package (the C++ predictor of
# tests/test_deploy.py) and CUDA sources need the CUDA toolkit itself, and an `nvcc` on
# PATH may be a wrapper outside it (torch then guesses /usr/local).
if [ -z "${CUDA_PATH:-}" ] && [ -d /usr/local/cuda/include ]; then
  export CUDA_PATH=/usr/local/cuda
fi
[ -n "${CUDA_HOME:-}" ] || [ -z "${CUDA_PATH:-}" ] || export CUDA_HOME=$CUDA_PATH

# The working tree's files (tracked and new, not ignored), their times kept: the object
# files in build/torch211/temp are reused where a source did not change.
SRC=build/torch211/src
rm -rf "$SRC" && mkdir -p "$SRC"
git ls-files -co --exclude-standard | tar -cf - --ignore-failed-read -T - 2>/dev/null \
  | tar -xf - -C "$SRC"
cd "$SRC"
echo "[torch211] building the library against $("$PY" -c 'import torch; print(torch.__version__)')"
MAX_JOBS=${MAX_JOBS:-1} "$PY" setup.py -q build_ext --inplace --build-temp ../temp
PYTHONPATH=$PWD exec "$PY" -m pytest -q -p no:cacheprovider "$@"
