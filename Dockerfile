# One image for every cluster role: shard (xcls serve shard), graph builder (xcls graph build)
# and training worker (torchrun ... -m xcls train). See docker-compose.yml.
#
# This is the CPU image. GPU hosts build the same steps FROM their own CUDA base image (with
# the CUDA torch build it ships), or skip containers and use scripts/launch_server.sh and
# scripts/launch_worker.sh.
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# torch first, from the CPU wheel index: the package only sets a lower bound on torch, so
# installing it afterwards keeps this (small) build instead of pulling the CUDA one.
RUN pip install --index-url https://download.pytorch.org/whl/cpu "torch>=2.1"

WORKDIR /opt/xcls
COPY pyproject.toml README.md ./
COPY ams ./ams
COPY workers ./workers
COPY bridge ./bridge
COPY xcls ./xcls
RUN pip install .

# Roles run unprivileged; /shared is where compose mounts the snapshot/checkpoint volume.
RUN useradd --create-home --uid 1000 xcls && mkdir /shared && chown xcls /shared
USER xcls
WORKDIR /work
ENTRYPOINT ["xcls"]
CMD ["--help"]
