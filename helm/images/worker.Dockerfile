# syntax=docker/dockerfile:1
# The pagoda worker image: `.[worker]` at the versions constraints.txt locks, on a base chosen by
# build argument. Build from the repository root:
#   GPU (the chart's default): a CUDA PyTorch base that already holds the locked torch
#     docker build -f helm/images/worker.Dockerfile -t ghcr.io/pagoda-llm/pagoda-worker:0.1.0 .
#   CPU (development, compose.yaml, the container tests): a plain Python base, CPU torch installed here
#     docker build -f helm/images/worker.Dockerfile --build-arg DEVICE=cpu \
#       --build-arg BASE_IMAGE=python:3.11-slim-bookworm -t ghcr.io/pagoda-llm/pagoda-worker:0.1.0-cpu .
# To bake a model in (values: model.source=image), build FROM this image and COPY the checkpoint
# directory, e.g. to /opt/models/<name>, readable by uid 10001.
ARG BASE_IMAGE=pytorch/pytorch:2.13.0-cuda13.0-cudnn9-runtime

# The dependency list (pyproject's `dependencies` and the `worker` extra), taken out of
# pyproject.toml here and copied below by content: editing pyproject's other sections leaves the
# install layers cached.
FROM ${BASE_IMAGE} AS requirements
WORKDIR /src
COPY pyproject.toml ./
RUN python -c 'import tomllib; p = tomllib.load(open("pyproject.toml", "rb"))["project"]; print("\n".join(p["dependencies"] + p["optional-dependencies"]["worker"]))' \
        > requirements.txt

FROM ${BASE_IMAGE}
# cuda: the base's torch must be a CUDA build (asserted). cpu: the CPU build of torch comes from
# TORCH_INDEX_URL (empty: from whatever indexes pip is configured with, e.g. an offline mirror).
ARG DEVICE=cuda
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu

ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HOME=/tmp

# Both need a C compiler at run time: Triton compiles a small C launcher the first time a kernel
# runs on a GPU, and a CPU worker builds its C kernels (kernels/cpu_lib.py: paged attention and
# small-batch linears, for the CPU it runs on) at start; without one it serves on torch's ops.
RUN case "$DEVICE" in cuda|cpu) ;; *) echo "DEVICE must be cuda or cpu, not '$DEVICE'" >&2; exit 1 ;; esac \
 && apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev \
 && rm -rf /var/lib/apt/lists/* \
 && groupadd --gid 10001 pagoda \
 && useradd --uid 10001 --gid 10001 --no-create-home --home-dir /tmp --shell /usr/sbin/nologin pagoda

WORKDIR /src
# The dependencies in layers of their own (a change to the sources rebuilds only the small layer
# below). torch is pinned to the one now installed, so resolving `.[worker]` never swaps the base's
# CUDA build for another; a base whose torch is not the locked one fails here, on the constraint.
COPY constraints.txt ./
RUN if [ "$DEVICE" = cpu ]; then \
        pip install --no-cache-dir -c constraints.txt ${TORCH_INDEX_URL:+--extra-index-url "$TORCH_INDEX_URL"} torch; \
    fi
COPY --from=requirements /src/requirements.txt ./
RUN TORCH="$(python -c 'import torch; print(torch.__version__)')" \
 && pip install --no-cache-dir -c constraints.txt -r requirements.txt "torch==${TORCH}" \
 && python -c "import sys, torch; assert sys.argv[1] == 'cpu' or torch.version.cuda, 'torch without CUDA in the worker image'" "$DEVICE"

COPY pyproject.toml README.md ./
COPY pagoda ./pagoda
COPY protos ./protos
COPY runtime ./runtime
COPY kernels ./kernels
COPY gpu_worker ./gpu_worker
COPY clients ./clients
# /models, empty and owned by the worker user: a new named volume mounted there (compose.yaml) takes
# that owner, so a container of this image can write a checkpoint into it.
RUN pip install --no-cache-dir --no-deps . \
 && python -c "import pagoda.gpu_worker.serving.server, pagoda.clients.cli" \
 && install -d -o 10001 -g 10001 /models \
 && cd / && rm -rf /src

WORKDIR /
USER 10001:10001
EXPOSE 50051 9100
ENTRYPOINT ["pagoda", "worker"]
