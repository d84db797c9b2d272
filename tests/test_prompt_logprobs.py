"""prompt_logprobs in the engine: every prompt token after the first scored from the model's own
logits (transformers' full forward is the reference), across chunked prefill, cached prefixes
(skipped for the scoring request), preemption, n > 1 and a mixed batch."""
import math
import random

import pytest

from pagoda.gpu_worker.core.sampling_params import SamplingParams

pytestmark = pytest.mark.usefixtures("no_block_leaks", "one_torch_thread")


def rand_ids(n, seed):
    rng = random.Random(seed)
    return [rng.randrange(5, 600) for _ in range(n)]


@pytest.fixture(scope="module")
def reference(tiny_model):
    """ids -> log-softmax [len, V] of transformers' fp32 forward over the whole prompt."""
    import torch
    import transformers
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()

    def ref(ids):
        with torch.no_grad():
            return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)
    return ref


def check(prompt_lps, ids, ref, k):
    assert prompt_lps[0] is None and len(prompt_lps) == len(ids)
    lp = ref(ids)
    for pos in range(1, len(ids)):
        got = prompt_lps[pos]
        assert got.sampled.token_id == ids[pos]
        assert math.isclose(got.sampled.logprob, lp[pos - 1, ids[pos]].item(), abs_tol=2e-4), pos
        assert len(got.top) == k
        if k:
            best = lp[pos - 1].topk(k)
            assert [t.token_id for t in got.top] == best.indices.tolist()
            assert all(math.isclose(t.logprob, v, abs_tol=2e-4) for t, v in zip(got.top, best.values.tolist()))


@pytest.mark.parametrize("async_scheduling", ["off", "on"])
def test_prompt_logprobs_match_a_full_forward_across_chunks(tiny_llm_factory, reference, async_scheduling):
    # A budget of 24 tokens a step: the 70-token prompt is scored over three chunks.
    llm = tiny_llm_factory("llama", num_kv_blocks=64, max_num_batched_tokens=24, async_scheduling=async_scheduling)
    ids = rand_ids(70, 1)
    out = llm.generate([ids], SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=3))[0]
    check(out.prompt_logprobs, ids, reference, 3)
    plain = llm.generate([ids], SamplingParams(max_tokens=2, temperature=0.0))[0]
    assert plain.prompt_logprobs is None and plain.outputs[0].token_ids == out.outputs[0].token_ids


def test_a_cached_prefix_is_computed_again_for_scoring(tiny_llm_factory, reference):
    llm = tiny_llm_factory("llama", num_kv_blocks=64)
    ids = rand_ids(50, 2)
    llm.generate([ids], SamplingParams(max_tokens=1))          # its 3 full blocks now cached
    before = llm.engine.stats()
    out = llm.generate([ids], SamplingParams(max_tokens=1, prompt_logprobs=0))[0]
    after = llm.engine.stats()
    assert out.num_cached_tokens == 0 and after.prompt_tokens - before.prompt_tokens == 50
    check(out.prompt_logprobs, ids, reference, 0)
    again = llm.generate([ids], SamplingParams(max_tokens=1))[0]   # without scoring the cache serves
    assert again.num_cached_tokens == 48


def test_mixed_batch_n_and_a_one_token_prompt(tiny_llm_factory, reference):
    llm = tiny_llm_factory("llama", num_kv_blocks=64)
    a, b, c = rand_ids(33, 3), rand_ids(20, 4), rand_ids(1, 5)
    outs = llm.generate([a, b, c], [SamplingParams(max_tokens=3, n=2, prompt_logprobs=1, temperature=1.0, seed=1),
                                    SamplingParams(max_tokens=3, logprobs=2),
                                    SamplingParams(max_tokens=3, prompt_logprobs=2)])
    check(outs[0].prompt_logprobs, a, reference, 1)
    assert outs[1].prompt_logprobs is None and len(outs[1].outputs[0].logprobs) == 3
    assert outs[2].prompt_logprobs == [None]
    assert all(len(o.token_ids) == 3 for o in outs[0].outputs)


def test_preempted_while_scoring_still_scores_each_token_once(tiny_llm_factory, reference):
    # 12 blocks of 16 for two 90-token prompts growing by 40: one is preempted and recomputed.
    llm = tiny_llm_factory("llama", num_kv_blocks=12, max_num_batched_tokens=32)
    a, b = rand_ids(90, 6), rand_ids(90, 7)
    before = llm.engine.stats().preemptions
    outs = llm.generate([a, b], SamplingParams(max_tokens=40, ignore_eos=True, prompt_logprobs=1))
    assert llm.engine.stats().preemptions > before
    check(outs[0].prompt_logprobs, a, reference, 1)
    check(outs[1].prompt_logprobs, b, reference, 1)


def test_prompt_logprobs_is_validated():
    with pytest.raises(ValueError, match="prompt_logprobs: must be in"):
        SamplingParams(prompt_logprobs=21).validate(100)
    with pytest.raises(ValueError, match="prompt_logprobs: must be an integer"):
        SamplingParams(prompt_logprobs=1.5).validate(100)  # type: ignore[arg-type]


@pytest.mark.gpu
def test_prompt_logprobs_on_cuda_with_async_scheduling(tiny_model, reference):
    """The CUDA path (Triton attention, async scheduling: scores travel with the step in flight)."""
    import torch
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA (CPU twin: test_prompt_logprobs_match_a_full_forward_across_chunks)")
    from pagoda.gpu_worker.engine.llm import LLM
    llm = LLM(tiny_model, device="cuda", dtype="float32", num_kv_blocks=64, max_num_batched_tokens=24,
              async_scheduling="on")
    a, b = rand_ids(70, 1), rand_ids(20, 4)
    outs = llm.generate([a, b], [SamplingParams(max_tokens=4, temperature=0.0, prompt_logprobs=3),
                                 SamplingParams(max_tokens=4, temperature=0.0)])
    got = outs[0].prompt_logprobs
    lp = reference(a)
    assert got[0] is None and len(got) == len(a) and outs[1].prompt_logprobs is None
    for pos in range(1, len(a)):
        assert got[pos].sampled.token_id == a[pos]
        assert math.isclose(got[pos].sampled.logprob, lp[pos - 1, a[pos]].item(), abs_tol=2e-3), pos
        assert [t.token_id for t in got[pos].top][:1] == lp[pos - 1].topk(1).indices.tolist()
