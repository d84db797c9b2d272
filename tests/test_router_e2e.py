"""End to end: a real redis-server, routers and two real workers (tiny model, CPU).

The workers start once for the module (they take seconds each); the tests run in file order and
the kill -9 test, which ends a worker, runs last.
"""
from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from pagoda.protos.pagoda.v1 import pagoda_pb2 as pb
from pagoda.protos.pagoda.v1 import pagoda_pb2_grpc as pb_grpc
from pagoda.runtime.tokenization import PromptTokenizer
from tests.test_router import metric, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
BLOCK = 16
TOPICS = ["the weather", "the sea", "the mountains", "the stars", "counting numbers", "Python loops",
          "the capital of France", "a lazy dog", "brown foxes", "paged caches", "routers", "small models"]


def system_prompt(p: int) -> str:
    topic = TOPICS[p % len(TOPICS)]
    # Long enough that its cached prefill outweighs a few requests in flight on its holder: the
    # router trades the two in time, and a 50-token prefix is worth less than one queued request.
    rules = " ".join(f"Rule {i}: keep to {topic} and be brief." for i in range(12))
    return (f"You are assistant number {p}. You answer questions about {topic}, briefly and politely. "
            f"Always mention {topic} once, and never talk about anything else than {topic}. {rules}")


def chat(p: int, k: int) -> list[pb.ChatMessage]:
    return [pb.ChatMessage(role="system", content=system_prompt(p)),
            pb.ChatMessage(role="user", content=f"Question {k}: what is new today?")]


def ask(stub, p, k, max_tokens=4, **kw):
    req = pb.GenerateRequest(messages=chat(p, k), sampling=pb.SamplingParams(max_tokens=max_tokens,
                                                                            temperature=0), **kw)
    return list(stub.Generate(req, timeout=60))[-1]


@pytest.fixture(scope="module")
def cluster(tiny_model, redis_server_module, start_worker_module):
    url = redis_server_module.url
    with ThreadPoolExecutor(2) as pool:
        workers = list(pool.map(lambda w: start_worker_module(tiny_model, redis_url=url, worker_id=w,
                                                              num_kv_blocks=256, snapshot_interval=1.0,
                                                              timeout=240),
                                ("wa", "wb")))
    return dict(redis=redis_server_module, workers=workers, tokenizer=PromptTokenizer.from_dir(tiny_model))


def live(router) -> float:
    return sum(v for k, v in router.metrics().items() if k.startswith("pagoda_router_live_workers{"))


def router_for(cluster, start_router, **flags):
    router = start_router(cluster["redis"].url, **flags)
    wait_for(lambda: live(router) == 2, 10, "router to see both workers")
    return router, pb_grpc.GenerationStub(grpc.insecure_channel(router.address))


def workload(stub, tok, first_prefix, n_prefixes=8, per_prefix=6):
    """8 system prompts x 6 requests, interleaved in concurrent rounds. -> (hit fraction, shares)."""
    first_ids, cacheable, cached, per_worker = {}, 0, 0, {}
    with ThreadPoolExecutor(n_prefixes) as pool:
        for k in range(per_prefix):
            # Each round starts one prefix later, so a prefix's requests do not keep one position
            # in the arrival order (with an even count, round robin would pin them to one worker).
            prefixes = [first_prefix + (k + i) % n_prefixes for i in range(n_prefixes)]
            finals = list(pool.map(lambda p: ask(stub, p, k), prefixes))
            for p, final in zip(prefixes, finals):
                per_worker[final.worker_id] = per_worker.get(final.worker_id, 0) + 1
                ids = tok.encode_chat([{"role": m.role, "content": m.content} for m in chat(p, k)])
                assert final.usage.prompt_tokens == len(ids)      # the router tokenized as the worker does
                if p not in first_ids:
                    first_ids[p] = ids
                    continue
                common = next((i for i, (a, b) in enumerate(zip(ids, first_ids[p])) if a != b),
                              min(len(ids), len(first_ids[p])))
                cacheable += min(common, len(ids) - 1) // BLOCK * BLOCK
                cached += final.usage.cached_prompt_tokens
    total = n_prefixes * per_prefix
    return cached / cacheable, {w: n / total for w, n in per_worker.items()}


def test_prefix_aware_vs_round_robin(cluster, start_router):
    figures = {}
    for first, policy in ((0, "prefix_aware"), (100, "round_robin")):
        router, stub = router_for(cluster, start_router, policy=policy)
        figures[policy] = workload(stub, cluster["tokenizer"], first)
        router.terminate()
    for policy, (hit, shares) in figures.items():
        print(f"\n{policy}: {hit:.1%} of cacheable prompt tokens reported cached; worker shares {shares}")
    hit, shares = figures["prefix_aware"]
    assert hit >= 0.90
    assert max(shares.values()) <= 0.65
    assert figures["round_robin"][0] < hit


