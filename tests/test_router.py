"""The router process against stand-in workers (tests/plugins/cluster.py) on a real redis-server:
routing quality, failover, Redis outages, replicas, namespaces, models and error mapping.
The same properties with real model workers are in test_router_e2e.py."""
from __future__ import annotations

import signal
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from protos.pagoda.v1 import pagoda_pb2 as pb
from protos.pagoda.v1 import pagoda_pb2_grpc as pb_grpc

pytestmark = pytest.mark.timeout(120)


def prompt(p: int, k: int, prefix_len: int = 96) -> list[int]:
    """Prefix `p` (shared) + a short suffix unique to request k."""
    return [1000 + p] * prefix_len + [k + 1] * 5


def generate(stub, ids=None, max_tokens=3, timeout=30, **kw):
    """-> (responses, grpc error or None)."""
    req = pb.GenerateRequest(sampling=pb.SamplingParams(max_tokens=max_tokens), **kw)
    if ids is not None:
        req.token_ids[:] = ids
    out = []
    try:
        for r in stub.Generate(req, timeout=timeout):
            out.append(r)
        return out, None
    except grpc.RpcError as e:
        return out, e


def metric(proc, name: str, **labels) -> float:
    want = name + ("{" + ",".join(f'{k}="{v}"' for k, v in sorted(labels.items())) + "}" if labels else "")
    for key, value in proc.metrics().items():
        if key == want or (labels and key.startswith(name + "{") and
                           all(f'{k}="{v}"' in key for k, v in labels.items())):
            return value
    return 0.0


