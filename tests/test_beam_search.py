"""Beam search (gpu_worker/beam_search.py): the engine's beams equal a brute-force beam search
over transformers' full logits, width 1 is greedy, beams share KV blocks by reference count
with copy-on-write of the partial block, and nothing leaks (also after an abort)."""
import pytest

from gpu_worker.beam_search import BeamSearchParams, Candidate, beam_score, candidates, select
from gpu_worker.outputs import Logprob, TokenLogprobs
from gpu_worker.sampling_params import SamplingParams

pytestmark = pytest.mark.usefixtures("no_block_leaks", "one_torch_thread")

PROMPTS = [[5, 6, 7, 8, 9, 10], [11, 12, 13], list(range(20, 45))]


@pytest.fixture(scope="module")
def hf_model(tiny_model):
    import torch
    import transformers
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    return model.eval()


def reference_beam_search(model, prompt, width, max_tokens, eos_ids, length_penalty=1.0, ignore_eos=False):
    """vLLM's beam search written out plainly, every candidate's logits from a full forward of
    its whole sequence (no KV cache): [(tokens with the prompt, cum_logprob)], best first."""
    import torch
    beams, done = [(list(prompt), 0.0)], []
    with torch.no_grad():
        for _ in range(max_tokens):
            if not beams:
                break
            cands = []
            for toks, cum in beams:
                lp = torch.log_softmax(model(torch.tensor([toks])).logits[0, -1].float(), dim=-1)
                vals, ids = lp.topk(2 * width)
                for v, t in zip(vals.tolist(), ids.tolist()):
                    (done if t in eos_ids and not ignore_eos else cands).append((toks + [t], cum + v))
            cands.sort(key=lambda c: c[1], reverse=True)
            beams = cands[:width]
    done += beams

    def score(c):
        toks, cum = c
        return cum / ((len(toks) - (toks[-1] in eos_ids)) ** length_penalty)
    return sorted(done, key=score, reverse=True)[:width]


@pytest.mark.parametrize("setup", [
    dict(block_size=8),                                        # the partial block is copied on fork
    dict(block_size=16, enable_prefix_caching=False),
    dict(block_size=8, num_kv_blocks=16),                      # beams preempted: recomputed
    # Groups queue for sequence slots: ready beams make room for their siblings.
    dict(block_size=8, max_num_seqs=4, max_num_batched_tokens=64),
])
def test_equals_brute_force_reference(tiny_llm_factory, hf_model, setup):
    llm = tiny_llm_factory(**setup)
    eos = llm.engine.eos_token_ids
    width, max_tokens = 4, 10
    for lp in (1.0, 0.5):
        outs = llm.beam_search(PROMPTS, BeamSearchParams(beam_width=width, max_tokens=max_tokens,
                                                         length_penalty=lp))
        for prompt, out in zip(PROMPTS, outs):
            ref = reference_beam_search(hf_model, prompt, width, max_tokens, eos, lp)
            assert [s.tokens for s in out.sequences] == [t for t, _ in ref]
            for s, (toks, cum) in zip(out.sequences, ref):
                assert s.output_token_ids == toks[len(prompt):]
                assert s.cum_logprob == pytest.approx(cum, abs=1e-3)
                assert s.score == pytest.approx(beam_score(len(toks), toks[-1] in eos, cum, lp), abs=1e-3)
                assert s.text == llm.tokenizer.decode(s.output_token_ids, skip_special_tokens=True)
            scores = [s.score for s in out.sequences]
            assert scores == sorted(scores, reverse=True)
    if "num_kv_blocks" in setup or "max_num_seqs" in setup:
        assert llm.engine.scheduler.num_preemptions > 0


def test_width_one_is_greedy(tiny_llm_factory):
    llm = tiny_llm_factory(block_size=8)
    greedy = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))
    beams = llm.beam_search(PROMPTS, BeamSearchParams(beam_width=1, max_tokens=24, ignore_eos=True))
    for g, b in zip(greedy, beams):
        assert [s.output_token_ids for s in b.sequences] == [g.outputs[0].token_ids]


def _run_watching(engine, rid, params, prompt, on_step=None):
    engine.add_request(rid, prompt, params)
    deltas, peak_ref, peak_held, steps = [], 0, 0, 0
    while engine.has_unfinished_requests():
        deltas += engine.step()
        steps += 1
        peak_ref = max(peak_ref, max(b.ref_cnt for b in engine.kv.pool.blocks))
        peak_held = max(peak_held, engine.num_blocks - engine.kv.pool.num_free_blocks())
        if on_step is not None and on_step(steps):
            break
    return deltas, peak_ref, peak_held


def test_beams_share_blocks_and_copy_only_the_partial_one(tiny_llm_factory):
    llm = tiny_llm_factory(block_size=8, num_kv_blocks=256)
    engine = llm.engine
    prompt = list(range(30, 70))        # 5 full blocks shared by every beam
    params = SamplingParams(n=4, use_beam_search=True, max_tokens=20, temperature=0.0)
    copies = engine.kv.num_copies
    deltas, peak_ref, peak_held = _run_watching(engine, "share", params, prompt)
    assert peak_ref >= 4, "the prompt's blocks are held by all 4 beams at once"
    # Unshared, 4 beams of 60 tokens hold 4 * 8 blocks; shared, the prompt's 5 are held once.
    assert peak_held <= 4 * 8 - 3 * 5
    # Copy-on-write copies partial blocks only: at most one per beam per step.
    assert 0 < engine.kv.num_copies - copies <= 4 * 20
    finals = [d for d in deltas if d.finished]
    assert sorted(d.index for d in finals) == [0, 1, 2, 3]
    assert all(d.cumulative_logprob is not None and len(d.token_ids) == 20 for d in finals)
    assert engine.kv.req_to_blocks == {}


