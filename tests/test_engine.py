"""LLMEngine and the offline LLM: prefix caching, stops, sampling options, n > 1, limits,
bad input with requests in flight, abort, KV events and statistics."""
import math
import random

import pytest

from pagoda.gpu_worker.core.sampling_params import SamplingParams
from pagoda.protos.block_hash import block_hashes, namespace_root

pytestmark = pytest.mark.usefixtures("no_block_leaks", "one_torch_thread")

GREEDY = dict(temperature=0.0)


def rand_ids(n, seed):
    rng = random.Random(seed)
    return [rng.randrange(5, 600) for _ in range(n)]


@pytest.fixture(scope="module")
def llm(tiny_llm_factory):
    return tiny_llm_factory("llama", num_kv_blocks=128)


@pytest.fixture(scope="module")
def hf(tiny_model):
    """transformers' tokenizer of llm's checkpoint: what the engine's own must match."""
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(tiny_model)


def run_engine(engine, *, max_steps=2000):
    deltas = []
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            return deltas
        deltas.extend(engine.step())
    raise AssertionError("engine did not finish")


def test_prefix_cache_hit_reports_cached_tokens_and_same_output(tiny_llm_factory):
    cached = tiny_llm_factory("llama", num_kv_blocks=128, block_size=16)
    plain = tiny_llm_factory("llama", num_kv_blocks=128, block_size=16, enable_prefix_caching=False)
    prefix = rand_ids(200, 1)
    first, second = prefix + rand_ids(9, 2), prefix + rand_ids(23, 3)
    sp = SamplingParams(max_tokens=24, **GREEDY)
    before = cached.engine.stats()
    out1 = cached.generate([first], sp)[0]
    out2 = cached.generate([second], sp)[0]
    assert out1.num_cached_tokens == 0
    assert out2.num_cached_tokens == 192            # the prefix's 12 full blocks of 16
    ref = plain.generate([second], sp)[0]
    assert ref.num_cached_tokens == 0
    assert out2.outputs[0].token_ids == ref.outputs[0].token_ids
    assert out2.outputs[0].text == ref.outputs[0].text
    after = cached.engine.stats()
    assert after.prefix_cache_queries - before.prefix_cache_queries == len(first) + len(second)
    assert after.prefix_cache_hits - before.prefix_cache_hits == 192


def test_streamed_text_is_the_decoded_output_and_max_tokens_is_length(llm, hf):
    out = llm.generate([rand_ids(30, 4)], SamplingParams(max_tokens=40, ignore_eos=True, **GREEDY))[0]
    c = out.outputs[0]
    assert len(c.token_ids) == 40 and c.finish_reason == "length" and c.stop_reason is None
    assert c.text == hf.decode(c.token_ids, skip_special_tokens=True)


def test_text_prompt_is_tokenized_like_the_tokenizer(llm, hf):
    out = llm.generate("The quick brown fox", SamplingParams(max_tokens=3, **GREEDY))[0]
    assert out.prompt == "The quick brown fox"
    assert out.prompt_token_ids == hf.encode("The quick brown fox")
    assert len(out.outputs[0].token_ids) >= 1


