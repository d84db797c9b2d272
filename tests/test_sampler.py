"""Sampler semantics (vLLM's) on hand-made logits, and seeded sampling through the runner.

Rows reach the sampler as the runner builds them: through the persistent batch."""
import math

import numpy as np
import pytest
import torch

from pagoda.gpu_worker.core.config import EngineConfig
from pagoda.gpu_worker.core.outputs import NewRequest, SchedulerOutput
from pagoda.gpu_worker.core.sampling_params import SamplingParams
from pagoda.gpu_worker.runner.input_batch import InputBatch
from pagoda.gpu_worker.runner.model_runner import ModelRunner
from pagoda.gpu_worker.runner.sampler import Sampler
from tests.plugins.engine import Chunk, fresh_step

V = 8
EOS = 7
BASE = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -1.5])


def row(prompt=(), output=(), generator=None, **kw):
    return SamplingParams(**kw), list(prompt), list(output), generator


def batch_of(rows):
    ib = InputBatch(len(rows), 64, 64, 8, V, [EOS], torch.device("cpu"))
    ib.update(SchedulerOutput([], new=[NewRequest(f"r{i}", prompt + output, len(prompt), params, [], gen)
                                       for i, (params, prompt, output, gen) in enumerate(rows)]))
    return ib.sampling_batch(np.arange(len(rows)))


def sample(logits, rows):
    return Sampler()(logits.clone().float(), batch_of(rows))


def process(logits, r):
    return Sampler.process(logits.clone().float()[None], batch_of([r]))[0]


def frequencies(logits, n=6000, **kw):
    torch.manual_seed(0)
    tokens, _ = sample(logits.expand(n, -1), [row(**kw) for _ in range(n)])
    return torch.bincount(torch.tensor(tokens), minlength=V).float() / n


def test_greedy_is_argmax_per_row():
    logits = torch.stack([BASE, BASE.flip(0), BASE.roll(3)])
    tokens, lps = sample(logits, [row(temperature=0.0)] * 3)
    assert tokens == [0, V - 1, 3] and lps == [None] * 3


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_random_sampling_follows_softmax_over_temperature(temperature):
    freq = frequencies(BASE, temperature=temperature)
    want = torch.softmax(BASE / temperature, dim=0)
    assert (freq - want).abs().max() < 0.025


def test_top_k_keeps_k_best_renormalised():
    freq = frequencies(BASE, top_k=2)
    assert freq[2:].sum() == 0
    want = torch.softmax(BASE[:2], dim=0)
    assert (freq[:2] - want).abs().max() < 0.025


def test_top_p_keeps_smallest_set_reaching_p():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05, 0, 0, 0, 0]) + 1e-9
    logits = probs.log()
    freq = frequencies(logits, top_p=0.75)     # 0.5 + 0.3 >= 0.75: two tokens
    assert freq[2:].sum() == 0 and freq[1] > 0.3
    freq = frequencies(logits, top_p=0.9)      # needs the third one too
    assert freq[3:].sum() == 0 and freq[2] > 0.1


def test_min_p_drops_tokens_below_fraction_of_best():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05, 0, 0, 0, 0]) + 1e-9
    freq = frequencies(probs.log(), min_p=0.4)  # threshold 0.2
    assert freq[2:].sum() == 0 and abs(freq[1] - 0.375) < 0.03


def test_repetition_penalty_over_prompt_and_output():
    logits = torch.tensor([3.0, 2.9, -1.0, -1.1, -5, -5, -5, -5])
    assert sample(logits[None], [row(temperature=0, prompt=[0], repetition_penalty=1.2)])[0] == [1]
    assert sample(logits[None], [row(temperature=0, output=[0], repetition_penalty=1.2)])[0] == [1]
    assert sample(logits[None], [row(temperature=0, prompt=[5], repetition_penalty=1.2)])[0] == [0]
    # Negative logits are multiplied (pushed down), positive divided.
    r = process(logits, row(prompt=[0, 2], repetition_penalty=2.0))
    assert r[0] == 1.5 and r[2] == -2.0 and r[3] == -1.1


def test_presence_and_frequency_penalties_count_output_only():
    r = process(BASE, row(prompt=[1, 1, 1], output=[0, 0, 3], presence_penalty=0.5, frequency_penalty=0.25))
    assert r[0] == 2.0 - 0.5 - 0.5 and r[3] == 0.5 - 0.5 - 0.25 and r[1] == 1.5
    tokens, _ = sample(BASE[None], [row(temperature=0, output=[0, 0], frequency_penalty=0.3)])
    assert tokens == [1]


