"""Fuzzing GenerateRequest with hypothesis against a real worker and a real router (tiny model, CPU,
a real redis-server): random fields, sizes and unicode. Every answer must be a complete stream or a
client error that names a field; both servers must stay up and serving, and the worker must end
with every KV block free (nothing leaked by refused, failed or cancelled requests).

Bounded: a fixed number of examples per target, derandomized (the same examples every run, so CI
is reproducible), no example database."""
from __future__ import annotations

import re
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagoda.clients import PagodaClient
from pagoda.protos.pagoda.v1 import pagoda_pb2 as pb
from pagoda.protos.pagoda.v1 import pagoda_pb2_grpc as pb_grpc
from tests.test_router import wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
MAX_LEN, VOCAB_MARGIN, EXAMPLES = 256, 8, 60
CLIENT_ERRORS = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND, grpc.StatusCode.OUT_OF_RANGE,
                 grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.RESOURCE_EXHAUSTED}
# "n: at most ...", "text, token_ids: give exactly one ...", "prompt: ..." -- the field comes first.
NAMED = re.compile(r"^[a-z_]+(, [a-z_]+)*:")

INT32 = st.integers(-(2**31), 2**31 - 1)
WILD_FLOATS = st.floats(width=32, allow_nan=True, allow_infinity=True)
# Mostly plausible values, so that many requests reach the engine; sometimes anything at all.
FLOATS = st.one_of(st.floats(0, 1.5, width=32), st.floats(0, 1.5, width=32), WILD_FLOATS)
TEXT = st.text(st.characters(blacklist_categories=("Cs",)), max_size=300)


def _small_int(lo: int, hi: int):
    """Mostly in [lo, hi], sometimes anything an int32 holds."""
    return st.one_of(st.integers(lo, hi), st.integers(lo, hi), INT32)


@st.composite
def sampling(draw):
    sp = pb.SamplingParams()
    optional = {"n": _small_int(-1, 3), "temperature": FLOATS, "top_p": FLOATS, "top_k": _small_int(-2, 50),
                "min_p": FLOATS, "repetition_penalty": FLOATS, "presence_penalty": FLOATS,
                "frequency_penalty": FLOATS, "seed": st.integers(-(2**63), 2**63 - 1),
                # Small, so that accepted requests stay fast on a CPU; big ones must be refused.
                "max_tokens": st.one_of(st.integers(-1, 6), st.sampled_from([MAX_LEN, 2**31 - 1])),
                "min_tokens": _small_int(-1, 4), "logprobs": _small_int(-1, 22),
                "skip_special_tokens": st.booleans()}
    for name, strategy in optional.items():
        if draw(st.integers(0, 3)) == 0:
            setattr(sp, name, draw(strategy))
    sp.stop[:] = draw(st.one_of(st.just([]), st.lists(TEXT, max_size=18)))
    sp.stop_token_ids[:] = draw(st.one_of(st.just([]), st.lists(_small_int(-1, 600), max_size=18)))
    for tok, bias in draw(st.dictionaries(_small_int(-1, 600), FLOATS, max_size=4)).items():
        sp.logit_bias[tok] = bias
    sp.ignore_eos = draw(st.booleans())
    sp.include_stop_str_in_output = draw(st.booleans())
    return sp


@st.composite
def requests(draw, model: str):
    req = pb.GenerateRequest(sampling=draw(sampling()))
    req.request_id = draw(st.one_of(st.just(""), TEXT))
    req.model = draw(st.sampled_from(["", model, "no-such-model"]))
    one = st.sampled_from([["text"], ["messages"], ["token_ids"]])
    kinds = draw(st.one_of(one, one, one, st.lists(st.sampled_from(["text", "messages", "token_ids"]), max_size=2,
                                                   unique=True)))
    if "text" in kinds:
        req.text = draw(st.one_of(TEXT, st.text(max_size=3000)))
    if "messages" in kinds:
        for _ in range(draw(st.integers(0, 4))):
            req.messages.add(role=draw(st.sampled_from(["system", "user", "assistant", "", "tool"])),
                             content=draw(TEXT))
    if "token_ids" in kinds:
        req.token_ids[:] = draw(st.lists(st.integers(-VOCAB_MARGIN, 600), max_size=MAX_LEN + 20))
    req.priority = draw(_small_int(-5, 5))
    req.cache_salt = draw(st.one_of(st.just(""), TEXT))
    req.adapter = draw(st.sampled_from(["", "", "lora-x"]))
    if draw(st.booleans()):
        req.add_generation_prompt = draw(st.booleans())
    return req


