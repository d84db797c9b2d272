"""Speculative decoding: --speculative-config parsing, n-gram lookup, the rejection sampler's
exactness in distribution, greedy output identical to no speculation, rejected drafts' blocks
rolled back, and the acceptance metrics under vLLM's names."""
import random

import numpy as np
import pytest
import torch

from pagoda.gpu_worker.core.drafter import ngram_propose
from pagoda.gpu_worker.core.sampling_params import SamplingParams
from pagoda.gpu_worker.core.spec_config import SpeculativeConfig, parse_speculative_config
from pagoda.gpu_worker.features.spec_decode import rejection_sample

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}


# ---- configuration ----------------------------------------------------------------------------

def test_config_parses_vllm_json_and_defaults():
    c = parse_speculative_config('{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}')
    assert c == SpeculativeConfig("ngram", 3, prompt_lookup_max=4, prompt_lookup_min=4)
    assert parse_speculative_config({"method": "ngram", "num_speculative_tokens": 2}).prompt_lookup_min == 5
    d = parse_speculative_config({"model": "/m/draft", "num_speculative_tokens": 5})
    assert (d.method, d.model, d.num_speculative_tokens) == ("draft_model", "/m/draft", 5)
    assert parse_speculative_config({"model": "ngram", "num_speculative_tokens": 2}).method == "ngram"
    assert parse_speculative_config(None) is None and parse_speculative_config("") is None


@pytest.mark.parametrize("value, key", [
    ("{not json", "speculative_config: not valid JSON"),
    ("[1, 2]", "speculative_config: must be a JSON object"),
    ({"method": "ngram"}, "speculative_config.num_speculative_tokens: required"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "speculative_config.num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": "4"}, "speculative_config.num_speculative_tokens"),
    ({"method": "eagle", "num_speculative_tokens": 2}, "speculative_config.method"),
    ({"num_speculative_tokens": 2}, "speculative_config.method"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 2, "prompt_lookup_min": 3},
     "speculative_config.prompt_lookup_min"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": -1}, "speculative_config.prompt_lookup_max"),
    ({"method": "ngram", "num_speculative_tokens": 2, "lookahead": 3}, "speculative_config.lookahead: unknown key"),
    ({"method": "draft_model", "num_speculative_tokens": 2}, "speculative_config.model"),
    ({"model": "/d", "num_speculative_tokens": 2, "prompt_lookup_max": 2}, "speculative_config.prompt_lookup_max"),
    ({"model": "/d", "num_speculative_tokens": 2, "draft_tensor_parallel_size": 2},
     "speculative_config.draft_tensor_parallel_size"),
])
def test_bad_config_is_refused_naming_the_key(value, key):
    with pytest.raises(ValueError) as e:
        parse_speculative_config(value)
    assert str(e.value).startswith(key), str(e.value)
    assert "\n" not in str(e.value)


