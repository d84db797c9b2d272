"""End to end: a real `python -m pagoda.gpu_worker` process on loopback with a tiny model, driven through
the client library: streamed tokens equal the offline API's, concurrency, cancellation freeing
blocks, validation, backpressure, health, reflection, metrics and SIGTERM drain."""
import asyncio
import math
import time
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from pagoda.clients import AsyncPagodaClient, PagodaClient
from pagoda.protos.pagoda.v1 import pagoda_pb2 as pb
from pagoda.runtime.tokenization import PromptTokenizer
from tests.plugins.servers import TINY_WORKER_FLAGS

pytestmark = pytest.mark.slow

NUM_BLOCKS, BLOCK, MAX_LEN = (TINY_WORKER_FLAGS[k] for k in ("num_kv_blocks", "block_size", "max_model_len"))
PROMPT = "The quick brown fox jumps over the lazy dog."


@pytest.fixture(scope="module")
def worker(tiny_worker):
    return tiny_worker


@pytest.fixture(scope="module")
def offline(tiny_model):
    from pagoda.gpu_worker.engine.llm import LLM
    return LLM(model=tiny_model, device="cpu", num_kv_blocks=NUM_BLOCKS, block_size=BLOCK, max_model_len=MAX_LEN)


@pytest.fixture(scope="module")
def client(worker):
    with PagodaClient(worker.address, retries=0) as c:
        yield c


def wait_idle(client, timeout=10.0) -> pb.LoadReport:
    """Load once nothing runs or waits; every block must then be free or evictable."""
    deadline = time.monotonic() + timeout
    while True:
        load = client.load()
        if (load.running == 0 and load.waiting == 0 and load.free_blocks == load.num_blocks) \
                or time.monotonic() > deadline:
            return load
        time.sleep(0.05)


@pytest.mark.parametrize("sampling", [dict(temperature=0.0, max_tokens=16),
                                      dict(temperature=0.9, top_p=0.9, top_k=50, seed=1234, max_tokens=20)])
def test_stream_equals_offline_api(client, offline, sampling):
    from pagoda.gpu_worker.core.sampling_params import SamplingParams
    chunks = list(client.generate(PROMPT, ignore_eos=True, **sampling))
    streamed_ids = [t for c in chunks for t in c.token_ids]
    offline = offline.generate([PROMPT], SamplingParams(ignore_eos=True, **sampling))[0]
    assert streamed_ids == offline.outputs[0].token_ids and len(streamed_ids) == sampling["max_tokens"]
    assert "".join(c.text for c in chunks) == offline.outputs[0].text
    last = chunks[-1]
    assert last.finished and last.finish_reason == "length"
    assert last.usage.prompt_tokens == len(offline.prompt_token_ids)
    assert last.usage.completion_tokens == sampling["max_tokens"]
    assert all(c.worker_id == client.model_info().worker_id for c in chunks)


def test_chat_messages_and_tokenizer_texts(client, worker):
    info = client.model_info()
    assert info.max_model_len == MAX_LEN and info.block_size == BLOCK and info.vocab_size > 0
    assert f"-{worker.port}-" in info.worker_id
    # A router rebuilds the tokenizer from GetModelInfo and must get the worker's ids.
    router_side = PromptTokenizer(info.tokenizer_json, info.tokenizer_config_json)
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]
    ids = router_side.encode_chat(msgs)
    assert client.tokenize(messages=msgs) == ids
    assert client.tokenize(PROMPT) == router_side.encode_text(PROMPT)
    by_chat = client.complete(messages=msgs, temperature=0.0, max_tokens=8, ignore_eos=True)
    by_ids = client.complete(ids, temperature=0.0, max_tokens=8, ignore_eos=True)
    assert by_chat.token_ids == by_ids.token_ids and by_chat.usage.prompt_tokens == len(ids)


def test_64_concurrent_streams(worker, client):
    async def one(c, i):
        n = 0
        async for ch in c.generate(f"Request number {i} asks about the sea.", temperature=0.0,
                                   max_tokens=8, ignore_eos=True, request_id=f"conc-{i}"):
            n += len(ch.token_ids)
            if ch.finished:
                return n, ch.finish_reason, ch.usage.completion_tokens

    async def run():
        async with AsyncPagodaClient(worker.address, retries=0) as c:
            return await asyncio.gather(*(one(c, i) for i in range(64)))

    results = asyncio.run(run())
    assert results == [(8, "length", 8)] * 64
    load = wait_idle(client)
    assert load.free_blocks == load.num_blocks == NUM_BLOCKS