@st.composite
def plausible(draw, model: str):
    """A request a real client might send (random unicode, sizes and options within bounds)."""
    sp = pb.SamplingParams(max_tokens=draw(st.integers(1, 6)), n=draw(st.integers(1, 3)),
                           temperature=draw(st.floats(0, 1.5, width=32)),
                           top_p=draw(st.floats(0.125, 1, width=32)), top_k=draw(st.integers(-1, 50)),
                           seed=draw(st.integers(0, 2**31)), logprobs=draw(st.integers(0, 5)),
                           presence_penalty=draw(st.floats(-2, 2, width=32)))
    sp.stop[:] = draw(st.lists(st.text(min_size=1, max_size=8), max_size=3))
    sp.ignore_eos = draw(st.booleans())
    req = pb.GenerateRequest(sampling=sp, model=draw(st.sampled_from(["", model])),
                             cache_salt=draw(st.text(max_size=20)), priority=draw(st.integers(-3, 3)))
    kind = draw(st.sampled_from(["text", "messages", "token_ids"]))
    if kind == "text":
        req.text = draw(st.text(st.characters(blacklist_categories=("Cs",)), min_size=1, max_size=600))
    elif kind == "messages":
        for role in draw(st.lists(st.sampled_from(["system", "user", "assistant"]), min_size=1, max_size=4)):
            req.messages.add(role=role, content=draw(st.text(st.characters(blacklist_categories=("Cs",)),
                                                              max_size=200)))
    else:
        req.token_ids[:] = draw(st.lists(st.integers(0, 250), min_size=1, max_size=200))
    return req


def check_answer(stub, req: pb.GenerateRequest) -> bool:
    """True for a complete stream, False for a named client error; anything else fails."""
    n = req.sampling.n if req.sampling.HasField("n") else 1
    finished: set[int] = set()
    try:
        for resp in stub.Generate(req, timeout=60):
            assert 0 <= resp.index < max(n, 1)
            if resp.finished:
                finished.add(resp.index)
    except grpc.RpcError as e:
        assert e.code() in CLIENT_ERRORS, (e.code(), e.details(), req)
        assert NAMED.match(e.details() or ""), (e.details(), req)
        return False
    assert len(finished) == n, (finished, req)
    return True


def assert_serving(address: str) -> None:
    with grpc.insecure_channel(address) as ch:
        assert health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5).status == \
            health_pb2.HealthCheckResponse.SERVING


@pytest.fixture(scope="module")
def stack(tiny_model, redis_server_module, start_worker_module):
    worker = start_worker_module(tiny_model, redis_url=redis_server_module.url, worker_id="fuzz",
                                 max_model_len=MAX_LEN, num_kv_blocks=48, timeout=240)
    with PagodaClient(worker.address, retries=0) as c:
        model = c.model_info().model
    return worker, model


def _fuzz(stub, model: str) -> None:
    served = []

    @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(st.one_of(plausible(model), requests(model)))
    def run(req):
        served.append(check_answer(stub, req))

    run()
    # Not all refused at the door: a good share reaches the engine and streams.
    assert sum(served) >= len(served) // 5, f"{sum(served)} of {len(served)} served"


def _no_leaks(worker) -> None:
    with PagodaClient(worker.address, retries=0) as c:
        def idle():
            load = c.load()
            return load.running == 0 and load.waiting == 0 and load.free_blocks == load.num_blocks
        wait_for(idle, 10, "every block free on the worker")


def test_fuzz_worker(stack):
    worker, model = stack
    with grpc.insecure_channel(worker.address) as ch:
        _fuzz(pb_grpc.GenerationStub(ch), model)
    assert_serving(worker.address)
    _no_leaks(worker)


def test_fuzz_router(stack, redis_server_module, start_router):
    worker, model = stack
    router = start_router(redis_server_module.url)
    wait_for(lambda: sum(v for k, v in router.metrics().items() if k.startswith("pagoda_router_live_workers{")) == 1,
             10, "the router to see the worker")
    t0 = time.monotonic()
    with grpc.insecure_channel(router.address) as ch:
        _fuzz(pb_grpc.GenerationStub(ch), model)
    assert time.monotonic() - t0 < 300
    assert_serving(router.address)
    assert_serving(worker.address)
    assert router.proc.poll() is None
    _no_leaks(worker)