def test_replicas_agree_and_late_router_syncs(cluster, start_router):
    a, stub_a = router_for(cluster, start_router)
    for p in range(200, 206):
        ask(stub_a, p, 0)
    b, stub_b = router_for(cluster, start_router)          # started after the traffic
    wait_for(lambda: metric(b, "pagoda_router_index_blocks") >= metric(a, "pagoda_router_index_blocks") > 0,
             1.5, "the late router to hold the workers' blocks within one snapshot period")
    time.sleep(0.6)                                       # a heartbeat: in-flight credits are settled
    for p in range(200, 206):
        wa = ask(stub_a, p, 1).worker_id
        time.sleep(0.6)
        final = ask(stub_b, p, 2)
        assert final.worker_id == wa and final.usage.cached_prompt_tokens > 0, p


def test_other_salt_or_model_never_matches(cluster, start_router):
    router, stub = router_for(cluster, start_router)
    ask(stub, 300, 0)
    assert ask(stub, 300, 0).usage.cached_prompt_tokens > 0
    before = metric(router, "pagoda_router_predicted_cached_tokens_total")
    salted = ask(stub, 300, 0, cache_salt="tenant-2")
    assert salted.usage.cached_prompt_tokens == 0
    assert metric(router, "pagoda_router_predicted_cached_tokens_total") == before
    with pytest.raises(grpc.RpcError) as e:                # the tiny workers serve no adapters
        ask(stub, 300, 0, adapter="lora-x")
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "adapter" in e.value.details()
    with pytest.raises(grpc.RpcError) as e:
        ask(stub, 300, 0, model="another-model")
    assert e.value.code() == grpc.StatusCode.NOT_FOUND and "another-model" in e.value.details()


def test_redis_stopped_and_started_mid_run(cluster, start_router):
    router, stub = router_for(cluster, start_router, speculative_ttl=0.3)
    redis = cluster["redis"]
    errors, stop_at = [], time.monotonic() + 5.0

    def traffic(p):
        k = 0
        while time.monotonic() < stop_at:
            try:
                ask(stub, p, k)
            except grpc.RpcError as e:
                errors.append(e)
            k += 1

    with ThreadPoolExecutor(4) as pool:
        futs = [pool.submit(traffic, p) for p in range(400, 404)]
        time.sleep(1.0)
        redis.stop()
        time.sleep(2.0)
        redis.start()
        back = time.monotonic()
        for f in futs:
            f.result()
    assert not errors, [e.details() for e in errors[:3]]
    # Prefix-aware again through Redis (speculation lasts only 0.3 s) within 5 s of its return.
    wait_for(lambda: metric(router, "pagoda_router_redis_connected") == 1, 5, "router reconnect")
    wait_for(lambda: live(router) == 2, 5, "leases back")
    for p in range(400, 404):                             # what was cached before is still found
        assert ask(stub, p, 99).usage.cached_prompt_tokens > 0
    first = ask(stub, 410, 0)
    time.sleep(1.0)                                       # speculation (0.3 s) long gone
    again = ask(stub, 410, 1)
    assert again.worker_id == first.worker_id and again.usage.cached_prompt_tokens > 0
    assert time.monotonic() - back < 5.0 + 2.0


def test_kill_9_during_a_burst(cluster, start_router):
    router, stub = router_for(cluster, start_router)
    victim = cluster["workers"][0]
    first_token: dict[int, str] = {}

    def one(i):  # max_tokens must fit max_model_len (1024) with the 400-500 token chat, or it is refused
        req = pb.GenerateRequest(messages=chat(500 + i, 0),
                                 sampling=pb.SamplingParams(max_tokens=450, ignore_eos=True, temperature=0))
        try:
            for r in stub.Generate(req, timeout=120):
                first_token.setdefault(i, r.worker_id)
                if r.finished:
                    return r, None
            return None, None
        except grpc.RpcError as e:
            return None, e

    with ThreadPoolExecutor(16) as pool:
        futs = [pool.submit(one, i) for i in range(8)]
        wait_for(lambda: sum(1 for w in first_token.values() if w == "wa") >= 2, 30, "streams on wa")
        victim.kill()                                          # SIGKILL to its process group
        killed_at = time.monotonic()
        futs += [pool.submit(one, i) for i in range(8, 16)]
        results = [f.result(timeout=150) for f in futs]
    for i, (final, err) in enumerate(results):
        if first_token.get(i) == "wa":
            assert err is not None and err.code() == grpc.StatusCode.UNAVAILABLE, (i, err)
        else:
            assert err is None and final.worker_id == "wb", (i, err)
    time.sleep(max(0.0, killed_at + 3.0 - time.monotonic()))
    before = sum(v for k, v in router.metrics().items() if 'worker="wa"' in k and "_total" in k)
    for i in range(4):
        assert ask(stub, 600 + i, 0).worker_id == "wb"
    assert sum(v for k, v in router.metrics().items() if 'worker="wa"' in k and "_total" in k) == before
    wait_for(lambda: live(router) == 1, 3, "the dead worker's lease to expire")
