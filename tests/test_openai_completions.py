"""/v1/completions as third-party tools drive it (issue 24), with the official `openai` client
against a real stack (redis-server, one tiny-model CPU worker, a router): `echo` with the
prompt's tokens scored by the engine (lm-eval's loglikelihood requests), `prompt_logprobs`,
a list of prompts served as independent requests, and stream_options.continuous_usage_stats.
"""
from __future__ import annotations

import openai
import pytest

from pagoda.clients.up import free_port
from tests.test_openai_http import _get, _wait_idle, cluster_procs_module  # noqa: F401
from tests.test_router import wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
GREEDY = dict(temperature=0, extra_body={"ignore_eos": True})


@pytest.fixture(scope="module")
def stack(tiny_model, redis_server_module, start_worker_module, cluster_procs_module):  # noqa: F811
    url = redis_server_module.url
    worker = start_worker_module(tiny_model, redis_url=url, worker_id="we", num_kv_blocks=64, max_model_len=256,
                                 timeout=240)
    http_port = free_port()
    cluster_procs_module(url, http_port=http_port)
    base = f"http://127.0.0.1:{http_port}/v1"
    wait_for(lambda: len(_get(base + "/models")["data"]) == 1, 20, "the router to list the model")
    return dict(base=base, model=_get(base + "/models")["data"][0]["id"], worker=worker)


@pytest.fixture
def client(stack):
    with openai.OpenAI(base_url=stack["base"], api_key="unused", max_retries=0, timeout=60) as c:
        yield c
    _wait_idle(stack["worker"].address)


def test_echo_puts_the_prompt_before_the_completion(client, stack):
    kw = dict(model=stack["model"], prompt="The sea is", max_tokens=5, **GREEDY)
    plain = client.completions.create(**kw).choices[0].text
    assert client.completions.create(echo=False, **kw).choices[0].text == plain
    assert client.completions.create(echo=True, **kw).choices[0].text == "The sea is" + plain
    # Streamed, the prompt comes in each choice's first chunk; with logprobs its scores too.
    whole = client.completions.create(echo=True, logprobs=0, **kw).choices[0].logprobs
    chunks = list(client.completions.create(echo=True, stream=True, n=2, logprobs=0, **kw))
    for i in (0, 1):
        mine = [c.choices[0] for c in chunks if c.choices[0].index == i]
        assert "".join(c.text for c in mine) == "The sea is" + plain
        assert mine[0].text.startswith("The sea is") and mine[0].logprobs.token_logprobs[0] is None
        # The prompt's tokens and the 5 generated (how many per chunk depends on how the worker
        # merged deltas that queued up: gpu_worker/serving/coalesce.py).
        assert [t for c in mine for t in c.logprobs.tokens] == whole.tokens


def test_echo_logprobs_score_the_prompt_as_the_engine_scores_its_own_tokens(client, stack):
    m = stack["model"]
    # The greedy continuation of a prompt, scored by the sampler when generated...
    gen = client.completions.create(model=m, prompt="Once upon a time", max_tokens=3, logprobs=1, **GREEDY)
    glp = gen.choices[0].logprobs
    # ... and the same tokens scored as part of the prompt (lm-eval's loglikelihood request: token
    # ids, echo, logprobs 1, max_tokens 1).
    head = client.completions.create(model=m, prompt="Once upon a time", max_tokens=1, echo=True, logprobs=1,
                                     **GREEDY)
    lp = head.choices[0].logprobs
    n_prompt = head.usage.prompt_tokens
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == n_prompt + 1
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert "".join(lp.tokens[1:n_prompt]) == "Once upon a time"     # after the BOS the tokenizer adds
    assert lp.text_offset[:2] == [0, len(lp.tokens[0])]
    assert all(v <= 0 for v in lp.token_logprobs[1:])
    # The prompt's own token is in its top_logprobs beside the best one (vLLM's shape).
    assert all(t in top and len(top) in (1, 2) for t, top in zip(lp.tokens[1:n_prompt], lp.top_logprobs[1:n_prompt]))
    full = client.completions.create(model=m, prompt="Once upon a time" + gen.choices[0].text, max_tokens=1,
                                     echo=True, logprobs=1, **GREEDY)
    flp = full.choices[0].logprobs
    assert full.usage.prompt_tokens == n_prompt + 3        # the text re-tokenizes to the same ids
    assert flp.tokens[n_prompt:n_prompt + 3] == glp.tokens
    assert flp.token_logprobs[n_prompt:n_prompt + 3] == pytest.approx(glp.token_logprobs, abs=1e-4)
    # Greedy tokens: each is the best of its place, as lm-eval's is_greedy reads it.
    for tok, top in zip(flp.token_logprobs[n_prompt:n_prompt + 3], flp.top_logprobs[n_prompt:n_prompt + 3]):
        assert tok == pytest.approx(max(top.values()))
    assert full.usage.completion_tokens == 1