def test_cancelled_stream_frees_its_blocks(worker, client):
    async def run():
        async with AsyncPagodaClient(worker.address, retries=0) as c:
            stream = c.generate(PROMPT * 3, max_tokens=300, ignore_eos=True, request_id="to-cancel")
            await stream.__anext__()
            await stream.__anext__()
            during = await c.load()
            await stream.aclose()
            return during

    during = asyncio.run(run())
    assert during.running == 1 and during.free_blocks < during.num_blocks
    after = wait_idle(client)
    assert after.running == 0 and after.free_blocks == after.num_blocks


def test_deadline_aborts_the_request(client):
    # The deadline is a fraction of what the whole request takes on this machine, so a fast machine
    # cannot finish it in time (a fixed 0.5 s did on CI); the first chunk must arrive before it.
    started = time.monotonic()
    assert sum(len(c.token_ids) for c in client.generate(PROMPT, max_tokens=350, ignore_eos=True)) == 350
    deadline = (time.monotonic() - started) / 3
    chunks = 0
    with pytest.raises(grpc.RpcError) as err:
        for _ in client.generate(PROMPT, max_tokens=350, ignore_eos=True, timeout=deadline):
            chunks += 1
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED and chunks > 0
    load = wait_idle(client)
    assert load.running == 0 and load.free_blocks == load.num_blocks


def test_admin_abort_by_request_id(worker, client):
    async def run():
        async with AsyncPagodaClient(worker.address, retries=0) as c:
            chunks = []
            async for ch in c.generate(PROMPT, max_tokens=300, ignore_eos=True, request_id="abort-me"):
                chunks.append(ch)
                if len(chunks) == 2:
                    assert await c.abort("abort-me") is True
            return chunks

    chunks = asyncio.run(run())
    assert chunks[-1].finished and chunks[-1].finish_reason == "abort"
    assert sum(len(c.token_ids) for c in chunks) < 300
    assert client.abort("no-such-request") is False
    assert wait_idle(client).free_blocks == NUM_BLOCKS


def _bad_requests(vocab_size):
    long_ids = [5] * (MAX_LEN + 1)
    return [
        ("prompt", pb.GenerateRequest()),
        ("text", pb.GenerateRequest(text="")),
        ("token_ids", pb.GenerateRequest(token_ids=[1, vocab_size])),
        ("token_ids", pb.GenerateRequest(token_ids=[-1])),
        ("max_tokens", pb.GenerateRequest(text="hi", sampling=pb.SamplingParams(max_tokens=0))),
        ("temperature", pb.GenerateRequest(text="hi", sampling=pb.SamplingParams(temperature=-0.5))),
        ("temperature", pb.GenerateRequest(text="hi", sampling=pb.SamplingParams(temperature=math.nan))),
        ("top_p", pb.GenerateRequest(text="hi", sampling=pb.SamplingParams(top_p=0.0))),
        ("top_p", pb.GenerateRequest(text="hi", sampling=pb.SamplingParams(top_p=1.5))),
        ("top_k", pb.GenerateRequest(text="hi", sampling=pb.SamplingParams(top_k=-2))),
        ("n", pb.GenerateRequest(text="hi", sampling=pb.SamplingParams(n=0))),
        ("token_ids", pb.GenerateRequest(token_ids=long_ids)),
        # Fits max_model_len (512) but prompt + max_tokens can never fit the 384-token pool.
        ("max_tokens", pb.GenerateRequest(token_ids=[5] * 200, sampling=pb.SamplingParams(max_tokens=300))),
        ("n", pb.GenerateRequest(text="hi", sampling=pb.SamplingParams(n=100_000))),
        ("max_tokens", pb.GenerateRequest(text="hi", sampling=pb.SamplingParams(max_tokens=MAX_LEN))),
        ("text", pb.GenerateRequest(text="x" * (2 << 20))),
        ("text, token_ids", pb.GenerateRequest(text="hi", token_ids=[1, 2])),
        ("stop", pb.GenerateRequest(text="hi", sampling=pb.SamplingParams(stop=[f"s{i}" for i in range(17)]))),
    ]


def test_every_invalid_field_is_named_and_the_worker_carries_on(client):
    vocab = client.model_info().vocab_size
    for field, req in _bad_requests(vocab):
        with pytest.raises(grpc.RpcError) as err:
            list(client.generate_request(req))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (field, err.value.details())
        assert err.value.details().startswith(field), (field, err.value.details())
        ok = client.complete("still serving?", max_tokens=3, temperature=0.0, ignore_eos=True)
        assert ok.finish_reason == "length" and len(ok.token_ids) == 3
    assert wait_idle(client).free_blocks == NUM_BLOCKS


