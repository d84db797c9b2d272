"""The router's HTTP routes besides the completions (issue 24), as vLLM's OpenAI server has them,
against a real stack (redis-server, one tiny-model CPU worker, a router): /tokenize, /detokenize,
/version, /v1/models/{id}, /metrics on the API port (GET and HEAD, as aiohttp-based tools probe
it), OpenAI error objects for unknown routes and methods, and HEAD on the worker's metrics port.
"""
from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request

import aiohttp
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pagoda.clients.up import free_port
from tests.test_openai_http import _get, _wait_idle, cluster_procs_module  # noqa: F401
from tests.test_router import wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
MAX_LEN = 256


@pytest.fixture(scope="module")
def stack(tiny_model, redis_server_module, start_worker_module, cluster_procs_module):  # noqa: F811
    url = redis_server_module.url
    worker = start_worker_module(tiny_model, redis_url=url, worker_id="wr", num_kv_blocks=64, max_model_len=MAX_LEN, metrics=True,
                                 timeout=240)
    http_port = free_port()
    cluster_procs_module(url, http_port=http_port)
    root = f"http://127.0.0.1:{http_port}"
    wait_for(lambda: len(_get(root + "/v1/models")["data"]) == 1, 20, "the router to list the model")
    return dict(root=root, base=root + "/v1", model=_get(root + "/v1/models")["data"][0]["id"], worker=worker)


@pytest.fixture
def client(stack):
    with openai.OpenAI(base_url=stack["base"], api_key="unused", max_retries=0, timeout=60) as c:
        yield c
    _wait_idle(stack["worker"].address)


def _call(method: str, url: str, body: dict | None = None) -> tuple[int, dict | str, dict]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            status, raw, headers = r.status, r.read().decode(), dict(r.headers)
    except urllib.error.HTTPError as e:
        status, raw, headers = e.code, e.read().decode(), dict(e.headers)
    try:
        return status, json.loads(raw), headers
    except ValueError:
        return status, raw, headers


def test_tokenize_counts_what_a_completion_is_billed(client, stack):
    root, model = stack["root"], stack["model"]
    status, tok, _ = _call("POST", root + "/tokenize", {"model": model, "prompt": "The sea is calm tonight."})
    assert status == 200, tok
    done = client.completions.create(model=model, prompt="The sea is calm tonight.", max_tokens=1)
    assert tok["count"] == len(tok["tokens"]) == done.usage.prompt_tokens
    assert tok["max_model_len"] == MAX_LEN and tok["token_strs"] is None
    # Without special tokens the BOS the tokenizer adds is gone.
    _, bare, _ = _call("POST", root + "/tokenize", {"model": model, "prompt": "The sea is calm tonight.",
                                                    "add_special_tokens": False, "return_token_strs": True})
    assert bare["tokens"] == tok["tokens"][1:] and len(bare["token_strs"]) == bare["count"]
    # Chat messages are rendered by the chat template, as the completion's prompt is.
    msgs = [{"role": "user", "content": "How is the weather?"}]
    _, chat, _ = _call("POST", root + "/tokenize", {"model": model, "messages": msgs})
    done = client.chat.completions.create(model=model, messages=msgs, max_tokens=1)   # type: ignore[arg-type]
    assert chat["count"] == done.usage.prompt_tokens
    # And /detokenize turns ids back into the text.
    _, text, _ = _call("POST", root + "/detokenize", {"model": model, "tokens": bare["tokens"]})
    assert text == {"prompt": "The sea is calm tonight."}


def test_tokenize_and_detokenize_refuse_bad_input_naming_the_field(stack):
    root = stack["root"]
    for path, body, param in (("/tokenize", {"prompt": 5}, "prompt"),
                              ("/tokenize", {"prompt": "x", "temperature": 1}, "temperature"),
                              ("/detokenize", {"tokens": "abc"}, "tokens"),
                              ("/detokenize", {"tokens": [1, 10**9]}, "tokens"),
                              ("/tokenize", {"prompt": "x", "model": "nope"}, "model")):
        status, err, _ = _call("POST", root + path, body)
        assert status in (400, 404) and err["error"]["param"] == param, (path, body, err)


def test_version_and_model_card(client, stack):
    status, v, _ = _call("GET", stack["root"] + "/version")
    assert status == 200 and v["version"] == "0.1.0"
    card = client.models.retrieve(stack["model"])
    assert card.id == stack["model"] and card.object == "model" and card.owned_by == "pagoda"
    assert card.max_model_len == MAX_LEN      # type: ignore[attr-defined]    (vLLM's extra field)
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("no-such-model")
    assert e.value.body["code"] == "model_not_found"      # type: ignore[index]


def test_unknown_routes_and_methods_answer_openai_error_objects(stack):
    root = stack["root"]
    for method, path, want in (("POST", "/chat/completions", 404), ("GET", "/v2/models", 404),
                               ("GET", "/v1/completions", 405), ("POST", "/version", 405)):
        status, err, headers = _call(method, root + path, {} if method == "POST" else None)
        assert status == want, (method, path, err)
        assert headers["Content-Type"].startswith("application/json")
        assert set(err["error"]) == {"message", "type", "param", "code"} and path in err["error"]["message"]
        assert err["error"]["type"] == "invalid_request_error", (method, path, err)     # as OpenAI's
        if want == 405:
            assert "Allow" in headers


def test_router_metrics_on_the_api_port(client, stack):
    before = _router_prompt_tokens(stack["root"])
    done = client.completions.create(model=stack["model"], prompt="Count the stars", max_tokens=2)
    assert _router_prompt_tokens(stack["root"]) == before + done.usage.prompt_tokens


def _router_prompt_tokens(root: str) -> float:
    text = urllib.request.urlopen(root + "/metrics", timeout=10).read().decode()
    return next(s.value for f in text_string_to_metric_families(text) for s in f.samples
                if s.name == "pagoda_router_prompt_tokens_total")


def test_head_on_metrics_has_no_body_on_router_and_worker(stack):
    """aiohttp reads no body after a HEAD: a body there would be read as the next answer on the
    connection, so HEAD then GET on one connection must both parse."""
    urls = [stack["root"] + "/metrics", f"http://127.0.0.1:{stack['worker'].metrics_port}/metrics"]

    async def probe(url: str) -> tuple[int, int, int, str]:
        async with aiohttp.ClientSession() as s:
            async with s.head(url) as h:
                head_status, head_len = h.status, int(h.headers.get("Content-Length", "-1"))
                assert await h.read() == b""
            async with s.get(url) as g:
                return head_status, head_len, g.status, await g.text()

    for url in urls:
        head_status, head_len, get_status, text = asyncio.run(probe(url))
        assert head_status == get_status == 200, url
        assert "# TYPE" in text and head_len > 0, url