def test_worker_flag_in_help_and_bad_json_named_before_the_model_loads(capsys):
    from pagoda.gpu_worker.serving.args import build_parser, engine_config_kwargs
    p = build_parser()
    assert "--speculative-config" in p.format_help()
    args = p.parse_args(["--model", "m", "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2}'])
    assert engine_config_kwargs(args)["speculative_config"].num_speculative_tokens == 2
    with pytest.raises(SystemExit):
        p.parse_args(["--model", "m", "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 99}'])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "--speculative-config" in err and "speculative_config.num_speculative_tokens" in err


def test_speculation_never_pipelines_steps():
    """auto is off with speculation, on CUDA too."""
    from pagoda.gpu_worker.core.config import EngineConfig
    from pagoda.gpu_worker.engine.llm_engine import uses_async_scheduling
    assert uses_async_scheduling(EngineConfig(model="m"), "cuda")
    assert not uses_async_scheduling(EngineConfig(model="m", speculative_config=NGRAM), "cuda")
    assert not uses_async_scheduling(EngineConfig(model="m", speculative_config=NGRAM, async_scheduling="off"), "cpu")


def test_engine_config_refuses_async_scheduling_and_tensor_parallel_with_speculation():
    from pagoda.gpu_worker.core.config import EngineConfig
    with pytest.raises(ValueError, match="^async_scheduling"):
        EngineConfig(model="m", speculative_config=NGRAM, async_scheduling="on")
    with pytest.raises(ValueError, match="^speculative_config"):
        EngineConfig(model="m", speculative_config=NGRAM, tensor_parallel_size=2)


# ---- n-gram lookup ----------------------------------------------------------------------------

def test_ngram_takes_the_longest_suffix_and_its_first_occurrence():
    t = np.array([1, 2, 3, 4, 9, 2, 3, 5, 6, 1, 2, 3])
    # The 3-gram [1, 2, 3] occurs at 0: what followed it there.
    assert ngram_propose(t, 1, 3, 4).tolist() == [4, 9, 2, 3]
    # With at most 2-grams, [2, 3] first occurs at 1 too.
    assert ngram_propose(t, 1, 2, 2).tolist() == [4, 9]
    # No 2-gram match and min 2: nothing.
    assert ngram_propose(np.array([1, 2, 3, 4, 5]), 2, 3, 4).tolist() == []
    # Only a 1-gram: [7] first at 1, followed by [8, 7].
    assert ngram_propose(np.array([5, 7, 8, 7]), 1, 3, 5).tolist() == [8, 7]


# ---- the rejection sampler, in distribution --------------------------------------------------

V = 6


def chi2(counts: np.ndarray, probs: np.ndarray) -> float:
    n = counts.sum()
    exp = n * probs
    keep = exp > 0
    assert counts[~keep].sum() == 0, "a token of probability 0 was emitted"
    return float(((counts[keep] - exp[keep]) ** 2 / exp[keep]).sum())


CHI2_CRIT_DF5 = 20.5      # p = 0.001 with 5 degrees of freedom (V - 1)


def _dist(seed):
    g = torch.Generator().manual_seed(seed)
    p = torch.rand(V, generator=g) ** 2
    return p / p.sum()


@pytest.mark.parametrize("with_draft_probs", [False, True])
def test_rejection_sampling_emits_the_targets_distribution(with_draft_probs):
    """k = 2 drafts; the first emitted token must follow p0, the next (when d0 was accepted)
    p1, and the bonus (both accepted) p2, whatever the drafts' distribution."""
    torch.manual_seed(0)
    n = 60000
    p = torch.stack([_dist(s) for s in (1, 2, 3)])                  # the target at positions 0, 1, 2
    q = torch.stack([_dist(s) for s in (11, 12)])                   # the proposer's
    if with_draft_probs:
        drafts = torch.multinomial(q, n, replacement=True).T         # [n, 2], d_j ~ q_j
    else:                                                           # n-gram: fixed drafts, point masses
        drafts = torch.tensor([[2, 4]]).expand(n, 2)
    target = p.repeat(n, 1)                                         # 3 rows per sequence
    u = torch.rand(3 * n)
    out = rejection_sample(target, np.full(n, 2), drafts.reshape(-1),
                           q.repeat(n, 1) if with_draft_probs else None, u)
    first = np.array([t[0] for t in out.tokens])
    assert chi2(np.bincount(first, minlength=V), p[0].numpy()) < CHI2_CRIT_DF5
    d = drafts.numpy()
    after0 = np.array([t[1] for t, dd in zip(out.tokens, d) if t[0] == dd[0]])
    assert chi2(np.bincount(after0, minlength=V), p[1].numpy()) < CHI2_CRIT_DF5
    after1 = np.array([t[2] for t, dd in zip(out.tokens, d) if len(t) == 3])
    assert len(after1) > 1000
    assert chi2(np.bincount(after1, minlength=V), p[2].numpy()) < CHI2_CRIT_DF5
    # Emitted tokens are the accepted drafts then one more.
    assert all(len(t) == a + 1 and t[:a] == list(dd[:a]) for t, a, dd in zip(out.tokens, out.num_accepted, d))


def test_the_distribution_check_has_power():
    """The same check catches a plausible bug: on rejection, drawing from p instead of the
    residual over-weights the draft token."""
    torch.manual_seed(0)
    n = 60000
    p = _dist(1)
    d = 2
    u = torch.rand(n)
    accepted = u < p[d]
    redraw = torch.multinomial(p, n, replacement=True)
    wrong = torch.where(accepted, torch.full((n,), d), redraw).numpy()
    assert chi2(np.bincount(wrong, minlength=V), p.numpy()) > 10 * CHI2_CRIT_DF5


def test_greedy_rows_accept_while_the_draft_is_the_argmax():
    one_hot = torch.eye(V)
    target = one_hot[[3, 1, 5, 0, 2]]               # seq 0: argmaxes 3, 1, 5 ; seq 1: 0, 2
    drafts = torch.tensor([3, 4, 0])                # seq 0 drafts 3 (right), 4 (wrong); seq 1 drafts 0
    out = rejection_sample(target, np.array([2, 1]), drafts, None, torch.rand(5))
    assert out.num_accepted == [1, 1]
    assert out.tokens == [[3, 1], [0, 2]]


# ---- through the engine --------------------------------------------------------------------------

def repetitive_prompts(n, seed=0):
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        seg = [rng.randrange(8, 600) for _ in range(rng.randrange(10, 30))]
        out.append(seg * 3 + [rng.randrange(8, 600) for _ in range(rng.randrange(1, 9))])
    return out


def copy_successors():
    """(document, successor map) of the copy model below."""
    rng = random.Random(5)
    toks = rng.sample(range(8, 1000), 400)
    doc = toks[:300]
    succ = {a: b for a, b in zip(doc, doc[1:])}
    for i in range(20, 300, 37):                  # edits: the map leaves the text here
        succ[doc[i]] = toks[300 + i // 37]
        succ[toks[300 + i // 37]] = doc[i + 2] if i + 2 < 300 else doc[0]
    return doc, toks, succ


@pytest.fixture(scope="module")
def copy_model(tmp_path_factory):
    """The tiny Llama made to copy (bench/spec_decode.py): its greedy output after t is
    succ[t], so drafts from the prompt are accepted, and some rejected where the map departs."""
    from bench.spec_decode import make_copy_model
    doc, _, succ = copy_successors()
    path = make_copy_model(str(tmp_path_factory.mktemp("copy")), succ)
    return path, doc


@pytest.fixture(scope="module")
def draft_model(tmp_path_factory):
    """A draft that copies like the target but departs from it elsewhere (every 23rd token of
    the document leads it to a token the target never writes there), so that the draft-model
    method has drafts rejected too, and the target's token must replace them."""
    from bench.spec_decode import make_copy_model
    doc, toks, succ = copy_successors()
    draft = dict(succ)
    for n, i in enumerate(range(10, 300, 23)):
        draft[doc[i]] = toks[320 + n]
    return make_copy_model(str(tmp_path_factory.mktemp("copy-draft")), draft)


@pytest.fixture(scope="module")
def engines(copy_model, draft_model):
    from pagoda.gpu_worker.engine.llm import LLM
    path, _ = copy_model
    kw = dict(device="cpu", num_kv_blocks=96, block_size=8)
    return {"plain": LLM(path, **kw), "ngram": LLM(path, speculative_config=NGRAM, **kw),
            "draft": LLM(path, speculative_config={"model": draft_model, "num_speculative_tokens": 3}, **kw)}


@pytest.mark.usefixtures("no_block_leaks", "one_torch_thread")
@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_greedy_output_is_identical_to_no_speculation(engines, copy_model, method):
    _, doc = copy_model
    prompts = [doc[:120] + doc[:3], doc[50:200] + doc[50:52], doc[:40] + doc[100:101]] + repetitive_prompts(2)
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in (60, 41, 33, 25, 30)]
    # A stop token inside a run of accepted drafts, and a stop string, end the output where
    # plain decoding ends it.
    params[1] = SamplingParams(temperature=0.0, max_tokens=41, stop_token_ids=[doc[60]], ignore_eos=True)
    plain = engines["plain"].generate(prompts, params)
    spec_llm = engines[method]
    before = spec_llm.engine.stats()
    spec = spec_llm.generate(prompts, params)
    after = spec_llm.engine.stats()
    for a, b in zip(plain, spec):
        assert b.outputs[0].token_ids == a.outputs[0].token_ids
        assert (b.outputs[0].finish_reason, b.outputs[0].stop_reason) == (a.outputs[0].finish_reason,
                                                                           a.outputs[0].stop_reason)
        assert b.outputs[0].text == a.outputs[0].text
    assert spec[1].outputs[0].finish_reason == "stop" and spec[1].outputs[0].token_ids[-1] == doc[60]
    drafted = after.spec_num_draft_tokens - before.spec_num_draft_tokens
    accepted = after.spec_num_accepted_tokens - before.spec_num_accepted_tokens
    assert drafted > 50 and accepted > 0.5 * drafted        # it copies: most drafts are accepted
    # ... and some are rejected (the target's edits; the draft model's own departures), so the
    # outputs above went through the replacement of a rejected draft by the target's token.
    assert accepted < drafted
    tokens = sum(len(o.outputs[0].token_ids) for o in spec)
    assert after.generation_tokens - before.generation_tokens == tokens


@pytest.mark.usefixtures("no_block_leaks", "one_torch_thread")
def test_stop_string_inside_accepted_drafts_truncates_like_plain(engines, copy_model):
    _, doc = copy_model
    prompt = doc[:100] + doc[:2]
    full = engines["plain"].generate([prompt], SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True))[0]
    text = full.outputs[0].text
    stop = text[len(text) // 2:len(text) // 2 + 2]
    sp = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, stop=[stop])
    a = engines["plain"].generate([prompt], sp)[0].outputs[0]
    b = engines["ngram"].generate([prompt], sp)[0].outputs[0]
    assert (b.text, b.token_ids, b.finish_reason, b.stop_reason) == (a.text, a.token_ids, a.finish_reason, a.stop_reason)
    assert a.finish_reason == "stop"


@pytest.mark.usefixtures("no_block_leaks", "one_torch_thread")
def test_rejected_drafts_slots_are_rolled_back(engines, copy_model):
    """After every step each running request holds exactly the blocks its computed KV needs
    (drafts' extra blocks freed), the runner's table agrees, and at the end nothing leaks."""
    from pagoda.gpu_worker.core.kv_cache_manager import cdiv
    _, doc = copy_model
    eng = engines["ngram"].engine
    bs = eng.block_size
    sp = SamplingParams(temperature=0.0, max_tokens=70, ignore_eos=True)
    for i, p in enumerate([doc[:60] + doc[:2], doc[10:90] + doc[10:12]] + repetitive_prompts(2, seed=3)):
        eng.add_request(f"roll-{i}", p, sp)
    while eng.has_unfinished_requests():
        eng.step()
        s = eng.scheduler
        for r in s.running:
            blocks = eng.kv.req_to_blocks[r.req_id]
            assert len(blocks) == cdiv(r.num_computed_tokens, bs), r
            row = eng.runner.batch.row_of[r.req_id]
            assert int(eng.runner.batch.num_blocks[row]) == len(blocks)
            assert list(eng.runner.batch.block_table[row, :len(blocks)]) == [b.block_id for b in blocks]
            assert r.num_computed_tokens == r.num_tokens - 1
        held = sum(len(b) for b in eng.kv.req_to_blocks.values())
        assert eng.kv.pool.num_free_blocks() == eng.num_blocks - held
    assert eng.kv.pool.num_free_blocks() == eng.num_blocks


@pytest.mark.usefixtures("no_block_leaks", "one_torch_thread")
def test_a_step_frees_the_blocks_of_rejected_drafts(copy_model):
    """With 8 drafts and blocks of 8 every verification takes a block more than the step
    before it; where the text was edited the drafts are rejected and the block goes back."""
    from pagoda.gpu_worker.engine.llm import LLM
    path, doc = copy_model
    llm = LLM(path, device="cpu", num_kv_blocks=64, block_size=8,
              speculative_config={"method": "ngram", "num_speculative_tokens": 8, "prompt_lookup_max": 2,
                                  "prompt_lookup_min": 1})
    eng = llm.engine
    eng.add_request("x", doc[:100] + doc[:2], SamplingParams(temperature=0.0, max_tokens=90, ignore_eos=True))
    free_at_schedule = []
    orig = eng.runner.launch

    def launch(out):
        free_at_schedule.append((eng.kv.pool.num_free_blocks(), [len(s.spec_token_ids) for s in out.scheduled]))
        return orig(out)
    eng.runner.launch = launch
    frees_after = []
    while eng.has_unfinished_requests():
        eng.step()
        frees_after.append(eng.kv.pool.num_free_blocks())
    spec_steps = [i for i, (_, k) in enumerate(free_at_schedule) if k and k[0] == 8]
    assert spec_steps
    # A step that verified 8 drafts held more blocks than the request needs afterwards.
    assert any(frees_after[i] > free_at_schedule[i][0] for i in spec_steps)
    st = eng.stats()
    assert st.spec_num_accepted_tokens < st.spec_num_draft_tokens


@pytest.mark.usefixtures("no_block_leaks", "one_torch_thread")
def test_sampled_speculation_runs_to_the_end_and_seeds_repeat(engines, copy_model):
    _, doc = copy_model
    prompts = [doc[:80] + doc[:2], doc[30:150] + doc[30:31]]
    sp = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=40, ignore_eos=True, seed=7)
    a = engines["ngram"].generate(prompts, sp)
    b = engines["ngram"].generate(prompts, sp)
    assert [o.outputs[0].token_ids for o in a] == [o.outputs[0].token_ids for o in b]
    assert all(len(o.outputs[0].token_ids) == 40 for o in a)
    # Rows that cannot speculate (penalties, logprobs) share the batch and still decode.
    mixed = [sp, SamplingParams(temperature=0.0, max_tokens=12, repetition_penalty=1.3, logprobs=2),
             SamplingParams(temperature=0.0, max_tokens=12, prompt_logprobs=1, ignore_eos=True)]
    out = engines["ngram"].generate(prompts + [doc[:40] + doc[:2]], mixed)
    assert len(out[1].outputs[0].token_ids) == 12 and len(out[1].outputs[0].logprobs) == 12
    assert len(out[2].prompt_logprobs) == 42 and len(out[2].outputs[0].token_ids) == 12


def test_metrics_under_vllms_names():
    from prometheus_client import generate_latest

    from pagoda.gpu_worker.core.outputs import EngineStats
    from pagoda.gpu_worker.serving.metrics import WorkerMetrics
    stats = EngineStats(running=0, waiting=0, queued_prefill_tokens=0, num_blocks=8, free_blocks=8, kv_usage=0.0,
                        prefix_cache_queries=0, prefix_cache_hits=0, preemptions=0, prompt_tokens=0,
                        generation_tokens=0, tokens_stored=0, blocks_held=0, block_size=16,
                        spec_num_drafts=5, spec_num_draft_tokens=17, spec_num_accepted_tokens=9,
                        spec_accepted_per_pos=(4, 3, 2))
    text = generate_latest(WorkerMetrics(lambda: stats, "m", "vllm").registry).decode()
    assert 'vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} 5.0' in text
    assert 'vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="m"} 17.0' in text
    assert 'vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="m"} 9.0' in text
    assert 'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="2"} 2.0' in text
    plain = EngineStats(**{**stats.__dict__, "spec_num_drafts": None})
    assert "spec_decode" not in generate_latest(WorkerMetrics(lambda: plain, "m", "vllm").registry).decode()


def test_speculation_on_cuda_matches_plain(copy_model):
    """The CUDA twin (bench/gpu_check.sh): Triton attention over the k + 1 query rows, the
    draft model's pool on the device; greedy output equal to plain decoding there."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from pagoda.gpu_worker.engine.llm import LLM
    path, doc = copy_model
    kw = dict(device="cuda", dtype="float32", num_kv_blocks=96, block_size=16)
    prompts = [doc[:120] + doc[:3], doc[50:200] + doc[50:52]]
    sp = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    plain = [o.outputs[0].token_ids for o in LLM(path, **kw).generate(prompts, sp)]
    for spec in (NGRAM, {"model": path, "num_speculative_tokens": 3}):
        llm = LLM(path, speculative_config=spec, **kw)
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, sp)] == plain
        st = llm.engine.stats()
        assert st.spec_num_accepted_tokens > 0.5 * st.spec_num_draft_tokens
        sampled = llm.generate(prompts, SamplingParams(temperature=0.8, max_tokens=32, ignore_eos=True, seed=3))
        assert all(len(o.outputs[0].token_ids) == 32 for o in sampled)


def test_bench_smoke(tmp_path, capsys):
    """bench/spec_decode.py end to end on a toy size: every configuration runs, outputs equal
    plain decoding's, and n-gram lookup takes fewer steps than tokens."""
    import json

    from bench.spec_decode import main
    out = tmp_path / "r.json"
    assert main(["--rounds", "1", "--doc-len", "40", "--requests", "1", "--layers", "1", "--hidden", "64",
                 "--json", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert len(rows) == 10 and all(r["same_output"] for r in rows)
    ngram = [r for r in rows if r["config"] == "ngram k=4"]
    assert all(r["tokens_per_step"] > 1.5 for r in ngram)
    assert "speed-up" in capsys.readouterr().out


@pytest.mark.usefixtures("no_block_leaks", "one_torch_thread")
def test_async_streams_and_abort_with_speculation(engines, copy_model):
    """Through AsyncLLM (what the worker serves): concurrent streams carry several tokens per
    delta and equal plain decoding; a stream aborted mid-way frees everything."""
    import asyncio

    from pagoda.gpu_worker.core.config import EngineConfig
    from pagoda.gpu_worker.serving.async_llm import AsyncLLM
    path, doc = copy_model
    prompts = [doc[:80] + doc[:2], doc[40:160] + doc[40:42], doc[100:220] + doc[100:101]]
    sp = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in engines["plain"].generate(prompts, sp)]
    eng = AsyncLLM(EngineConfig(model=path, device="cpu", num_kv_blocks=96, block_size=8, speculative_config=NGRAM))

    async def collect(rid, p):
        return [d async for d in eng.generate(rid, p, sp)]

    async def aborted():
        got = 0
        async for d in eng.generate("gone", prompts[0], SamplingParams(temperature=0.0, max_tokens=200,
                                                                       ignore_eos=True)):
            got += len(d.token_ids)
            if got >= 10:
                break       # leaving the stream aborts the request
        return got

    async def main():
        return await asyncio.gather(*[collect(f"s{i}", p) for i, p in enumerate(prompts)], aborted())

    try:
        *streams, got = asyncio.run(main())
        assert got >= 10
        for deltas, w in zip(streams, want):
            assert [t for d in deltas for t in d.token_ids] == w
            assert max(len(d.token_ids) for d in deltas) > 1
            assert deltas[-1].finished and deltas[-1].num_output_tokens == 40
    finally:
        asyncio.run(eng.shutdown())
