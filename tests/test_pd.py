"""Prefill/decode disaggregation end to end (router/disagg.py): a real redis-server, a router, one
prefill and one decode CPU worker (tiny Llama), all with keys: a tenant calls the router, the
router calls workers with its admin key acting for the tenant, the decode worker fetches with its
peer key. Through the router, a prompt is computed on the prefill worker and streamed by the
decode worker, which fetched its blocks (so both legs hashed in the tenant's namespace): the
tokens equal a colocated run's and transformers'. A prefill worker killed before the request, and a fetch whose
bytes are spoilt, still give the full, correct stream (decode recomputes). The tests run in file
order: the second kills the first prefill worker, the third starts a faulty one."""
from __future__ import annotations

import urllib.request

import grpc
import pytest

from pagoda.gpu_worker.serving.kv_transfer import FAULT_ENV
from pagoda.protos.pagoda.v1 import pagoda_pb2 as pb
from pagoda.protos.pagoda.v1 import pagoda_pb2_grpc as pb_grpc
from tests.plugins.cluster import _spawn
from tests.test_kv_transfer import BLOCK, FETCHABLE, PROMPT, TENANT, keys, reference  # noqa: F401 (fixtures)
from tests.test_router import metric, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

FLAGS = dict(num_kv_blocks=64, block_size=BLOCK, max_model_len=512, snapshot_interval=1.0, metrics=True)


@pytest.fixture(scope="module")
def pd(tiny_model, redis_server_module, start_worker_module, tmp_path_factory, keys):  # noqa: F811
    url = redis_server_module.url
    flags = dict(FLAGS, redis_url=url, api_keys_file=str(keys / "keys"))
    decode = start_worker_module(tiny_model, worker_id="dec", kv_role="decode",
                                 kv_peer_api_key_file=str(keys / "peer"), **flags)
    prefill = start_worker_module(tiny_model, worker_id="pre", kv_role="prefill", **flags)
    from pagoda.clients.up import free_port
    procs: list = []
    port = free_port()
    router = _spawn(["-m", "pagoda.router", "--host", "127.0.0.1", "--port", "0", "--redis-url", url,
                     "--metrics-port", str(port), "--http-port", "0", "--api-keys-file", str(keys / "keys"),
                     "--worker-api-key-file", str(keys / "peer")],
                    tmp_path_factory.mktemp("router"), "router", procs, port)
    wait_for(lambda: live(router) == 2, 15, "router to see both workers")
    channel = grpc.insecure_channel(router.address)
    yield dict(url=url, router=router, stub=pb_grpc.GenerationStub(channel), decode=decode, prefill=prefill,
               start=lambda **kw: start_worker_module(tiny_model, kv_role="prefill", **flags, **kw))
    channel.close()
    for p in procs:
        p.kill()


def live(router) -> float:
    return sum(v for k, v in router.metrics().items() if k.startswith("pagoda_router_live_workers{"))


def generate(stub, salt: str, max_tokens: int = 12):
    """(tokens, final response); `salt` gives each test prompt blocks no worker holds yet."""
    req = pb.GenerateRequest(token_ids=PROMPT, cache_salt=salt,
                             sampling=pb.SamplingParams(temperature=0.0, max_tokens=max_tokens))
    tokens, last = [], None
    for r in stub.Generate(req, timeout=120, metadata=[("authorization", f"Bearer {TENANT}")]):
        tokens += r.token_ids
        last = r
    assert last is not None and last.finished
    return tokens, last


def worker_metrics(worker) -> str:
    return urllib.request.urlopen(f"http://127.0.0.1:{worker.metrics_port}/metrics", timeout=5).read().decode()


def test_prefill_then_decode_gives_the_colocated_tokens(pd, reference):  # noqa: F811
    got, last = generate(pd["stub"], "one")
    # The decode worker streamed it, and its prompt blocks came from the prefill worker, whole.
    assert last.worker_id == "dec"
    assert last.usage.cached_prompt_tokens == FETCHABLE
    assert f"kv fetch from {pd['prefill'].address}: {FETCHABLE // BLOCK} of {FETCHABLE // BLOCK} blocks" \
        in pd["decode"].log()
    assert metric(pd["router"], "pagoda_router_pd_requests_total") == 1
    assert metric(pd["router"], "pagoda_router_worker_attempts_total", worker="pre", result="prefill_ok") == 1
    # Colocated: the same prompt computed whole by one worker (another salt: nothing cached).
    with grpc.insecure_channel(pd["decode"].address) as ch:
        req = pb.GenerateRequest(token_ids=PROMPT, cache_salt="colocated",
                                 sampling=pb.SamplingParams(temperature=0.0, max_tokens=12))
        finals = list(pb_grpc.GenerationStub(ch).Generate(req, timeout=120,
                                                          metadata=[("authorization", f"Bearer {TENANT}")]))
    colocated = [t for r in finals for t in r.token_ids]
    assert finals[-1].usage.cached_prompt_tokens == 0
    assert got == colocated == reference
    # Latency by role: the decode worker's first tokens, the prefill worker's one-token legs.
    assert 'kv_role="decode"' in worker_metrics(pd["decode"])
    text = worker_metrics(pd["prefill"])
    assert 'pagoda:time_to_first_token_seconds_count{kv_role="prefill"' in text


def test_a_dead_prefill_worker_leaves_a_full_stream(pd, reference):  # noqa: F811
    pd["prefill"].kill()
    pd["prefill"].proc.wait()
    got, last = generate(pd["stub"], "two")
    assert got == reference and last.worker_id == "dec"
    # Whether the router still saw the lease (a failed prefill leg) or not (colocated): recomputed.
    assert last.usage.cached_prompt_tokens == 0
    r = pd["router"]
    assert metric(r, "pagoda_router_pd_requests_total") == 1
    assert metric(r, "pagoda_router_pd_fallbacks_total", reason="prefill_failed") <= 1


def test_a_spoilt_fetch_recomputes_with_the_same_tokens(pd, reference):  # noqa: F811
    faulty = pd["start"](worker_id="pre2", env={FAULT_ENV: "corrupt:2"})
    r = pd["router"]
    wait_for(lambda: live(r) == 2, 15, "router to see the new prefill worker (and not the dead one)")
    got, last = generate(pd["stub"], "three")
    assert got == reference and last.worker_id == "dec"
    assert last.usage.cached_prompt_tokens == 0
    assert f"kv fetch from {faulty.address}" in pd["decode"].log()
    assert "recomputing from block 0" in pd["decode"].log()
    assert metric(r, "pagoda_router_pd_requests_total") == 2
    assert metric(r, "pagoda_router_pd_fallbacks_total", reason="recomputed") == 1