def test_max_tokens_0_with_echo_scores_the_prompt_alone(client, stack, tiny_model):
    """vLLM's echo without generation (lm-eval's loglikelihood shape): before, 400 "max_tokens:
    must be at least 1"; now the prompt's scores, equal to transformers' log-softmax, and no
    completion token."""
    import torch
    import transformers
    ids = [5, 17, 300, 42, 99, 7, 250, 12]
    r = client.completions.create(model=stack["model"], prompt=ids, max_tokens=0, echo=True, logprobs=1,
                                  temperature=0)
    choice = r.choices[0]
    lp = choice.logprobs
    assert choice.finish_reason == "length" and r.usage.completion_tokens == 0 and r.usage.prompt_tokens == len(ids)
    assert len(lp.tokens) == len(ids) and choice.text == "".join(lp.tokens)
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)
    assert lp.token_logprobs[0] is None
    assert lp.token_logprobs[1:] == pytest.approx([ref[i - 1, ids[i]].item() for i in range(1, len(ids))], abs=2e-4)
    for i in range(1, len(ids)):          # the best token of each place is in its top_logprobs
        assert max(lp.top_logprobs[i].values()) == pytest.approx(ref[i - 1].max().item(), abs=2e-4)
    # Streamed: the same prompt alone, then the end.
    chunks = list(client.completions.create(model=stack["model"], prompt=ids, max_tokens=0, echo=True, logprobs=1,
                                            temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == choice.text
    assert [t for c in chunks if c.choices[0].logprobs for t in c.choices[0].logprobs.tokens] == lp.tokens
    assert chunks[-1].choices[0].finish_reason == "length"
    # prompt_logprobs alone scores too; nothing to score or show is refused, naming the field.
    r = client.completions.create(model=stack["model"], prompt=ids, max_tokens=0, temperature=0,
                                  extra_body={"prompt_logprobs": 1})
    assert r.choices[0].text == "" and r.usage.completion_tokens == 0
    assert len(r.choices[0].model_extra["prompt_logprobs"]) == len(ids)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=stack["model"], prompt=ids, max_tokens=0)
    assert e.value.body["param"] == "max_tokens" and "echo" in e.value.body["message"]


def test_token_id_batches_with_n_are_independent_requests(client, stack):
    m = stack["model"]
    a = client.completions.create(model=m, prompt=[5, 6, 7, 8, 9], max_tokens=4, **GREEDY)
    b = client.completions.create(model=m, prompt=[40, 41, 42], max_tokens=4, **GREEDY)
    both = client.completions.create(model=m, prompt=[[5, 6, 7, 8, 9], [40, 41, 42]], max_tokens=4, n=2, **GREEDY)
    assert [c.index for c in both.choices] == [0, 1, 2, 3]
    assert [c.text for c in both.choices] == [a.choices[0].text] * 2 + [b.choices[0].text] * 2
    assert both.usage.prompt_tokens == 8 and both.usage.completion_tokens == 16
    texts = client.completions.create(model=m, prompt=["The sea is", "Mountains are"], max_tokens=3,
                                      echo=True, logprobs=0, **GREEDY)
    assert [c.text[:10] for c in texts.choices] == ["The sea is", "Mountains "]
    assert texts.usage.prompt_tokens == sum(len(c.logprobs.tokens) - 3 for c in texts.choices)


def test_prompt_logprobs_in_vllm_shape(client, stack):
    r = client.completions.create(model=stack["model"], prompt=[5, 6, 7, 8], max_tokens=1,
                                  extra_body={"prompt_logprobs": 2}, temperature=0)
    plp = r.choices[0].model_extra["prompt_logprobs"]
    assert plp[0] is None and len(plp) == 4
    for tok, entry in zip([6, 7, 8], plp[1:]):
        assert str(tok) in entry and 2 <= len(entry) <= 3
        assert sorted(e["rank"] for e in entry.values() if e["rank"] is not None) == [1, 2]


def test_continuous_usage_stats_on_every_chunk(client, stack):
    m = stack["model"]
    chunks = list(client.completions.create(
        model=m, prompt=["The sea is", "Mountains are"], max_tokens=6, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True}, **GREEDY))
    body, last = chunks[:-1], chunks[-1]
    assert body and all(c.usage is not None for c in body)
    for i in (0, 1):
        mine = [c for c in body if c.choices[0].index == i]
        counts = [c.usage.completion_tokens for c in mine]
        assert counts == sorted(counts) and counts[-1] == 6
        assert mine[0].usage.prompt_tokens == mine[-1].usage.prompt_tokens
    assert last.choices == [] and last.usage.completion_tokens == 12
    chat = list(client.chat.completions.create(
        model=m, messages=[{"role": "user", "content": "hi"}], max_tokens=3, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True}, **GREEDY))
    assert chat[0].usage.completion_tokens == 0 and chat[-2].usage.completion_tokens == 3
    plain = list(client.completions.create(model=m, prompt="hi", max_tokens=3, stream=True,
                                           stream_options={"include_usage": True}, **GREEDY))
    assert all(c.usage is None for c in plain[:-1]) and plain[-1].usage.completion_tokens == 3


def test_bad_prompts_and_stream_options_are_400_naming_them(client, stack):
    kw = dict(model=stack["model"], max_tokens=2)
    for prompt in ([], [[]], ["a", [1, 2]], [1.5], [True]):
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(prompt=prompt, **kw)
        assert e.value.body["param"] == "prompt", prompt
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(prompt="hi", stream=True, stream_options={"include_usage": True, "bogus": 1}, **kw)
    assert e.value.body["param"] == "stream_options" and "stream_options.bogus" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(prompt="hi", stream=True, stream_options={"continuous_usage_stats": "yes"}, **kw)
    assert "stream_options.continuous_usage_stats" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(prompt="hi", echo="yes", **kw)
    assert e.value.body["param"] == "echo"
    with pytest.raises(openai.BadRequestError) as e:      # the worker's bound, named
        client.completions.create(prompt="hi", extra_body={"prompt_logprobs": 99}, **kw)
    assert e.value.body["param"] == "prompt_logprobs"
    with pytest.raises(openai.BadRequestError) as e:      # one bad prompt of a batch refuses the batch
        client.completions.create(prompt=["hi", "x" * 4000], **kw)
    assert e.value.body["param"] == "prompt"
