# syntax=docker/dockerfile:1
# The pagoda worker image: `.[worker]` on a CUDA PyTorch base.
# Build from the repository root:
#   docker build -f helm/images/worker.Dockerfile -t ghcr.io/pagoda-llm/pagoda-worker:0.1.0 .
# To bake a model in (values: model.source=image), build FROM this image and COPY the checkpoint
# directory, e.g. to /opt/models/<name>, readable by uid 10001.
ARG BASE_IMAGE=pytorch/pytorch:2.6.0-cuda12.4-cudnn9-runtime
FROM ${BASE_IMAGE}

ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HOME=/tmp

# Triton compiles a small C launcher the first time a kernel runs, so the runtime needs a C compiler.
RUN apt-get update \
 && apt-get install -y --no-install-recommends gcc libc6-dev \
 && rm -rf /var/lib/apt/lists/* \
 && groupadd --gid 10001 pagoda \
 && useradd --uid 10001 --gid 10001 --no-create-home --home-dir /tmp --shell /usr/sbin/nologin pagoda

WORKDIR /src
COPY pyproject.toml README.md ./
COPY protos ./protos
COPY kernels ./kernels
COPY gpu_worker ./gpu_worker
COPY clients ./clients
# Pin torch to the base image's CUDA build so that resolving `.[worker]` can never swap it out.
RUN TORCH="$(python -c 'import torch; print(torch.__version__)')" \
 && pip install --no-cache-dir ".[worker]" "torch==${TORCH}" \
 && python -c "import torch; assert torch.version.cuda, 'torch without CUDA in the worker image'" \
 && python -c "import gpu_worker.server, clients.cli" \
 && cd / && rm -rf /src

WORKDIR /
USER 10001:10001
EXPOSE 50051 9100
ENTRYPOINT ["pagoda", "worker"]
