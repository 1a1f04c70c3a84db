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
BUILD_INPUTS  := setup.py pyproject.toml pyembed/_cuda_home.py pyembed/_libstdcxx.py pyembed/_sources.py \
	$(shell find csrc -type f 2>/dev/null)

.PHONY: test bench install clean gpu-check gpu-prepare test-compat test-gpu-stack

# A pytest-xdist worker per core, 8 at most (~1 GB each; TEST_WORKERS=N chooses, 0: none),
# tests handed out one by one; a fixture whose work is the same on every worker (the nvcc
# and Triton AOT compiles) runs once (tests/conftest.py's once_per_session). On CI's 2 cores
# the suite took 21:39 alone.
TEST_WORKERS ?= auto
test: $(INSTALL_STAMP)
	$(PY) -m pytest tests -n $(TEST_WORKERS) --maxprocesses=8 --durations=15

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

# The oldest torch we declare, built against and tested in a venv of its own (not part of
# `make test`: it installs a second torch). It installs the sdist (built in a temporary
# folder, so nothing mixes with .venv's build), and the tests run from that venv's folder
# so `import pyembed` is the installed copy.
COMPAT_TORCH ?= 2.13.0
COMPAT_VENV  := .venv-compat
# The GPU machine's Triton (make gpu-check compiles the kernels with it), installed on a path
# of its own: every specialisation compiles for that machine's sm_90 without spills, and an
# eager forward + backward compiles through its JIT and launches through pyembed's cached
# launcher (tests/triton_launch_worker.py, driver stood in; it caught a backward kernel
# that 3.6 failed to compile at d = 16-64), and every specialisation the triton tests
# launch (recorded under .venv's interpreter) compiles (tests/triton_specs.py). Only that:
# its interpreter, with NumPy >= 2.4, cannot run a loop bounded by a tensor (Triton
# 3.8's can), and for sm_80 it spills 8 B in one d=100 bf16 forward, where 3.8 does not.
GPU_TRITON   ?= 3.6.0
define NO_SPILLS
import json, sys
report = json.load(sys.stdin)
spills = {name: row["spill_bytes"] for name, row in report.items() if row["spill_bytes"]}
print(f"{len(report)} Triton specialisations compiled, spills: {spills or 'none'}")
sys.exit(bool(spills))
endef
export NO_SPILLS
test-compat: $(INSTALL_STAMP)
	rm -rf $(COMPAT_VENV) && $(PYTHON) -m venv $(COMPAT_VENV)
	$(COMPAT_VENV)/bin/pip install "torch==$(COMPAT_TORCH)" "setuptools>=77" wheel ninja build pytest hypothesis numpy
	$(COMPAT_VENV)/bin/python -m build --sdist --outdir $(COMPAT_VENV)/dist .
	$(COMPAT_VENV)/bin/pip install --no-build-isolation --no-deps $(COMPAT_VENV)/dist/*.tar.gz
	cd $(COMPAT_VENV) && bin/python -m pyembed.info && bin/python -m pytest -q -p no:cacheprovider \
		--rootdir=$(CURDIR) $(CURDIR)/tests/test_parity.py $(CURDIR)/tests/test_dropin.py $(CURDIR)/tests/test_errors.py \
		$(CURDIR)/tests/test_dropout.py $(CURDIR)/tests/test_dtensor.py \
		"$(CURDIR)/tests/test_packaging.py::test_readme_python_blocks_run_as_written" \
		"$(CURDIR)/tests/test_dispatch.py::test_eager_apply_is_torchs_function_apply"
	$(COMPAT_VENV)/bin/pip install --no-deps --target $(COMPAT_VENV)/gpu-triton "triton==$(GPU_TRITON)"
	cd $(COMPAT_VENV) && PYTHONPATH=$(CURDIR)/$(COMPAT_VENV)/gpu-triton bin/python $(CURDIR)/tests/triton_aot.py --quick \
		| bin/python -c "$$NO_SPILLS"
	cd $(COMPAT_VENV) && PYTHONPATH=$(CURDIR)/$(COMPAT_VENV)/gpu-triton bin/python $(CURDIR)/tests/triton_launch_worker.py eager
	for check in planned planned-node planned-backward planned-node-backward planned-optimizer-backward; do (cd $(COMPAT_VENV) && PYTHONPATH=$(CURDIR)/$(COMPAT_VENV)/gpu-triton \
		bin/python $(CURDIR)/tests/triton_launch_worker.py $$check | bin/python -c "import json, sys; \
		r = json.loads(sys.stdin.read().splitlines()[-1]); print(r); sys.exit(bool(r['mismatches']))") || exit 1; done
	cd $(COMPAT_VENV) && PYTHONPATH=$(CURDIR)/$(COMPAT_VENV)/gpu-triton bin/python $(CURDIR)/tests/triton_launch_worker.py \
		whole | bin/python -c "import json, sys; r = json.loads(sys.stdin.read().splitlines()[-1]); print(r); \
		sys.exit(not (r['copies'] and all(r['replay'].values())) or r['sorts'] or r['offset view'] or r['returns input'])"
	cd $(COMPAT_VENV) && PYTHONPATH=$(CURDIR)/$(COMPAT_VENV)/gpu-triton bin/python $(CURDIR)/tests/triton_launch_worker.py \
		node-after-column-shard | bin/python -c "import json, sys; r = json.loads(sys.stdin.read().splitlines()[-1]); \
		print(r); sys.exit(not r['same'])"
	for seed in 0 1 2; do (cd $(COMPAT_VENV) && PYTHONPATH=$(CURDIR)/$(COMPAT_VENV)/gpu-triton bin/python \
		$(CURDIR)/tests/triton_launch_worker.py random-calls $$seed | bin/python -c "import json, sys; \
		r = json.loads(sys.stdin.read().splitlines()[-1]); print(r['seed'], r['mismatches'], r['replayed']); \
		sys.exit(bool(r['mismatches']))") || exit 1; done
	$(PY) tests/triton_specs.py record $(CURDIR)/build/triton_specs.json
	cd $(COMPAT_VENV) && PYTHONPATH=$(CURDIR)/$(COMPAT_VENV)/gpu-triton bin/python $(CURDIR)/tests/triton_specs.py \
		compile $(CURDIR)/build/triton_specs.json

# The GPU machine's stack -- its Python, torch, Triton and transformers (the device tool's
# KINDS.md) -- on this CPU machine, so that what breaks there is found before a GPU session
# spends its minutes: the suite (its triton tests under 3.6's interpreter, which needs
# NumPy < 2.4; the GPU machine's NumPy is newer, its triton tests compile) and, within it,
# bench.triton_host's real 3.6 JIT for sm_90 behind the stand-in driver (it found 3.6 unable
# to compile a one-token AdamW step's update kernel, which 3.8 compiles). A copy of the
# working tree, built in place for CPU only (`make test` compiles the CUDA sources); torch
# 2.11 is older than the torch>=2.13 declared, as on the GPU machine, whose build allows it
# (PYEMBED_ALLOW_OLD_TORCH=1). Left out, as differing on torch 2.11 and not what gpu-check
# runs there: torch.distributed's (no second GPU there), AOTInductor packages, the AOT
# compiles for sm_80 (3.6 spills there; `make test-compat` compiles sm_90 with 3.6).
# (Dynamo before 2.13 answered torch.compiler.is_exporting() with True in compiled graphs:
# the host-sync recorder's compiled tests and test_optim's compiled fused-optimizer calls
# found it here, and gpu-check's compiled timings at 82eabd8 on an H200: pyembed.functional.)
# Not part of `make test`: a second torch (~5 GB), ~20 minutes.
# A Python 3.12: pyenv's where it has one (its python3.12 shim refuses to run unless selected), else PATH's.
GPU_STACK_PYTHON ?= $(firstword $(wildcard $(HOME)/.pyenv/versions/3.12*/bin/python3.12) python3.12)
GPU_STACK_VENV   := .venv-gpu-stack
GPU_STACK_PINS   := torch==2.11.0 triton==3.6.0 transformers==5.17.0 "numpy<2.4"
GPU_STACK_DEPS   := $(GPU_STACK_PINS) "setuptools>=77" wheel ninja pytest pytest-xdist hypothesis tqdm matplotlib
test-gpu-stack:
	rm -rf $(GPU_STACK_VENV) && $(GPU_STACK_PYTHON) -m venv $(GPU_STACK_VENV)
	$(GPU_STACK_VENV)/bin/pip install $(GPU_STACK_DEPS)
	mkdir -p $(GPU_STACK_VENV)/src && git ls-files -co --exclude-standard | tar -cf - -T - | tar -xf - -C $(GPU_STACK_VENV)/src
	cd $(GPU_STACK_VENV)/src && PYEMBED_ALLOW_OLD_TORCH=1 PYEMBED_BUILD_CUDA=0 ../bin/pip install --no-build-isolation \
		--no-deps -e . && ../bin/python -m pyembed.info
	cd $(GPU_STACK_VENV)/src && ../bin/python -m pytest tests -q -p no:cacheprovider -n $(TEST_WORKERS) --maxprocesses=8 \
		--ignore=tests/test_packaging.py --ignore=tests/test_cuda_build.py --ignore=tests/test_dtensor.py \
		--ignore=tests/test_parallel.py --ignore=tests/test_triton_aot.py \
		-k "not aotinductor_package"

