# Two entry points; each one sets up ./.venv first (see scripts/setup_env.sh).
#   make bench   - the regroup benchmark (scattered seed-size layout, CPU), tables on stdout
#   make test    - the test suite
.PHONY: bench test setup
BENCH_ARGS ?=
PYTEST_ARGS ?=

setup:
	./scripts/setup_env.sh

bench: setup
	.venv/bin/python -m kt_regroup.bench $(BENCH_ARGS)

test: setup
	.venv/bin/python -m pytest -q $(PYTEST_ARGS)