def test_copy_on_write_keeps_siblings_apart(tiny_llm_factory, hf_model):
    """Without sharing (every block copied on fork) the beams are the same: the copies keep
    each beam's KV its own, whichever sibling writes first."""
    llm = tiny_llm_factory(block_size=8, num_kv_blocks=256)
    params = BeamSearchParams(beam_width=3, max_tokens=12)
    shared = llm.beam_search(PROMPTS[:2], params)
    llm.engine.kv.share_on_fork = False
    try:
        copied = llm.beam_search(PROMPTS[:2], params)
    finally:
        llm.engine.kv.share_on_fork = True
    assert [[s.tokens for s in o.sequences] for o in shared] == [[s.tokens for s in o.sequences] for o in copied]


def test_abort_mid_search_frees_everything(tiny_llm_factory):
    llm = tiny_llm_factory(block_size=8)
    engine = llm.engine
    params = SamplingParams(n=2, best_of=4, use_beam_search=True, max_tokens=50)
    held = []

    def abort_at(step):
        if step == 5:
            held.append(engine.num_blocks - engine.kv.pool.num_free_blocks())
            engine.abort_request("gone")
        return False
    deltas, _, _ = _run_watching(engine, "gone", params, PROMPTS[2], abort_at)
    assert held and held[0] > 0
    finals = [d for d in deltas if d.finished]
    assert sorted(d.index for d in finals) == [0, 1] and {d.finish_reason for d in finals} == {"abort"}
    assert "gone" not in engine.beam_groups and "gone" not in engine.children
    assert engine.kv.req_to_blocks == {}
    # The engine goes on serving: the same id again, to the end.
    out = llm.generate([PROMPTS[0]], SamplingParams(n=2, best_of=4, use_beam_search=True, max_tokens=6))
    assert [len(c.token_ids) for c in out[0].outputs] == [6, 6]


def test_n_of_best_of_returns_the_best_n(tiny_llm_factory):
    llm = tiny_llm_factory(block_size=8)
    four = llm.beam_search([PROMPTS[0]], BeamSearchParams(beam_width=4, max_tokens=8))[0].sequences
    two = llm.generate([PROMPTS[0]], SamplingParams(n=2, best_of=4, use_beam_search=True, max_tokens=8))[0]
    assert [c.token_ids for c in two.outputs] == [s.output_token_ids for s in four[:2]]
    assert [c.cumulative_logprob for c in two.outputs] == pytest.approx([s.cum_logprob for s in four[:2]])


def _lps(pairs, sampled):
    return TokenLogprobs(Logprob(sampled, dict(pairs).get(sampled, -9.0)), [Logprob(t, v) for t, v in pairs])


def test_selection_completes_eos_and_ranks_the_rest():
    eos = [2]
    offered = [(-1.0, 7, _lps([(7, -0.1), (2, -0.2), (8, -3.0)], 7)),
               (-2.0, 9, _lps([(2, -0.05), (9, -0.5), (4, -0.6)], 9))]
    cands = candidates(offered)
    run, done = select(cands, 2, eos, ignore_eos=False)
    assert [(c.parent, c.token) for c in run] == [(0, 7), (1, 9)]
    assert sorted((c.parent, c.token) for c in done) == [(0, 2), (1, 2)]
    run, done = select(cands, 2, eos, ignore_eos=True)
    assert done == [] and [(c.parent, c.token) for c in run] == [(0, 7), (0, 2)]
    # A sampled token outside the top list is a candidate too (temperature > 0, as vLLM).
    assert Candidate(0, 5, -1.0 - 9.0) in candidates([(-1.0, 5, _lps([(7, -0.1)], 5))])
    # vLLM's score: length counts the prompt and not a final EOS.
    assert beam_score(10, True, -9.0, 1.0) == -1.0 and beam_score(10, False, -9.0, 0.0) == -9.0


@pytest.mark.parametrize("kwargs, field", [
    (dict(n=3, best_of=2), "best_of"),
    (dict(n=2, best_of=3, use_beam_search=False), "best_of"),
    (dict(n=17), "n"),
    (dict(n=2, best_of=40), "best_of"),
    (dict(top_p=0.5), "top_p"),
    (dict(top_k=5), "top_k"),
    (dict(min_p=0.1), "min_p"),
    (dict(presence_penalty=1.0), "presence_penalty"),
    (dict(stop=["x"]), "stop"),
    (dict(logprobs=2), "logprobs"),
    (dict(seed=1), "seed"),
    (dict(length_penalty=float("nan")), "length_penalty"),
])
def test_bad_beam_params_name_the_field(tiny_llm_factory, kwargs, field):
    llm = tiny_llm_factory(block_size=8)
    params = SamplingParams(**{"use_beam_search": True, "n": 2, **kwargs})
    with pytest.raises(ValueError, match=f"^{field}:"):
        llm.generate([PROMPTS[0]], params)


def test_engine_limits_name_the_field(tiny_llm_factory):
    llm = tiny_llm_factory(block_size=8, max_num_seqs=4, num_kv_blocks=32)
    with pytest.raises(ValueError, match="^best_of: beam width 8 exceeds max_num_seqs=4"):
        llm.generate([PROMPTS[0]], SamplingParams(n=2, best_of=8, use_beam_search=True))
    with pytest.raises(ValueError, match="^max_tokens:"):
        llm.generate([PROMPTS[0]], SamplingParams(n=4, use_beam_search=True, max_tokens=100))
