# The README's two commands: `make demo` and `make test`. Both install into .venv first.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
export HF_HUB_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: install demo test test-full lint bench bench-peers gpu-carry gpu-rehearsal wheelhouse image-tools base-image image image-gateway image-cuda

$(VENV)/.installed: pyproject.toml constraints.txt
	python3 -m venv $(VENV)
	# torch first, from the CPU wheel the constraints file pins (pyproject keeps a range for GPUs)
	$(PIP) install -q -c constraints.txt torch
	$(PIP) install -q -c constraints.txt -e '.[dev]'
	touch $@

install: $(VENV)/.installed

demo: install
	$(VENV)/bin/embedfleet demo

# `make test`: the fast tier a developer runs many times a day (minutes on 2 cores): everything
# but the modules that start worker or gateway processes, the image, the cluster, chaos and
# packaging (each module marks its tier: `pytestmark = pytest.mark.slow`; pyproject.toml). `make test-full`:
# the whole suite, as CI runs it (.ci/run), listing its 30 slowest tests at the end: CI must
# stay under 30 minutes on 2 cores, and that list says where the time goes.
FAST_TIER := not slow and not chaos and not image and not packaging and not cluster
# The image tests wait mostly on apt and buildah (under one core between them), so test-full
# runs them in a second pytest beside the rest and prints their report after it; either failing
# fails the target. Tests marked `beside` (mypy: no model, no server) join them there. The
# wheelhouse is made first, alone: it builds the project in this tree, as the packaging tests
# do, and two builds in one tree collide.
# EMBEDFLEET_TEST_WHEELHOUSE=made tells tests/end_to_end/test_image.py not to make it again.
test: install
	$(PY) -m pytest -m "$(FAST_TIER)"

test-full: install
	mkdir -p $(BUILD_DIR)
	if command -v $(BUILDAH) >/dev/null; then $(MAKE) --no-print-directory wheelhouse; fi
	EMBEDFLEET_TEST_WHEELHOUSE=made $(PY) -m pytest -p no:cacheprovider \
	  --basetemp=$(BUILD_DIR)/pytest-image --durations=10 -m "image or beside" \
	  > $(BUILD_DIR)/test-image.log 2>&1 & image=$$!; \
	$(PY) -m pytest --durations=30 -m "not image and not beside"; rest=$$?; \
	wait $$image; status=$$?; \
	echo "== the image tests, run beside the rest ($(BUILD_DIR)/test-image.log) =="; \
	cat $(BUILD_DIR)/test-image.log; \
	test $$rest -eq 0 && test $$status -eq 0

lint: install
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check . && $(VENV)/bin/mypy

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

# Images (see Dockerfile and the README's "Images"). With Docker, `docker build .` builds the CPU
# worker image and `docker build --target gateway .` the gateway's, from PyPI. `make image` and
# `make image-gateway` build them on this kind of machine with nothing pulled: a Debian base from
# mmdebstrap, every wheel from the host (wheelhouse/), buildah with chroot isolation. Both tools
# need root (or rootless buildah).
VERSION := $(shell sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml)
IMAGE ?= embedfleet/embedfleet
BASE_IMAGE ?= localhost/embedfleet-base:bookworm
BUILDAH ?= buildah
MMDEBSTRAP ?= mmdebstrap
BUILD_DIR ?= build
IMAGE_BUILD_ARGS = --build-arg BASE_IMAGE=$(BASE_IMAGE) --build-arg PIP_NO_INDEX=1 \
  --build-arg VERSION=$(VERSION)

# Before anything slow: buildah, and mmdebstrap unless the base image (or its tarball) is there.
image-tools:
	@missing=""; \
	command -v $(BUILDAH) >/dev/null 2>&1 || missing="$(BUILDAH)"; \
	if [ ! -f $(BUILD_DIR)/base.tar ] && { [ -n "$$missing" ] || \
	    ! $(BUILDAH) inspect --type image $(BASE_IMAGE) >/dev/null 2>&1; }; then \
	  command -v $(MMDEBSTRAP) >/dev/null 2>&1 || missing="$$missing $(MMDEBSTRAP)"; fi; \
	if [ -n "$$missing" ]; then \
	  echo "make image: needs $$missing (not found on PATH)." >&2; \
	  echo "  Install them as root on Debian/Ubuntu: apt-get install buildah mmdebstrap" >&2; \
	  echo "  Or build with Docker instead: docker build -t $(IMAGE):$(VERSION) ." >&2; \
	  echo "  (the gateway: docker build --target gateway -t $(IMAGE):$(VERSION)-gateway .)" >&2; \
	  exit 1; fi

# Every wheel the images install, for an offline build: the CPU worker's in wheelhouse/ (the torch
# file pinned by constraints.txt), those only the gateway adds in wheelhouse/gateway/ (the worker
# image installs every wheel of wheelhouse/, and must not get the gateway's)
wheelhouse: install
	$(PIP) wheel -q -c constraints.txt --wheel-dir wheelhouse '.[worker]' 'setuptools>=68' wheel \
	  'async-timeout>=4.0.3'  # redis needs it on Debian's Python 3.11.2 (< 3.11.3), not on ours
	$(PIP) wheel -q -c constraints.txt --find-links wheelhouse --wheel-dir wheelhouse/gateway \
	  '.[gateway]' packaging
	cd wheelhouse/gateway && for wheel in *.whl; do if [ -e "../$$wheel" ]; then rm "$$wheel"; fi; done
	# the project's own wheel is built inside the image from its sources; a copy here would change
	# on every build (zip timestamps) and invalidate every cached layer after it
	rm -f wheelhouse/embedfleet-*.whl wheelhouse/gateway/embedfleet-*.whl

# A minimal Debian bookworm with Python 3.11, imported as a local image (no registry pull)
$(BUILD_DIR)/base.tar: | image-tools
	mkdir -p $(BUILD_DIR)
	$(MMDEBSTRAP) --variant=minbase --include=python3,python3-venv bookworm $@

base-image: image-tools
	if ! $(BUILDAH) inspect --type image $(BASE_IMAGE) >/dev/null 2>&1; then \
	  $(MAKE) --no-print-directory $(BUILD_DIR)/base.tar && \
	  ctr=$$($(BUILDAH) from scratch) && $(BUILDAH) add $$ctr $(BUILD_DIR)/base.tar / && \
	  $(BUILDAH) commit -q $$ctr $(BASE_IMAGE) && $(BUILDAH) rm $$ctr; fi

image: image-tools wheelhouse base-image
	$(BUILDAH) bud --isolation chroot --layers --target cpu $(IMAGE_BUILD_ARGS) \
	  --build-arg TORCH_SPEC===$(shell sed -n 's/^torch==//p' constraints.txt) \
	  -t $(IMAGE):$(VERSION) .

# The gateway (`embedfleet serve`): the gateway extra, no torch; the chart's gateway.image
image-gateway: image-tools wheelhouse base-image
	$(BUILDAH) bud --isolation chroot --layers --target gateway $(IMAGE_BUILD_ARGS) \
	  -t $(IMAGE):$(VERSION)-gateway .

# The CUDA image needs PyPI and download.pytorch.org (about 3 GB of CUDA wheels)
image-cuda: image-tools base-image
	$(BUILDAH) bud --isolation chroot --layers --target cuda \
	  --build-arg BASE_IMAGE=$(BASE_IMAGE) --build-arg VERSION=$(VERSION) \
	  -t $(IMAGE):$(VERSION)-cuda .
