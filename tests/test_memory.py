"""CPU checks of the CUDA sizing and launch decisions: KV budget arithmetic with the sampler's
working set, split-KV counts from the step's real longest context, and device="auto"."""
import inspect

import pytest
import torch

from pagoda.gpu_worker.core.config import EngineConfig
from pagoda.gpu_worker.engine.llm import LLM
from pagoda.gpu_worker.runner.memory import kv_budget_bytes, sampler_workspace_bytes
from pagoda.kernels.triton_attention import num_kv_splits

GiB = 2**30


def test_sampler_workspace_is_counted_at_max_num_seqs():
    # Llama-3's 128k vocabulary at 256 rows: the 1-1.5 GiB the sampler really holds.
    big = sampler_workspace_bytes(256, 128256)
    assert 1.0 * GiB <= big <= 1.5 * GiB
    assert sampler_workspace_bytes(128, 128256) * 2 == big
    assert sampler_workspace_bytes(256, 32000) < big / 4 + 1


def test_kv_budget_subtracts_everything_beside_the_pool():
    total = 140 * GiB
    budget = kv_budget_bytes(total, 0.9, outside_torch=1 * GiB, forward_peak=20 * GiB,
                             sampler_bytes=GiB // 2, graph_bytes=GiB // 4)
    assert budget == int(total * 0.9) - GiB - 20 * GiB - GiB // 2 - GiB // 4
    assert kv_budget_bytes(total, 0.1, 1 * GiB, 20 * GiB, 0) < 0


@pytest.mark.parametrize("num_seqs,max_seq_len,want", [
    (1, 100, 1),          # a short context is never split: each segment keeps >= 4 key tiles
    (1, 4 * 64 * 4, 4),   # 16 tiles -> 4 segments of 4 tiles
    (1, 32768, 16),       # long context, one sequence: capped at 16
    (1, None, 16),        # unknown length: the old behaviour (up to 16)
    (8, 32768, 8),        # 64 programs on 132 SMs: next_pow2(ceil(2 * 132 / 64)) = 8
    (17, 32768, 1),       # 136 programs >= 132 SMs: every SM busy already
])
def test_split_kv_follows_the_longest_context(num_seqs, max_seq_len, want):
    assert num_kv_splits(num_seqs, 8, 132, 64, max_seq_len) == want


def test_runner_passes_the_steps_longest_context(tiny_model):
    from pagoda.gpu_worker.runner.model_runner import ModelRunner
    from tests.plugins.engine import Chunk, fresh_step
    r = ModelRunner(EngineConfig(model=tiny_model, device="cpu", block_size=8, num_kv_blocks=16))
    step = fresh_step(r, [Chunk("a", [1, 2, 3], 6, [5, 9]), Chunk("b", [4], 0, [3])])
    r.batch.update(step)
    meta = r.batch.prepare(step.scheduled).meta
    assert meta.max_seq_len == 9 == int(meta.seq_lens.max())


def test_llm_defaults_to_auto_device(monkeypatch):
    # LLM takes EngineConfig's keywords, so EngineConfig's default is LLM's.
    assert "device" not in inspect.signature(LLM).parameters and EngineConfig(model="/x").device == "auto"
    cfg = EngineConfig(model="/x")
    assert cfg.resolved_device() == ("cuda" if torch.cuda.is_available() else "cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a GPU host, simulated
    assert cfg.resolved_device() == "cuda"
    assert EngineConfig(model="/x", device="cpu").resolved_device() == "cpu"
