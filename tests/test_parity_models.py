"""Greedy parity with transformers `generate` for the families served through the transformers
backend, the native families through both backends, and sliding windows shorter than the prompt.

One engine set-up per case, the hard one: block size 8, a pool so small that the batch preempts
and recomputes, prefix caching on (prompts share a long prefix) and chunked prefill (a small
token budget). fp32 on the CPU; token ids must match exactly. tests/test_parity.py covers the
native backend over the full matrix of set-ups.
"""
import random

import pytest

from pagoda.gpu_worker.core.kv_cache_manager import cdiv
from pagoda.gpu_worker.core.sampling_params import SamplingParams
from pagoda.gpu_worker.engine.llm import LLM
from pagoda.gpu_worker.testing.tiny_model import NATIVE_FAMILIES, TRANSFORMERS_FAMILIES

pytestmark = pytest.mark.usefixtures("no_block_leaks", "one_torch_thread")

BLOCK_SIZE = 8
# Longer than the 48-token windows of the windowed cases; 2 and 3 share 3's first 64 tokens.
LENGTHS = [90, 3, 130, 70]
GENS = [24, 16, 20, 24]


def make_prompts(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    prompts = [[rng.randrange(5, 600) for _ in range(n)] for n in LENGTHS]
    prompts[3][:64] = prompts[2][:64]
    return prompts


@pytest.fixture(scope="module")
def reference(tiny_model_factory):
    """(family, overrides) -> (model dir, prompts, transformers' greedy outputs), cached."""
    cache: dict = {}

    def get(family: str, **overrides):
        key = (family, tuple(sorted(overrides.items())))
        if key not in cache:
            import torch
            import transformers
            path = tiny_model_factory(family, **overrides)
            prompts = make_prompts(len(cache))
            model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
            refs = []
            with torch.no_grad():
                for p, g in zip(prompts, GENS):
                    ids = torch.tensor([p])
                    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=g,
                                         do_sample=False)
                    refs.append(out[0, len(p):].tolist())
            cache[key] = (path, prompts, refs)
        return cache[key]

    return get


def check_parity(path, prompts, refs, model_impl):
    largest = max(len(p) + g for p, g in zip(prompts, GENS))
    llm = LLM(path, device="cpu", block_size=BLOCK_SIZE, num_kv_blocks=cdiv(largest, BLOCK_SIZE) + 1,
              enable_prefix_caching=True, max_num_batched_tokens=48, model_impl=model_impl)
    served_by = type(llm.engine.runner.model).__name__
    assert (served_by == "TransformersForCausalLM") == (model_impl == "transformers"), served_by
    outs = llm.generate(prompts, [SamplingParams(temperature=0.0, max_tokens=g) for g in GENS])
    for i, (o, r) in enumerate(zip(outs, refs)):
        assert o.outputs[0].token_ids == r, f"prompt {i} ({len(prompts[i])} tokens) diverges"
    stats = llm.engine.stats()
    assert stats.preemptions > 0
    assert stats.prefix_cache_hits >= 64


@pytest.mark.parametrize("family", TRANSFORMERS_FAMILIES)
def test_transformers_backend_matches_generate(reference, family):
    check_parity(*reference(family), "transformers")


@pytest.mark.parametrize("model_impl", ["native", "transformers"])
@pytest.mark.parametrize("family", NATIVE_FAMILIES)
def test_native_families_match_through_both_backends(reference, family, model_impl):
    check_parity(*reference(family), model_impl)


@pytest.mark.parametrize("model_impl", ["native", "transformers"])
def test_mistral_window_shorter_than_prompt(reference, model_impl):
    # Every prompt but one outgrows the window, so masking it wrongly changes the tokens.
    path, prompts, refs = reference("mistral", sliding_window=48)
    check_parity(path, prompts, refs, model_impl)
