# Build the virtual environment from nothing, then run the demo or the tests.
# TORCH=cpu (default) installs the CPU wheel torch==$(TORCH_VERSION);
# TORCH=cuda installs the default (CUDA) build from the package index for GPU workers.
PYTHON ?= python3
VENV ?= .venv
TORCH ?= cpu
TORCH_VERSION ?= 2.13.0
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-$(TORCH)
SHARED ?= ../shared
JASPER := $(SHARED)/datasets/jasper_ridge
DEMO_DIR ?= runs/demo

.PHONY: setup test lint demo bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
ifeq ($(TORCH),cuda)
	$(PY) -m pip install --quiet torch
else
	$(PY) -m pip install --quiet torch==$(TORCH_VERSION)
endif
	$(PY) -m pip install --quiet -e '.[dev]'
	rm -f $(VENV)/.installed-*
	touch $(STAMP)

test: setup
	$(PY) -m ruff check .
	$(PY) -m mypy
	$(PY) -m pytest -q -ra

lint: setup
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

demo: setup
	$(PY) -m launch.demo --shared $(SHARED) --out $(DEMO_DIR)

bench: setup
	$(PY) bench/wire.py
	$(PY) bench/sync_round.py

clean:
	rm -rf $(VENV) runs .pytest_cache .ruff_cache *.egg-info
