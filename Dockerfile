# One image for every cluster role: shard (xcls serve shard), graph builder (xcls graph build)
# and training worker (torchrun ... -m xcls train). See docker-compose.yml.
#
# The default base is a slim CPU image. GPU hosts build FROM an image that has a CUDA build of
# torch (docker-compose.gpu.yml does), e.g.
#   docker build --build-arg BASE_IMAGE=pytorch/pytorch:2.5.1-cuda12.4-cudnn9-runtime .
# or skip containers and use scripts/launch_server.sh and scripts/launch_worker.sh.
#
# Where pip gets packages: pip's own settings as build args, for a mirror or an offline build
#   PIP_INDEX_URL     a package index (a mirror); torch comes from it too (default: torch's CPU
#                     index, then PyPI)
#   PIP_FIND_LINKS    a wheelhouse: a URL (the build uses the host's network, so a server on
#                     the host's loopback works) or a directory inside the image
#   PIP_NO_INDEX      1: the wheelhouse only
#   PIP_TRUSTED_HOST  a host served over plain HTTP
# e.g. scripts/ci_compose.sh: --build-arg PIP_NO_INDEX=1 \
#   --build-arg PIP_FIND_LINKS=http://127.0.0.1:8765/ --build-arg PIP_TRUSTED_HOST=127.0.0.1
# BASE_IMAGE needs python and pip on PATH (a virtual environment's will do).
ARG BASE_IMAGE=python:3.11-slim
FROM ${BASE_IMAGE}
ARG PIP_INDEX_URL
ARG PIP_FIND_LINKS
ARG PIP_NO_INDEX
ARG PIP_TRUSTED_HOST

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# torch first, kept when the base image has one (a CUDA build); otherwise the CPU wheel: the
# package only sets a lower bound on torch, so the later installs keep it.
RUN python -c "import torch" 2>/dev/null \
    || pip install --index-url "${PIP_INDEX_URL:-https://download.pytorch.org/whl/cpu}" "torch>=2.1"

WORKDIR /opt/xcls
# The dependencies in their own layer: a change to the sources does not reinstall them.
COPY pyproject.toml README.md ./
RUN python -c "import tomllib; print('\\n'.join(tomllib.load(open('pyproject.toml', 'rb'))\
['project']['dependencies']))" > /tmp/requirements.txt && pip install -r /tmp/requirements.txt
COPY ams ./ams
COPY workers ./workers
COPY bridge ./bridge
COPY xcls ./xcls
# A C compiler only while installing: it builds the shard's compiled row update
# (ams/shard/_kernels.c). A base without gcc gets it from apt, which needs Debian's mirrors:
# offline, build FROM a base that has gcc and libc6-dev (docs/deploy.md, "With Docker").
RUN if command -v apt-get >/dev/null && ! command -v gcc >/dev/null; then \
        apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev \
        && pip install --no-deps . \
        && apt-get purge -y --auto-remove gcc libc6-dev && rm -rf /var/lib/apt/lists/*; \
    else pip install --no-deps .; fi

# Roles run unprivileged (uid 1000; some base images already have a user with it); /shared is
# where compose mounts the snapshot/checkpoint volume.
RUN (id 1000 >/dev/null 2>&1 || useradd --create-home --uid 1000 xcls) \
    && mkdir -p /shared && chown 1000 /shared
USER 1000
WORKDIR /work
ENTRYPOINT ["xcls"]
CMD ["--help"]
