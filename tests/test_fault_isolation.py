"""Fault isolation (gpu_worker/core/faults.py): an error one request's parameters or data cause in a
per-request stage of a step (sampling transforms and grammar, beam scoring, stop checks and
detokenization) ends that request alone, its blocks freed, while its neighbours' tokens are
exactly what they are without it; an error of the engine itself (the forward) fails every
request, and the engine (and the worker's health) is dead. Also the finding end to end on a real
worker. The validation bounds that keep the finding out in the first place: test_sampling_bounds.py."""
from __future__ import annotations

import asyncio
import random
import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pagoda.gpu_worker.core.config import EngineConfig
from pagoda.gpu_worker.core.faults import EngineDeadError, RequestFault
from pagoda.gpu_worker.core.sampling_params import SamplingParams
from pagoda.gpu_worker.engine.llm_engine import LLMEngine

pytestmark = [pytest.mark.usefixtures("no_block_leaks", "one_torch_thread"), pytest.mark.timeout(300)]

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


def rand_ids(n, seed):
    rng = random.Random(seed)
    return [rng.randrange(5, 600) for _ in range(n)]


@pytest.fixture
def engine(tiny_model):
    return LLMEngine(EngineConfig(model=tiny_model, device="cpu", num_kv_blocks=64, max_num_seqs=8))


def run(engine: LLMEngine) -> tuple[dict[str, list[int]], dict[str, RequestFault]]:
    """Step until idle: (tokens per caller request, faults per caller request)."""
    tokens: dict[str, list[int]] = {}
    faults: dict[str, RequestFault] = {}
    for _ in range(500):
        if not engine.has_unfinished_requests():
            break
        for d in engine.step():
            tokens.setdefault(d.request_id, []).extend(d.token_ids)
        faults.update((f.request_id, f) for f in engine.take_faults())
    assert not engine.has_unfinished_requests()
    return tokens, faults


def neighbours(engine: LLMEngine, k: int = 4) -> dict[str, list[int]]:
    for i in range(k):
        engine.add_request(f"ok{i}", rand_ids(20 + i, i), GREEDY)
    return {f"ok{i}": [] for i in range(k)}


def assert_idle(engine: LLMEngine) -> None:
    s = engine.stats()
    assert (s.running, s.waiting, s.free_blocks) == (0, 0, s.num_blocks)
    assert engine.children == {} and engine.beam_groups == {} and engine.detokenizers == {}


def alone(engine: LLMEngine) -> dict[str, list[int]]:
    neighbours(engine)
    tokens, faults = run(engine)
    assert not faults
    return tokens


# ---- one test per per-request stage -------------------------------------------------------------

def test_beam_scoring_that_overflows_fails_its_search_alone(engine):
    want = alone(engine)
    neighbours(engine)
    engine.add_request("bad", rand_ids(30, 9), SamplingParams(n=2, use_beam_search=True, temperature=0.0,
                                                              max_tokens=4))
    # The finding: a length_penalty past validation's bound, at the engine (len ** 1e38 overflows).
    engine.beam_groups["bad"].length_penalty = 1e38
    tokens, faults = run(engine)
    assert set(faults) == {"bad"} and faults["bad"].stage == "beam search scoring"
    assert isinstance(faults["bad"].cause, OverflowError) and "OverflowError" in str(faults["bad"])
    assert {k: v for k, v in tokens.items() if k != "bad"} == want
    assert_idle(engine)


class _BrokenGrammarState:
    """A grammar whose advance raises (a corrupt matcher): the sampler's per-row Python stage."""
    consumed = 0

    def sync(self, output_token_ids):
        raise RuntimeError("matcher state corrupt")


class _BrokenGrammar:
    def new_state(self):
        return _BrokenGrammarState()


