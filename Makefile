# The README's two commands: `make demo` and `make test`. Both install into .venv first.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
export HF_HUB_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: install demo test test-quick lint bench gpu-carry

$(VENV)/.installed: pyproject.toml constraints.txt
	python3 -m venv $(VENV)
	# torch first, from the CPU wheel the constraints file pins (pyproject keeps a range for GPUs)
	$(PIP) install -q -c constraints.txt torch
	$(PIP) install -q -c constraints.txt -e '.[dev]'
	touch $@

install: $(VENV)/.installed

demo: install
	$(VENV)/bin/embedfleet demo

test: install
	$(PY) -m pytest

test-quick: install
	$(PY) -m pytest -m "not chaos and not chart"

lint: install
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check .

bench: install
	$(PY) -m loadtest.bench

# The folder a device run carries (Python 3.12 wheels the GPU image lacks + an fp16 copy of the
# packaged model), sizes printed and checked under the 64 MiB a run may send; see
# docs/BENCHMARKS.md (GPU check) for the device command that uses it.
gpu-carry: install
	$(PY) -m loadtest.gpu_carry
