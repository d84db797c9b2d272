# syntax=docker/dockerfile:1
# The pagoda router image: the base package only (gRPC, Redis, tokenizers; no torch, no GPU stack).
# Build from the repository root:
#   docker build -f helm/images/router.Dockerfile -t ghcr.io/pagoda-llm/pagoda-router:0.1.0 .
ARG PYTHON_IMAGE=python:3.11-slim-bookworm

# The base dependency list (pyproject's `dependencies`, no extra), taken out of pyproject.toml here
# and copied below by content: editing pyproject's other sections leaves the install layer cached.
FROM ${PYTHON_IMAGE} AS requirements
WORKDIR /src
COPY pyproject.toml ./
RUN python -c 'import tomllib; print("\n".join(tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]))' \
        > requirements.txt

FROM ${PYTHON_IMAGE}
ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HOME=/tmp

# The chart runs every pagoda pod as this uid/gid (values: securityContext).
RUN groupadd --gid 10001 pagoda \
 && useradd --uid 10001 --gid 10001 --no-create-home --home-dir /tmp --shell /usr/sbin/nologin pagoda

WORKDIR /src
# The dependencies, at the versions constraints.txt locks, in a layer of their own: a change to the
# sources rebuilds only the small layer below. The base list carries no torch; the check keeps it so.
COPY constraints.txt ./
COPY --from=requirements /src/requirements.txt ./
RUN pip install --no-cache-dir -c constraints.txt -r requirements.txt \
 && python -c "import importlib.util as u; assert u.find_spec('torch') is None, 'torch in the router image'"

COPY pyproject.toml README.md ./
COPY pagoda ./pagoda
COPY protos ./protos
COPY runtime ./runtime
COPY router ./router
COPY clients ./clients
RUN pip install --no-cache-dir --no-deps . \
 && python -c "import pagoda.router.server, pagoda.clients.cli" \
 && cd / && rm -rf /src

WORKDIR /
USER 10001:10001
EXPOSE 50050 9101
ENTRYPOINT ["pagoda", "router"]
