"""The warm-up plan covers every kernel variant a decode or prefill step can select, its steps are
valid batches for the runner, and step-varying kernel integers are not specialised."""
import pytest

from pagoda.gpu_worker.core.config import EngineConfig
from pagoda.gpu_worker.runner.warmup import WarmupStep, reachable_splits, warmup_plan
from pagoda.kernels.triton_attention import _merge_splits_kernel, _paged_attn_kernel, num_kv_splits

SHAPES = [  # (max_num_seqs, max_model_len, kv heads, SMs, block_n)
    (256, 8192, 8, 132, 64),    # Llama-3-8B on an H200
    (64, 131072, 8, 132, 64),
    (8, 1024, 2, 132, 64),
    (16, 300, 1, 16, 32),
]


@pytest.mark.parametrize("max_seqs,max_len,hkv,sms,block_n", SHAPES)
def test_plan_covers_every_reachable_split_count(max_seqs, max_len, hkv, sms, block_n):
    lens = sorted({1, max_len} | {min(max_len, 2 ** i) for i in range(18)} | set(range(1, max_len, 97)))
    every = {num_kv_splits(n, hkv, sms, block_n, L) for n in range(1, max_seqs + 1) for L in lens}
    assert set(reachable_splits(max_seqs, max_len, hkv, sms, block_n)) == every
    plan = warmup_plan(max_seqs, max_len, 2048, hkv, sms, block_n)
    decode = [s for s in plan if s.decode]
    assert {num_kv_splits(s.num_seqs, hkv, sms, block_n, s.seq_len) for s in decode} == every
    prefill = [s for s in plan if not s.decode]
    assert prefill and all(s.seq_len > s.num_seqs for s in prefill), "no prefill-tile step"
    assert all(s.seq_len <= max_len for s in plan)


def test_plan_steps_are_valid_runner_batches(tiny_model):
    from pagoda.gpu_worker.runner.model_runner import ModelRunner
    r = ModelRunner(EngineConfig(model=tiny_model, device="cpu", block_size=16, num_kv_blocks=70,
                                 max_model_len=1024))
    r.allocate_kv_cache(70)
    for step in warmup_plan(8, r.max_model_len, 2048, r.num_kv_heads, 132, 64) + [WarmupStep(3, 1024, True)]:
        batch = r.warmup_batch(step)
        logits = r.forward(batch)
        assert logits.shape == (step.num_seqs, r.vocab_size)
        got = r.batch.prepare(batch.scheduled)
        pos, meta = got.positions, got.meta
        assert int(pos.max()) + 1 == min(step.seq_len, 70 * 16) == meta.max_seq_len
        assert (pos.numel() == step.num_seqs) == step.decode
    r.warm_up()  # on CPU nothing compiles: a no-op, not an error


def test_step_varying_integers_are_not_specialised():
    def unspecialised(kernel):
        return {p.name for p in kernel.params if p.do_not_specialize}
    assert unspecialised(_paged_attn_kernel) == {"num_seqs", "num_tokens", "stride_bt"}
    assert unspecialised(_merge_splits_kernel) == {"num_tokens"}