# What `make gpu-check`'s first minutes on the GPU machine would go to, made here with that
# machine's stack beforehand (tests/gpu/gpu_prepare.py): _C built for sm_90 against its torch,
# and every Triton specialisation the tests launch compiled for sm_90 by its Triton, packed
# into build/gpu-prepared (32 MiB) for the device tool's `carry`; gpu-check uses each where
# it fits that machine. On 2 cores: 16 minutes of compiles the first time (~1610
# specialisations, a few more or fewer from one recording to the next),
# 3 minutes in all where no kernel's own source changed (the cache is
# kept; it packs only this tree's kernels), after recording the launches where their
# sources changed (10 minutes). A venv of the GPU machine's stack is made if there is none.
GPU_PREPARED := build/gpu-prepared
# The launches recorded: tests/triton_specs.py's DEFAULT_TESTS, the sanitizer workload's and
# the GPU benchmark's (its cases and providers: bench/'s other tools launch none of them).
SPEC_SOURCES := $(wildcard kernels/*.py pyembed/*.py) $(addprefix bench/,__init__.py cases.py providers.py run.py \
	report.py) tests/triton_specs.py tests/conftest.py \
	tests/helpers.py $(addprefix tests/test_,parity.py dropout.py optim.py host_sync.py modules.py dropin.py) \
	tests/gpu/sanitizer_workload.py
build/triton_specs.json: $(SPEC_SOURCES) | $(INSTALL_STAMP)
	$(PY) tests/triton_specs.py record $@
$(GPU_STACK_VENV)/bin/python:
	$(GPU_STACK_PYTHON) -m venv $(GPU_STACK_VENV)
	$(GPU_STACK_VENV)/bin/pip install $(GPU_STACK_DEPS)
gpu-prepare: build/triton_specs.json | $(GPU_STACK_VENV)/bin/python
	$(GPU_STACK_VENV)/bin/python tests/gpu/gpu_prepare.py $(GPU_PREPARED)

clean:
	rm -rf build *.egg-info pyembed/*.so