def test_logit_bias_forces_a_token_greedy_and_random():
    tokens, _ = sample(BASE.expand(50, -1), [row(temperature=0, logit_bias={6: 100.0})] +
                       [row(temperature=1.5, logit_bias={6: 100.0})] * 49)
    assert tokens == [6] * 50
    tokens, _ = sample(BASE[None], [row(temperature=0, logit_bias={0: -100.0})])
    assert tokens == [1]


def test_min_tokens_suppresses_eos_and_stop_tokens_until_reached():
    logits = torch.zeros(V)
    logits[EOS], logits[3] = 10.0, 9.0
    greedy = dict(temperature=0, min_tokens=2, max_tokens=5)
    assert sample(logits[None], [row(output=[1], **greedy)])[0] == [3]
    assert sample(logits[None], [row(output=[1], stop_token_ids=[3], **greedy)])[0] == [0]
    assert sample(logits[None], [row(output=[1, 1], stop_token_ids=[3], **greedy)])[0] == [EOS]
    # ignore_eos: EOS is no stop, so it is not held back (stop_token_ids still are).
    assert sample(logits[None], [row(output=[1], ignore_eos=True, **greedy)])[0] == [EOS]


def test_logprobs_are_raw_sorted_and_consistent():
    logits = torch.stack([BASE, BASE.flip(0)])
    rows = [row(temperature=0.3, logprobs=V, logit_bias={5: 50.0}), row(temperature=0, logprobs=0)]
    tokens, lps = sample(logits, rows)
    raw = torch.log_softmax(logits, dim=-1)
    assert tokens == [5, V - 1]
    first = lps[0]
    assert [lp.token_id for lp in first.top] == list(range(V))
    assert all(a.logprob >= b.logprob for a, b in zip(first.top, first.top[1:]))
    assert math.isclose(first.sampled.logprob, raw[0, 5].item(), rel_tol=1e-6)   # before the bias
    assert math.isclose(sum(math.exp(lp.logprob) for lp in first.top), 1.0, rel_tol=1e-5)
    assert lps[1].top == [] and math.isclose(lps[1].sampled.logprob, raw[1, V - 1].item(), rel_tol=1e-6)


def test_seeded_rows_ignore_batch_neighbours():
    def run(batch_before, batch_after, seed):
        g = torch.Generator().manual_seed(seed)
        out = []
        for _ in range(20):
            rows = [row(temperature=1.5)] * batch_before + [row(temperature=1.5, generator=g)] + \
                   [row(temperature=0.7, top_k=3)] * batch_after
            logits = BASE.expand(len(rows), -1)
            out.append(sample(logits, rows)[0][batch_before])
        return out
    alone = run(0, 0, seed=11)
    assert run(3, 2, seed=11) == alone == run(1, 5, seed=11)
    assert run(0, 0, seed=12) != alone
    assert len(set(alone)) > 2


# ---- through the runner ---------------------------------------------------------------

@pytest.fixture(scope="module")
def runner(tiny_model):
    r = ModelRunner(EngineConfig(model=tiny_model, device="cpu", block_size=8))
    r.allocate_kv_cache(64)
    return r


def decode(runner, rid, prompt, blocks, params, steps, others=(), preempt_at=None, generator=None):
    """Run one request for `steps` tokens, next to `others` (each (rid, prompt, blocks)); every
    step is hand-built, so each request re-enters the batch (as after a preemption)."""
    out = []
    neighbour_out = {o[0]: [] for o in others}
    for step in range(steps):
        recompute = step == preempt_at
        seq = prompt + out
        start = 0 if step == 0 or recompute else len(seq) - 1
        chunks = [Chunk(rid, seq[start:], start, blocks, True, params, prompt, list(out), generator)]
        for orid, oprompt, oblocks in others:
            oseq = oprompt + neighbour_out[orid]
            ostart = 0 if step == 0 else len(oseq) - 1
            chunks.append(Chunk(orid, oseq[ostart:], ostart, oblocks, True, SamplingParams(temperature=1.0),
                                oprompt, neighbour_out[orid]))
        res = runner.execute(fresh_step(runner, chunks)).sampled_token_ids
        out.append(res[rid])
        for orid in neighbour_out:
            neighbour_out[orid].append(res[orid])
    return out


PROMPT = list(range(40, 60))
SEEDED = SamplingParams(temperature=1.0, seed=1234)


