"""The images built and run for real, with podman and buildah: no stand-ins for the servers.

Where podman and buildah are installed (CI installs them: .ci/run), the module builds a stand-in for
python:3.11-slim-bookworm (helm/images/standin-base.sh, kept between runs), a Redis image on it, the
router image and the worker image's CPU variant (build layers cached between runs). pip inside the
builds is configured as pip on this machine is: its indexes, wheel folders and CA bundle are mounted
in, so the builds need no registry but the ones this machine already uses.

Containers run as the chart runs them: uid 10001, read-only root filesystem with /tmp the only
writable path, no capabilities. They are removed at the end whatever happened.
"""
from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import grpc
import pytest
import yaml

from pagoda.clients.up import wait_serving
from pagoda.protos.pagoda.v1 import pagoda_pb2 as pb
from pagoda.protos.pagoda.v1 import pagoda_pb2_grpc as pb_grpc
from tests.plugins.servers import free_port

ROOT = Path(__file__).resolve().parents[1]
IMAGES = ROOT / "helm" / "images"
CHART = ROOT / "helm" / "pagoda"
_APP = yaml.safe_load((CHART / "Chart.yaml").read_text())["appVersion"]
_VALUES = yaml.safe_load((CHART / "values.yaml").read_text())
# The chart's image names at the chart's appVersion; the CPU worker is the same tag with -cpu.
ROUTER_IMAGE = f"{_VALUES['router']['image']['repository']}:{_APP}"
WORKER_CPU_IMAGE = f"{_VALUES['workerDefaults']['image']['repository']}:{_APP}-cpu"
BASE_IMAGE = "localhost/pagoda-standin/python:3.11-slim-bookworm"
REDIS_IMAGE = "localhost/pagoda-standin/redis:bookworm"
# What the README tells a user to pass for each image, beyond the stand-in base (checked there too).
BUILD_ARGS = {"router": {}, "worker": {"DEVICE": "cpu"}}
UID = _VALUES["securityContext"]["runAsUser"]
# Seconds: a fresh machine builds everything once (mmdebstrap, then pip installs torch).
BUILD_TIMEOUT = 900
PIP_LOCATIONS = ("index-url", "extra-index-url", "find-links")

pytestmark = [pytest.mark.slow, pytest.mark.timeout(BUILD_TIMEOUT + 600)]


def engine_problem() -> str | None:
    """Why no container can run here, or None."""
    for tool in ("podman", "buildah"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (apt-get install podman buildah; .ci/run does)"
    info = subprocess.run(["podman", "info"], capture_output=True, text=True, env=engine_env(), timeout=120)
    if info.returncode != 0:
        return f"podman cannot run here: {info.stderr.strip().splitlines()[-1:]}"
    return None


_CONF: list[Path] = []


def engine_env() -> dict[str, str]:
    """The environment for podman/buildah. Their configuration for this test: no default ulimits
    (rootful podman raises nofile/nproc, which fails where root lacks CAP_SYS_RESOURCE, as in a
    sandbox; containers inherit this process's limits instead) and, where installed, netavark,
    whose DNS lets compose services find each other by name."""
    if not _CONF:
        conf = Path(os.environ.get("TMPDIR", "/tmp")) / f"pagoda-containers-{os.getpid()}.conf"
        lines = ["[containers]", "default_ulimits = []"]
        if any(Path(d, "netavark").exists() for d in ("/usr/lib/podman", "/usr/libexec/podman")):
            lines += ["[network]", 'network_backend = "netavark"']
        conf.write_text("\n".join(lines) + "\n")
        _CONF.append(conf)
    return {**os.environ, "CONTAINERS_CONF": str(_CONF[0])}


def sh(*cmd: str, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, capture_output=True, text=True, env=engine_env(), timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"{shlex.join(cmd)} exited {proc.returncode}:\n{(proc.stdout + proc.stderr)[-4000:]}")
    return proc


def image_exists(name: str) -> bool:
    return sh("podman", "image", "exists", name, check=False).returncode == 0


def host_pip_config(folder: Path) -> tuple[Path, list[str]]:
    """pip.conf for the builds, saying what `pip config list` says here, and the bind mounts its
    local folders (wheel folders, file:// indexes) and CA bundle need."""
    out = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True,
                         check=True).stdout
    settings: dict[str, str] = {}
    for line in out.splitlines():
        key, _, value = line.partition("=")
        settings[key.rsplit(".", 1)[-1]] = value.strip("'\"")
    mounts, conf = set(), ["[global]"]
    for key in PIP_LOCATIONS:
        if key in settings:
            conf.append(f"{key} = {settings[key]}")
            for item in settings[key].split():
                path = Path(item.removeprefix("file://"))
                if path.is_absolute() and path.exists():
                    # An index's pages link to files beside it (../../files/x.whl): mount its parent.
                    mounts.add(str(path if key == "find-links" else path.parent))
    if "cert" in settings:
        conf.append("cert = /etc/pagoda-build-ca.crt")
        mounts.add(f"{settings['cert']}:/etc/pagoda-build-ca.crt")
    path = folder / "pip.conf"
    path.write_text("\n".join(conf) + "\n")
    volumes = [f"{path}:/etc/pip.conf"] + [m if ":" in m else f"{m}:{m}" for m in sorted(mounts)]
    return path, [arg for v in volumes for arg in ("-v", f"{v}:ro")]


