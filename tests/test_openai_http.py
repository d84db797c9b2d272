"""The router's OpenAI-compatible HTTP front, driven by the official `openai` client (sync and
async) against a real stack: redis-server, two real workers (tiny model, CPU) and a router.

The workers start once for the module; every test leaves them idle with all blocks free.
"""
from __future__ import annotations

import asyncio
import json
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import grpc
import openai
import pytest

from pagoda.clients.up import free_port
from pagoda.protos.pagoda.v1 import pagoda_pb2 as pb
from pagoda.protos.pagoda.v1 import pagoda_pb2_grpc as pb_grpc
from tests.test_router import wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
MAX_LEN = 256
SYSTEM = ("You are a careful assistant for the pagoda test suite. Answer in one short sentence, "
          "mention the weather, the sea and the mountains, and never repeat the question back.")


@pytest.fixture(scope="module")
def stack(tiny_model, redis_server_module, start_worker_module, cluster_procs_module):
    url = redis_server_module.url
    with ThreadPoolExecutor(2) as pool:
        workers = list(pool.map(lambda w: start_worker_module(tiny_model, redis_url=url, worker_id=w,
                                                              num_kv_blocks=64, max_model_len=MAX_LEN,
                                                              timeout=240),
                                ("wa", "wb")))
    http_port = free_port()
    router = cluster_procs_module(url, http_port=http_port)
    base = f"http://127.0.0.1:{http_port}/v1"
    wait_for(lambda: len(_get(base + "/models")["data"]) == 1, 20, "the router to list the model")
    model = _get(base + "/models")["data"][0]["id"]
    return dict(base=base, model=model, workers=workers, router=router)


@pytest.fixture(scope="module")
def cluster_procs_module(tmp_path_factory):
    """A router for the module (start_router is per test)."""
    from tests.plugins.cluster import Proc, _spawn
    procs: list[Proc] = []
    log_dir = tmp_path_factory.mktemp("router")

    def start(redis_url: str, http_port: int) -> Proc:
        args = ["-m", "pagoda.router", "--host", "127.0.0.1", "--port", "0", "--redis-url", redis_url,
                "--metrics-port", "0", "--http-port", str(http_port)]
        return _spawn(args, log_dir, "router", procs)
    yield start
    for p in procs:
        p.kill()


def _get(url: str) -> dict:
    return json.load(urllib.request.urlopen(url, timeout=10))


@pytest.fixture
def client(stack):
    with openai.OpenAI(base_url=stack["base"], api_key="unused", max_retries=0, timeout=60) as c:
        yield c
    for w in stack["workers"]:           # every test leaves the workers idle with all blocks free
        _wait_idle(w.address)


def _load(address: str) -> pb.LoadReport:
    with grpc.insecure_channel(address) as ch:
        return pb_grpc.AdminStub(ch).GetLoad(pb.LoadRequest(), timeout=5)


def _wait_idle(address: str, timeout: float = 15.0) -> pb.LoadReport:
    deadline = time.monotonic() + timeout
    while True:
        load = _load(address)
        if (load.running == 0 and load.waiting == 0 and load.free_blocks == load.num_blocks) \
                or time.monotonic() > deadline:
            assert load.running == 0 and load.free_blocks == load.num_blocks, load
            return load
        time.sleep(0.05)


def chat(k: int = 0, system: str = SYSTEM) -> list[dict]:
    return [{"role": "system", "content": system}, {"role": "user", "content": f"Question {k}: how are you?"}]


def test_models_lists_the_served_model(client, stack):
    assert [m.id for m in client.models.list().data] == [stack["model"]]


def test_chat_n2_with_usage(client, stack):
    r = client.chat.completions.create(model=stack["model"], messages=chat(1), max_tokens=6, n=2,
                                       temperature=1.0, seed=3, extra_body={"ignore_eos": True})
    assert r.object == "chat.completion" and [c.index for c in r.choices] == [0, 1]
    assert all(c.message.role == "assistant" and c.message.content and c.finish_reason == "length"
               for c in r.choices)
    assert r.usage.completion_tokens == 12 and r.usage.total_tokens == r.usage.prompt_tokens + 12
    assert r.usage.prompt_tokens > 16


def test_stream_equals_non_stream(client, stack):
    kw = dict(model=stack["model"], max_tokens=12, temperature=0, extra_body={"ignore_eos": True})
    whole = client.completions.create(prompt="The sea is", **kw)
    chunks = list(client.completions.create(prompt="The sea is", stream=True,
                                            stream_options={"include_usage": True}, **kw))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    whole = client.chat.completions.create(messages=chat(2), **kw)
    chunks = list(client.chat.completions.create(messages=chat(2), stream=True, **kw))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == whole.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == "length" and chunks[-1].usage is None


