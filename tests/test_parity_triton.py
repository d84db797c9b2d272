"""The engine gives identical greedy tokens with the Triton kernels as with the torch reference.

On CPU the kernels run under the Triton interpreter (tests/plugins/kernels.py), with fp32
weights, so greedy argmaxes must agree exactly. The set-up forces what the kernels must get
right inside a real engine: several blocks per sequence (block size 8), chunked prefill mixed
with decodes in one step (a small token budget), and prefix-cache hits (shared prompt starts).
"""
import pytest

from pagoda.gpu_worker import LLM
from pagoda.gpu_worker.core.sampling_params import SamplingParams
from pagoda.kernels.triton_attention import paged_attention_triton
from pagoda.kernels.triton_cache import write_kv_cache_triton

PROMPTS = [
    "Hello there",
    "The quick brown fox jumps over the lazy dog, then the dog wakes",
    "The quick brown fox jumps over the lazy dog, then the dog sleeps again",
    "a",
]


def generate(model: str, backend: str) -> tuple[list[list[int]], LLM]:
    llm = LLM(model, device="cpu", block_size=8, num_kv_blocks=64, max_num_batched_tokens=24,
              attention_backend=backend)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    return [o.outputs[0].token_ids for o in outs], llm


@pytest.mark.timeout(240)
def test_greedy_parity_triton_vs_torch(tiny_model):
    want, _ = generate(tiny_model, "torch")
    got, llm = generate(tiny_model, "triton")
    # The Triton path was really taken (not silently the reference).
    assert llm.engine.runner.attend_fn is paged_attention_triton
    assert llm.engine.runner.write_fn is write_kv_cache_triton
    assert all(len(ids) == 6 for ids in want)
    assert got == want
