# The README's two commands: `make demo` and `make test`. Both install into .venv first.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
export HF_HUB_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: install demo test test-quick lint bench

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