def test_stop_string_ends_the_text(client, stack):
    kw = dict(model=stack["model"], prompt="Once upon a time", max_tokens=24, temperature=0,
              extra_body={"ignore_eos": True})
    text = client.completions.create(**kw).choices[0].text
    stop = text[len(text) // 2:len(text) // 2 + 2]
    assert stop.strip(), text
    r = client.completions.create(stop=[stop], **kw)
    assert r.choices[0].finish_reason == "stop" and r.choices[0].text == text[:text.index(stop)]


def test_same_seed_same_text(client, stack):
    kw = dict(model=stack["model"], messages=chat(3), max_tokens=16, temperature=1.0, seed=1234)
    texts = {client.chat.completions.create(**kw).choices[0].message.content for _ in range(3)}
    assert len(texts) == 1


def test_logprobs(client, stack):
    r = client.chat.completions.create(model=stack["model"], messages=chat(4), max_tokens=5, temperature=0,
                                       logprobs=True, top_logprobs=3, extra_body={"ignore_eos": True})
    content = r.choices[0].logprobs.content
    assert len(content) == 5 and all(len(e.top_logprobs) == 3 for e in content)
    # Greedy: the sampled token is the most likely one.
    assert all(e.logprob == pytest.approx(e.top_logprobs[0].logprob) for e in content)
    assert "".join(e.token for e in content) == r.choices[0].message.content
    r = client.completions.create(model=stack["model"], prompt="The sea", max_tokens=4, temperature=0,
                                  logprobs=2, extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    assert lp.text_offset[0] == 0 and all(len(t) == 2 for t in lp.top_logprobs)


def test_cached_tokens_on_a_repeated_system_prompt(client, stack):
    kw = dict(model=stack["model"], max_tokens=2, temperature=0)
    system = f"Conversation {time.time_ns()}. {SYSTEM}"      # a prefix never seen before
    first = client.chat.completions.create(messages=chat(5, system), **kw)
    time.sleep(0.5)
    second = client.chat.completions.create(messages=chat(6, system), **kw)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    # The system prompt's full blocks are cached on the worker the router picks again.
    assert second.usage.prompt_tokens_details.cached_tokens >= 32


def test_documented_errors(client, stack):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=stack["model"], messages=chat(), max_tokens=MAX_LEN)
    assert e.value.status_code == 400 and e.value.body["param"] == "max_tokens"
    assert "maximum context length is 256" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=stack["model"], prompt="hi", max_tokens=MAX_LEN + 1)
    assert e.value.body["param"] == "max_tokens"
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="no-such-model", messages=chat(), max_tokens=2)
    assert e.value.body["code"] == "model_not_found" and e.value.body["param"] == "model"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=stack["model"], prompt="hi", max_tokens=2, extra_body={"best_of": 3})
    assert e.value.body["param"] == "best_of" and "use_beam_search" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:       # the worker's own check, param named
        client.completions.create(model=stack["model"], prompt="hi", max_tokens=2, temperature=-1)
    assert e.value.body["param"] == "temperature"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=stack["model"], prompt="hi", max_tokens=2, top_p="high")
    assert e.value.body["param"] == "top_p"


def test_beam_search_on_both_endpoints_and_grpc(client, stack, tiny_llm_factory):
    """use_beam_search: the n best of best_of beams, as the offline LLM.beam_search ranks them."""
    from pagoda.gpu_worker.features.beam_search import BeamSearchParams
    llm = tiny_llm_factory()
    prompt = "The sea and the mountains"
    want = llm.beam_search([prompt], BeamSearchParams(beam_width=4, max_tokens=8))[0].sequences
    beam = {"use_beam_search": True, "best_of": 4}
    out = client.completions.create(model=stack["model"], prompt=prompt, max_tokens=8, n=2, extra_body=beam)
    assert [c.text for c in sorted(out.choices, key=lambda c: c.index)] == [s.text for s in want[:2]]
    assert out.usage.completion_tokens == sum(len(s.output_token_ids) for s in want[:2])
    # Without best_of, n is the beam width.
    out = client.completions.create(model=stack["model"], prompt=prompt, max_tokens=8, n=4,
                                    extra_body={"use_beam_search": True, "length_penalty": 1.0})
    assert [c.text for c in sorted(out.choices, key=lambda c: c.index)] == [s.text for s in want]
    chat_out = client.chat.completions.create(model=stack["model"], messages=chat(), max_tokens=6, n=2,
                                              extra_body=beam)
    assert len(chat_out.choices) == 2 and chat_out.choices[0].message.content != chat_out.choices[1].message.content
    assert {c.finish_reason for c in chat_out.choices} <= {"stop", "length"}
    # gRPC: each beam whole in one final response, with its cumulative log-probability.
    ids = llm.tokenizer.encode_text(prompt)
    with grpc.insecure_channel(stack["workers"][0].address) as ch:
        resps = list(pb_grpc.GenerationStub(ch).Generate(pb.GenerateRequest(
            token_ids=ids, sampling=pb.SamplingParams(n=3, best_of=4, use_beam_search=True, max_tokens=8)),
            timeout=60))
    assert sorted(r.index for r in resps) == [0, 1, 2] and all(r.finished for r in resps)
    by_index = sorted(resps, key=lambda r: r.index)
    assert [list(r.token_ids) for r in by_index] == [s.output_token_ids for s in want[:3]]
    assert [r.cumulative_logprob for r in by_index] == pytest.approx([s.cum_logprob for s in want[:3]], abs=1e-4)


