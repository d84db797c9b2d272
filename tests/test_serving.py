"""protos/serving.py: server options that agree with the router's client keepalive, the derived
metrics port, and port checks that name the port and its flag."""
import socket

import pytest

from protos.serving import CLIENT_KEEPALIVE, METRICS_PORT_OFFSET, StartupError, check_port_free, metrics_port, server_options


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
