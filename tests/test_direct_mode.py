"""Direct mode end to end: a real redis-server, two real keyed workers (tiny model, CPU) and a
router with tenant keys. A client's Route gets a worker and a grant, it streams from the worker
itself, with the tenancy and limits of a proxied request; the worker refuses grants for anything
else; a client that cannot reach the worker, or is refused, comes back through the router."""
from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from pagoda.clients import AsyncPagodaClient, PagodaClient
from pagoda.clients.up import free_port
from pagoda.protos.pagoda.v1 import pagoda_pb2 as pb
from pagoda.protos.pagoda.v1 import pagoda_pb2_grpc as pb_grpc
from pagoda.runtime.security import GRANT_HEADER
from tests.test_router import metric, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
SHARED = "You are a terse assistant for direct mode tests. " * 4 + "Name three rivers."
ALICE, BOB = (("authorization", "Bearer alice-key"),), (("authorization", "Bearer bob-key"),)


@pytest.fixture(scope="module")
def keyed(tiny_model, tmp_path_factory, redis_server_module, start_worker_module):
    d = tmp_path_factory.mktemp("keys")
    # Tenants exist at the router only: their keys open no worker; the router's admin key does.
    (d / "worker-keys").write_text("router-key router admin\n")
    (d / "router-keys").write_text("alice-key alice\nbob-key bob\n")
    (d / "router-key").write_text("router-key\n")
    with ThreadPoolExecutor(2) as pool:
        workers = list(pool.map(lambda w: start_worker_module(
            tiny_model, redis_url=redis_server_module.url, worker_id=w, num_kv_blocks=128,
            api_keys_file=str(d / "worker-keys"), timeout=240), ("da", "db")))
    return dict(workers=workers, keys=d, redis=redis_server_module)


@pytest.fixture
def router(keyed, start_router):
    d = keyed["keys"]
    r = start_router(keyed["redis"].url, api_keys_file=str(d / "router-keys"),
                     worker_api_key_file=str(d / "router-key"))
    wait_for(lambda: sum(v for k, v in r.metrics().items() if k.startswith("pagoda_router_live_workers{")) == 2,
             10, "the router to confirm both workers")
    return r


def req(prompt=SHARED, max_tokens=12, **kw) -> pb.GenerateRequest:
    return pb.GenerateRequest(text=prompt, sampling=pb.SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                                      ignore_eos=True), **kw)


def code_of(fn) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as e:
        fn()
    return e.value.code()


def proxied_ok(router) -> float:
    return metric(router, "pagoda_router_decisions_total", outcome="ok")


def test_direct_streams_from_the_worker_as_the_proxy_would(router, keyed):
    prompt = "Tell me about the sea, " * 3
    with PagodaClient(router.address, api_key="alice-key", retries=0) as proxy:
        want = proxy.complete(prompt, max_tokens=16, temperature=0.0, ignore_eos=True)
    before = proxied_ok(router)

    async def run():
        async with AsyncPagodaClient(router.address, api_key="alice-key", retries=0, direct=True) as c:
            chunks = [ch async for ch in c.generate(prompt, max_tokens=16, temperature=0.0, ignore_eos=True)]
            return chunks, await c.complete(prompt, max_tokens=16, temperature=0.0, ignore_eos=True)

    chunks, again = asyncio.run(run())
    assert [t for c in chunks for t in c.token_ids] == want.token_ids == again.token_ids
    assert "".join(c.text for c in chunks) == want.text and chunks[-1].finish_reason == "length"
    assert chunks[-1].worker_id in ("da", "db") and chunks[-1].usage.completion_tokens == 16
    # The router chose (and credited) both, relayed neither.
    assert metric(router, "pagoda_router_decisions_total", outcome="direct") == 2
    assert proxied_ok(router) == before
    # The blocking client too.
    with PagodaClient(router.address, api_key="alice-key", retries=0, direct=True) as c:
        assert c.complete(prompt, max_tokens=16, temperature=0.0, ignore_eos=True).token_ids == want.token_ids
    assert metric(router, "pagoda_router_decisions_total", outcome="direct") == 3 and proxied_ok(router) == before


