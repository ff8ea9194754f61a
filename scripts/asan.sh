#!/usr/bin/env bash
# Builds kt_regroup's op library with AddressSanitizer into build/asan (never over
# kt_regroup/_C.so) and runs a sample of tests/test_fuzz.py's cases against it.
#   scripts/asan.sh [CASES] [FIRST]     (default 3000 cases from seed 0)
# Any ASan report aborts the child (exit != 0) and prints the case that caused it.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
CASES=${1:-3000}
FIRST=${2:-0}
OUT=build/asan
SITE=$OUT/site

LIB=$SITE/kt_regroup/_C.so
# The Python package without its library or sources; the ASan library goes next to it.
"$PY" - "$SITE" <<'PYEOF'
import shutil, sys
shutil.copytree("kt_regroup", f"{sys.argv[1]}/kt_regroup", dirs_exist_ok=True,
                ignore=shutil.ignore_patterns("_C*.so", "__pycache__", "csrc"))
PYEOF
read -r INCLUDES LIBDIR ABI < <("$PY" -c '
import torch
from torch.utils.cpp_extension import include_paths, library_paths
print(",".join(include_paths()), library_paths()[0], int(torch._C._GLIBCXX_USE_CXX11_ABI))')
if [ -f "$LIB" ] && [ -z "$(find kt_regroup/csrc -newer "$LIB")" ]; then
  echo "asan: $LIB is up to date"
else
  echo "asan: building $LIB (a few minutes)"
  ${CXX:-c++} -std=c++20 -shared -fPIC -O1 -g -fno-omit-frame-pointer -fsanitize=address \
  -fopenmp -D_GLIBCXX_USE_CXX11_ABI="$ABI" $(sed 's/^/-I/; s/,/ -I/g' <<<"$INCLUDES") \
  kt_regroup/csrc/*.cpp -o "$LIB" \
  -L"$LIBDIR" -lc10 -ltorch -ltorch_cpu -Wl,-rpath,"$LIBDIR"
fi

# libstdc++ preloaded too: ASan's __cxa_throw interceptor needs it resolved at start-up.
LIBASAN="$(${CXX:-c++} -print-file-name=libasan.so) $(${CXX:-c++} -print-file-name=libstdc++.so)"
echo "asan: $CASES fuzz cases from seed $FIRST, LD_PRELOAD=$LIBASAN"
# Python and libtorch are not instrumented: no leak check; huge sizes make allocations
# fail (a Python exception), as they do without ASan.
LOG=$OUT/fuzz.log
set +e
LD_PRELOAD="$LIBASAN" PYTHONPATH="$SITE" \
  ASAN_OPTIONS=detect_leaks=0:allocator_may_return_null=1:halt_on_error=1:abort_on_error=1 \
  "$PY" tests/test_fuzz.py --first "$FIRST" --cases "$CASES" >"$LOG" 2>&1
rc=$?
set -e
grep -v '^case [0-9]*$' "$LOG" | tail -n 40
if [ $rc -ne 0 ]; then
  echo "asan: FAILED (exit $rc) in $(grep '^case [0-9]*$' "$LOG" | tail -n 1); full log: $LOG"
  exit 1
fi
grep -q "^library $PWD/$SITE/kt_regroup/_C.so" "$LOG" || { echo "asan: the ASan library was not loaded"; exit 1; }
if grep -q DEFECT "$LOG"; then echo "asan: defects found (see $LOG)"; exit 1; fi
echo "asan: $CASES cases, no ASan report, no defect"
