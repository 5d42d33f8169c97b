# The two set-up commands of the README. Both install into the active Python
# environment (a virtualenv if one is active). torch is installed only where it
# is absent, as torch==2.13.0, so a user's own torch is kept.

PYTHON ?= python3
PIP := $(PYTHON) -m pip
PHOENIX_VENV ?= .ci/.phoenix-venv
# the Phoenix release the end-to-end tests were written against
PHOENIX_VERSION ?= ==20.26.1
# What the tests install is pinned (pip constraints), so that a new upstream release cannot turn
# `make test` red on a commit that changed nothing. `make lock` refreshes both files; otel-gpu's
# own dependency ranges in pyproject.toml stay ranges.
TEST_CONSTRAINTS ?= .ci/constraints-test.txt
PHOENIX_CONSTRAINTS ?= .ci/constraints-phoenix.txt
LATEST_VENV ?= .ci/.latest-venv

.PHONY: demo test test-quick test-gpu test-latest install install-test lint lock gpu-kit

install:
	@$(PYTHON) -c "import torch" 2>/dev/null || $(PIP) install torch==2.13.0
	$(PIP) install -q -e .

## demo: install otel-gpu and run the demo workload at level 5 on the console
demo: install
	$(PYTHON) -m otel_gpu demo

# FlashInfer's real package for the tests of its target: with --no-deps, because a plain install
# pulls CUDA packages a CPU run never imports; these three are what it needs to import on CPU.
FLASHINFER_PKGS ?= flashinfer-python==0.7.2.post1 apache-tvm-ffi==0.1.15.post2 tqdm

install-test:
	@echo "==> installing otel-gpu with its test dependencies and FlashInfer, pinned by $(TEST_CONSTRAINTS) (pip; torch only if absent)"
	@$(PYTHON) -c "import torch" 2>/dev/null || $(PIP) install -c $(TEST_CONSTRAINTS) torch==2.13.0
	$(PIP) install -q -c $(TEST_CONSTRAINTS) -e ".[test]"
	$(PIP) install -q -c $(TEST_CONSTRAINTS) --no-deps $(FLASHINFER_PKGS)

lint: install-test
	@echo "==> lint: ruff check, ruff format --check, mypy, the import layers (lint-imports)"
	$(PYTHON) -m ruff check .
	$(PYTHON) -m ruff format --check .
	$(PYTHON) -m mypy
	$(PYTHON) .ci/lint_layers.py

## test: install what the tests need (Phoenix in its own venv) and run every test
test: lint
	@echo "==> installing arize-phoenix$(PHOENIX_VERSION) into $(PHOENIX_VENV), the end-to-end tests' backend (an existing install is kept)"
	PHOENIX_VENV=$(PHOENIX_VENV) PHOENIX_VERSION="$(PHOENIX_VERSION)" PHOENIX_CONSTRAINTS=$(abspath $(PHOENIX_CONSTRAINTS)) bash .ci/install-phoenix.sh
	@echo "==> the full test suite, end-to-end Phoenix tests included: about 20 minutes on 2 cores, pytest shows progress"
	OTEL_GPU_TEST_PHOENIX=$(abspath $(PHOENIX_VENV))/bin/phoenix $(PYTHON) -m pytest tests --benchmark-disable

## test-quick: the tests without the end-to-end Phoenix suite
test-quick: install-test
	@echo "==> the test suite without the end-to-end Phoenix tests"
	$(PYTHON) -m pytest tests -m "not e2e" --benchmark-disable -q

## test-gpu: the GPU suite (tests/gpu): real CUDA graphs, host syncs, pinned copies, NVML.
## Needs torch with CUDA and an NVIDIA GPU; without one every test reports a skip (docs/gpu.md).
test-gpu: install-test
	@$(PYTHON) -c "import torch; print('==> the GPU suite on', torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'no CUDA device: every test is skipped')"
	$(PYTHON) -m pytest tests/gpu -v -rs -p no:cacheprovider --benchmark-disable

## gpu-kit: the wheels a GPU machine with no network lacks (CPython 3.12, manylinux x86_64;
## GPU_KIT_PYTHON=3.11 for another), into .gpu-kit/; there, `bash tests/gpu/run.sh` runs the
## GPU suite on the machine's own torch (docs/gpu.md)
gpu-kit:
	PYTHON=$(PYTHON) bash .ci/gpu-kit.sh

## test-latest: the tests (without Phoenix) on the newest releases of every test dependency,
## unpinned, in a virtualenv of its own ($(LATEST_VENV)): shows the day an upstream release breaks
## something, before `make lock` pins it. Not part of CI, which must not change with the registries.
test-latest:
	@echo "==> the newest releases of the test dependencies, unpinned, into $(LATEST_VENV)"
	@[ -x $(LATEST_VENV)/bin/python ] || $(PYTHON) -m venv $(LATEST_VENV)
	@$(LATEST_VENV)/bin/python -c "import torch" 2>/dev/null || $(LATEST_VENV)/bin/python -m pip install torch==2.13.0
	$(LATEST_VENV)/bin/python -m pip install -q --upgrade -e ".[test]"
	$(LATEST_VENV)/bin/python -m pip install -q --upgrade --no-deps flashinfer-python apache-tvm-ffi tqdm
	@$(LATEST_VENV)/bin/python -m pip list 2>/dev/null | grep -i -E "^(transformers|flashinfer-python|opentelemetry-sdk|torch) "
	$(LATEST_VENV)/bin/python -m pytest tests -m "not e2e" --benchmark-disable -q

## lock: refresh the pinned test dependencies ($(TEST_CONSTRAINTS), $(PHOENIX_CONSTRAINTS))
lock:
	PYTHON=$(PYTHON) PHOENIX_VERSION="$(PHOENIX_VERSION)" FLASHINFER_PKGS="$(FLASHINFER_PKGS)" bash .ci/lock.sh
