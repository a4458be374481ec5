# embedfleet worker images. Two targets from one file:
#   cpu  (default): torch's CPU build
#   cuda:           torch's CUDA build (its CUDA libraries come as wheels; the driver from the node)
# Wheels are built and installed into a virtual environment in a build stage; the final stage
# copies only that environment onto the base, so it holds no compilers, sources or pip caches.
#
#   make image                      # CPU, on a Debian base made by mmdebstrap (nothing pulled)
#   buildah bud --target cuda --build-arg BASE_IMAGE=docker.io/library/python:3.11-slim-bookworm \
#       -t embedfleet/embedfleet:0.1.0-cuda .      # or `docker build` with the same flags
#
# Offline builds (as `make image` does): wheelhouse/ holds every wheel, PIP_NO_INDEX=1.

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

# Last, so a build without --target gives the CPU image.
FROM runtime AS cpu
COPY --from=build-cpu /opt/embedfleet /opt/embedfleet
ENV EMBEDFLEET_DEVICE=cpu
