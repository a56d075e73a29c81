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
# Extra pytest options, e.g. PYTEST_ARGS="--require data,browser,slurm,netns,cgroup,profiler,tmpfs" (.ci/run).
PYTEST_ARGS ?=
# Processes the fast lane runs its tests in (pytest-xdist).
TEST_JOBS ?= 2

.PHONY: setup test test-fast lint cli-doc demo bench clean ci-deps slurm-testbed slurm-testbed-down

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

# System packages the CI needs: Debian's Chromium and ChromeDriver for the browser test
# (--require browser in .ci/run); installed only where missing, with a bounded wait for
# the dpkg lock.
ci-deps:
	@if command -v chromium >/dev/null && command -v chromedriver >/dev/null; then \
		echo "chromium and chromedriver present"; \
	else \
		apt-get -o DPkg::Lock::Timeout=300 update -q && \
		DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=300 install -y -q \
			chromium chromium-driver; \
	fi

# The whole suite in three lanes: the unit tests that are not marked slow (as test-fast); the
# slow unit tests and the end-to-end tests (tests/e2e/, which start processes) that are not
# marked exclusive, also in $(TEST_JOBS) processes, a module's tests in one (module-scoped
# runs are made once); then the exclusive ones, which time what they run or use a machine-wide
# resource, one at a time.
test: setup
	$(PY) -m ruff check .
	$(PY) -m mypy
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -ra -m "unit and not slow" -n $(TEST_JOBS) $(PYTEST_ARGS)
	$(PY) -m pytest -q -ra --durations=25 -m "not (unit and not slow) and not exclusive" \
		-n $(TEST_JOBS) --dist loadfile $(PYTEST_ARGS)
	$(PY) -m pytest -q -ra --durations=25 -m exclusive $(PYTEST_ARGS)

# The unit tests that are not marked slow, in $(TEST_JOBS) processes of one compute thread
# each (more threads than cores make torch's OpenMP workers spin against each other).
test-fast: setup
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -ra -m "unit and not slow" -n $(TEST_JOBS) $(PYTEST_ARGS)

lint: setup
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(PY) -m mypy
	$(PY) -m launch.cli_doc --check

# docs/cli.md's option tables, regenerated from the commands.
cli-doc: setup
	$(PY) -m launch.cli_doc

demo: setup
	$(PY) -m launch.demo --shared $(SHARED) --out $(DEMO_DIR) --overwrite

# Every bench run docs/results.md cites, again with its own command (BENCH=name for one bench's;
# hours for all: the multi-host ones need root), then docs/results.md rendered from the results.
bench: setup
	$(PY) -m bench rerun $(BENCH)
	$(PY) -m bench report

# A real Slurm on this machine for the tests marked 'slurm' (needs root: installs Debian's
# slurm-wlm and munge when missing, starts a controller and 3 nodes on 127.0.0.1). The tests
# only use a testbed started here; they start and install nothing.
slurm-testbed:
	bash launch/slurm/testbed.sh up

slurm-testbed-down:
	bash launch/slurm/testbed.sh down

clean:
	rm -rf $(VENV) runs .pytest_cache .ruff_cache *.egg-info