def test_cancelled_beam_search_frees_the_workers_blocks(stack):
    """A gRPC call cancelled mid-search aborts every beam on the worker: all blocks free after."""
    address = stack["workers"][0].address
    with grpc.insecure_channel(address) as ch:
        call = pb_grpc.GenerationStub(ch).Generate(pb.GenerateRequest(
            text="Once upon a time", sampling=pb.SamplingParams(n=4, use_beam_search=True, max_tokens=200,
                                                                ignore_eos=True)), timeout=60)
        wait_for(lambda: _load(address).running >= 4, 20, "the beams to run")
        call.cancel()
        with pytest.raises(grpc.RpcError) as e:
            list(call)
        assert e.value.code() == grpc.StatusCode.CANCELLED
    _wait_idle(address)


@pytest.mark.parametrize("extra, param", [
    ({"stream": True}, "stream"),
    ({"temperature": 0.7}, "temperature"),
    ({"n": 3, "best_of": 2}, "n"),
    ({"top_p": 0.5}, "top_p"),                   # the worker's own check
    ({"logprobs": 2}, "logprobs"),
    ({"use_beam_search": "yes"}, "use_beam_search"),
])
def test_beam_search_bad_combinations_name_the_field(client, stack, extra, param):
    body = {"model": stack["model"], "prompt": "hi", "max_tokens": 4, "use_beam_search": True, "n": 2, **extra}
    req = urllib.request.Request(stack["base"] + "/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=30)
    err = json.load(e.value)["error"]
    assert e.value.code == 400 and err["param"] == param, err


def test_length_penalty_without_beam_search_is_refused_and_user_accepted():
    """length_penalty ranks beams; without use_beam_search it used to be accepted and ignored.
    `user` is OpenAI's: accepted (and unused)."""
    from pagoda.router.openai.request import ApiError, build_requests
    for kind, body in (("completion", {"prompt": "hi"}), ("chat", {"messages": [{"role": "user", "content": "hi"}]})):
        with pytest.raises(ApiError) as e:
            build_requests({"model": "m", "length_penalty": 0.5, **body}, kind)
        assert e.value.param == "length_penalty" and "use_beam_search" in e.value.message
        beam = build_requests({"model": "m", "length_penalty": 0.5, "use_beam_search": True, **body}, kind)
        assert beam[0].sampling.length_penalty == 0.5
        assert build_requests({"model": "m", "length_penalty": 1.0, "user": "u-1", **body}, kind)


def test_client_disconnect_frees_the_workers_blocks(client, stack):
    body = json.dumps({"model": stack["model"], "prompt": "Tell me a long story", "max_tokens": 200,
                       "ignore_eos": True, "stream": True}).encode()
    req = urllib.request.Request(stack["base"] + "/completions", body, {"Content-Type": "application/json"})
    resp = urllib.request.urlopen(req, timeout=30)
    assert resp.readline().startswith(b"data: ")
    busy = [w for w in stack["workers"] if _load(w.address).running == 1]
    assert len(busy) == 1 and _load(busy[0].address).free_blocks < _load(busy[0].address).num_blocks
    resp.close()                         # the client goes away mid-stream
    wait_for(lambda: _load(busy[0].address).running == 0, 10, "the worker to abort the request")
    load = _wait_idle(busy[0].address)
    assert load.free_blocks == load.num_blocks


def test_async_client_concurrent_streams(stack):
    async def main():
        async with openai.AsyncOpenAI(base_url=stack["base"], api_key="unused", max_retries=0) as c:
            kw = dict(model=stack["model"], max_tokens=8, temperature=0, extra_body={"ignore_eos": True})

            async def one(k: int) -> tuple[str, str]:
                whole = await c.chat.completions.create(messages=chat(10 + k), **kw)
                stream = await c.chat.completions.create(messages=chat(10 + k), stream=True, **kw)
                parts = [ch.choices[0].delta.content or "" async for ch in stream]
                return whole.choices[0].message.content, "".join(parts)
            return await asyncio.gather(*(one(k) for k in range(4)))
    for whole, streamed in asyncio.run(main()):
        assert whole == streamed and whole
    for w in stack["workers"]:
        _wait_idle(w.address)


# -- status mapping, against stand-in workers (no model, fast) ------------------------------------

def _post(base: str, path: str, body: dict) -> tuple[int, dict]:
    req = urllib.request.Request(base + path, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.load(r)
    except urllib.error.HTTPError as e:
        return e.code, json.load(e)


def test_queue_full_is_429_and_no_worker_is_503(redis_server, start_fake_worker, start_router):
    http_port = free_port()
    start_router(redis_server.url, http_port=http_port)
    base = f"http://127.0.0.1:{http_port}/v1"
    body = {"model": "m", "prompt": "a b c", "max_tokens": 2}
    status, err = _post(base, "/completions", body)
    assert status == 503 and err["error"]["type"] == "service_unavailable_error", err
    with pytest.raises(urllib.error.HTTPError, match="503"):
        urllib.request.urlopen(f"http://127.0.0.1:{http_port}/health", timeout=10)
    start_fake_worker(redis_server.url, "full", fail_first=1000, fail_code="RESOURCE_EXHAUSTED")
    wait_for(lambda: _get(base + "/models")["data"], 10, "the router to see the worker")
    assert _get(f"http://127.0.0.1:{http_port}/health") == {"models": ["m"]}
    status, err = _post(base, "/completions", body)
    assert status == 429 and err["error"]["type"] == "rate_limit_error", err
    status, err = _post(base, "/chat/completions", {"model": "m", "messages": "hi"})
    assert status == 400 and err["error"]["param"] == "messages", err


# -- structured output over HTTP ------------------------------------------------------------------

def pet(k: int) -> list[dict]:
    return [{"role": "user", "content": f"Describe pet number {k} as JSON."}]


def test_50_json_schema_requests_at_temperature_1_all_validate(stack):
    import jsonschema

    from tests.test_structured_output import MAX_TOKENS, SCHEMA
    fmt = {"type": "json_schema", "json_schema": {"name": "pet", "schema": SCHEMA, "strict": True}}

    async def main():
        async with openai.AsyncOpenAI(base_url=stack["base"], api_key="unused", max_retries=0, timeout=120) as c:
            async def one(k: int) -> tuple[str, str]:
                r = await c.chat.completions.create(model=stack["model"], messages=pet(k), temperature=1.0,
                                                    max_tokens=MAX_TOKENS, response_format=fmt)
                return r.choices[0].message.content, r.choices[0].finish_reason
            return await asyncio.gather(*(one(k) for k in range(50)))
    for text, finish in asyncio.run(main()):
        assert finish == "stop", text
        jsonschema.validate(json.loads(text), SCHEMA)


def test_guided_choice_and_regex(client, stack):
    choices = ["positive", "negative", "neutral"]
    r = client.chat.completions.create(model=stack["model"], messages=chat(7), temperature=1.0, n=8,
                                       max_tokens=16, extra_body={"guided_choice": choices})
    assert all(c.message.content in choices and c.finish_reason == "stop" for c in r.choices)
    chunks = client.completions.create(model=stack["model"], prompt="Code:", temperature=1.0, max_tokens=16,
                                       stream=True, extra_body={"guided_regex": "[A-Z]{3}-[0-9]{3}"})
    import re
    assert re.fullmatch("[A-Z]{3}-[0-9]{3}", "".join(c.choices[0].text for c in chunks))


def test_invalid_schema_is_400_naming_response_format(client, stack):
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "no-such-type"}}}
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=stack["model"], messages=chat(), max_tokens=8, response_format=bad)
    assert e.value.body["param"] == "response_format" and "no-such-type" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=stack["model"], prompt="x", max_tokens=8,
                                  extra_body={"guided_regex": "(open"})
    assert e.value.body["param"] == "guided_regex"


def test_greedy_parity_beside_constrained_requests(client, stack):
    from tests.test_structured_output import MAX_TOKENS, SCHEMA
    kw = dict(model=stack["model"], max_tokens=24, temperature=0, extra_body={"ignore_eos": True})
    prompts = [f"Story {k}: once upon a time" for k in range(4)]
    alone = [client.completions.create(prompt=p, **kw).choices[0].text for p in prompts]
    fmt = {"type": "json_schema", "json_schema": {"name": "pet", "schema": SCHEMA}}
    with ThreadPoolExecutor(8) as pool:
        constrained = [pool.submit(client.chat.completions.create, model=stack["model"], messages=pet(k),
                                   temperature=1.0, max_tokens=MAX_TOKENS, response_format=fmt)
                       for k in range(4)]
        together = list(pool.map(lambda p: client.completions.create(prompt=p, **kw).choices[0].text, prompts))
        assert all(f.result().choices[0].finish_reason == "stop" for f in constrained)
    assert together == alone
