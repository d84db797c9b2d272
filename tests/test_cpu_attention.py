"""The in-place CPU attention kernel (kernels/cpu_attention.py) against the torch reference, and
its fallbacks to the reference for what it does not take."""
import pytest
import torch

from kernels import cpu_attention
from kernels.cpu_attention import paged_attention_cpu
from kernels.fp8 import FP8_DTYPE, quantize_fp8
from kernels.reference import paged_attention_ref, random_paged_batch
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
    # bf16 and a head_dim the kernel's vectors do not divide
    bf16 = dict(b, q=b["q"].bfloat16(), k_cache=b["k_cache"].bfloat16(), v_cache=b["v_cache"].bfloat16())
    odd = random_paged_batch([1, 4], [20, 9], 4, 2, 12, 8, generator=gen)
    for batch in (bf16, odd):
        assert not cpu_attention.supports(batch["q"], batch["k_cache"])
        torch.testing.assert_close(paged_attention_cpu(**batch), paged_attention_ref(**batch), rtol=0, atol=0)


def test_no_compiler_falls_back_to_the_reference(tmp_path, monkeypatch, caplog):
    from gpu_worker.attention import select_backend
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
