"""Greedy parity with transformers: the engine's token ids equal `generate`'s, prompt by prompt.

Per family, 16 prompts of 1 to 300 tokens (some sharing long prefixes) generate 32 to 128
tokens each, batched together, under every engine set-up of: block size 8, 16 or 32; a large
pool or one so small that requests are preempted and recomputed; prefix caching on or off.
The small pools also prefill in chunks (a small token budget per step). The reference is computed once per family, one
prompt at a time, unpadded, in fp32.
"""
import random

import pytest

from pagoda.gpu_worker.core.kv_cache_manager import cdiv
from pagoda.gpu_worker.core.sampling_params import SamplingParams
from pagoda.gpu_worker.engine.llm import LLM

pytestmark = pytest.mark.usefixtures("no_block_leaks", "one_torch_thread")

FAMILIES = ["llama", "mistral", "qwen2", "qwen3"]
LENGTHS = [1, 300, 2, 17, 160, 31, 64, 5, 100, 250, 16, 45, 200, 8, 128, 90]
# name: (block_size, small pool?, prefix caching, max_num_batched_tokens)
SETUPS = {
    f"bs{bs}-{'small' if small else 'large'}-{'cached' if caching else 'uncached'}":
        (bs, small, caching, 64 if small else None)
    for bs in (8, 16, 32) for small in (False, True) for caching in (True, False)
}


def make_prompts(seed: int):
    rng = random.Random(seed)
    prompts = [[rng.randrange(5, 600) for _ in range(n)] for n in LENGTHS]
    # Shared prefixes: prompt 9 starts with prompt 4's 160 tokens, 12 with 9's first 120.
    prompts[9][:160] = prompts[4]
    prompts[12][:120] = prompts[9][:120]
    gens = [rng.choice([32, 48, 64, 96, 128]) for _ in LENGTHS]
    return prompts, gens


@pytest.fixture(scope="session")
def hf_reference(tiny_model_factory):
    """family -> (model dir, prompts, max_tokens, transformers' greedy outputs)."""
    cache = {}

    def get(family):
        if family not in cache:
            import torch
            import transformers
            path = tiny_model_factory(family)
            prompts, gens = make_prompts(FAMILIES.index(family))
            model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
            model.eval()
            refs = []
            with torch.no_grad():
                for p, g in zip(prompts, gens):
                    ids = torch.tensor([p])
                    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=g,
                                         do_sample=False)
                    refs.append(out[0, len(p):].tolist())
            cache[family] = (path, prompts, gens, refs)
        return cache[family]

    return get


@pytest.mark.parametrize("setup", list(SETUPS))
@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_matches_transformers(hf_reference, family, setup):
    path, prompts, gens, refs = hf_reference(family)
    block_size, small, caching, budget = SETUPS[setup]
    # Small: the largest request just fits, so a batch of 16 must preempt.
    largest = max(len(p) + g for p, g in zip(prompts, gens))
    num_blocks = cdiv(largest, block_size) + 1 if small else None
    llm = LLM(path, device="cpu", block_size=block_size, num_kv_blocks=num_blocks,
              enable_prefix_caching=caching, max_num_batched_tokens=budget)
    outs = llm.generate(prompts, [SamplingParams(temperature=0.0, max_tokens=g) for g in gens])
    got = [o.outputs[0].token_ids for o in outs]
    for i, (g, r) in enumerate(zip(got, refs)):
        assert g == r, f"prompt {i} ({len(prompts[i])} tokens) diverges"
    stats = llm.engine.stats()
    if small:
        assert stats.preemptions > 0
    if caching:
        assert stats.prefix_cache_hits >= 160 - 160 % block_size
    else:
        assert stats.prefix_cache_hits == 0
    # Finish reasons agree with the reference: stopped at EOS, or ran to max_tokens.
    eos = set(llm.engine.eos_token_ids)
    for o, r, g in zip(outs, refs, gens):
        if r[-1] in eos:
            assert o.outputs[0].finish_reason == "stop"
        else:
            assert o.outputs[0].finish_reason == "length" and len(r) == g


def test_a_shared_system_prompt_matches_transformers(tiny_model_factory, monkeypatch):
    """Twelve requests behind one 100-token system prompt decode together: the CPU attention
    forms a cascade group over the cached prompt's blocks (kernels/cpu_attention.py) and the
    tokens still equal transformers' one prompt at a time."""
    import torch
    import transformers

    from pagoda.kernels import cpu_attention
    path = tiny_model_factory("llama")
    rng = random.Random(5)
    system = [rng.randrange(5, 600) for _ in range(100)]
    prompts = [system + [rng.randrange(5, 600) for _ in range(rng.randint(3, 20))] for _ in range(12)]
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        refs = [model.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                               max_new_tokens=24, do_sample=False)[0, len(p):].tolist() for p in prompts]
    shared = []
    plan = cpu_attention._plan

    def spy(*args, **kwargs):
        result = plan(*args, **kwargs)
        if result.prefix is not None:
            shared.append(int(result.prefix.max()))
        return result
    monkeypatch.setattr(cpu_attention, "_plan", spy)
    llm = LLM(path, device="cpu", block_size=16, enable_prefix_caching=True)
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=24))
    assert [o.outputs[0].token_ids for o in outs] == refs
    assert shared and max(shared) == 96          # six whole blocks of the system prompt
