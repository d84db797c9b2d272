"""TLS, mTLS and API keys on both hops, with real servers: a router (TLS + mTLS + keys) in front
of a real tiny worker (TLS + mTLS + keys) that it reaches with its own certificate and admin key.
Certificates are made at test time (tests/plugins/certs.py)."""
from __future__ import annotations

import signal
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pagoda.clients import PagodaClient
from tests.test_router import wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
PROMPT = "You are a helpful assistant who answers briefly. " * 4 + "What is the capital of France?"
SHARED = "You are a terse assistant for routing tests. " * 4 + "Name three rivers."


@pytest.fixture(scope="module")
def secured(tiny_model, test_certs, tmp_path_factory, redis_server_module, start_worker_module):
    d = tmp_path_factory.mktemp("keys")
    (d / "worker-keys").write_text("# worker keys\nrouter-key router admin\nops-key ops admin\nalice-key alice\nbob-key bob\n")
    (d / "router-keys").write_text("alice-key alice\nbob-key bob\n")
    (d / "router-key").write_text("router-key\n")
    c = test_certs
    worker = start_worker_module(tiny_model, redis_url=redis_server_module.url, worker_id="tls-w",
                                 tls_cert=c.server_cert, tls_key=c.server_key, tls_client_ca=c.ca,
                                 api_keys_file=str(d / "worker-keys"), timeout=240)
    return dict(worker=worker, keys=d, redis=redis_server_module)


def client(address, certs, key=None, mtls=True):
    kw = dict(root_certificates=open(certs.ca, "rb").read())
    if mtls:
        kw.update(private_key=open(certs.client_key, "rb").read(),
                  certificate_chain=open(certs.client_cert, "rb").read())
    return PagodaClient(address, retries=0, api_key=key or "", **kw)


def test_worker_tls_mtls_and_keys(secured, test_certs):
    address = secured["worker"].address
    with grpc.insecure_channel(address) as ch:             # plaintext to a TLS server fails
        with pytest.raises(grpc.RpcError):
            health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=3)
    with client(address, test_certs, "alice-key", mtls=False) as c:    # no client certificate
        with pytest.raises(grpc.RpcError) as e:
            c.model_info(timeout=3)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    with client(address, test_certs) as c:
        assert health_pb2_grpc.HealthStub(c.channel).Check(health_pb2.HealthCheckRequest()).status == \
            health_pb2.HealthCheckResponse.SERVING                       # health stays open
        with pytest.raises(grpc.RpcError) as e:
            c.complete(PROMPT, max_tokens=2)
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with client(address, test_certs, "not-a-key") as c:
        with pytest.raises(grpc.RpcError) as e:
            c.model_info()
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with client(address, test_certs, "alice-key") as c:
        assert c.complete(PROMPT, max_tokens=2).choices[0].finish_reason == "length"
        for call in (c.drain, c.load, lambda: c.abort("x")):
            with pytest.raises(grpc.RpcError) as e:
                call()
            assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED, call
    with client(address, test_certs, "ops-key") as c:
        assert c.load().num_blocks > 0                                  # an admin key may
    # Request ids are per tenant on a worker too: alice and bob both run "job-1" at once.
    with client(address, test_certs, "alice-key") as alice, client(address, test_certs, "bob-key") as bob:
        with ThreadPoolExecutor(2) as pool:
            runs = [pool.submit(cl.complete, PROMPT, max_tokens=20, ignore_eos=True, request_id="job-1")
                    for cl in (alice, bob)]
            assert [r.result(timeout=60).request_id for r in runs] == ["job-1", "job-1"]


def test_router_tls_keys_and_tenant_isolation(secured, test_certs, start_router):
    from pagoda.clients.up import free_port
    # Not the prompt of the worker test: there bob cached PROMPT in his own namespace already
    # (the same namespace the router gives him, as it should be).
    c, d = test_certs, secured["keys"]
    http_port = free_port()
    router = start_router(secured["redis"].url, http_port=http_port, tls_cert=c.server_cert, tls_key=c.server_key,
                          tls_client_ca=c.ca,
                          api_keys_file=str(d / "router-keys"), worker_tls_ca=c.ca, worker_tls_cert=c.client_cert,
                          worker_tls_key=c.client_key, worker_api_key_file=str(d / "router-key"))
    wait_for(lambda: sum(v for k, v in router.metrics().items() if k.startswith("pagoda_router_live_workers{")) == 1,
             10, "the router to confirm the TLS worker")
    with grpc.insecure_channel(router.address) as ch:
        with pytest.raises(grpc.RpcError):
            health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=3)
    with client(router.address, test_certs) as anon:
        with pytest.raises(grpc.RpcError) as e:
            anon.complete(SHARED, max_tokens=2)
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with client(router.address, test_certs, "alice-key") as alice, \
            client(router.address, test_certs, "bob-key") as bob:
        first = alice.complete(SHARED, max_tokens=2, temperature=0.0)
        time.sleep(0.5)
        assert alice.complete(SHARED, max_tokens=2, temperature=0.0).usage.cached_prompt_tokens > 0
        # Same prompt, another tenant: nothing of alice's cache is visible to bob.
        assert bob.complete(SHARED, max_tokens=2, temperature=0.0).usage.cached_prompt_tokens == 0
        assert first.request_id
        # Request ids are per tenant: both may use "job-1" at once.
        with ThreadPoolExecutor(2) as pool:
            runs = [pool.submit(cl.complete, SHARED, max_tokens=20, ignore_eos=True, request_id="job-1")
                    for cl in (alice, bob)]
            assert [r.result(timeout=60).request_id for r in runs] == ["job-1", "job-1"]
    # The OpenAI HTTP front takes the same keys (OpenAI clients send `Authorization: Bearer KEY`).
    assert _http(http_port, None) == 401 and _http(http_port, "not-a-key") == 401
    assert _http(http_port, "bob-key") == 200
    # Keys are reloaded on SIGHUP; a file that no longer parses leaves the old keys in force.
    with open(d / "router-keys", "a") as f:
        f.write("carol-key carol\n")
    router.kill(signal.SIGHUP)
    with client(router.address, test_certs, "carol-key") as carol:
        wait_for(lambda: _ok(carol), 5, "the reloaded key")
        (d / "router-keys").write_text("garbage line with too many fields\n")
        router.kill(signal.SIGHUP)
        time.sleep(0.5)
        assert _ok(carol) and "reload failed" in router.log()


def _ok(c) -> bool:
    try:
        return c.complete(PROMPT, max_tokens=1).choices[0].finish_reason == "length"
    except grpc.RpcError as e:
        assert e.code() == grpc.StatusCode.UNAUTHENTICATED
        return False


def _http(port: int, key: str | None) -> int:
    import json
    import urllib.error
    import urllib.request
    body = json.dumps({"prompt": PROMPT, "max_tokens": 1}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body,
                                 {"Content-Type": "application/json",
                                  **({"Authorization": f"Bearer {key}"} if key else {})})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