def test_stop_token_ids_stop_at_first_occurrence(llm, hf):
    prompt = rand_ids(20, 5)
    full = llm.generate([prompt], SamplingParams(max_tokens=40, ignore_eos=True, **GREEDY))[0].outputs[0]
    stop_tok = full.token_ids[5]
    first = full.token_ids.index(stop_tok)
    out = llm.generate([prompt], SamplingParams(max_tokens=40, stop_token_ids=[stop_tok],
                                                ignore_eos=True, **GREEDY))[0].outputs[0]
    assert out.token_ids == full.token_ids[:first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_tok
    # The stop token's own text is not part of the output.
    assert out.text == hf.decode(full.token_ids[:first], skip_special_tokens=True)


def test_min_tokens_defers_stop_tokens(llm):
    prompt = rand_ids(20, 5)
    full = llm.generate([prompt], SamplingParams(max_tokens=40, ignore_eos=True, **GREEDY))[0].outputs[0]
    stop_tok = full.token_ids[1]
    out = llm.generate([prompt], SamplingParams(max_tokens=40, min_tokens=6, stop_token_ids=[stop_tok],
                                                ignore_eos=True, **GREEDY))[0].outputs[0]
    assert len(out.token_ids) >= 6
    assert stop_tok not in out.token_ids[:5]
    if out.finish_reason == "stop":
        assert out.token_ids[-1] == stop_tok and stop_tok not in out.token_ids[:-1]


def test_min_tokens_defers_stop_strings(llm, hf):
    prompt = hf.encode("Once upon a time there was a small model")
    full = llm.generate([prompt], SamplingParams(max_tokens=24, ignore_eos=True, **GREEDY))[0].outputs[0]
    early = hf.decode(full.token_ids[:2], skip_special_tokens=True).strip()
    assert early and full.text.find(early) < len(hf.decode(full.token_ids[:2]))
    out = llm.generate([prompt], SamplingParams(max_tokens=24, min_tokens=6, stop=[early], ignore_eos=True,
                                                **GREEDY))[0].outputs[0]
    # The stop string completed within the first two tokens, before min_tokens allowed a stop.
    assert len(out.token_ids) >= 6 and out.token_ids == full.token_ids[:len(out.token_ids)]


def test_stop_strings_earliest_completed_wins_and_truncates(llm, hf):
    # Real words, so the tiny model's BPE produces text with several distinct substrings.
    prompt = hf.encode("Once upon a time there was a small model")
    full = llm.generate([prompt], SamplingParams(max_tokens=48, ignore_eos=True, **GREEDY))[0].outputs[0]
    text = full.text
    assert len(text) >= 12
    a, b = text[8:12], text[3:10]        # b starts earlier, a completes earlier
    stops = [b, a]
    ends = {s: text.find(s) + len(s) for s in stops}
    winner = min(stops, key=lambda s: (ends[s], text.find(s)))
    out = llm.generate([prompt], SamplingParams(max_tokens=48, stop=stops, ignore_eos=True,
                                                **GREEDY))[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == winner
    assert out.text == text[:text.find(winner)]
    assert out.token_ids == full.token_ids[:len(out.token_ids)]
    kept = llm.generate([prompt], SamplingParams(max_tokens=48, stop=[winner], ignore_eos=True,
                                                 include_stop_str_in_output=True, **GREEDY))[0]
    assert kept.outputs[0].text == text[:ends[winner]]


def test_eos_stops_unless_ignored(llm):
    eos = llm.engine.eos_token_ids[0]
    bias = {eos: 100.0}
    out = llm.generate([rand_ids(10, 6)], SamplingParams(max_tokens=5, logit_bias=bias, **GREEDY))[0]
    c = out.outputs[0]
    assert c.token_ids == [eos] and c.finish_reason == "stop" and c.text == ""
    out = llm.generate([rand_ids(10, 6)], SamplingParams(max_tokens=5, logit_bias=bias, ignore_eos=True,
                                                         **GREEDY))[0]
    assert out.outputs[0].token_ids == [eos] * 5 and out.outputs[0].finish_reason == "length"


def test_logprobs_per_token(llm):
    out = llm.generate([rand_ids(12, 7)], SamplingParams(max_tokens=6, logprobs=3, ignore_eos=True,
                                                         **GREEDY))[0].outputs[0]
    assert len(out.logprobs) == 6
    for tok, lp in zip(out.token_ids, out.logprobs):
        assert lp.sampled.token_id == tok and lp.sampled.logprob <= 0
        assert len(lp.top) == 3
        assert lp.top[0].token_id == tok and math.isclose(lp.top[0].logprob, lp.sampled.logprob)
    none = llm.generate([rand_ids(12, 7)], SamplingParams(max_tokens=2, **GREEDY))[0].outputs[0]
    assert none.logprobs is None


def test_n_children_share_prompt_blocks_and_seed_plus_i(llm):
    prompt = rand_ids(70, 8)                 # 4 full blocks of 16
    sp = SamplingParams(n=3, temperature=1.0, seed=1234, max_tokens=12, ignore_eos=True)
    before = llm.engine.stats()
    out = llm.generate([prompt], sp)[0]
    after = llm.engine.stats()
    assert [c.index for c in out.outputs] == [0, 1, 2]
    # Children 1 and 2 find the prompt's 4 full blocks that child 0 computes.
    assert after.prefix_cache_hits - before.prefix_cache_hits >= 2 * 64
    for i, c in enumerate(out.outputs):
        single = llm.generate([prompt], SamplingParams(temperature=1.0, seed=1234 + i, max_tokens=12,
                                                       ignore_eos=True))[0].outputs[0]
        assert c.token_ids == single.token_ids
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    # Seeded sampling is reproducible.
    again = llm.generate([prompt], sp)[0]
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in out.outputs]


def test_max_model_len_caps_generation(tiny_llm_factory):
    small = tiny_llm_factory("llama", max_model_len=64, num_kv_blocks=16)
    out = small.generate([rand_ids(60, 9)], SamplingParams(max_tokens=20, ignore_eos=True, **GREEDY))[0]
    assert len(out.outputs[0].token_ids) == 4 and out.outputs[0].finish_reason == "length"
    out = small.generate([rand_ids(64, 9)], SamplingParams(max_tokens=20, ignore_eos=True, **GREEDY))[0]
    assert len(out.outputs[0].token_ids) == 1


BAD = [
    ("prompt_token_ids", [], {}),
    ("prompt_token_ids", [1, 2, 10**6], {}),
    ("prompt_token_ids", [1, -1], {}),
    ("prompt_token_ids", list(range(5, 5 + 65)), {}),           # longer than max_model_len 64
    ("max_tokens", [5, 6], {"max_tokens": 0}),
    ("temperature", [5, 6], {"temperature": -0.5}),
    ("temperature", [5, 6], {"temperature": float("nan")}),
    ("top_p", [5, 6], {"top_p": 0.0}),
    ("top_p", [5, 6], {"top_p": 1.5}),
    ("top_k", [5, 6], {"top_k": -2}),
    ("n", [5, 6], {"n": 0}),
]


def test_bad_input_names_the_field_and_engine_keeps_serving(tiny_llm_factory):
    llm = tiny_llm_factory("llama", max_model_len=64, num_kv_blocks=6, block_size=8)
    engine = llm.engine
    sp = SamplingParams(max_tokens=8, ignore_eos=True, **GREEDY)
    prompt = rand_ids(20, 10)
    alone = llm.generate([prompt], sp)[0].outputs[0].token_ids
    engine.add_request("good", prompt, sp)
    deltas = engine.step() + engine.step()
    state = (engine.stats(), engine.kv.block_ids(engine.scheduler.running[0]))
    for field, ids, kw in BAD:
        with pytest.raises(ValueError, match=field):
            engine.add_request(f"bad-{field}", ids, SamplingParams(**kw))
    # Never fits the pool: 6 blocks of 8 = 48 tokens.
    with pytest.raises(ValueError, match="max_tokens"):
        engine.add_request("too-big", rand_ids(40, 11), SamplingParams(max_tokens=20))
    with pytest.raises(ValueError, match="prompt_token_ids"):
        engine.add_request("too-big", rand_ids(50, 11), SamplingParams(max_tokens=1))
    with pytest.raises(ValueError, match="request_id"):
        engine.add_request("good", prompt, sp)
    with pytest.raises(ValueError, match="adapter"):
        engine.add_request("lora", prompt, sp, adapter="x")
    assert (engine.stats(), engine.kv.block_ids(engine.scheduler.running[0])) == state
    deltas += run_engine(engine)
    toks = [t for d in deltas if d.request_id == "good" for t in d.token_ids]
    assert toks == alone
    assert {d.request_id for d in deltas} == {"good"}


def test_abort_frees_blocks_and_reports_abort(llm):
    engine = llm.engine
    sp = SamplingParams(max_tokens=50, ignore_eos=True, **GREEDY)
    engine.add_request("a", rand_ids(40, 12), sp)
    engine.add_request("b", rand_ids(40, 13), SamplingParams(n=2, max_tokens=50, ignore_eos=True,
                                                              **GREEDY))
    engine.step()
    engine.step()
    used = engine.stats().num_blocks - engine.stats().free_blocks
    # 42 tokens each in blocks of 16: a has 3; b's children share 2 full prompt blocks.
    assert used == 3 + 3 + 1
    engine.abort_request(["b", "missing"])
    assert engine.stats().running == 1
    deltas = engine.step()
    aborted = [d for d in deltas if d.request_id == "b"]
    assert sorted(d.index for d in aborted) == [0, 1]
    assert all(d.finished and d.finish_reason == "abort" and d.token_ids == [] for d in aborted)
    engine.abort_request("a")
    deltas = engine.step()
    assert [(d.request_id, d.finish_reason) for d in deltas] == [("a", "abort")]
    assert not engine.has_unfinished_requests()
    assert engine.stats().free_blocks == engine.stats().num_blocks
    # The id is free again.
    engine.add_request("a", [5, 6, 7], SamplingParams(max_tokens=2, **GREEDY))
    run_engine(engine)


def test_kv_events_and_cached_hashes_follow_the_chain(tiny_llm_factory):
    llm = tiny_llm_factory("qwen2", num_kv_blocks=8, block_size=8)
    engine = llm.engine
    engine.take_kv_events()
    prompt = rand_ids(33, 14)
    llm.generate([prompt], SamplingParams(max_tokens=4, ignore_eos=True, **GREEDY))
    out = llm.generate([prompt], SamplingParams(max_tokens=4, ignore_eos=True, **GREEDY))[0]
    root = namespace_root(engine.model_name)
    want = block_hashes(prompt + out.outputs[0].token_ids[:-1], 8, root)
    assert len(want) == 4
    events = engine.take_kv_events()
    assert events == [("stored", h) for h in want]      # the second run hit, stored nothing
    assert set(want) <= set(engine.cached_block_hashes())
    # A salted request shares nothing and, with 8 blocks, evicts the chain tail first.
    salted = engine.model_name
    engine.add_request("s", prompt, SamplingParams(max_tokens=24, ignore_eos=True, **GREEDY),
                       cache_salt="tenant")
    run_engine(engine)
    events = engine.take_kv_events()
    salt_root = namespace_root(salted, "", "tenant")
    stored = [h for kind, h in events if kind == "stored"]
    removed = [h for kind, h in events if kind == "removed"]
    assert stored[:4] == block_hashes(prompt, 8, salt_root)
    assert removed and removed[0] == want[-1]
    assert set(removed) <= set(want)
    assert not set(removed) & set(engine.cached_block_hashes())


def test_stats_track_running_waiting_and_preemptions(tiny_llm_factory):
    llm = tiny_llm_factory("mistral", num_kv_blocks=10, block_size=8, max_num_seqs=2)
    engine = llm.engine
    sp = SamplingParams(max_tokens=30, ignore_eos=True, **GREEDY)
    for i in range(3):
        engine.add_request(f"r{i}", rand_ids(20, 20 + i), sp)
    s = engine.stats()
    assert (s.running, s.waiting, s.queued_prefill_tokens) == (0, 3, 60)
    engine.step()
    s = engine.stats()
    assert (s.running, s.waiting) == (2, 1)
    assert s.queued_prefill_tokens == 20 and s.prompt_tokens == 40 and s.generation_tokens == 2
    assert math.isclose(s.kv_usage, 1 - s.free_blocks / s.num_blocks) and s.free_blocks == 4
    run_engine(engine)
    s = engine.stats()
    assert s.preemptions > 0 and s.generation_tokens == 2 + 88
    assert (s.running, s.waiting, s.kv_usage) == (0, 0, 0.0)


def test_offline_generate_with_one_bad_prompt_raises_and_leaves_engine_clean(llm):
    good = rand_ids(10, 30)
    with pytest.raises(ValueError, match="prompt_token_ids"):
        llm.generate([good, [], good], SamplingParams(max_tokens=4, **GREEDY))
    assert not llm.engine.has_unfinished_requests()
    with pytest.raises(ValueError, match="sampling_params"):
        llm.generate([good, good], [SamplingParams()])
    outs = llm.generate([good, good], SamplingParams(max_tokens=4, ignore_eos=True, **GREEDY))
    assert outs[0].outputs[0].token_ids == outs[1].outputs[0].token_ids


def test_priority_policy_serves_lower_value_first(tiny_llm_factory):
    llm = tiny_llm_factory("llama", num_kv_blocks=64, max_num_seqs=1, scheduling_policy="priority")
    engine = llm.engine
    sp = SamplingParams(max_tokens=3, ignore_eos=True, **GREEDY)
    for rid, prio in [("late", 5), ("urgent", -1), ("normal", 0)]:
        engine.add_request(rid, rand_ids(8, 40), sp, priority=prio)
    finished = [d.request_id for d in run_engine(engine) if d.finished]
    assert finished == ["urgent", "normal", "late"]
    with pytest.raises(ValueError, match="priority"):
        engine.add_request("x", [5], sp, priority="high")


def test_engine_freezes_its_heap_out_of_the_cyclic_gc(tiny_model):
    """A step's short-lived objects trigger full collections; the engine's long-lived heap (model,
    tokenizer, imports) is frozen once built so that those collections do not walk it."""
    import gc

    from pagoda.gpu_worker.engine.llm import LLM
    gc.unfreeze()
    llm = LLM(tiny_model, device="cpu", num_kv_blocks=16)
    try:
        assert gc.get_freeze_count() > 0
        assert not any(o is llm.engine.runner.model for o in gc.get_objects())
    finally:
        gc.unfreeze()