def seeded(seed=1234):
    """What the engine hands the runner for a seeded request: a generator owned by the request."""
    return torch.Generator().manual_seed(seed)


def test_seed_gives_same_tokens_whatever_shares_the_batch(runner):
    alone = decode(runner, "a", PROMPT, [0, 1, 2, 3, 4], SEEDED, 12, generator=seeded())
    crowded = decode(runner, "a", PROMPT, [10, 11, 12, 13, 14], SEEDED, 12,
                     others=[("x", list(range(100, 117)), [20, 21, 22, 23, 24]),
                             ("y", list(range(200, 203)), [30, 31, 32])], generator=seeded())
    assert crowded == alone
    other_seed = decode(runner, "a", PROMPT, [0, 1, 2, 3, 4], SamplingParams(temperature=1.0, seed=99), 12,
                        generator=seeded(99))
    assert other_seed != alone


def test_recompute_after_preemption_continues_the_random_stream(runner):
    straight = decode(runner, "p", PROMPT, [0, 1, 2, 3, 4], SEEDED, 10, generator=seeded())
    # The recompute step (whole sequence again) draws exactly one sample, like a decode step.
    resumed = decode(runner, "p", PROMPT, [5, 6, 7, 8, 9], SEEDED, 10, preempt_at=4, generator=seeded())
    assert resumed == straight


def test_runner_reports_logprobs_and_only_sampling_rows(runner):
    params = SamplingParams(temperature=0, logprobs=5)
    out = runner.execute(fresh_step(runner, [Chunk("l", PROMPT, 0, [0, 1, 2], True, params, PROMPT, []),
                                             Chunk("m", PROMPT[:8], 0, [3], False, params, PROMPT, [])]))
    assert set(out.sampled_token_ids) == {"l"} and set(out.logprobs) == {"l"}
    lp = out.logprobs["l"]
    assert lp.sampled.token_id == out.sampled_token_ids["l"] == lp.top[0].token_id
    assert len(lp.top) == 5


def big_batch(rows, vocab):
    ib = InputBatch(len(rows), 8, 8, 8, vocab, [EOS], torch.device("cpu"))
    ib.update(SchedulerOutput([], new=[NewRequest(f"r{i}", [1], 1, p, []) for i, p in enumerate(rows)]))
    return ib.sampling_batch(np.arange(len(rows)))


@pytest.mark.parametrize("peaked", [True, False])
def test_top_p_on_a_large_vocabulary_keeps_exactly_the_nucleus(peaked):
    # Large enough that top_p first looks at the best candidates only (peaked: they hold p, so
    # no sort) and, when flat, has to fall back to the sorted vocabulary; same answer either way.
    vocab = 8 * 1024
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(vocab, generator=gen) * (0.01 if not peaked else 1.0)
    if peaked:
        logits[:20] += 12.0
    probs = torch.softmax(logits, dim=0)
    order = probs.argsort(descending=True)
    ahead = probs[order].cumsum(0) - probs[order]
    nucleus = set(order[ahead < 0.8].tolist())
    n = 3000
    tokens, _ = Sampler()(logits.expand(n, -1).clone(), big_batch([SamplingParams(top_p=0.8)] * n, vocab))
    assert set(tokens) <= nucleus
    if peaked:
        assert len(set(tokens)) >= min(len(nucleus), 5)
    combined, _ = Sampler()(logits.expand(n, -1).clone(), big_batch([SamplingParams(top_p=0.8, top_k=3)] * n, vocab))
    assert set(combined) <= set(order[:3].tolist())


def test_seeded_request_same_alone_and_in_a_full_batch(tiny_llm_factory):
    llm = tiny_llm_factory("llama", num_kv_blocks=256, max_num_seqs=32)
    prompt = list(range(40, 70))
    seeded = SamplingParams(temperature=0.9, top_p=0.95, top_k=40, seed=77, max_tokens=12, ignore_eos=True)
    alone = llm.generate([prompt], seeded)[0].outputs[0].token_ids
    others = [[(7 * i + j) % 500 + 5 for j in range(5 + i)] for i in range(31)]
    mixed = [SamplingParams(temperature=t, top_p=p, max_tokens=12, ignore_eos=True, repetition_penalty=r)
             for t, p, r in zip([0.0, 1.0, 1.3] * 11, [1.0, 0.5, 0.9] * 11, [1.0, 1.0, 1.2] * 11)][:31]
    outs = llm.generate(others[:15] + [prompt] + others[15:], mixed[:15] + [seeded] + mixed[15:])
    assert outs[15].outputs[0].token_ids == alone
