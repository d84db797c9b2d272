"""guidellm (its CLI, unchanged) against a real `pagoda up` on loopback (issue 24): a bounded
synchronous run of a few streamed chat requests on guidellm's own synthetic data, the tiny model's
tokenizer directory, offline. A recording relay between guidellm and the router keeps every request
and its whole (SSE) response, so the test checks that guidellm finishes with every request ok and
no warning the server causes, and that the token counts it reports are the server's usage, request
by request, and the worker's own counters.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.request

import pytest

pytest.importorskip("guidellm")
aiohttp = pytest.importorskip("aiohttp")

from tests.plugins.relay import RecordingRelay  # noqa: E402
from tests.plugins.up import pagoda_up  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

REQUESTS, PROMPT_TOKENS, OUTPUT_TOKENS = 4, 24, 8


def counters(metrics_url: str) -> dict[str, float]:
    text = urllib.request.urlopen(metrics_url, timeout=10).read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in ("pagoda:prompt_tokens_total", "pagoda:generation_tokens_total"):
            out[name] = out.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def sse_events(text: str) -> list[dict]:
    events = [x.removeprefix("data:").strip() for x in text.splitlines() if x.startswith("data:")]
    assert events and events[-1] == "[DONE]", text[-500:]
    return [json.loads(e) for e in events[:-1]]


@pytest.fixture(scope="module")
def cluster(tiny_model, tmp_path_factory):
    with pagoda_up(tiny_model, tmp_path_factory.mktemp("up")) as urls:
        yield urls


def test_guidellm_synchronous_chat(cluster, tiny_model, tmp_path):
    base, metrics_url = cluster
    model = json.load(urllib.request.urlopen(base + "/v1/models", timeout=10))["data"][0]["id"]
    relay = RecordingRelay(base)
    before = counters(metrics_url)
    out = tmp_path / "guidellm.json"
    cmd = [sys.executable, "-m", "guidellm", "run", "--backend",
           f"kind=openai_http,target=http://127.0.0.1:{relay.port},model={model}",
           "--profile", "kind=synchronous", "--constraint", f"kind=max_requests,count={REQUESTS}",
           "--tokenizer", f"kind=hf_auto,model={tiny_model}",
           "--data", f"kind=synthetic_text,prompt_tokens={PROMPT_TOKENS},output_tokens={OUTPUT_TOKENS}",
           "--output", f"kind=json,path={out}", "--disable-console-interactive"]
    # One scheduler worker process (guidellm starts 10 by default: a minute of imports here).
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "OMP_NUM_THREADS": "1",
           "TOKENIZERS_PARALLELISM": "false", "GUIDELLM__MAX_WORKER_PROCESSES": "1"}
    try:
        run = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    finally:
        relay.close()
    log = run.stdout + run.stderr
    assert run.returncode == 0, log[-4000:]
    assert not [x for x in log.splitlines() if "WARNING" in x or "|ERROR" in x], log[-4000:]
    bench, = json.loads(out.read_text())["benchmarks"]
    # Two of guidellm's warnings time guidellm alone, before a request is sent: generation_delay_ttft
    # (how long its request generator took to yield each synthetic request, against the time to
    # first token: the first is slow on a loaded host, and with a few fast requests the mean passes
    # 1 %) and root_late (its dispatch late against its own schedule). Any other warning fails.
    assert [w for w in bench["warnings"] if w["code"] not in ("generation_delay_ttft", "root_late")] == []
    reqs = bench["requests"]
    assert len(reqs["successful"]) == REQUESTS and not reqs["errored"] and not reqs["incomplete"]

    # Every call guidellm made was answered 200; the chat calls streamed to [DONE] with usage.
    assert relay.records and all(status == 200 for *_, status, _ in relay.records), relay.records[:3]
    chats = {}
    for _method, path, body, _status, text in relay.records:
        if path != "/v1/chat/completions":
            continue
        assert body["stream"] and body["max_completion_tokens"] == OUTPUT_TOKENS and body["ignore_eos"]
        events = sse_events(text)
        ids = {e["id"] for e in events}
        assert len(ids) == 1
        usage = events[-1]["usage"]
        generated = sum(1 for e in events for c in e["choices"] if c.get("delta", {}).get("content") is not None
                        and c["delta"]["content"] != "")
        assert usage["completion_tokens"] == OUTPUT_TOKENS and 0 < generated <= OUTPUT_TOKENS
        chats[ids.pop()] = usage
    assert len(chats) == REQUESTS
    # guidellm's per-request token counts are the server's usage, response by response.
    for r in reqs["successful"]:
        usage = chats[r["response_id"]]
        assert (r["prompt_tokens"], r["output_tokens"]) == (usage["prompt_tokens"], usage["completion_tokens"])
        assert r["prompt_tokens"] > PROMPT_TOKENS - 2      # the synthetic text plus the chat template
    # ... and the worker counted exactly those tokens.
    after = counters(metrics_url)
    assert after["pagoda:prompt_tokens_total"] - before["pagoda:prompt_tokens_total"] == \
        sum(u["prompt_tokens"] for u in chats.values())
    assert after["pagoda:generation_tokens_total"] - before["pagoda:generation_tokens_total"] == \
        REQUESTS * OUTPUT_TOKENS