def wait_for(cond, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return time.monotonic()
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def stub_for(proc):
    return pb_grpc.GenerationStub(grpc.insecure_channel(proc.address))


def run_workload(stub, n_prefixes=8, per_prefix=6):
    """Interleaved rounds: request k of every prefix, sent concurrently. -> list of (prefix, final)."""
    results = []
    with ThreadPoolExecutor(n_prefixes) as pool:
        for k in range(per_prefix):
            futs = [(p, pool.submit(generate, stub, prompt(p, k))) for p in range(n_prefixes)]
            for p, f in futs:
                out, err = f.result()
                assert err is None, err
                results.append((p, out[-1]))
    return results


def summarize(results, block_size=16):
    """-> (cached / cacheable after each prefix's first request, largest worker share)."""
    seen, cacheable, cached, per_worker = set(), 0, 0, {}
    for p, final in results:
        per_worker[final.worker_id] = per_worker.get(final.worker_id, 0) + 1
        if p in seen:
            cacheable += (final.usage.prompt_tokens - 1) // block_size * block_size
            cached += final.usage.cached_prompt_tokens
        seen.add(p)
    return cached / cacheable, max(per_worker.values()) / len(results)


def test_prefix_aware_beats_round_robin(redis_server, start_fake_worker, start_router):
    for w in ("w1", "w2"):
        start_fake_worker(redis_server.url, w)
    figures = {}
    for policy in ("prefix_aware", "round_robin"):
        router = start_router(redis_server.url, policy=policy)
        stub = stub_for(router)
        wait_for(lambda: metric(router, "pagoda_router_live_workers", model="m") == 2, 5, "workers")
        # Fresh prefixes per policy so that the first run's cache does not help the second.
        base = 0 if policy == "prefix_aware" else 100
        results = run_workload(_Offset(stub, base))
        figures[policy] = summarize(results)
        router.terminate()
    print(f"\nstand-in workers: cached fraction / largest share: {figures}")
    hit, share = figures["prefix_aware"]
    assert hit >= 0.9 and share <= 0.65
    assert figures["round_robin"][0] < hit


class _Offset:
    """A stub whose prompts use prefixes shifted by `base` (fresh, uncached ones)."""

    def __init__(self, stub, base):
        self.stub, self.base = stub, base

    def Generate(self, req, timeout=None):
        req.token_ids[:] = [t + self.base if t >= 1000 else t for t in req.token_ids]
        return self.stub.Generate(req, timeout=timeout)


def test_kill_9_during_a_burst(redis_server, start_fake_worker, start_router):
    w1 = start_fake_worker(redis_server.url, "w1", token_delay=0.05)
    start_fake_worker(redis_server.url, "w2", token_delay=0.05)
    router = start_router(redis_server.url)
    stub = stub_for(router)
    wait_for(lambda: metric(router, "pagoda_router_live_workers", model="m") == 2, 5, "workers")
    first_token: dict[int, str] = {}

    def one(i):
        out, err = [], None
        req = pb.GenerateRequest(token_ids=prompt(i, 0), sampling=pb.SamplingParams(max_tokens=60))
        try:
            for r in stub.Generate(req, timeout=30):
                first_token.setdefault(i, r.worker_id)
                out.append(r)
        except grpc.RpcError as e:
            err = e
        return out, err

    with ThreadPoolExecutor(24) as pool:
        futs = [pool.submit(one, i) for i in range(12)]
        time.sleep(1.0)                                   # the first 12 are streaming
        w1.kill(signal.SIGKILL)
        killed_at = time.monotonic()
        futs += [pool.submit(one, i) for i in range(12, 24)]   # not yet started anywhere
        results = [f.result(timeout=40) for f in futs]
    on_dead = [i for i in range(24) if first_token.get(i) == "w1"]
    assert on_dead, "the burst never reached w1"
    for i, (out, err) in enumerate(results):
        if first_token.get(i) == "w1":
            assert err is not None and err.code() == grpc.StatusCode.UNAVAILABLE, (i, err)
            assert "w1" in err.details()
        else:
            assert err is None, (i, err)
            assert out[-1].finished and out[-1].worker_id == "w2"
    # Within 3 s of the kill the router no longer picks w1, whatever the lease says.
    time.sleep(max(0.0, killed_at + 3.0 - time.monotonic()))
    before = sum(v for k, v in router.metrics().items() if 'worker="w1"' in k and "_total" in k)
    for i in range(6):
        out, err = generate(stub, prompt(100 + i, 0))
        assert err is None and out[-1].worker_id == "w2"
    after = sum(v for k, v in router.metrics().items() if 'worker="w1"' in k and "_total" in k)
    assert after == before
    wait_for(lambda: metric(router, "pagoda_router_live_workers", model="m") == 1, 2, "lease expiry")


def test_redis_outage_and_return(redis_server, start_fake_worker, start_router):
    for w in ("w1", "w2"):
        start_fake_worker(redis_server.url, w, snapshot=1.0)
    router = start_router(redis_server.url, speculative_ttl=0.3)
    stub = stub_for(router)
    wait_for(lambda: metric(router, "pagoda_router_live_workers", model="m") == 2, 5, "workers")
    owner = {p: generate(stub, prompt(p, 0))[0][-1].worker_id for p in range(4)}
    errors, stop_at = [], time.monotonic() + 4.0
    with ThreadPoolExecutor(4) as pool:
        def traffic(p):
            k = 1
            while time.monotonic() < stop_at:
                out, err = generate(stub, prompt(p, k))
                if err is not None:
                    errors.append(err)
                k += 1
        futs = [pool.submit(traffic, p) for p in range(4)]
        time.sleep(1.0)
        redis_server.stop()
        wait_for(lambda: metric(router, "pagoda_router_redis_connected") == 0, 3, "router to notice")
        time.sleep(1.5)
        redis_server.start()
        back = time.monotonic()
        for f in futs:
            f.result()
    assert not errors, errors[:3]
    assert metric(router, "pagoda_router_live_workers", model="m") == 2
    # Prefix-aware again through Redis itself (speculation lasts 0.3 s): a new prefix's blocks
    # must come back as events within 5 s of the return.
    wait_for(lambda: metric(router, "pagoda_router_redis_connected") == 1, 5 - (time.monotonic() - back), "reconnect")
    first = generate(stub, prompt(50, 0))[0][-1]
    time.sleep(0.5)
    again = generate(stub, prompt(50, 1))[0][-1]
    assert time.monotonic() - back < 8
    assert again.worker_id == first.worker_id and again.usage.cached_prompt_tokens == 96
    # The prefixes served before and during the outage are still found (on whichever worker
    # load spread them to).
    for p in owner:
        assert generate(stub, prompt(p, 99))[0][-1].usage.cached_prompt_tokens == 96


def test_replicas_agree_and_a_late_router_syncs_from_snapshots(redis_server, start_fake_worker, start_router):
    for w in ("w1", "w2"):
        start_fake_worker(redis_server.url, w, snapshot=1.0)
    a = start_router(redis_server.url)
    wait_for(lambda: metric(a, "pagoda_router_live_workers", model="m") == 2, 5, "workers")
    run_workload(stub_for(a), n_prefixes=6, per_prefix=2)
    b = start_router(redis_server.url, speculative_ttl=0.1)   # after the traffic: knows only Redis
    started = time.monotonic()
    blocks = metric(a, "pagoda_router_index_blocks")
    assert blocks >= 6 * 6
    wait_for(lambda: metric(b, "pagoda_router_index_blocks") == blocks, 1.5, "late router to hold the blocks")
    assert time.monotonic() - started < 1.5
    time.sleep(0.6)                                  # a heartbeat later: no in-flight credit left anywhere
    for p in range(6):
        wa = generate(stub_for(a), prompt(p, 7))[0][-1].worker_id
        time.sleep(0.6)
        wb = generate(stub_for(b), prompt(p, 8))[0][-1].worker_id
        assert wa == wb, p


def test_other_namespaces_and_models_never_match(redis_server, start_fake_worker, start_router):
    start_fake_worker(redis_server.url, "w1", model="m")
    start_fake_worker(redis_server.url, "w2", model="m")
    start_fake_worker(redis_server.url, "n1", model="n")
    router = start_router(redis_server.url)
    stub = stub_for(router)
    wait_for(lambda: metric(router, "pagoda_router_live_workers", model="n") == 1, 5, "workers")
    ids = prompt(1, 0)
    out, err = generate(stub, ids, model="m")
    assert err is None

    def predicted_after(**kw):
        before = metric(router, "pagoda_router_predicted_cached_tokens_total")
        out, err = generate(stub, ids, **kw)
        assert err is None, err
        return metric(router, "pagoda_router_predicted_cached_tokens_total") - before, out[-1]

    assert predicted_after(model="m")[0] == 96
    for kw in (dict(model="m", cache_salt="t2"), dict(model="m", adapter="lora-x"), dict(model="n")):
        predicted, final = predicted_after(**kw)
        assert predicted == 0 and final.usage.cached_prompt_tokens == 0, kw
    # Each model's requests go only to its own workers.
    for _ in range(4):
        assert generate(stub, prompt(9, 0), model="n")[0][-1].worker_id == "n1"
        assert generate(stub, prompt(9, 0), model="m")[0][-1].worker_id in ("w1", "w2")
    _, err = generate(stub, ids)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "model" in err.details()
    _, err = generate(stub, ids, model="zzz")
    assert err.code() == grpc.StatusCode.UNAVAILABLE and "zzz" in err.details()


def test_errors_tokenization_health_and_reflection(redis_server, start_fake_worker, start_router):
    start_fake_worker(redis_server.url, "w1")
    start_fake_worker(redis_server.url, "w2")
    router = start_router(redis_server.url)
    stub = stub_for(router)
    wait_for(lambda: metric(router, "pagoda_router_live_workers", model="m") == 2, 5, "workers")
    # The worker's INVALID_ARGUMENT reaches the client once: no retry, no circuit breaking.
    _, err = generate(stub, token_ids=[], text="")
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "token_ids" in err.details()
    _, err = generate(stub, [1, 2, 3], text="a b")
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "text/messages/token_ids" in err.details()
    assert metric(router, "pagoda_router_decisions_total", outcome="rejected", policy="prefix_aware") == 2
    # Text is tokenized once at the router with the worker's tokenizer; ids are forwarded.
    out, err = generate(stub, text="aa bb zz", max_tokens=2)
    assert err is None and out[-1].usage.prompt_tokens == 3
    toks = stub.Tokenize(pb.TokenizeRequest(text="aa bb zz"))
    from protos.tokenization import PromptTokenizer
    from tests.plugins.cluster import word_tokenizer_json
    assert list(toks.token_ids) == PromptTokenizer(word_tokenizer_json()).encode_text("aa bb zz")
    info = stub.GetModelInfo(pb.ModelInfoRequest())
    assert info.model == "m" and info.block_size == 16
    ch = grpc.insecure_channel(router.address)
    assert health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest()).status == \
        health_pb2.HealthCheckResponse.SERVING
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
    refl = reflection_pb2_grpc.ServerReflectionStub(ch)
    resp = next(refl.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")])))
    assert "pagoda.v1.Generation" in {s.name for s in resp.list_services_response.service}
    hist = router.metrics()
    assert hist["pagoda_router_decision_seconds_count"] >= 1
