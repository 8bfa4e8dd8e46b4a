# TrainMover developer commands. Each target works from a fresh clone with python3 and make.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: install system-deps test test-long demo bench lint schemas clean

# The Python environment and the Debian programs the tests run (tools/system-deps.sh).
install: $(STAMP) system-deps

system-deps:
	@tools/system-deps.sh

# torch first: the CPU wheel 2.13.0 when none is present (a newer torch would be a
# multi-GB CUDA download); a torch already in the environment is kept.
$(STAMP): pyproject.toml setup.py
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "torch==2.13.0"
	$(PY) -m pip install -q --no-deps "torchft-nightly==2026.10.26"
	$(PY) -m pip install -q -e ".[dev,bench]"
	touch $(STAMP)

# One pytest-xdist stream per core, at most 4: the end-to-end tests wait on real time
# (jobs training, detection windows) more than they compute. TEST_STREAMS=0: one process.
# `test` leaves out the tests marked long (whole-product scenarios of minutes each:
# demos, soaks, benchmark smokes, bus and store faults, hangs); `test-long` runs only those.
# CI runs both.
TEST_STREAMS ?= auto
PYTEST := $(PY) -m pytest -q -n $(TEST_STREAMS) --maxprocesses=4 --dist loadgroup --no-loadscope-reorder
test: install
	$(PYTEST) -m "not long"

test-long: install
	$(PYTEST) -m long

demo: $(STAMP)
	$(VENV)/bin/trainmover demo --json demo.json

# All three benchmarks at their defaults (tens of minutes on 2 shared cores); each one
# alone: trainmover bench downtime|rebalance|scale --json FILE (docs/benchmarks.md).
bench: $(STAMP)
	$(VENV)/bin/trainmover bench

lint: $(STAMP)
	$(VENV)/bin/ruff check shared services tests tools examples
	$(VENV)/bin/ruff format --check shared services tests tools examples
	$(PY) tools/mypy_check.py
	$(PY) -m trainmover.schemas --check

schemas: $(STAMP)
	$(PY) -m trainmover.schemas

clean:
	rm -rf $(VENV) .build .pytest_cache .mypy_cache .ruff_cache
