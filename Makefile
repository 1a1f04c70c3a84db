# The front door: `make test` and `make bench` set everything up from nothing
# (venv, pinned torch, the package and its extension) and are incremental.

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
# Stamps record finished steps so a second run skips them. The install is editable, so
# Python edits need no reinstall; C++/CUDA edits rebuild incrementally (ninja).
DEPS_STAMP    := $(VENV)/.deps-installed
INSTALL_STAMP := $(VENV)/.pyembed-installed
BUILD_INPUTS  := setup.py pyproject.toml pyembed/_cuda_home.py $(shell find csrc -type f 2>/dev/null)

.PHONY: test bench install clean gpu-check

test: $(INSTALL_STAMP)
	$(PY) -m pytest tests

bench: $(INSTALL_STAMP)
	$(PY) -m bench $(BENCH_ARGS)

install: $(INSTALL_STAMP)

# GPU machines (DESIGN §6): the machine's own python3 with its CUDA torch, no venv, no
# network. Builds for the visible GPU only, runs tests/ + tests/gpu/, compute-sanitizer
# and the GPU benchmark; everything lands in $(GPU_CHECK_OUT). Exits 2 without a GPU.
GPU_CHECK_OUT ?= gpu-check
gpu-check:
	$(PYTHON) tests/gpu/gpu_check.py --out $(GPU_CHECK_OUT) $(GPU_CHECK_ARGS)

$(PY):
	$(PYTHON) -m venv $(VENV)

$(DEPS_STAMP): requirements-dev.txt | $(PY)
	$(PIP) install -r requirements-dev.txt
	touch $@

$(INSTALL_STAMP): $(DEPS_STAMP) $(BUILD_INPUTS)
	$(PIP) install --no-build-isolation --no-deps -e .
	touch $@

clean:
	rm -rf build *.egg-info pyembed/*.so
