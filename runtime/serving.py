"""What router and worker servers share at start-up: gRPC server options, port binding that fails
with one line naming the port and its flag, and the derived default metrics port.

Both servers bind (or check) every port before loading anything slow, so a taken port is
reported in a second rather than after a model load; and neither shares a port with another
process (SO_REUSEPORT off), so a second server on a taken port fails instead of silently
splitting the traffic.
"""
from __future__ import annotations

import logging
import os
import socket
import sys
import threading

import grpc

# Clients (the router's channels to workers) ping every 10 s while idle; a server that allowed
# less would answer GOAWAY too_many_pings and the next request on that connection would fail.
CLIENT_KEEPALIVE = [("grpc.keepalive_time_ms", 10_000), ("grpc.keepalive_timeout_ms", 5_000),
                    ("grpc.keepalive_permit_without_calls", 1)]
METRICS_PORT_OFFSET = 10_000


class StopDeadline:
    """Once a server has been told to stop: if it is still alive `seconds` later, one line says
    which stage it was in, and the process exits with code 1 (a daemon timer thread, so it fires
    whether the event loop or the interpreter's teardown is the stuck part). Seen here: about one
    router in ten, stopped together with Redis and its workers, outlived pagoda up's 15 s wait;
    grpc.aio's asyncio teardown has had such races (grpc/grpc#40989). A supervisor's stop should
    not wait on that, and the stage named tells the next engineer where to look."""

    def __init__(self, name: str, seconds: float):
        self.name, self.seconds, self.stage = name, seconds, "stopping"
        self._timer = threading.Timer(seconds, self._expired)
        self._timer.daemon = True

    def start(self) -> StopDeadline:
        self._timer.start()
        return self

    def _expired(self) -> None:
        print(f"pagoda {self.name}: shutdown still in '{self.stage}' after {self.seconds:g}s; exiting",
              file=sys.stderr, flush=True)
        os._exit(1)


def at_stage(deadline: StopDeadline | None, stage: str) -> None:
    """Record the shutdown stage a server enters (what a stuck one's line names)."""
    if deadline is not None:
        deadline.stage = stage


def exit_now(code: int) -> None:
    """End a server process that has stopped cleanly, without the interpreter's teardown of grpc
    (and torch) module state: it takes seconds, only delays a rolling restart, and is where
    grpc.aio's shutdown races live."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


class StartupError(Exception):
    """A start-up failure the user fixes with a flag: printed as one line, no traceback."""


def server_options(max_concurrent_streams: int) -> list[tuple[str, int]]:
    return [("grpc.so_reuseport", 0),
            ("grpc.max_concurrent_streams", max_concurrent_streams),
            # Accept the clients' keepalive pings (CLIENT_KEEPALIVE) with room to spare.
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
            # Find clients that vanished (their streams hold engine slots) within a minute.
            ("grpc.keepalive_time_ms", 30_000), ("grpc.keepalive_timeout_ms", 10_000),
            # A stream's unsent output is bounded by the HTTP/2 flow-control window: keep the
            # window at its 64 KiB default instead of letting BDP probing grow it per connection.
            ("grpc.http2.bdp_probe", 0),
            ("grpc.max_send_message_length", 16 << 20), ("grpc.max_receive_message_length", 64 << 20)]


def bind(server: grpc.aio.Server, host: str, port: int, flag: str,
         credentials: grpc.ServerCredentials | None = None) -> int:
    """Bind the gRPC port (secure when credentials are given); StartupError naming it otherwise."""
    address = f"{host}:{port}"
    try:
        bound = (server.add_secure_port(address, credentials) if credentials is not None
                 else server.add_insecure_port(address))
    except RuntimeError:
        bound = 0
    if not bound:
        raise StartupError(f"port {port} ({flag}) on {host} is in use or cannot be bound; "
                           f"pick another with {flag}")
    return bound


def check_port_free(host: str, port: int, flag: str) -> None:
    """StartupError when `port` cannot be bound now (checked before a slow model load)."""
    if not port:
        return
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError as e:
            raise StartupError(f"port {port} ({flag}) on {host} is in use or cannot be bound ({e.strerror}); "
                               f"pick another with {flag}") from None


def metrics_port(flag_value: int | None, grpc_port: int) -> int:
    """--metrics-port as given, or by default the gRPC port + 10000, so that servers started on
    one host with only --port differing never collide (0 turns metrics off; so does --port 0
    unless --metrics-port is given)."""
    if flag_value is not None:
        return flag_value
    if not grpc_port:
        return 0
    derived = grpc_port + METRICS_PORT_OFFSET
    if derived > 65535:
        raise StartupError(f"port {grpc_port} (--port) leaves no default metrics port (--port + "
                           f"{METRICS_PORT_OFFSET} > 65535); pass --metrics-port")
    return derived
