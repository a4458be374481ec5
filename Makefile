# The README's two commands: `make demo` and `make test`. Both install into .venv first.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
export HF_HUB_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: install demo test test-quick lint bench bench-peers gpu-carry gpu-rehearsal wheelhouse base-image image image-cuda

# The editable install is setuptools' strict mode: a tree of links under build/ that IDEs and
# type checkers follow (embedfleet.shared -> shared/), instead of an import hook they cannot see.
# A link tree knows the files of its install, so a module file added since is linked anew (the
# .linked stamp); tests/conftest.py stops with this hint if one is missing.
EDITABLE := --config-settings editable_mode=strict
PACKAGE_SOURCES := $(wildcard embedfleet/*.py embedfleet/*/*.py shared/*.py shared/*/*.py \
  producer/*.py workers/*.py workers/*/*.py embedfleet/py.typed)

$(VENV)/.installed: pyproject.toml constraints.txt
	python3 -m venv $(VENV)
	# torch first, from the CPU wheel the constraints file pins (pyproject keeps a range for GPUs)
	$(PIP) install -q -c constraints.txt torch
	$(PIP) install -q -c constraints.txt -e '.[dev]' $(EDITABLE)
	touch $@

$(VENV)/.linked: $(VENV)/.installed $(PACKAGE_SOURCES)
	$(PIP) install -q --no-deps -e . $(EDITABLE)
	touch $@

install: $(VENV)/.linked

demo: install
	$(VENV)/bin/embedfleet demo

test: install
	$(PY) -m pytest

test-quick: install
	$(PY) -m pytest -m "not chaos and not chart and not image and not packaging and not cluster"

lint: install
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check .

# Infinity, the benchmark's serving-engine peer, in an environment of its own (see
# loadtest/requirements-infinity.txt)
INFINITY_VENV ?= .venv-infinity
$(INFINITY_VENV)/.installed: loadtest/requirements-infinity.txt constraints.txt
	python3 -m venv $(INFINITY_VENV)
	$(INFINITY_VENV)/bin/pip install -q -c constraints.txt torch
	$(INFINITY_VENV)/bin/pip install -q -c constraints.txt -r loadtest/requirements-infinity.txt
	touch $@

bench-peers: $(INFINITY_VENV)/.installed

bench: install bench-peers
	$(PY) -m loadtest.bench

# The folder a device run carries (Python 3.12 wheels the GPU image lacks + an fp16 copy of the
# packaged model), sizes printed and checked under the 64 MiB a run may send; see
# docs/BENCHMARKS.md (GPU check) for the device command that uses it.
gpu-carry: install
	$(PY) -m loadtest.gpu_carry

# The same check rehearsed here on the CPU, in a Python 3.12 venv with only the GPU image's
# packages (.venv-rehearsal312, built once) and the carry: loadtest/gpu_rehearsal.sh.
gpu-rehearsal: gpu-carry
	bash loadtest/gpu_rehearsal.sh

# Worker images (see Dockerfile and the README's "Images"). `make image` builds the CPU image on
# this kind of machine with nothing pulled: a Debian base from mmdebstrap, every wheel from the
# host (wheelhouse/), buildah with chroot isolation. Both need root (or rootless buildah).
VERSION := $(shell sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml)
IMAGE ?= embedfleet/embedfleet
BASE_IMAGE ?= localhost/embedfleet-base:bookworm
BUILDAH ?= buildah
BUILD_DIR ?= build

# Every wheel the CPU image installs, for an offline build (the torch file pinned by constraints.txt)
wheelhouse: install
	$(PIP) wheel -q -c constraints.txt --wheel-dir wheelhouse '.[worker]' 'setuptools>=68' wheel \
	  'async-timeout>=4.0.3'  # redis needs it on Debian's Python 3.11.2 (< 3.11.3), not on ours
	# the project's own wheel is built inside the image from its sources; a copy here would change
	# on every build (zip timestamps) and invalidate every cached layer after it
	rm -f wheelhouse/embedfleet-*.whl

# A minimal Debian bookworm with Python 3.11, imported as a local image (no registry pull)
$(BUILD_DIR)/base.tar:
	mkdir -p $(BUILD_DIR)
	mmdebstrap --variant=minbase --include=python3,python3-venv bookworm $@

base-image: $(BUILD_DIR)/base.tar
	if ! $(BUILDAH) inspect --type image $(BASE_IMAGE) >/dev/null 2>&1; then \
	  ctr=$$($(BUILDAH) from scratch) && $(BUILDAH) add $$ctr $(BUILD_DIR)/base.tar / && \
	  $(BUILDAH) commit -q $$ctr $(BASE_IMAGE) && $(BUILDAH) rm $$ctr; fi

image: wheelhouse base-image
	$(BUILDAH) bud --isolation chroot --layers --target cpu \
	  --build-arg BASE_IMAGE=$(BASE_IMAGE) --build-arg PIP_NO_INDEX=1 \
	  --build-arg TORCH_SPEC===$(shell sed -n 's/^torch==//p' constraints.txt) \
	  --build-arg VERSION=$(VERSION) -t $(IMAGE):$(VERSION) .

# The CUDA image needs PyPI and download.pytorch.org (about 3 GB of CUDA wheels)
image-cuda: base-image
	$(BUILDAH) bud --isolation chroot --layers --target cuda \
	  --build-arg BASE_IMAGE=$(BASE_IMAGE) --build-arg VERSION=$(VERSION) \
	  -t $(IMAGE):$(VERSION)-cuda .