def test_a_direct_stream_closed_early_ends_the_request_on_the_worker(router, keyed):
    async def run():
        async with AsyncPagodaClient(router.address, api_key="alice-key", retries=0, direct=True) as c:
            stream = c.generate("Tell me everything, " * 3, max_tokens=400, ignore_eos=True)
            first = await stream.__anext__()
            await stream.__anext__()
            await stream.aclose()
            return first.worker_id

    worker = keyed["workers"][("da", "db").index(asyncio.run(run()))]    # started in that order
    with PagodaClient(worker.address, api_key="router-key", retries=0) as admin:
        wait_for(lambda: (lambda load: load.running == 0 and load.free_blocks == load.num_blocks)(admin.load()),
                 10, "the worker to end the abandoned request")


def test_a_grant_carries_the_tenant(router):
    with PagodaClient(router.address, api_key="alice-key", retries=0, direct=True) as alice, \
            PagodaClient(router.address, api_key="bob-key", retries=0, direct=True) as bob:
        blocks = metric(router, "pagoda_router_index_blocks")
        first = alice.complete(SHARED, max_tokens=2, temperature=0.0)
        # The router learns the new blocks from the worker's events through Redis, a moment later;
        # routing before they arrive is a guess (CI once sent the second request to the other worker).
        wait_for(lambda: first.usage.cached_prompt_tokens > 0 or metric(router, "pagoda_router_index_blocks") > blocks,
                 10, "the router to index the first request's blocks")
        second = alice.complete(SHARED, max_tokens=2, temperature=0.0)
        assert second.worker_id == first.worker_id and second.usage.cached_prompt_tokens > 0
        # Same prompt, another tenant: served in bob's namespace, none of alice's cache.
        assert bob.complete(SHARED, max_tokens=2, temperature=0.0).usage.cached_prompt_tokens == 0
        # Request ids are per tenant: both run "job-1" at once, on whichever workers.
        with ThreadPoolExecutor(2) as pool:
            runs = [pool.submit(c.complete, SHARED, max_tokens=20, ignore_eos=True, request_id="job-1")
                    for c in (alice, bob)]
            assert [r.result(timeout=60).request_id for r in runs] == ["job-1", "job-1"]
    assert metric(router, "pagoda_router_decisions_total", outcome="direct") == 5


def test_workers_refuse_grants_for_anything_else(router, keyed):
    addresses = {w.address for w in keyed["workers"]}
    rch = grpc.insecure_channel(router.address)
    route = pb_grpc.GenerationStub(rch).Route(req(), metadata=ALICE, timeout=30)
    assert route.worker_address in addresses and route.grant and route.request.token_ids
    assert route.request.request_id and not route.request.HasField("text")
    other = (addresses - {route.worker_address}).pop()
    grant = ((GRANT_HEADER, route.grant),)
    chosen = pb_grpc.GenerationStub(grpc.insecure_channel(route.worker_address))

    def stream(stub, request, md):
        return list(stub.Generate(request, metadata=md, timeout=30))

    # No grant and a tenant key the workers do not hold: refused before anything runs.
    assert code_of(lambda: stream(chosen, route.request, ())) == grpc.StatusCode.UNAUTHENTICATED
    assert code_of(lambda: stream(chosen, route.request, ALICE)) == grpc.StatusCode.UNAUTHENTICATED
    # More tokens than the router admitted, or another worker than it chose: refused.
    more = pb.GenerateRequest()
    more.CopyFrom(route.request)
    more.sampling.max_tokens = 500
    with pytest.raises(grpc.RpcError) as e:
        stream(chosen, more, grant)
    assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED and "not signed for this request" in e.value.details()
    assert code_of(lambda: stream(pb_grpc.GenerationStub(grpc.insecure_channel(other)), route.request, grant)) \
        == grpc.StatusCode.PERMISSION_DENIED
    # The right request on the right worker: served, under the caller's id; once only.
    out = stream(chosen, route.request, grant)
    assert out[-1].finished and sum(len(r.token_ids) for r in out) == 12
    assert {r.request_id for r in out} == {route.request.request_id}
    with pytest.raises(grpc.RpcError) as e:
        stream(chosen, route.request, grant)
    assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED and "already used" in e.value.details()
    # A grant opens Generate on a worker and nothing else, and nothing on the router.
    assert code_of(lambda: pb_grpc.AdminStub(grpc.insecure_channel(route.worker_address)).GetLoad(
        pb.LoadRequest(), metadata=grant, timeout=10)) == grpc.StatusCode.UNAUTHENTICATED
    assert code_of(lambda: stream(pb_grpc.GenerationStub(rch), req(), grant)) == grpc.StatusCode.UNAUTHENTICATED
    # Route asks what Generate asks: a key, and a valid request (the field named).
    assert code_of(lambda: pb_grpc.GenerationStub(rch).Route(req(), timeout=10)) == grpc.StatusCode.UNAUTHENTICATED
    with pytest.raises(grpc.RpcError) as e:
        pb_grpc.GenerationStub(rch).Route(req(max_tokens=100000), metadata=ALICE, timeout=10)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "max_tokens" in e.value.details()
    # Workers do not route.
    admin = (("authorization", "Bearer router-key"),)
    assert code_of(lambda: chosen.Route(req(), metadata=admin, timeout=10)) == grpc.StatusCode.UNIMPLEMENTED


