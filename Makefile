# The README's two commands: `make demo` and `make test`. Both install into .venv first.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
export HF_HUB_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false
# Bytecode, and pytest's rewritten test modules, written beside the sources: where the machine
# sets PYTHONDONTWRITEBYTECODE=1 (as this project's machines do), every test run, xdist worker
# and `embedfleet worker` process a test starts compiled the sources and rewrote the tests again
# (docs/DEVELOPMENT.md, "Installing"). .gitignore and .dockerignore leave __pycache__ out.
unexport PYTHONDONTWRITEBYTECODE

.PHONY: install demo test test-full lint bench bench-peers gpu-carry gpu-rehearsal wheelhouse image-tools base-image image image-gateway image-cuda

$(VENV)/.installed: pyproject.toml constraints.txt
	python3 -m venv $(VENV)
	# torch first, from the CPU wheel the constraints file pins (pyproject keeps a range for GPUs):
	# pip reads this machine's pip configuration, where that wheel lies; uv beside it
	$(PIP) install -q -c constraints.txt torch uv
	# the rest with uv, which resolves the same versions pip does and fetches them in parallel
	# (docs/DEVELOPMENT.md, "Installing"); pip where uv cannot
	$(VENV)/bin/uv pip install --python $(PY) -q --compile-bytecode -c constraints.txt -e '.[dev]' || \
	  $(PIP) install -q -c constraints.txt -e '.[dev]'
	touch $@

install: $(VENV)/.installed

demo: install
	$(VENV)/bin/embedfleet demo

# Tiers are markers each test module declares (pyproject.toml lists them): `slow` (starts worker
# or gateway processes or other servers, or compiles a model), `chaos`, `image`, `packaging`,
# `cluster`. `make test` is the fast tier a developer runs many times a day (minutes on 2 cores):
# none of those. `make test-full` is the whole suite, as CI runs it (.ci/run): it must stay under
# 25 minutes on the slowest 2-core CPU seen (AVX2-only), and the per-module table it prints at the
# end (tests/timing.py: wall against CPU seconds) says where the time goes.
# Both run the modules on two pytest-xdist workers, one module per worker at a time (--dist
# loadfile: a module's fixtures stay in one process), except the modules marked `serial`: those
# whose assertions hold a time or a rate (a token rate, a latency bound, a slice's length, a
# race between two compiled copies) or that fill both cores on their own run alone, after.
XDIST := -n 2 --dist loadfile
# test-full's parallel tier runs three, each with one torch thread (tests/one_thread.py): a
# quarter of that tier's wall is its modules waiting (on a rate, an outage, a worker's start),
# which a third keeps the cores busy through (docs/DEVELOPMENT.md, "CI time"; one core pinned
# to each was tried too)
XDIST_FULL := -n 3 --dist loadfile
# the -m expression of the fast tier: none of the slow tiers tests/tiers.py owns
FAST_TIER = $(shell python3 -m tests.tiers)
# The fast tier holds no serial module (tests/conftest.py refuses one marked serial and not
# slow, and fails a test that starts a worker process unless it is marked slow), so it is one
# parallel run.
test: install
	$(PY) -m pytest $(XDIST) -m "$(FAST_TIER)"