def build(image: str, tag: str, pip_mounts: list[str], **args: str) -> None:
    dockerfile = IMAGES / f"{image}.Dockerfile"
    cmd = ["buildah", "bud", "--layers", "--network", "host", "-f", str(dockerfile),
           "--ignorefile", f"{dockerfile}.dockerignore", "-t", tag, *pip_mounts]
    for key, value in args.items():
        cmd += ["--build-arg", f"{key}={value}"]
    sh(*cmd, str(ROOT), timeout=BUILD_TIMEOUT)


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    """Builds (or finds, from an earlier run) every image the tests run."""
    problem = engine_problem()
    if problem:
        pytest.skip(problem)
    if not image_exists(BASE_IMAGE):
        if shutil.which("mmdebstrap") is None:
            pytest.skip(f"{BASE_IMAGE} is absent and mmdebstrap, which builds it, is not installed")
        sh(str(IMAGES / "standin-base.sh"), BASE_IMAGE, timeout=BUILD_TIMEOUT)
    if not image_exists(REDIS_IMAGE):
        sh("buildah", "bud", "--layers", "--network", "host", "--build-arg", f"BASE={BASE_IMAGE}",
           "-f", str(ROOT / "tests" / "data" / "redis.Containerfile"), "-t", REDIS_IMAGE,
           str(ROOT / "tests" / "data"), timeout=BUILD_TIMEOUT)
    _, pip_mounts = host_pip_config(tmp_path_factory.mktemp("pip"))
    build("router", ROUTER_IMAGE, pip_mounts, PYTHON_IMAGE=BASE_IMAGE, **BUILD_ARGS["router"])
    # TORCH_INDEX_URL empty: the CPU torch comes from this machine's pip indexes (mounted above).
    build("worker", WORKER_CPU_IMAGE, pip_mounts, BASE_IMAGE=BASE_IMAGE, TORCH_INDEX_URL="",
          **BUILD_ARGS["worker"])
    return dict(router=ROUTER_IMAGE, worker=WORKER_CPU_IMAGE, redis=REDIS_IMAGE)


