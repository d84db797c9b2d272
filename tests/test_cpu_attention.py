"""The in-place CPU attention kernel (kernels/cpu_attention.py) against the torch reference, and
its fallbacks to the reference for what it does not take."""
import pytest
import torch

from pagoda.kernels import cpu_attention, cpu_lib
from pagoda.kernels.cpu_attention import paged_attention_cpu
from pagoda.kernels.fp8 import FP8_DTYPE, quantize_fp8
from pagoda.kernels.reference import paged_attention_ref, random_paged_batch
from tests.test_reference import dense_attention


def poison_spare_blocks(b):
    """NaN in every block no sequence owns: reading one shows up in the output."""
    owned = b["block_tables"][b["block_tables"] >= 0].long()
    spare = torch.ones(b["k_cache"].shape[0], dtype=torch.bool)
    spare[owned] = False
    b["k_cache"][spare] = float("nan")
    b["v_cache"][spare] = float("nan")


def test_kernel_builds_here():
    assert cpu_attention.available(), "the C kernel must build on the test machine (gcc/cc)"


STEPS = {
    "decode": ([1] * 9, [3, 170, 17, 64, 65, 140, 129, 33, 160]),
    "prefill": ([40, 9], [40, 9]),
    "chunked": ([1, 7, 1, 16, 1, 21], [33, 7, 2, 48, 17, 90]),
}


