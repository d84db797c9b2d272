"""runtime/serving.py: server options that agree with the router's client keepalive, the derived
metrics port, port checks that name the port and its flag, and the stop deadline that ends a
server stuck in its shutdown."""
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pagoda.runtime.serving import (
    CLIENT_KEEPALIVE,
    METRICS_PORT_OFFSET,
    StartupError,
    check_port_free,
    metrics_port,
    server_options,
)

ROOT = Path(__file__).resolve().parents[1]

# A server's shutdown reduced to its shape: arm the deadline, then (when told to) hang in a stage
# the way a stuck event loop does, or finish and leave through exit_now.
_STOPPER = """
import asyncio, sys
from pagoda.runtime.serving import StopDeadline, exit_now
async def stop(hang):
    d = StopDeadline("router", float(sys.argv[2])).start()
    d.stage = "redis sync stop"
    if hang:
        await asyncio.Event().wait()
asyncio.run(stop(sys.argv[1] == "hang"))
exit_now(0)
"""


def _stopper(mode: str, seconds: float) -> tuple[subprocess.CompletedProcess, float]:
    t = time.monotonic()
    done = subprocess.run([sys.executable, "-c", _STOPPER, mode, str(seconds)], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)
    return done, time.monotonic() - t


def test_servers_accept_the_routers_keepalive_pings():
    server, client = dict(server_options(64)), dict(CLIENT_KEEPALIVE)
    # A server that saw pings more often than it allows would answer GOAWAY too_many_pings.
    assert server["grpc.http2.min_ping_interval_without_data_ms"] <= client["grpc.keepalive_time_ms"]
    assert server["grpc.keepalive_permit_without_calls"] == 1 and client["grpc.keepalive_permit_without_calls"] == 1
    assert server["grpc.so_reuseport"] == 0 and server["grpc.max_concurrent_streams"] == 64


def test_metrics_port_is_derived_from_the_grpc_port_unless_given():
    assert metrics_port(None, 50051) == 50051 + METRICS_PORT_OFFSET
    assert metrics_port(None, 50052) != metrics_port(None, 50051)
    assert metrics_port(9100, 50051) == 9100 and metrics_port(0, 50051) == 0 and metrics_port(None, 0) == 0
    with pytest.raises(StartupError, match="--metrics-port"):
        metrics_port(None, 60000)


def test_a_taken_port_names_itself_and_its_flag():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(StartupError, match=rf"^port {port} \(--metrics-port\)"):
            check_port_free("127.0.0.1", port, "--metrics-port")
    check_port_free("127.0.0.1", port, "--metrics-port")       # free again


def test_a_shutdown_stuck_past_its_deadline_exits_with_one_line_naming_the_stage():
    done, took = _stopper("hang", 0.5)
    assert done.returncode == 1, (done.returncode, done.stderr)
    assert done.stderr.strip().splitlines() == ["pagoda router: shutdown still in 'redis sync stop' after 0.5s; exiting"]
    assert took < 30


def test_a_shutdown_that_finishes_in_time_is_not_held_by_its_deadline():
    done, took = _stopper("finish", 30)
    assert done.returncode == 0 and done.stderr == "", done.stderr
    assert took < 20        # the armed timer is a daemon thread: it neither fires nor holds the exit


def test_a_router_whose_redis_died_still_stops_cleanly_on_sigterm(redis_server, start_router):
    router = start_router(redis_server.url)
    redis_server.stop()
    time.sleep(0.5)         # the sync notices and backs off, as in an outage
    router.kill(signal.SIGTERM)
    assert router.proc.wait(20) == 0, router.log()[-2000:]
    assert "shutdown still in" not in router.log()