def test_unknown_model_is_not_found_and_a_long_text_names_text(client, worker):
    stub = client.generation
    for call in (lambda: list(stub.Generate(pb.GenerateRequest(text="hi", model="no-such-model"))),
                 lambda: stub.GetModelInfo(pb.ModelInfoRequest(model="no-such-model")),
                 lambda: stub.Tokenize(pb.TokenizeRequest(text="hi", model="no-such-model"))):
        with pytest.raises(grpc.RpcError) as err:
            call()
        assert err.value.code() == grpc.StatusCode.NOT_FOUND and err.value.details().startswith("model:")
    with pytest.raises(grpc.RpcError) as err:            # more tokens than max_model_len, sent as text
        list(client.generate_request(pb.GenerateRequest(text="fox " * (MAX_LEN + 10))))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and err.value.details().startswith("text:")


def test_health_and_reflection(worker):
    with grpc.insecure_channel(worker.address) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        for service in ("", "pagoda.v1.Generation", "pagoda.v1.Admin"):
            assert stub.Check(health_pb2.HealthCheckRequest(service=service)).status == \
                health_pb2.HealthCheckResponse.SERVING
        refl = reflection_pb2_grpc.ServerReflectionStub(ch)
        answers = list(refl.ServerReflectionInfo(iter([
            reflection_pb2.ServerReflectionRequest(list_services=""),
            reflection_pb2.ServerReflectionRequest(file_containing_symbol="pagoda.v1.Generation")])))
    services = {s.name for s in answers[0].list_services_response.service}
    assert {"pagoda.v1.Generation", "pagoda.v1.Admin", "grpc.health.v1.Health"} <= services
    from google.protobuf import descriptor_pb2
    files = [descriptor_pb2.FileDescriptorProto.FromString(b)
             for b in answers[1].file_descriptor_response.file_descriptor_proto]
    assert any(f.package == "pagoda.v1" and any(s.name == "Generation" for s in f.service) for f in files)


def test_metrics_scrape_parses_and_holds_the_series(worker, client):
    before = wait_idle(client)
    for _ in range(2):      # the second run of the same prompt hits the prefix cache
        client.complete(PROMPT * 4, max_tokens=5, temperature=0.0, ignore_eos=True)
    text = urllib.request.urlopen(f"http://127.0.0.1:{worker.metrics_port}/metrics", timeout=5).read().decode()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    value = {}
    for f in families.values():
        for s in f.samples:
            value[s.name] = value.get(s.name, 0) + s.value
    gauges = ["pagoda:num_requests_running", "pagoda:num_requests_waiting", "pagoda:kv_cache_usage_perc"]
    counters = ["pagoda:prefix_cache_queries", "pagoda:prefix_cache_hits", "pagoda:num_preemptions",
                "pagoda:prompt_tokens", "pagoda:generation_tokens"]
    hists = ["pagoda:time_to_first_token_seconds", "pagoda:inter_token_latency_seconds",
             "pagoda:e2e_request_latency_seconds"]
    for name in gauges:
        assert families[name].type == "gauge"
    for name in counters:
        assert families[name].type == "counter"
    for name in hists:
        assert families[name].type == "histogram" and value[name + "_count"] > 0
    assert value["pagoda:generation_tokens_total"] >= 10
    assert value["pagoda:prefix_cache_hits_total"] >= BLOCK
    assert value["pagoda:prefix_cache_queries_total"] >= value["pagoda:prefix_cache_hits_total"]
    assert 0 <= value["pagoda:kv_cache_usage_perc"] <= 1
    assert before.num_blocks == NUM_BLOCKS