@pytest.mark.parametrize("step", sorted(STEPS))
@pytest.mark.parametrize("hq,hkv,d,bs", [(8, 2, 32, 16), (4, 4, 64, 8), (8, 1, 16, 32), (6, 2, 128, 16)])
def test_matches_reference_and_float64(step, hq, hkv, d, bs):
    q_lens, seq_lens = STEPS[step]
    b = random_paged_batch(q_lens, seq_lens, hq, hkv, d, bs, generator=torch.Generator().manual_seed(1))
    poison_spare_blocks(b)
    out = paged_attention_cpu(**b, out=torch.full_like(b["q"], float("nan")))
    assert not out.isnan().any()
    torch.testing.assert_close(out, paged_attention_ref(**b), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.double(), dense_attention(b), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("hq,hkv,d,bs", [(8, 4, 64, 16), (6, 2, 128, 8)])
def test_16_bit_prefill_chunks_as_matrix_products(dtype, hq, hkv, d, bs):
    # gemm_attention_cpu.c on bf16/fp16 queries and pools (converted as it packs them): against
    # the float64 attention of the same 16-bit inputs, within one rounding of the output.
    q_lens, seq_lens = [300, 40, 1, 600], [600, 300, 50, 600]
    b = random_paged_batch(q_lens, seq_lens, hq, hkv, d, bs, generator=torch.Generator().manual_seed(12))
    b = dict(b, q=b["q"].to(dtype), k_cache=b["k_cache"].to(dtype), v_cache=b["v_cache"].to(dtype))
    poison_spare_blocks(b)
    memo: dict = {}
    out = paged_attention_cpu(**b, out=torch.full_like(b["q"], float("nan")), memo=memo)
    assert plan_of(memo).jobs.rep.tolist() == [0, 1, 3]
    assert out.dtype == dtype and not out.isnan().any()
    ulp = 2.0 ** -8 if dtype == torch.bfloat16 else 2.0 ** -11
    torch.testing.assert_close(out.double(), dense_attention(b), rtol=ulp, atol=1e-5)


@pytest.mark.parametrize("feature", ["window", "softcap", "sinks", "all"])
@pytest.mark.parametrize("step", ["decode", "chunked"])
def test_features_match_float64(feature, step):
    gen = torch.Generator().manual_seed(2)
    b = random_paged_batch(*STEPS[step], 8, 2, 32, 16, generator=gen)
    poison_spare_blocks(b)
    b["q"] *= 3   # sharp scores, so that the cap and the window change the output visibly
    kw = {}
    if feature in ("window", "all"):
        kw["sliding_window"] = 20   # not a multiple of the block size
    if feature in ("softcap", "all"):
        kw["softcap"] = 2.0
    if feature in ("sinks", "all"):
        kw["sinks"] = torch.randn(8, generator=gen)
    expected = dense_attention(b, **kw)
    torch.testing.assert_close(paged_attention_cpu(**b, **kw).double(), expected, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(paged_attention_cpu(**b).double(), expected, atol=1e-3)


@pytest.mark.parametrize("heads_per_item", [1, 2, 4])
@pytest.mark.parametrize("threads", [1, 2])
def test_work_split_does_not_change_the_result(heads_per_item, threads):
    b = random_paged_batch([1, 5, 1, 12, 30], [30, 20, 77, 12, 200], 8, 4, 32, 16,
                           generator=torch.Generator().manual_seed(5))
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        out = paged_attention_cpu(**b, heads_per_item=heads_per_item)
    finally:
        torch.set_num_threads(before)
    torch.testing.assert_close(out, paged_attention_ref(**b), rtol=1e-5, atol=1e-5)


def test_any_pool_layout_and_shared_blocks():
    """A token-major pool (not the engine's head-major one) and blocks shared by several
    sequences, as the prefix cache shares them, read the same."""
    b = random_paged_batch([1, 1, 5, 1], [40, 40, 45, 70], 8, 2, 32, 16, generator=torch.Generator().manual_seed(4))
    b["block_tables"][1, :2] = b["block_tables"][0, :2]
    b["block_tables"][2, :2] = b["block_tables"][0, :2]
    expected = paged_attention_ref(**b)
    for name in ("k_cache", "v_cache"):
        b[name] = b[name].contiguous()
    assert b["k_cache"].is_contiguous()
    torch.testing.assert_close(paged_attention_cpu(**b), expected, rtol=1e-5, atol=1e-5)


def test_what_the_kernel_does_not_take_goes_to_the_reference():
    gen = torch.Generator().manual_seed(6)
    b = random_paged_batch([1, 4], [20, 9], 4, 2, 16, 8, generator=gen)
    # fp8 pools: the reference dequantises them (exactly the same numbers)
    fp8 = dict(b, k_cache=quantize_fp8(b["k_cache"], 0.5), v_cache=quantize_fp8(b["v_cache"], 0.25))
    assert fp8["k_cache"].dtype == FP8_DTYPE and not cpu_attention.supports(fp8["q"], fp8["k_cache"])
    torch.testing.assert_close(paged_attention_cpu(**fp8, k_scale=0.5, v_scale=0.25),
                               paged_attention_ref(**fp8, k_scale=0.5, v_scale=0.25), rtol=0, atol=0)
    # fp32 queries over a bf16 pool, and a head_dim the kernel's vectors do not divide
    mixed = dict(b, k_cache=b["k_cache"].bfloat16(), v_cache=b["v_cache"].bfloat16())
    odd = random_paged_batch([1, 4], [20, 9], 4, 2, 12, 8, generator=gen)
    for batch in (mixed, odd):
        assert not cpu_attention.supports(batch["q"], batch["k_cache"])
        torch.testing.assert_close(paged_attention_cpu(**batch), paged_attention_ref(**batch), rtol=0, atol=0)


def test_no_compiler_falls_back_to_the_reference(tmp_path, monkeypatch, caplog):
    from pagoda.gpu_worker.models.attention import select_backend
    monkeypatch.setenv("CC", str(tmp_path / "no-cc"))
    monkeypatch.setenv("PAGODA_KERNEL_CACHE", str(tmp_path))
    cpu_attention.load_library.cache_clear()
    try:
        write, attend = select_backend("auto", torch.device("cpu"))
        assert attend is paged_attention_cpu and not cpu_attention.available()
        assert "using the torch reference" in caplog.text
        b = random_paged_batch([1, 3], [10, 5], 4, 2, 16, 8)
        assert torch.equal(attend(**b), paged_attention_ref(**b))
    finally:
        cpu_attention.load_library.cache_clear()
    monkeypatch.undo()
    assert cpu_attention.available()


# ---- cascade: shared prefixes attended once per group (csrc/gemm_attention_cpu.c) ----

def shared_batch(q_lens, seq_lens, hq, hkv, d, bs, shares, seed=7):
    """random_paged_batch with shares = [(members, blocks)]: the members' tables start with the
    first member's first `blocks` blocks, as the prefix cache hands them out."""
    b = random_paged_batch(q_lens, seq_lens, hq, hkv, d, bs, generator=torch.Generator().manual_seed(seed))
    for members, blocks in shares:
        for s in members[1:]:
            b["block_tables"][s, :blocks] = b["block_tables"][members[0], :blocks]
    poison_spare_blocks(b)
    return b


def plan_of(memo):
    (plan,) = memo.values()
    return plan


def shared_lens(plan):
    """The keys each cascade group shares (its job's key count)."""
    if plan.jobs is None:
        return []
    mode, keys = plan.jobs.mode, plan.jobs.keys
    return keys[mode == cpu_attention.TO_PARTIALS].tolist()


@pytest.mark.parametrize("hq,hkv,d,bs", [(8, 4, 64, 16), (8, 2, 32, 16), (4, 4, 64, 8), (6, 2, 128, 16),
                                         (8, 1, 16, 32)])
def test_cascade_matches_reference_and_float64(hq, hkv, d, bs):
    # A group of 12 decodes, a group of two prefill chunks, a pair of decodes too small to
    # group, and a sequence alone; 9 shared blocks of 8 keys pad the packed keys (72 -> 80).
    q_lens = [1] * 12 + [9, 20, 1, 1, 3]
    seq_lens = [200 + i for i in range(12)] + [150, 300, 90, 100, 60]
    shared = 9 if bs == 8 else 200 // bs - 1
    b = shared_batch(q_lens, seq_lens, hq, hkv, d, bs, [(list(range(12)), shared), ([12, 13], 128 // bs),
                                                          ([14, 15], 64 // bs)])
    memo: dict = {}
    out = paged_attention_cpu(**b, out=torch.full_like(b["q"], float("nan")), memo=memo)
    plan = plan_of(memo)
    assert plan.prefix is not None
    prefix, glens = plan.prefix, sorted(shared_lens(plan))
    assert glens == sorted([shared * bs, 128])
    assert prefix[:12].tolist() == [shared * bs] * 12 and prefix[14:].tolist() == [0, 0, 0]
    assert not out.isnan().any()
    torch.testing.assert_close(out, paged_attention_ref(**b), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.double(), dense_attention(b), rtol=1e-5, atol=1e-5)


def test_cascade_shares_only_the_blocks_every_member_has():
    # Eight members agree on 6 blocks, one of them on only 4: the group shares 4.
    b = shared_batch([1] * 8, [120, 130, 140, 150, 160, 170, 180, 190], 8, 2, 32, 16, [(list(range(8)), 6)])
    b["block_tables"][3, 4:6] = b["block_tables"][7, 6:8]
    memo: dict = {}
    out = paged_attention_cpu(**b, memo=memo)
    assert shared_lens(plan_of(memo)) == [64]
    torch.testing.assert_close(out, paged_attention_ref(**b), rtol=1e-5, atol=1e-5)


def test_cascade_group_of_many_rows_splits_into_items():
    # 60 decodes x 4 query heads per KV head = 240 rows per KV head: several row chunks.
    b = shared_batch([1] * 60, [100 + 3 * i for i in range(60)], 8, 2, 32, 16, [(list(range(60)), 6)])
    memo: dict = {}
    out = paged_attention_cpu(**b, memo=memo)
    items = plan_of(memo).jobs.items
    assert len(items) == 2 * -(-240 // cpu_lib.GEMM_ATTENTION_ROWS)
    torch.testing.assert_close(out, paged_attention_ref(**b), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("threads", [2, 3])
@pytest.mark.parametrize("case", ["cascade", "prefill"])
def test_matrix_products_are_the_same_on_any_thread_count(case, threads):
    if case == "cascade":
        b = shared_batch([1] * 20 + [30], [300] * 20 + [400], 8, 2, 64, 16, [(list(range(21)), 16)])
    else:
        b = random_paged_batch([300, 40], [600, 300], 8, 2, 64, 16, generator=torch.Generator().manual_seed(12))
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = paged_attention_cpu(**b)
        torch.set_num_threads(threads)
        assert torch.equal(paged_attention_cpu(**b), one)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("feature", ["window", "softcap", "sinks"])
def test_cascade_is_off_for_window_cap_and_sinks(feature):
    gen = torch.Generator().manual_seed(3)
    b = shared_batch([1] * 10, [100] * 10, 8, 2, 32, 16, [(list(range(10)), 5)])
    kw = {"window": dict(sliding_window=40), "softcap": dict(softcap=2.0),
          "sinks": dict(sinks=torch.randn(8, generator=gen))}[feature]
    memo: dict = {}
    out = paged_attention_cpu(**b, memo=memo, **kw)
    assert plan_of(memo).jobs is None
    torch.testing.assert_close(out.double(), dense_attention(b, **kw), rtol=1e-5, atol=1e-5)


def test_the_step_memo_is_planned_once_and_kept_apart_by_shape():
    b = shared_batch([1] * 10, [100] * 10, 8, 2, 32, 16, [(list(range(10)), 5)])
    memo: dict = {}
    paged_attention_cpu(**b, memo=memo)
    plan = plan_of(memo)
    paged_attention_cpu(**b, memo=memo)
    assert plan_of(memo) is plan
    # another layer shape in the same step (a draft model, say) gets a plan of its own
    other = shared_batch([1] * 10, [100] * 10, 4, 4, 16, 16, [(list(range(10)), 5)])
    torch.testing.assert_close(paged_attention_cpu(**other, memo=memo), paged_attention_ref(**other),
                               rtol=1e-5, atol=1e-5)
    assert len(memo) == 2


def test_too_little_to_share_is_not_grouped():
    # below CASCADE_MIN_TOKENS query tokens, or CASCADE_MIN_KEYS shared keys
    few = shared_batch([1] * (cpu_attention.CASCADE_MIN_TOKENS - 1), [200] * 7, 8, 2, 32, 16, [(list(range(7)), 10)])
    short = shared_batch([1] * 10, [200] * 10, 8, 2, 32, 16, [(list(range(10)), cpu_attention.CASCADE_MIN_KEYS // 16 - 1)])
    for b in (few, short):
        memo: dict = {}
        out = paged_attention_cpu(**b, memo=memo)
        assert plan_of(memo).jobs is None
        torch.testing.assert_close(out, paged_attention_ref(**b), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("hq,hkv,d,bs", [(8, 4, 64, 16), (6, 2, 128, 8), (8, 1, 16, 32)])
def test_long_prefill_chunks_as_matrix_products(hq, hkv, d, bs):
    # Chunks past one key chunk (gemm_attention_cpu.c's KEY_CHUNK keys per online-softmax step)
    # with the causal edge inside them, a fresh prompt, a chunk after cached context, one just
    # below PREFILL_MIN_TOKENS, and decodes beside.
    q_lens = [300, 40, cpu_attention.PREFILL_MIN_TOKENS - 1, 1, 600]
    seq_lens = [600, 300, 70, 50, 600]
    chunk = cpu_lib.load_library().gemm_attention_key_chunk()
    assert chunk == cpu_lib.GEMM_ATTENTION_KEY_CHUNK
    # What the sizes are for: the chunk after cached context runs over more than two key chunks
    # and its causal edge falls inside one; the fresh prompt runs over more than four.
    assert seq_lens[0] > 2 * chunk and (seq_lens[0] - q_lens[0]) % chunk and seq_lens[4] > 4 * chunk
    b = random_paged_batch(q_lens, seq_lens, hq, hkv, d, bs, generator=torch.Generator().manual_seed(11))
    poison_spare_blocks(b)
    memo: dict = {}
    out = paged_attention_cpu(**b, out=torch.full_like(b["q"], float("nan")), memo=memo)
    plan = plan_of(memo)
    assert plan.jobs.rep.tolist() == [0, 1, 4]                  # the chunks of 16 tokens or more
    assert sorted({int(i) >> 32 for i in plan.items}) == [2, 3]  # the rest, one sequence at a time
    assert not out.isnan().any()
    torch.testing.assert_close(out, paged_attention_ref(**b), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.double(), dense_attention(b), rtol=1e-5, atol=1e-5)



@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("step", sorted(STEPS))
@pytest.mark.parametrize("hq,hkv,d,bs", [(8, 2, 32, 16), (6, 2, 128, 16), (4, 4, 64, 8)])
def test_16_bit_pools_read_in_place(dtype, step, hq, hkv, d, bs):
    """bf16 / fp16 queries and pools, read in place and summed in fp32: against the float64
    attention of the same 16-bit inputs, within the rounding of the 16-bit output (one rounding,
    half an ulp of the output's dtype, plus fp32 summation)."""
    b = random_paged_batch(*STEPS[step], hq, hkv, d, bs, generator=torch.Generator().manual_seed(7))
    b = dict(b, q=b["q"].to(dtype), k_cache=b["k_cache"].to(dtype), v_cache=b["v_cache"].to(dtype))
    poison_spare_blocks(b)
    assert cpu_attention.supports(b["q"], b["k_cache"])
    out = paged_attention_cpu(**b, out=torch.full_like(b["q"], float("nan")))
    assert out.dtype == dtype and not out.isnan().any()
    want = dense_attention(b)
    ulp = 2.0 ** -8 if dtype == torch.bfloat16 else 2.0 ** -11
    torch.testing.assert_close(out.double(), want, rtol=ulp, atol=1e-5)
    # the reference (which computes in fp32 on gathered rows and rounds once) agrees as closely
    torch.testing.assert_close(out.double(), paged_attention_ref(**b).double(), rtol=2 * ulp, atol=1e-5)


@pytest.mark.parametrize("feature", ["window", "softcap", "sinks"])
def test_16_bit_features(feature):
    gen = torch.Generator().manual_seed(8)
    b = random_paged_batch(*STEPS["chunked"], 8, 2, 32, 16, generator=gen)
    b = dict(b, q=(b["q"] * 3).bfloat16(), k_cache=b["k_cache"].bfloat16(), v_cache=b["v_cache"].bfloat16())
    poison_spare_blocks(b)
    kw = {"window": {"sliding_window": 20}, "softcap": {"softcap": 2.0},
          "sinks": {"sinks": torch.randn(8, generator=gen)}}[feature]
    torch.testing.assert_close(paged_attention_cpu(**b, **kw).double(), dense_attention(b, **kw),
                               rtol=2.0 ** -8, atol=1e-5)


def test_a_small_steps_plan_is_the_full_plans_without_numpy():
    # _small_plan (fewer than CASCADE_MIN_TOKENS query tokens: a decode of a few sequences) gives
    # the items _plan gives, in the same order, ties included
    import random

    import numpy as np
    rng = random.Random(0)
    for trial in range(300):
        s = rng.randrange(1, cpu_attention.CASCADE_MIN_TOKENS)
        q = [0] * s
        for _ in range(rng.randrange(s, cpu_attention.CASCADE_MIN_TOKENS)):
            q[rng.randrange(s)] += 1
        lens = [qi + rng.choice([0, 5, 17, 17, 300]) for qi in q]
        starts = [0, *np.cumsum(q).tolist()]
        hq, hkv = rng.choice([(8, 2), (4, 4), (32, 8), (14, 2)])
        threads, hpi = rng.choice([1, 2, 4]), rng.choice([None, None, 1])
        tables = torch.zeros(s, 4, dtype=torch.int32)
        want = cpu_attention._plan(tables, np.array(lens, np.int64), np.array(starts, np.int64), 16, hq, hkv, 64,
                                   threads, True, hpi)
        got = cpu_attention._small_plan(lens, starts, hq, hkv, threads, hpi)
        assert want.jobs is None and want.prefix is None and got.heads_per_item == want.heads_per_item
        assert got.items.tolist() == want.items.tolist(), (trial, q, lens)
