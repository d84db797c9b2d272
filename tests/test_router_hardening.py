"""The router against hostile requests and misbehaving workers (real router, stand-in workers on a
real redis-server): request limits before any work, a first-token deadline for workers that never
answer, stream checking, and tokenizer pinning by digest."""
from __future__ import annotations

import time

import grpc
import pytest

from pagoda.protos.pagoda.v1 import pagoda_pb2 as pb
from tests.test_router import generate, metric, prompt, stub_for, wait_for

pytestmark = pytest.mark.timeout(120)


def two_workers(redis_server, start_fake_worker, start_router, w1_opts=None, **router_flags):
    start_fake_worker(redis_server.url, "w1", **(w1_opts or {}))
    start_fake_worker(redis_server.url, "w2")
    router = start_router(redis_server.url, policy="round_robin", **router_flags)
    wait_for(lambda: metric(router, "pagoda_router_live_workers", model="m") == 2, 5, "workers")
    return router, stub_for(router)


def test_work_multiplying_fields_are_refused_before_any_work(redis_server, start_fake_worker, start_router):
    router, stub = two_workers(redis_server, start_fake_worker, start_router, max_n=8)
    for kw, field in ((dict(sampling=pb.SamplingParams(n=100_000)), "n"),
                      (dict(sampling=pb.SamplingParams(n=9)), "n"),
                      (dict(sampling=pb.SamplingParams(logit_bias={i: 1.0 for i in range(2000)})), "logit_bias"),
                      (dict(text="aa " * 400_000), "text"),
                      (dict(messages=[pb.ChatMessage(role="user", content="a")] * 2000), "messages"),
                      (dict(token_ids=[1] * 200_000), "token_ids"),
                      (dict(request_id="r" * 300, token_ids=[1]), "request_id"),
                      (dict(token_ids=[1] * 10, sampling=pb.SamplingParams(max_tokens=5000)), "max_tokens")):
        t0 = time.monotonic()
        req = pb.GenerateRequest(model="m", **kw)
        with pytest.raises(grpc.RpcError) as e:
            list(stub.Generate(req, timeout=10))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and e.value.details().startswith(field + ":"), \
            (field, e.value.details())
        assert time.monotonic() - t0 < 1.0, field
        out, err = generate(stub, prompt(1, 0), model="m")        # a normal request right after
        assert err is None and out[-1].finished
    assert sum(v for k, v in router.metrics().items() if k.startswith("pagoda_router_worker_attempts_total")) == 8


def test_a_worker_that_never_answers_costs_at_most_the_first_token_deadline(redis_server, start_fake_worker,
                                                                          start_router):
    router, stub = two_workers(redis_server, start_fake_worker, start_router, dict(hang=True),
                               first_token_timeout=1.0)
    for k in range(4):
        t0 = time.monotonic()
        out, err = generate(stub, prompt(k, k), model="m", timeout=30)
        assert err is None and out[-1].worker_id == "w2", err
        assert time.monotonic() - t0 < 1.0 + 0.8
    # Two timeouts open the breaker: later requests do not wait on w1 at all.
    assert metric(router, "pagoda_router_worker_attempts_total", worker="w1", result="timeout_before_first") == 2


def test_a_bad_first_response_fails_over_before_the_first_token(redis_server, start_fake_worker, start_router):
    router, stub = two_workers(redis_server, start_fake_worker, start_router, dict(misbehave="index"))
    for k in range(3):
        out, err = generate(stub, prompt(k, k), model="m")
        assert err is None and {r.worker_id for r in out} == {"w2"} and all(r.index == 0 for r in out), err
    assert metric(router, "pagoda_router_worker_attempts_total", worker="w1", result="bad_stream") >= 1


def test_a_stream_that_ends_unfinished_is_an_error_not_ok(redis_server, start_fake_worker, start_router):
    router, stub = two_workers(redis_server, start_fake_worker, start_router, dict(misbehave="no_finish"))
    errors = [generate(stub, prompt(k, k), model="m", max_tokens=3)[1] for k in range(2)]
    bad = [e for e in errors if e is not None]
    assert len(bad) == 1 and bad[0].code() == grpc.StatusCode.UNAVAILABLE and "unfinished" in bad[0].details()


def test_a_worker_that_ignores_max_tokens_is_cut_off_and_sits_out(redis_server, start_fake_worker, start_router):
    """A worker that streams past max_tokens: the client gets at most max_tokens of it, then an
    error naming the worker, and the worker's breaker opens at once (no second request goes to it)."""
    router, stub = two_workers(redis_server, start_fake_worker, start_router, dict(misbehave="overrun"))
    results = [generate(stub, prompt(k, k), model="m", max_tokens=4, timeout=30) for k in range(4)]
    cut = [(out, err) for out, err in results if err is not None]
    assert len(cut) == 1, [e for _, e in results]         # round robin sent one request to w1, then never again
    out, err = cut[0]
    assert err.code() == grpc.StatusCode.UNAVAILABLE and "w1" in err.details() and "max_tokens=4" in err.details()
    assert sum(len(r.token_ids) for r in out) <= 4
    assert all(err is None and out[-1].worker_id == "w2" for out, err in results if (out, err) != cut[0])
    assert metric(router, "pagoda_router_worker_attempts_total", worker="w1", result="failed_mid_stream") == 1


def test_a_worker_advertising_another_tokenizer_is_not_routed_to(redis_server, start_fake_worker, start_router):
    start_fake_worker(redis_server.url, "w1")
    start_fake_worker(redis_server.url, "w2")
    start_fake_worker(redis_server.url, "rogue", tokenizer_digest="0" * 32)
    router = start_router(redis_server.url, policy="round_robin")
    stub = stub_for(router)
    wait_for(lambda: metric(router, "pagoda_router_live_workers", model="m") == 3, 5, "workers")
    served = {generate(stub, text="aa bb", model="m")[0][-1].worker_id for _ in range(6)}
    assert served == {"w1", "w2"}
    assert "advertises tokenizer" in router.log() and "rogue" in router.log()