class _Detour(AsyncPagodaClient):
    """A direct client whose routes are spoilt after the router answers: the worker is somewhere
    it cannot connect to, or the grant is not the one the router signed."""

    def __init__(self, target, how, **kw):
        super().__init__(target, **kw)
        self.how = how

    async def _route(self, req, timeout, metadata):
        route = await super()._route(req, timeout, metadata)
        assert route is not None
        if self.how == "unreachable":
            route.worker_address = f"127.0.0.1:{free_port()}"
        else:
            route.grant = route.grant[:-1] + bytes([route.grant[-1] ^ 1])
        return route


@pytest.mark.parametrize("how", ["unreachable", "refused"])
def test_a_worker_out_of_reach_or_refusing_sends_the_request_through_the_router(router, how):
    prompt = "Count the stars, " * 3
    with PagodaClient(router.address, api_key="alice-key", retries=0) as proxy:
        want = proxy.complete(prompt, max_tokens=10, temperature=0.0, ignore_eos=True)
    before = proxied_ok(router)

    async def run():
        async with _Detour(router.address, how, api_key="alice-key", retries=0, direct=True,
                           direct_connect_timeout=1.0) as c:
            return await c.complete(prompt, max_tokens=10, temperature=0.0, ignore_eos=True, request_id="detour")

    got = asyncio.run(run())
    assert got.token_ids == want.token_ids and got.request_id == "detour"
    assert proxied_ok(router) == before + 1          # through the proxy, once
    assert metric(router, "pagoda_router_decisions_total", outcome="direct") == 1


def test_the_cli_streams_direct(router):
    import json
    import os
    import subprocess
    import sys
    r = subprocess.run([sys.executable, "-m", "pagoda.clients.cli", "generate", "--target", router.address, "--direct",
                        "--api-key", "alice-key", "Once upon a time", "--max-tokens", "5", "--temperature", "0",
                        "--json"], capture_output=True, text=True, timeout=60,
                       cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert r.returncode == 0, r.stderr
    last = json.loads(r.stdout.splitlines()[-1])
    assert last["finished"] and last["usage"]["completion_tokens"] == 5 and last["worker_id"] in ("da", "db")
    assert metric(router, "pagoda_router_decisions_total", outcome="direct") == 1


def test_direct_against_a_worker_streams_from_it(keyed):
    w = keyed["workers"][0]
    with PagodaClient(w.address, api_key="router-key", retries=0, direct=True) as c:
        assert c.complete(SHARED, max_tokens=3, temperature=0.0).usage.completion_tokens == 3
        assert not c._routes            # told UNIMPLEMENTED once: no Route before each request
        assert c.complete(SHARED, max_tokens=3, temperature=0.0).worker_id == "da"
