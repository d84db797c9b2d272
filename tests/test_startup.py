"""Start-up failures are one line naming the port and its flag, found before the model loads;
servers never share a port; defaults do not collide on one host; `pagoda up` checks its ports
first."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from tests.plugins.servers import launch_worker

ROOT = Path(__file__).resolve().parents[1]
pytestmark = [pytest.mark.timeout(240)]


def _env():
    return {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1",
            "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}


def _held_port() -> socket.socket:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    return s


def _free_pair() -> int:
    """A port p with p + 10000 free too (the default metrics port)."""
    for _ in range(200):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            p = s.getsockname()[1]
        if p + 10000 > 65535:
            continue
        try:
            with socket.socket() as a, socket.socket() as b:
                a.bind(("127.0.0.1", p))
                b.bind(("127.0.0.1", p + 10000))
            return p
        except OSError:
            continue
    raise RuntimeError("no free port pair")


def _one_line_failure(cmd: list[str], port: int, flag: str, within: float) -> None:
    t0 = time.monotonic()
    out = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=120)
    took = time.monotonic() - t0
    err = out.stderr.strip()
    assert out.returncode != 0 and "Traceback" not in err, err
    assert f"port {port} ({flag})" in err.splitlines()[-1], err
    assert took < within, took


def test_worker_port_taken_is_one_line_before_the_model_loads(tiny_model):
    with _held_port() as s:
        port = s.getsockname()[1]
        base = [sys.executable, "-m", "pagoda.gpu_worker", "--model", tiny_model, "--host", "127.0.0.1", "--device", "cpu"]
        _one_line_failure(base + ["--port", str(port), "--metrics-port", "0"], port, "--port", 20)
        _one_line_failure(base + ["--port", "0", "--metrics-port", str(port)], port, "--metrics-port", 20)


def test_router_refuses_a_port_another_router_holds(redis_server, start_router):
    first = start_router(redis_server.url)
    port = int(first.address.rsplit(":", 1)[1])
    _one_line_failure([sys.executable, "-m", "pagoda.router", "--host", "127.0.0.1", "--port", str(port),
                       "--metrics-port", "0", "--redis-url", redis_server.url], port, "--port", 10)


def test_up_fails_fast_naming_its_taken_port(tmp_path):
    with _held_port() as s:
        port = s.getsockname()[1]
        _one_line_failure([sys.executable, "-m", "pagoda.clients.up", "--port", str(port),
                           "--cache-dir", str(tmp_path)], port, "--port", 2.0)


@pytest.mark.slow
def test_two_workers_and_a_router_differing_only_in_port_all_serve(tiny_model, redis_server, tmp_path):
    ports = [_free_pair() for _ in range(3)]
    workers = []
    try:
        for p in ports[:2]:
            workers.append(launch_worker(tiny_model, tmp_path, port=p, metrics_port=None,
                                         redis_url=redis_server.url))
        router = subprocess.Popen([sys.executable, "-m", "pagoda.router", "--port", str(ports[2]),
                                   "--redis-url", redis_server.url], cwd=ROOT, env=_env(),
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        try:
            from pagoda.clients import PagodaClient
            deadline = time.monotonic() + 30
            while True:
                try:
                    with PagodaClient(f"127.0.0.1:{ports[2]}", retries=0) as c:
                        assert c.complete("hello", max_tokens=2).choices[0].finish_reason == "length"
                    break
                except Exception:
                    if time.monotonic() > deadline or router.poll() is not None:
                        raise
                    time.sleep(0.3)
            for p in ports:                                  # metrics on --port + 10000, for each
                body = urllib.request.urlopen(f"http://127.0.0.1:{p + 10000}/metrics", timeout=5).read()
                assert b"pagoda" in body
        finally:
            router.kill()
            router.wait()
    finally:
        for w in workers:
            w.stop()
