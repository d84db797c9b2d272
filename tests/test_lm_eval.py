"""lm-eval (EleutherAI's harness, unchanged, as its CLI) against a real `pagoda up` on loopback
(issue 24): a multiple-choice task (loglikelihood: echo + logprobs of the prompt's tokens) and a
generate_until task, on offline data the test writes, batched 4 prompts a request. A recording
relay between lm-eval and the router keeps every request and response, so the test checks that
lm-eval finishes, prints no warning the server causes, and that the token counts it sent agree
with the server's usage and with the worker's own counters.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

pytest.importorskip("lm_eval")
aiohttp = pytest.importorskip("aiohttp")

from tests.plugins.relay import RecordingRelay  # noqa: E402
from tests.plugins.up import pagoda_up  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]

MC = [("What colour is the sky?", [" blue", " green", " red"], 0),
      ("How many legs has a cat?", [" two", " four", " six"], 1),
      ("Where do fish live?", [" in trees", " in the sea", " on the moon"], 1),
      ("What is ice made of?", [" water", " stone", " wood"], 0),
      ("Which is a fruit?", [" apple", " brick"], 0)]
GEN = [("Say hello.", "hello"), ("Name a colour.", "blue"), ("Count to three.", "1 2 3")]
MAX_GEN_TOKS = 8
TASKS = """task: pagoda_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {dir}/mc.jsonl
test_split: test
output_type: multiple_choice
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
---
task: pagoda_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {dir}/gen.jsonl
test_split: test
output_type: generate_until
doc_to_text: "Q: {{{{question}}}}\\nA:"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: {max_gen}
  do_sample: false
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
"""


def write_tasks(d: Path) -> None:
    (d / "mc.jsonl").write_text("".join(json.dumps({"question": q, "choices": c, "answer": a}) + "\n"
                                        for q, c, a in MC))
    (d / "gen.jsonl").write_text("".join(json.dumps({"question": q, "answer": a}) + "\n" for q, a in GEN))
    for name, text in zip(("pagoda_mc", "pagoda_gen"), TASKS.format(dir=d, max_gen=MAX_GEN_TOKS).split("---\n")):
        (d / f"{name}.yaml").write_text(text)


def generation_tokens(metrics_url: str) -> float:
    text = urllib.request.urlopen(metrics_url, timeout=10).read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(("pagoda:generation_tokens_total", "vllm:generation_tokens_total")))


@pytest.fixture(scope="module")
def cluster(tiny_model, tmp_path_factory):
    """`pagoda up` with one CPU worker on the tiny model: (OpenAI base URL, worker metrics URL)."""
    with pagoda_up(tiny_model, tmp_path_factory.mktemp("up")) as urls:
        yield urls


def test_lm_eval_loglikelihood_and_generate_until(cluster, tiny_model, tmp_path):
    base, metrics_url = cluster
    model = json.load(urllib.request.urlopen(base + "/v1/models", timeout=10))["data"][0]["id"]
    write_tasks(tmp_path)
    relay = RecordingRelay(base)
    before = generation_tokens(metrics_url)
    cmd = [sys.executable, "-m", "lm_eval", "--model", "local-completions", "--model_args",
           f"model={model},base_url=http://127.0.0.1:{relay.port}/v1/completions,tokenizer={tiny_model},"
           "tokenizer_backend=huggingface,num_concurrent=1,max_retries=1",
           "--batch_size", "4", "--tasks", "pagoda_mc,pagoda_gen", "--include_path", str(tmp_path),
           "--output_path", str(tmp_path / "out"), "--log_samples"]
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1",
           "TOKENIZERS_PARALLELISM": "false"}
    try:
        run = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=360)
    finally:
        relay.close()
    log = run.stdout + run.stderr
    assert run.returncode == 0, log[-4000:]
    # The one warning left is lm-eval's own note on batching, printed for every API model.
    warnings = [x for x in log.splitlines() if "WARNING" in x and "Batch size > 1 detected" not in x]
    assert not warnings, warnings
    results = json.loads(next((tmp_path / "out").rglob("results_*.json")).read_text())
    assert results["n-samples"]["pagoda_mc"]["effective"] == len(MC)
    assert results["n-samples"]["pagoda_gen"]["effective"] == len(GEN)
    assert 0 <= results["results"]["pagoda_mc"]["acc,none"] <= 1

    records = [(path, body, status, json.loads(text)) for _, path, body, status, text in relay.records]
    assert records and all(path == "/v1/completions" and status == 200
                           for path, _, status, _ in records), records[:3]
    scored = [(b, r) for _, b, _, r in records if b.get("echo")]
    generated = [(b, r) for _, b, _, r in records if not b.get("echo")]
    # Loglikelihood: one prompt per choice (token ids, batched); each echoes every prompt token
    # (the first unscored) plus the one generated, and usage counts exactly what lm-eval sent.
    assert sum(len(b["prompt"]) for b, _ in scored) == sum(len(c) for _, c, _ in MC)
    assert max(len(b["prompt"]) for b, _ in scored) == 4
    for body, resp in scored:
        prompts = body["prompt"]
        assert [c["index"] for c in resp["choices"]] == list(range(len(prompts)))
        for ids, choice in zip(prompts, resp["choices"]):
            lp = choice["logprobs"]
            assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(ids) + 1
            assert lp["token_logprobs"][0] is None and all(v <= 0 for v in lp["token_logprobs"][1:])
        assert resp["usage"]["prompt_tokens"] == sum(len(ids) for ids in prompts)
        assert resp["usage"]["completion_tokens"] == len(prompts)
    # generate_until: usage again counts the ids sent, and completions stay within max_gen_toks.
    assert sum(len(b["prompt"]) for b, _ in generated) == len(GEN)
    for body, resp in generated:
        assert body["max_tokens"] == MAX_GEN_TOKS and len(resp["choices"]) == len(body["prompt"])
        assert resp["usage"]["prompt_tokens"] == sum(len(ids) for ids in body["prompt"])
        assert 0 < resp["usage"]["completion_tokens"] <= MAX_GEN_TOKS * len(body["prompt"])
    # The worker generated exactly the tokens the responses' usage reports.
    reported = sum(r["usage"]["completion_tokens"] for _, _, _, r in records)
    assert generation_tokens(metrics_url) - before == reported
    # Each loglikelihood lm-eval reports is a sum of the server's scores over a continuation: the
    # scores of some echoed prompt from some token on, the generated token left out.
    samples = [json.loads(x) for f in (tmp_path / "out").rglob("samples_pagoda_mc_*.jsonl")
               for x in f.read_text().splitlines()]
    assert len(samples) == len(MC)
    sums = [sum(c["logprobs"]["token_logprobs"][k:-1]) for _, r in scored for c in r["choices"]
            for k in range(1, len(c["logprobs"]["tokens"]) - 1)]
    for s in samples:
        for (value, _greedy), in s["resps"]:
            assert min(abs(float(value) - x) for x in sums) < 1e-6, value