# The image tests wait mostly on apt and buildah (under one core between them), so test-full
# runs them in a second lane beside the rest and prints its report after it; either failing
# fails the target. The tests marked `beside` (mypy: no model, no server) join them there; then,
# in a second pytest of that lane, the modules marked `waits`: they mostly wait (an outage, a
# rate's window, a client's timeout) and held an xdist worker for minutes at a third of a core
# (their tests marked `serial` run in the serial tier). In that order, what may still run when
# the serial tier begins is what waits, not a build or mypy, and the serial tier begins with the
# modules that hold no latency (test_batch_withdrawal, test_chaos). The lane's worker processes
# run one torch thread too (EMBEDFLEET_TEST_ONE_THREAD). It makes the wheelhouse first (it builds
# nothing in this tree: the packaging tests can build the project meanwhile);
# EMBEDFLEET_TEST_WHEELHOUSE=made tells tests/end_to_end/test_image.py not to make it again.
# every pytest of test-full records its modules' times there (tests/timing.py), read at the end
TIMING_ENV = EMBEDFLEET_TEST_TIMING_DIR=$(BUILD_DIR)/test-timing
LANE_ENV = EMBEDFLEET_TEST_WHEELHOUSE=made $(TIMING_ENV) EMBEDFLEET_TEST_ONE_THREAD=1
LANE_PYTEST = $(PY) -m pytest -p no:cacheprovider -p tests.timing -p tests.one_thread --durations=10
test-full: install
	mkdir -p $(BUILD_DIR) && rm -rf $(BUILD_DIR)/test-timing
	{ if command -v $(BUILDAH) >/dev/null; then $(MAKE) --no-print-directory wheelhouse; fi && { \
	  $(LANE_ENV) EMBEDFLEET_TEST_TIMING_LANE=image $(LANE_PYTEST) \
	    --basetemp=$(BUILD_DIR)/pytest-image -m "image or beside"; first=$$?; \
	  $(LANE_ENV) EMBEDFLEET_TEST_TIMING_LANE=waits $(LANE_PYTEST) \
	    --basetemp=$(BUILD_DIR)/pytest-waits -m "waits and not serial"; waits=$$?; \
	  test $$first -eq 0 && test $$waits -eq 0; }; \
	  } > $(BUILD_DIR)/test-image.log 2>&1 & image=$$!; \
	$(TIMING_ENV) $(PY) -m pytest -p tests.timing \
	  -p tests.one_thread $(XDIST_FULL) --durations=20 \
	  -m "not image and not beside and not waits and not serial"; parallel=$$?; \
	$(TIMING_ENV) $(PY) -m pytest -p tests.timing \
	  --durations=10 -m "serial and not image and not beside"; serial=$$?; \
	wait $$image; status=$$?; \
	$(TIMING_ENV) $(PY) -m tests.timing; \
	echo "== the lane beside the rest: image, beside, waits ($(BUILD_DIR)/test-image.log) =="; \
	cat $(BUILD_DIR)/test-image.log; \
	test $$parallel -eq 0 && test $$serial -eq 0 && test $$status -eq 0

# mypy reads files, not import hooks: tools/import_root.py lays the package out as the wheel
# does under build/import_root/ and runs mypy over it ([tool.mypy] in pyproject.toml)
lint: install
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check . && $(PY) -m tools.import_root --mypy

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
# The requirements come from pyproject.toml (tools/wheelhouse.py), not from '.[worker]': the
# project is not built here (the images build it from their sources; its wheel would change on
# every build, zip timestamps, and invalidate every cached layer after it), so the wheelhouse can
# be made while the packaging tests build the project in this tree.
wheelhouse: install
	mkdir -p $(BUILD_DIR)
	$(PY) -m tools.wheelhouse worker > $(BUILD_DIR)/wheelhouse-worker.txt
	$(PY) -m tools.wheelhouse gateway > $(BUILD_DIR)/wheelhouse-gateway.txt
	$(PIP) wheel -q -c constraints.txt --wheel-dir wheelhouse -r $(BUILD_DIR)/wheelhouse-worker.txt \
	  'setuptools>=68' wheel \
	  'async-timeout>=4.0.3'  # redis needs it on Debian's Python 3.11.2 (< 3.11.3), not on ours
	$(PIP) wheel -q -c constraints.txt --find-links wheelhouse --wheel-dir wheelhouse/gateway \
	  -r $(BUILD_DIR)/wheelhouse-gateway.txt packaging
	cd wheelhouse/gateway && for wheel in *.whl; do if [ -e "../$$wheel" ]; then rm "$$wheel"; fi; done

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
