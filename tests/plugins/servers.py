"""Fixtures that run real `python -m pagoda.gpu_worker` processes on loopback.

start_worker(model_dir, **flags) -> WorkerHandle with .address, .port, .proc, .stop(). Flags are
worker flags with underscores (num_kv_blocks=32 -> --num-kv-blocks 32; True -> bare flag). The
worker binds port 0 and logs its address; the handle waits for that line, then for health SERVING.
Every process runs in its own process group, killed at teardown whatever the test did.
"""
from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pagoda.runtime.lifetime import PARENT_PID_ENV

ROOT = Path(__file__).resolve().parents[2]
_LISTEN = re.compile(r"listening on [^\s]+:(\d+)")
# The shared worker's pool (384 tokens) is smaller than its max_model_len on purpose, so that a
# request can pass the length check and still never fit the pool.
TINY_WORKER_FLAGS = dict(num_kv_blocks=24, block_size=16, max_model_len=512, metrics=True)
DEFAULT_FLAGS = dict(host="127.0.0.1", port=0, device="cpu", num_kv_blocks=64, metrics_port=0,
                     drain_grace_seconds=10, log_level="INFO")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def flag_args(flags: dict) -> list[str]:
    out = []
    for key, value in flags.items():
        if value is None or value is False:
            continue
        out.append("--" + key.replace("_", "-"))
        if value is not True:
            out.append(str(value))
    return out


class WorkerHandle:
    def __init__(self, proc: subprocess.Popen, log_path: Path, metrics_port: int):
        self.proc, self.log_path, self.metrics_port = proc, log_path, metrics_port
        self.port = None
        self.address = None

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_ready(self, timeout: float, credentials=None) -> None:
        deadline = time.monotonic() + timeout
        while self.port is None:
            m = _LISTEN.search(self.log())
            if m:
                self.port = int(m.group(1))
                self.address = f"127.0.0.1:{self.port}"
            elif self.proc.poll() is not None:
                raise RuntimeError(f"worker exited with {self.proc.returncode}:\n{self.log()[-4000:]}")
            elif time.monotonic() > deadline:
                raise TimeoutError(f"worker did not start in {timeout}s:\n{self.log()[-4000:]}")
            else:
                time.sleep(0.1)
        try:
            from pagoda.clients.up import wait_serving  # needs grpc: imported only when a worker starts
            wait_serving(self.address, self.proc, "worker", max(deadline - time.monotonic(), 0.1), credentials)
        except (RuntimeError, TimeoutError) as e:
            raise type(e)(f"{e}:\n{self.log()[-4000:]}") from None

    def signal(self, sig=signal.SIGTERM) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, sig)

    def stop(self, timeout: float = 30.0) -> int:
        """SIGTERM (graceful drain); SIGKILL the group if it outlives `timeout`. Returns the exit code."""
        self.signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            return self.proc.wait()

    def kill(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def launch_worker(model_dir: str, log_dir: Path, metrics: bool = False, timeout: float = 120.0,
                  env: dict | None = None, import_root: Path = ROOT, **flags) -> WorkerHandle:
    """With tls_cert/tls_client_ca flags (a test CA that signed both sides), readiness is
    checked over mTLS with the client certificate beside the CA (tests/plugins/certs.py).
    `import_root` is the folder the worker runs in and imports `pagoda` from (a wheel's install
    target, say): the checkout by default."""
    flags = {**DEFAULT_FLAGS, **flags}
    if metrics:
        flags["metrics_port"] = free_port()
    log_path = Path(log_dir) / f"worker-{time.monotonic_ns()}.log"
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **(env or {})}
    full_env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(import_root), full_env.get("PYTHONPATH")]))
    full_env[PARENT_PID_ENV] = str(os.getpid())     # no worker outlives a killed test run
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "pagoda.gpu_worker", "--model", model_dir, *flag_args(flags)],
                                cwd=import_root, env=full_env, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
    handle = WorkerHandle(proc, log_path, flags["metrics_port"])
    try:
        handle.wait_ready(timeout, _test_credentials(flags))
    except Exception:
        handle.kill()
        proc.wait()
        raise
    return handle


def _test_credentials(flags: dict):
    if not flags.get("tls_cert"):
        return None
    import grpc
    folder = Path(flags["tls_cert"]).parent
    return grpc.ssl_channel_credentials((folder / "ca.pem").read_bytes(), (folder / "client.key").read_bytes(),
                                        (folder / "client.pem").read_bytes())


def _factory(tmp_path_factory):
    handles: list[WorkerHandle] = []
    log_dir = tmp_path_factory.mktemp("worker-logs")

    def start(model_dir: str, **flags) -> WorkerHandle:
        h = launch_worker(model_dir, log_dir, **flags)
        handles.append(h)
        return h

    return start, handles


def _cleanup(handles):
    for h in handles:
        if h.proc.poll() is None:
            h.stop(timeout=15)
        h.kill()    # any children left in the group


@pytest.fixture
def start_worker(tmp_path_factory):
    """start_worker(model_dir, **flags) -> WorkerHandle; stopped at the end of the test."""
    start, handles = _factory(tmp_path_factory)
    yield start
    _cleanup(handles)


@pytest.fixture(scope="module")
def start_worker_module(tmp_path_factory):
    """As start_worker, but the workers live for the whole test module."""
    start, handles = _factory(tmp_path_factory)
    yield start
    _cleanup(handles)


@pytest.fixture(scope="session")
def tiny_worker(tmp_path_factory, tiny_model):
    """One worker on the tiny Llama (TINY_WORKER_FLAGS) shared by the whole session: for tests that
    only need a worker to talk to and leave it idle and serving."""
    start, handles = _factory(tmp_path_factory)
    yield start(tiny_model, **TINY_WORKER_FLAGS)
    _cleanup(handles)
