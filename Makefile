# Two entry points; each one sets up ./.venv first (see scripts/setup_env.sh).
#   make bench   - the regroup benchmark (training step, serving, op alone), tables on stdout
#   make test    - the test suite, on every core (pytest-xdist; PYTEST_XDIST= runs it in one process)
#   make lint    - ruff check (configured in pyproject.toml) and clang-format --dry-run
#                  of the C++ sources (.clang-format)
#   make format  - clang-format the C++ sources in place
#   make asan    - the op library built with AddressSanitizer (build/asan), fuzz cases run on it
#   make test-torch211 - the suite against torch 2.11 in .venv-torch211 (not in CI: a ~3 GB
#                  venv, 15-25 min; scripts/check_torch211.sh)
.PHONY: bench test setup asan lint format test-torch211
BENCH_ARGS ?=
PYTEST_ARGS ?=
# Each test file runs on one worker, so its module-scoped fixtures (builds, exports, a
# benchmark run) are made once.
PYTEST_XDIST ?= -n auto --dist loadfile
ASAN_CASES ?= 3000

setup:
	./scripts/setup_env.sh

bench: setup
	.venv/bin/python -m benchmarks.regroup $(BENCH_ARGS)

test: setup
	.venv/bin/python -m pytest -q $(PYTEST_XDIST) $(PYTEST_ARGS)

CPP_SOURCES = $(wildcard kt_regroup/csrc/*.cpp kt_regroup/csrc/*.h kt_regroup/csrc/cuda/*.cu kt_regroup/csrc/cuda/*.cuh tests/*.cpp)

lint: setup
	.venv/bin/ruff check kt_regroup tests benchmarks examples
	.venv/bin/clang-format --dry-run -Werror $(CPP_SOURCES)

format: setup
	.venv/bin/clang-format -i $(CPP_SOURCES)

asan: setup
	./scripts/asan.sh $(ASAN_CASES)

test-torch211:
	./scripts/check_torch211.sh $(PYTEST_ARGS)
