# One image for every cluster role: shard (xcls serve shard), graph builder (xcls graph build)
# and training worker (torchrun ... -m xcls train). See docker-compose.yml.
#
# The default base is a slim CPU image. GPU hosts build FROM an image that has a CUDA build of
# torch (docker-compose.gpu.yml does), e.g.
#   docker build --build-arg BASE_IMAGE=pytorch/pytorch:2.5.1-cuda12.4-cudnn9-runtime .
# or skip containers and use scripts/launch_server.sh and scripts/launch_worker.sh.
ARG BASE_IMAGE=python:3.11-slim
FROM ${BASE_IMAGE}

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# torch first, kept when the base image has one (a CUDA build); otherwise the CPU wheel: the
# package only sets a lower bound on torch, so the later installs keep it.
RUN python -c "import torch" 2>/dev/null \
    || pip install --index-url https://download.pytorch.org/whl/cpu "torch>=2.1"

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
# (ams/shard/_kernels.c); without one the install goes on and the shards update rows in torch.
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