def test_vllm_metrics_prefix_serves_vllms_names_and_labels(start_worker, tiny_model):
    """--metrics-prefix vllm: the series vLLM's dashboards and KEDA rules query, by vLLM's names
    (v1 PrometheusStatLogger) with its labels model_name and engine."""
    w = start_worker(tiny_model, **{**TINY_WORKER_FLAGS, "metrics_prefix": "vllm", "served_model_name": "tiny"})
    with PagodaClient(w.address, retries=0) as c:
        first = c.complete(PROMPT * 4, max_tokens=3, temperature=0.0, ignore_eos=True).usage
        # The same prompt again: its full blocks come from the prefix cache.
        again = c.complete(PROMPT * 4, max_tokens=3, temperature=0.0, ignore_eos=True).usage
    text = urllib.request.urlopen(f"http://127.0.0.1:{w.metrics_port}/metrics", timeout=5).read().decode()
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for f in text_string_to_metric_families(text) for s in f.samples}
    labels = (("engine", "0"), ("model_name", "tiny"))
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total", "vllm:num_preemptions_total",
                 "vllm:prompt_tokens_total", "vllm:generation_tokens_total",
                 "vllm:e2e_request_latency_seconds_count"):
        assert (name, labels) in samples, name
    # Latencies also by the worker's --kv-role (prefill/decode disaggregation).
    for name in ("vllm:time_to_first_token_seconds_count", "vllm:time_per_output_token_seconds_count"):
        assert (name, tuple(sorted((*labels, ("kv_role", "both"))))) in samples, name
    assert samples["vllm:generation_tokens_total", labels] == 6
    assert samples["vllm:e2e_request_latency_seconds_count", labels] == 2
    assert samples["vllm:request_success_total", tuple(sorted((*labels, ("finished_reason", "length"))))] == 2
    # vLLM's prompt_tokens: every request's whole prompt, computed or cached, as its usage says;
    # by source, what the cache served and what was computed.
    assert again.cached_prompt_tokens > 0 and first.cached_prompt_tokens == 0
    assert samples["vllm:prompt_tokens_total", labels] == first.prompt_tokens + again.prompt_tokens
    cached = again.cached_prompt_tokens
    assert samples["vllm:prompt_tokens_cached_total", labels] == cached
    assert samples["vllm:prompt_tokens_by_source_total", (*labels, ("source", "local_cache_hit"))] \
        == cached
    assert samples["vllm:prompt_tokens_by_source_total", (*labels, ("source", "local_compute"))] \
        == first.prompt_tokens + again.prompt_tokens - cached
    # Prefill computed is pagoda's own figure: the uncached part of each prompt.
    assert samples["pagoda:prefill_tokens_computed_total", labels] == first.prompt_tokens + again.prompt_tokens - cached
    assert not any(n.startswith("pagoda:") for n, _ in samples if n not in (
        "pagoda:num_kv_blocks", "pagoda:num_free_kv_blocks",
        "pagoda:prefill_tokens_computed_total") and not n.startswith("pagoda:kv_transfer_"))   # vLLM has no name for these


def test_backpressure_then_sigterm_drains_and_exits_zero(start_worker, tiny_model, redis_server):
    import redis

    from pagoda.protos import redis_schema as rs
    w = start_worker(tiny_model, num_kv_blocks=NUM_BLOCKS, max_num_seqs=1, max_waiting=1, drain_grace_seconds=20,
                     redis_url=redis_server.url, worker_id="drain-me")
    r = redis.Redis.from_url(redis_server.url)
    deadline = time.monotonic() + 10
    while r.get(rs.lease_key("drain-me")) is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert rs.Lease.decode(r.get(rs.lease_key("drain-me"))).address == w.address

    async def run():
        async with AsyncPagodaClient(w.address, retries=0) as c:
            # Long enough that it is still running after the checks below, even on a slow machine.
            first = c.generate(PROMPT, max_tokens=300, ignore_eos=True, temperature=0.0)
            got = [await first.__anext__()]
            second = asyncio.ensure_future(c.complete(PROMPT, max_tokens=4, ignore_eos=True))
            while (await c.load()).waiting < 1:
                await asyncio.sleep(0.01)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await c.complete(PROMPT, max_tokens=2)
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            # SIGTERM with streams open: admissions stop, the open streams still finish.
            w.signal()
            with grpc.insecure_channel(w.address) as ch:
                stub = health_pb2_grpc.HealthStub(ch)
                while stub.Check(health_pb2.HealthCheckRequest()).status == health_pb2.HealthCheckResponse.SERVING:
                    await asyncio.sleep(0.02)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await c.complete(PROMPT, max_tokens=2)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
            # Draining withdraws the Redis lease so routers stop choosing this worker.
            gone_by = time.monotonic() + 5
            while r.get(rs.lease_key("drain-me")) is not None and time.monotonic() < gone_by:
                await asyncio.sleep(0.02)
            assert r.get(rs.lease_key("drain-me")) is None
            got += [ch async for ch in first]
            return got, await second

    chunks, second = asyncio.run(run())
    assert sum(len(c.token_ids) for c in chunks) == 300 and chunks[-1].finish_reason == "length"
    assert second.finish_reason == "length" and len(second.token_ids) == 4
    assert w.proc.wait(30) == 0
