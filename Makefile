# The two entry points of the README. Each one sets up .venv first (scripts/setup_env.sh is a no-op when done).
NPROC ?= 4
PY := .venv/bin/python

.PHONY: setup train test test-fast lint format

setup:
	bash scripts/setup_env.sh

train: setup
	$(PY) -m torch.distributed.run --standalone --nproc-per-node $(NPROC) examples/train_gpt.py $(ARGS)

lint: setup
	$(PY) -m ruff check meshpar tests examples benchmarks
	$(PY) -m ruff format --check meshpar tests examples benchmarks

test: setup lint
	$(PY) -m pytest -q $(ARGS)

# the edit loop's tier (under 6 minutes on 2 cores): everything not marked slow (see tests/conftest.py)
test-fast: setup lint
	$(PY) -m pytest -q -m "not slow" $(ARGS)

format: setup
	$(PY) -m ruff format meshpar tests examples benchmarks
	$(PY) -m ruff check --fix meshpar tests examples benchmarks