class Containers:
    """Containers on the host network, run as the chart runs pagoda pods (the image's own user, read-only
    root filesystem, /tmp a tmpfs, no capabilities); all removed by close()."""

    def __init__(self, prefix: str):
        self.prefix, self.names = prefix, []

    def run(self, name: str, image: str, *args: str, volumes: tuple[str, ...] = ()) -> str:
        full = f"{self.prefix}-{name}"
        self.names.append(full)
        cmd = ["podman", "run", "-d", "--name", full, "--network", "host", "--read-only",
               "--read-only-tmpfs=false", "--tmpfs", "/tmp", "--cap-drop", "ALL",
               "--security-opt", "no-new-privileges"]
        for v in volumes:
            cmd += ["-v", v]
        sh(*cmd, image, *args)
        return full

    def logs(self, name: str) -> str:
        proc = sh("podman", "logs", name, check=False)
        return (proc.stdout + proc.stderr)[-3000:]

    def running(self, name: str) -> bool:
        state = sh("podman", "inspect", "--format", "{{.State.Running}}", name, check=False).stdout
        return state.strip() == "true"

    def close(self) -> None:
        if self.names:
            sh("podman", "rm", "--force", "--time", "2", *self.names, check=False, timeout=120)


class ContainerProcess:
    """A container seen as pagoda.clients.up.wait_serving sees a process: poll() is None while it runs."""

    def __init__(self, containers: Containers, name: str):
        self.containers, self.name, self.returncode = containers, name, None

    def poll(self) -> str | None:
        if not self.containers.running(self.name):
            self.returncode = "a stopped container"
        return self.returncode


def stream(stub, prompt: str) -> list[pb.GenerateResponse]:
    req = pb.GenerateRequest(text=prompt, sampling=pb.SamplingParams(max_tokens=8, temperature=0))
    return list(stub.Generate(req, timeout=60))


def serve_twice(address: str, timeout: float) -> tuple[list, list]:
    """Streams one prompt through the router (retrying while it has no worker yet), waits for the
    workers' block summaries to reach it, then streams the same prompt again."""
    prompt = "Containers keep the router, the workers and Redis apart. " * 6
    deadline = time.monotonic() + timeout
    with grpc.insecure_channel(address) as ch:
        stub = pb_grpc.GenerationStub(ch)
        while True:
            try:
                first = stream(stub, prompt)
                break
            except grpc.RpcError as e:
                if e.code() != grpc.StatusCode.UNAVAILABLE or time.monotonic() > deadline:
                    raise
                time.sleep(1)
        time.sleep(2)           # the workers publish the new blocks (KV events) to the router via Redis
        return first, stream(stub, prompt)


def assert_cached_repeat(first: list, again: list) -> None:
    assert len(first) > 1 and "".join(c.text for c in first[:-1])     # streamed token by token
    assert first[-1].finish_reason and first[-1].usage.completion_tokens == 8
    assert first[-1].usage.cached_prompt_tokens == 0
    assert again[-1].worker_id == first[-1].worker_id
    assert again[-1].usage.cached_prompt_tokens >= 16                   # at least one full block
    # The same tokens and text; how they split into chunks is timing: deltas that queue up
    # behind a slow reader go out merged (gpu_worker stream coalescing).
    assert [t for c in again for t in c.token_ids] == [t for c in first for t in c.token_ids]
    assert "".join(c.text for c in again) == "".join(c.text for c in first)


def metric(port: int, name: str) -> float:
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in body.splitlines()
               if line.startswith(name) and not line.startswith("#"))


def readable_copy(src: str, dst: Path) -> str:
    """The checkpoint copied where uid 10001 can read it (pytest's temporary folders are 0700)."""
    shutil.copytree(src, dst)
    for path in [dst, *dst.rglob("*")]:
        path.chmod(0o755 if path.is_dir() else 0o644)
    dst.parent.chmod(0o755)
    return str(dst)


@pytest.fixture
def containers():
    group = Containers(f"pagoda-test-{os.getpid()}-{time.monotonic_ns() % 10**6}")
    yield group
    group.close()