@pytest.mark.parametrize("async_scheduling", ["off", "on"])
def test_a_sampling_stage_that_raises_for_one_row_fails_that_request_alone(tiny_model, async_scheduling):
    engine = LLMEngine(EngineConfig(model=tiny_model, device="cpu", num_kv_blocks=64, max_num_seqs=8,
                                    async_scheduling=async_scheduling))
    want = alone(engine)
    neighbours(engine)
    engine.add_request("bad", rand_ids(25, 7), SamplingParams(max_tokens=6, structured_output=_BrokenGrammar()))
    tokens, faults = run(engine)
    assert set(faults) == {"bad"} and faults["bad"].stage.startswith("sampling")
    assert "matcher state corrupt" in str(faults["bad"])
    assert "bad" not in tokens          # it never got a token
    assert tokens == want               # the others' draws are untouched, token for token
    assert_idle(engine)
    assert alone(engine) == want        # and the engine goes on as before


def test_detokenization_that_raises_fails_that_request_alone(engine):
    want = alone(engine)
    neighbours(engine)
    engine.add_request("bad", rand_ids(25, 3), SamplingParams(max_tokens=6, ignore_eos=True, n=2))
    first = engine.step()               # admitted: its sequences have detokenizers now

    class Broken:
        def add_token(self, *a, **k):
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte")
    engine.detokenizers[engine.children["bad"][1].req_id] = Broken()     # one of its two sequences
    tokens, faults = run(engine)
    for d in first:
        tokens[d.request_id] = d.token_ids + tokens.get(d.request_id, [])
    assert set(faults) == {"bad"} and faults["bad"].stage == "stop checks and detokenization"
    assert {k: v for k, v in tokens.items() if k != "bad"} == want
    assert_idle(engine)


def test_a_fault_of_the_engine_itself_fails_every_request_and_the_engine_is_dead(engine):
    neighbours(engine)
    engine.step()

    def forward_fails(out):
        raise RuntimeError("device lost")
    engine.runner.launch = forward_fails
    with pytest.raises(RuntimeError, match="device lost"):
        while engine.has_unfinished_requests():
            engine.step()
    assert engine.take_faults() == []       # nobody's request: not attributed to one
    assert engine.dead is not None and engine.children == {}
    assert engine.stats().free_blocks == engine.num_blocks
    with pytest.raises(EngineDeadError, match="device lost"):
        engine.add_request("later", [5, 6, 7], GREEDY)
    engine.pending.clear()                  # the abort notices, nobody to read them here


# ---- end to end: a real worker on loopback ---------------------------------------------------

