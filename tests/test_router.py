"""The router process against stand-in workers (tests/plugins/cluster.py) on a real redis-server:
namespaces, several models, error mapping, tokenization, health and reflection. Routing quality,
failover, Redis outages and replicas are tested with real workers in test_router_e2e.py."""
from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pagoda.protos.pagoda.v1 import pagoda_pb2 as pb
from pagoda.protos.pagoda.v1 import pagoda_pb2_grpc as pb_grpc

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
    assert err.code() == grpc.StatusCode.NOT_FOUND and "zzz" in err.details()


def test_errors_tokenization_health_and_reflection(redis_server, start_fake_worker, start_router):
    start_fake_worker(redis_server.url, "w1")
    start_fake_worker(redis_server.url, "w2")
    router = start_router(redis_server.url)
    stub = stub_for(router)
    wait_for(lambda: metric(router, "pagoda_router_live_workers", model="m") == 2, 5, "workers")
    # Refused at the router naming the field the caller sent: no retry, no circuit breaking.
    _, err = generate(stub, token_ids=[], text="")
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and err.details().startswith("text:")
    _, err = generate(stub, [1, 2, 3], text="a b")
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "text/messages/token_ids" in err.details()
    assert metric(router, "pagoda_router_decisions_total", outcome="rejected", policy="prefix_aware") == 2
    # Text is tokenized once at the router with the worker's tokenizer; ids are forwarded.
    out, err = generate(stub, text="aa bb zz", max_tokens=2)
    assert err is None and out[-1].usage.prompt_tokens == 3
    toks = stub.Tokenize(pb.TokenizeRequest(text="aa bb zz"))
    from pagoda.runtime.tokenization import PromptTokenizer
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
    # Histograms per policy and model: decision time, TTFT and latency as the client sees them, and
    # per decision how far the predicted cache hit was from the worker's report.
    labels = {"policy": "prefix_aware", "model": "m"}
    for name in ("decision_seconds", "time_to_first_token_seconds", "e2e_request_latency_seconds",
                 "cached_tokens_error"):
        assert metric(router, f"pagoda_router_{name}_count", **labels) >= 1, name
    assert metric(router, "pagoda_router_e2e_request_latency_seconds_sum", **labels) >= \
        metric(router, "pagoda_router_time_to_first_token_seconds_sum", **labels) > 0
    assert metric(router, "pagoda_router_cached_tokens_error_bucket", le="-1.0", **labels) == 0


def test_breaker_keeps_a_failing_worker_out_then_lets_one_trial_through(redis_server, start_fake_worker,
                                                                      start_router):
    # round_robin over the workers the breaker allows, sorted by id: the order is predictable.
    start_fake_worker(redis_server.url, "w1", fail_first=2, token_delay=0.5)
    start_fake_worker(redis_server.url, "w2")
    router = start_router(redis_server.url, policy="round_robin")
    stub = stub_for(router)
    wait_for(lambda: metric(router, "pagoda_router_live_workers", model="m") == 2, 5, "workers")

    def served_by(k):
        out, err = generate(stub, prompt(k, k), model="m")
        assert err is None, err
        return out[-1].worker_id

    # w1 fails twice before a first token: each time the request is retried on w2.
    assert [served_by(k) for k in range(4)] == ["w2", "w2", "w2", "w2"]
    assert metric(router, "pagoda_router_worker_attempts_total", worker="w1", result="failed_before_first") == 2
    time.sleep(2.3)                              # the breaker's first cooldown is 2 s
    trial = ThreadPoolExecutor(1).submit(served_by, 10)
    time.sleep(0.2)                              # the trial is on w1 (slow) ...
    # ... so w1 is out for everyone else until it answers, even where round robin points at it.
    assert [served_by(11), served_by(12)] == ["w2", "w2"]
    assert trial.result(timeout=10) == "w1"
    # The trial succeeded: w1 is back in the rotation.
    assert sorted(served_by(k) for k in (13, 14)) == ["w1", "w2"]