def test_router_and_two_workers_in_containers_serve_with_prefix_caching(images, containers, tiny_model,
                                                                         tmp_path_factory):
    model = readable_copy(tiny_model, tmp_path_factory.mktemp("models", numbered=True) / "tiny-llama")
    redis_port, router_port, metrics_port, http_port = free_port(), free_port(), free_port(), free_port()
    redis_url = f"redis://127.0.0.1:{redis_port}/0"
    redis = containers.run("redis", images["redis"], "redis-server", "--port", str(redis_port),
                           "--bind", "127.0.0.1", "--save", "", "--appendonly", "no")
    router = containers.run("router", images["router"], "--host", "127.0.0.1", "--port", str(router_port),
                            "--metrics-port", str(metrics_port), "--http-port", str(http_port),
                            "--redis-url", redis_url)
    workers = {}
    for i in range(2):
        port = free_port()
        workers[port] = containers.run(
            f"worker-{i}", images["worker"], "--model", "/models/tiny-llama", "--device", "cpu",
            "--host", "127.0.0.1", "--port", str(port), "--metrics-port", "0", "--num-kv-blocks", "128",
            "--advertise-address", f"127.0.0.1:{port}", "--redis-url", redis_url,
            volumes=(f"{model}:/models/tiny-llama:ro",))
    try:
        for port, name in [(router_port, router), *workers.items()]:
            wait_serving(f"127.0.0.1:{port}", ContainerProcess(containers, name), name, 180)
        deadline = time.monotonic() + 30
        while metric(metrics_port, "pagoda_router_live_workers{") < 2:
            assert time.monotonic() < deadline, "the router did not see both workers in 30 s"
            time.sleep(0.5)
        first, again = serve_twice(f"127.0.0.1:{router_port}", 30)
        assert_cached_repeat(first, again)
        models = json.load(urllib.request.urlopen(f"http://127.0.0.1:{http_port}/v1/models", timeout=10))
        assert [m["id"] for m in models["data"]] == ["tiny-llama"]
        for name in [redis, router, *workers.values()]:
            assert containers.running(name), containers.logs(name)
        for name in [router, *workers.values()]:        # the images' own user; nothing outside /tmp writable
            assert sh("podman", "exec", name, "id", "-u").stdout.strip() == str(UID)
            assert sh("podman", "exec", name, "touch", "/tmp/ok").returncode == 0
            denied = sh("podman", "exec", name, "touch", "/opt/x", check=False)
            assert denied.returncode != 0 and "Read-only file system" in denied.stderr
    except BaseException:
        for name in containers.names:
            print(f"--- {name}\n{containers.logs(name)}")
        raise


def test_compose_file_serves_with_prefix_caching_under_podman_compose(images, tmp_path):
    if shutil.which("podman-compose") is None:
        pytest.skip("podman-compose is not installed (pip install podman-compose; the test extra has it)")
    grpc_port = free_port()
    project = f"pagoda-test-{os.getpid()}"
    env = {**engine_env(), "PAGODA_ROUTER_IMAGE": images["router"], "PAGODA_WORKER_IMAGE": images["worker"],
           "PAGODA_REDIS_IMAGE": images["redis"], "PAGODA_GRPC_PORT": str(grpc_port),
           "PAGODA_HTTP_PORT": str(free_port())}
    compose = ["podman-compose", "-f", str(ROOT / "compose.yaml"), "-p", project]

    def run(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
        return subprocess.run([*compose, *args], capture_output=True, text=True, env=env, timeout=timeout,
                              cwd=tmp_path)

    try:
        up = run("up", "-d")
        assert up.returncode == 0, (up.stdout + up.stderr)[-4000:]
        first, again = serve_twice(f"127.0.0.1:{grpc_port}", 240)
        assert_cached_repeat(first, again)
    except BaseException:
        logs = run("logs", timeout=60)
        print((logs.stdout + logs.stderr)[-8000:])
        raise
    finally:
        down = run("down", "-v", "-t", "2", timeout=180)
    assert down.returncode == 0, (down.stdout + down.stderr)[-2000:]
