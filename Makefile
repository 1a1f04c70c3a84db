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

.PHONY: test bench install clean

test: $(INSTALL_STAMP)
	$(PY) -m pytest tests

bench: $(INSTALL_STAMP)
	$(PY) -m bench $(BENCH_ARGS)

install: $(INSTALL_STAMP)

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