class _WorkerThread:
    """A real pagoda worker (Worker: gRPC server, AsyncLLM, health) in this process, on loopback,
    so that a test can reach past validation into its engine."""

    def __init__(self, tiny_model):
        from pagoda.gpu_worker.serving.args import build_parser
        from pagoda.gpu_worker.serving.server import Worker
        args = build_parser().parse_args(["--model", tiny_model, "--host", "127.0.0.1", "--port", "0",
                                          "--metrics-port", "0", "--device", "cpu", "--num-kv-blocks", "96",
                                          "--max-num-seqs", "16"])
        self.worker = Worker(args)
        self.loop = asyncio.new_event_loop()
        started = threading.Event()

        def serve():
            asyncio.set_event_loop(self.loop)
            self.loop.run_until_complete(self.worker.start())
            started.set()
            self.loop.run_forever()
        self.thread = threading.Thread(target=serve, daemon=True)
        self.thread.start()
        assert started.wait(120), "worker did not start"
        self.address = f"127.0.0.1:{self.worker.port}"

    def health(self) -> int:
        with grpc.insecure_channel(self.address) as ch:
            return health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=5).status

    def stop(self):
        asyncio.run_coroutine_threadsafe(self.worker.shutdown(0), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture
def worker(tiny_model):
    w = _WorkerThread(tiny_model)
    yield w
    w.stop()


def _stream(address, ids, **sampling):
    """-> (tokens, grpc error or None)."""
    from pagoda.protos.pagoda.v1 import pagoda_pb2 as pb
    from pagoda.protos.pagoda.v1 import pagoda_pb2_grpc as pb_grpc
    tokens = []
    with grpc.insecure_channel(address) as ch:
        try:
            for r in pb_grpc.GenerationStub(ch).Generate(
                    pb.GenerateRequest(token_ids=ids, sampling=pb.SamplingParams(**sampling)), timeout=120):
                tokens.extend(r.token_ids)
            return tokens, None
        except grpc.RpcError as e:
            return tokens, e


def test_the_finding_one_tenants_overflowing_beam_search_never_hurts_another(worker, monkeypatch):
    """8 streams of one tenant while another's beam search with length_penalty=1e38 (past
    validation, as it was before the bound) overflows in beam_score: before, every stream on
    the worker ended UNKNOWN; now only the bad one ends, INVALID_ARGUMENT naming the cause."""
    real = SamplingParams.validate

    def past_the_bound(self, vocab_size):       # the finding's parameter reaches the engine
        lp, self.length_penalty = self.length_penalty, 1.0
        try:
            real(self, vocab_size)
        finally:
            self.length_penalty = lp
    monkeypatch.setattr(SamplingParams, "validate", past_the_bound)
    from concurrent.futures import ThreadPoolExecutor
    with ThreadPoolExecutor(9) as pool:
        good = [pool.submit(_stream, worker.address, rand_ids(24 + i, i), max_tokens=24, temperature=0.0,
                            ignore_eos=True) for i in range(8)]
        time.sleep(0.3)
        bad = pool.submit(_stream, worker.address, rand_ids(30, 99), max_tokens=4, n=2, temperature=0.0,
                          use_beam_search=True, length_penalty=1e38)
        results = [f.result() for f in good]
        bad_tokens, err = bad.result()
    assert [e for _, e in results] == [None] * 8 and all(len(t) == 24 for t, _ in results)
    assert err is not None and err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "beam search scoring" in err.details() and "OverflowError" in err.details()
    engine = worker.worker.engine
    deadline = time.monotonic() + 10
    while engine.stats().free_blocks != engine.stats().num_blocks and time.monotonic() < deadline:
        time.sleep(0.05)
    assert engine.stats().free_blocks == engine.stats().num_blocks        # no block leaked
    assert worker.health() == health_pb2.HealthCheckResponse.SERVING and engine.fatal is None
    assert _stream(worker.address, rand_ids(10, 5), max_tokens=3)[1] is None     # and it serves on


def test_an_engine_fault_fails_every_stream_and_the_worker_reports_not_serving(worker):
    engine = worker.worker.engine
    assert worker.health() == health_pb2.HealthCheckResponse.SERVING
    runner = engine.engine.runner

    def forward_fails(out):
        raise RuntimeError("device lost")
    runner.launch = forward_fails
    tokens, err = _stream(worker.address, rand_ids(20, 1), max_tokens=5)
    assert err is not None and err.code() == grpc.StatusCode.UNAVAILABLE and "device lost" in err.details()
    deadline = time.monotonic() + 5
    while worker.health() != health_pb2.HealthCheckResponse.NOT_SERVING and time.monotonic() < deadline:
        time.sleep(0.05)
    assert worker.health() == health_pb2.HealthCheckResponse.NOT_SERVING
    assert isinstance(engine.fatal, RuntimeError)
    assert engine.stats().free_blocks == engine.stats().num_blocks


def test_the_offline_llm_raises_the_fault_and_stays_usable(tiny_llm_factory):
    llm = tiny_llm_factory(num_kv_blocks=64)
    ok = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    want = llm.generate([rand_ids(12, 1)], ok)[0].outputs[0].token_ids
    with pytest.raises(RequestFault, match="matcher state corrupt"):
        llm.generate([rand_ids(12, 1), rand_ids(14, 2)],
                     [ok, SamplingParams(max_tokens=4, structured_output=_BrokenGrammar())])
    assert llm.engine.stats().free_blocks == llm.engine.num_blocks and not llm.engine.has_unfinished_requests()
    assert llm.generate([rand_ids(12, 1)], ok)[0].outputs[0].token_ids == want
