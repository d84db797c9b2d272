"""Triton paged-KV kernels against the torch references.

Without CUDA these run under the Triton interpreter (tests/plugins/kernels.py sets it) at tiny
shapes; the @gpu twins rerun the same matrix plus bf16 and larger shapes on a device. Every
output is poisoned with NaN first, so an element the kernel forgot to write fails the test.
"""
import pytest
import torch

from pagoda.kernels import triton_attention
from pagoda.kernels.reference import new_kv_cache, paged_attention_ref, random_paged_batch, write_kv_cache_ref
from pagoda.kernels.triton_attention import paged_attention_triton
from pagoda.kernels.triton_cache import write_kv_cache_triton

HAS_CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
TOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def scenario(name: str, bs: int) -> tuple[list[int], list[int]]:
    """(q_lens, seq_lens): ragged, with lengths of 1 and exact multiples of the block size."""
    if name == "decode":
        seq_lens = [1, bs, 2 * bs + 3, 3 * bs, bs - 1]
        return [1] * len(seq_lens), seq_lens
    if name == "prefix":  # prefill chunks attending to cached prefix blocks
        return [7, bs, 1, bs + 5], [2 * bs + 7, bs, bs + 4, 3 * bs]
    if name == "mixed":  # decodes, a chunk over a prefix, a fresh prompt, a sequence with no rows
        return [1, 9, 1, 2 * bs, 0, 1], [bs, bs + 9, 1, 2 * bs, bs, 4 * bs + 1]
    raise ValueError(name)


# Pairwise over block size x GQA ratio x head dim x dtype (every pair of values appears).
MATRIX = [
    (8, 1, 64, torch.float32, "mixed"),
    (8, 4, 128, torch.float16, "decode"),
    (8, 8, 64, torch.float16, "prefix"),
    (16, 1, 128, torch.float16, "prefix"),
    (16, 4, 64, torch.float32, "mixed"),
    (16, 8, 128, torch.float32, "decode"),
    (32, 1, 64, torch.float16, "decode"),
    (32, 4, 128, torch.float32, "prefix"),
    (32, 8, 64, torch.float32, "mixed"),
]
NUM_KV_HEADS = 2


def run_attention(bs, group, head_dim, dtype, name, device, seed=0, **kw):
    q_lens, seq_lens = scenario(name, bs)
    gen = torch.Generator().manual_seed(seed)
    b = random_paged_batch(q_lens, seq_lens, group * NUM_KV_HEADS, NUM_KV_HEADS, head_dim, bs,
                           dtype=dtype, device=device, generator=gen)
    ref = paged_attention_ref(**b)
    out = torch.full_like(b["q"], float("nan"))
    got = paged_attention_triton(**b, out=out, **kw)
    assert got is out
    assert not out.isnan().any(), "some output elements were never written"
    torch.testing.assert_close(out.float(), ref.float(), atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("bs,group,head_dim,dtype,name", MATRIX)
def test_attention_matches_reference(bs, group, head_dim, dtype, name):
    run_attention(bs, group, head_dim, dtype, name, "cpu")


@pytest.fixture
def poisoned_workspace(monkeypatch):
    """Split-KV partials start as NaN, so an empty segment that writes nothing poisons the merge."""
    real = triton_attention.split_workspace

    def poisoned(*args):
        return tuple(t.fill_(float("nan")) for t in real(*args))

    monkeypatch.setattr(triton_attention, "split_workspace", poisoned)


# Splits beyond a short context's key tiles are empty segments.
@pytest.mark.parametrize("bs,group,head_dim,dtype,name,splits", [
    (8, 4, 64, torch.float32, "decode", 4),
    (16, 8, 128, torch.float16, "decode", 8),
    (32, 1, 64, torch.float32, "mixed", 2),
])
def test_split_kv_matches_reference(poisoned_workspace, bs, group, head_dim, dtype, name, splits):
    run_attention(bs, group, head_dim, dtype, name, "cpu", num_splits=splits)


def feature_kwargs(feature: str, num_q_heads: int, bs: int, device) -> dict:
    """Keywords for one attention feature; the window is not a multiple of the block size."""
    gen = torch.Generator().manual_seed(9)
    kw: dict = {}
    if feature in ("window", "all"):
        kw["sliding_window"] = bs + 3
    if feature in ("softcap", "all"):
        kw["softcap"] = 1.5
    if feature in ("sinks", "all"):
        kw["sinks"] = torch.randn(num_q_heads, generator=gen).to(device)
    return kw


# Each feature on decode and on prefill chunks over a cached prefix, fp32 and fp16, with and
# without splits (the sink belongs to split 0 only; the window moves where the splits start).
@pytest.mark.parametrize("feature,bs,group,dtype,name,splits", [
    ("window", 8, 4, torch.float32, "prefix", 1),
    ("window", 16, 1, torch.float16, "decode", 4),
    ("window", 8, 2, torch.float32, "mixed", 2),
    ("softcap", 8, 4, torch.float16, "mixed", 1),
    ("softcap", 16, 2, torch.float32, "decode", 2),
    ("sinks", 8, 2, torch.float32, "mixed", 1),
    ("sinks", 16, 4, torch.float16, "decode", 4),
    ("all", 8, 4, torch.float32, "mixed", 2),
])
def test_attention_features_match_reference(poisoned_workspace, feature, bs, group, dtype, name, splits):
    q_lens, seq_lens = scenario(name, bs)
    gen = torch.Generator().manual_seed(4)
    b = random_paged_batch(q_lens, seq_lens, group * NUM_KV_HEADS, NUM_KV_HEADS, 32, bs,
                           dtype=dtype, generator=gen)
    b["q"] *= 3   # sharp scores: the cap and the window change the output visibly
    kw = feature_kwargs(feature, group * NUM_KV_HEADS, bs, "cpu")
    ref = paged_attention_ref(**b, **kw)
    assert not torch.allclose(ref.float(), paged_attention_ref(**b).float(), atol=1e-2)
    out = torch.full_like(b["q"], float("nan"))
    paged_attention_triton(**b, out=out, num_splits=splits, **kw)
    assert not out.isnan().any(), "some output elements were never written"
    torch.testing.assert_close(out.float(), ref.float(), atol=TOL[dtype], rtol=TOL[dtype])


def test_query_rows_past_batch_are_untouched():
    # A padded batch: rows after query_start_loc[-1] belong to no sequence and must keep their value.
    b = random_paged_batch([1, 3], [5, 20], 4, 2, 64, 16, generator=torch.Generator().manual_seed(1))
    q = torch.cat([b["q"], torch.randn(3, 4, 64)])
    out = torch.full_like(q, 7.0)
    paged_attention_triton(**{**b, "q": q}, out=out)
    assert (out[4:] == 7.0).all()
    torch.testing.assert_close(out[:4], paged_attention_ref(**b), atol=2e-5, rtol=2e-5)


def test_attention_rejects_bad_shapes():
    b = random_paged_batch([1], [3], 4, 2, 64, 16)
    with pytest.raises(ValueError, match="query_start_loc"):
        paged_attention_triton(**{**b, "query_start_loc": b["query_start_loc"][:1]})
    with pytest.raises(ValueError, match="q:"):
        paged_attention_triton(**{**b, "q": b["q"][:, :3]})
    with pytest.raises(ValueError, match="block_tables"):
        paged_attention_triton(**{**b, "block_tables": b["block_tables"][0]})
    with pytest.raises(ValueError, match="out"):
        paged_attention_triton(**b, out=torch.empty(1, 4, 32))


def run_cache_write(dtype, cache_dtype, bs, device):
    gen = torch.Generator().manual_seed(3)
    num_tokens, hkv, d = 11, 2, 64
    # key/value as strided views into one fused projection output, as a model produces them.
    qkv = torch.randn(num_tokens, 4 * hkv + 2 * hkv, d, generator=gen).to(dtype=dtype, device=device)
    key, value = qkv[:, 4 * hkv:5 * hkv], qkv[:, 5 * hkv:]
    num_blocks = 5
    slots = torch.randperm(num_blocks * bs, generator=gen)[:num_tokens]
    slots[[0, 4, 10]] = -1
    # The engine's pool is head-major (new_kv_cache); both kernels index through strides.
    k_cache = new_kv_cache(num_blocks, bs, hkv, d, cache_dtype, device).fill_(float("nan"))
    v_cache = k_cache.clone()
    assert k_cache.stride() == v_cache.stride() == (hkv * bs * d, d, bs * d, 1)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    slots = slots.to(device)
    write_kv_cache_ref(key, value, k_ref, v_ref, slots)
    write_kv_cache_triton(key, value, k_cache, v_cache, slots)
    torch.testing.assert_close(k_cache, k_ref, atol=0, rtol=0, equal_nan=True)
    torch.testing.assert_close(v_cache, v_ref, atol=0, rtol=0, equal_nan=True)
    written = (~k_cache.isnan()).all(-1).all(-1).sum().item()
    assert written == num_tokens - 3


@pytest.mark.parametrize("dtype,cache_dtype,bs", [
    (torch.float32, torch.float32, 8), (torch.float16, torch.float16, 16), (torch.float32, torch.float16, 32)])
def test_cache_write_matches_reference(dtype, cache_dtype, bs):
    run_cache_write(dtype, cache_dtype, bs, "cpu")


def test_cache_write_rejects_bad_slot_mapping():
    key = torch.randn(3, 2, 64)
    cache = torch.zeros(2, 16, 2, 64)
    with pytest.raises(ValueError, match="slot_mapping"):
        write_kv_cache_triton(key, key, cache, cache.clone(), torch.tensor([0, 1]))


# ---- GPU twins: same matrix on the device, bf16 added, default split heuristic exercised. ----

@pytest.mark.parametrize("bs,group,head_dim,dtype,name", MATRIX + [
    (16, 4, 128, torch.bfloat16, "decode"), (16, 4, 128, torch.bfloat16, "mixed"),
    (32, 8, 64, torch.bfloat16, "prefix")])
@pytest.mark.gpu
@needs_cuda
def test_attention_matches_reference_gpu(bs, group, head_dim, dtype, name):
    run_attention(bs, group, head_dim, dtype, name, "cuda")


@pytest.mark.parametrize("feature", ["window", "softcap", "sinks", "all"])
@pytest.mark.gpu
@needs_cuda
def test_attention_features_gpu(feature):
    gen = torch.Generator().manual_seed(7)
    b = random_paged_batch([1, 300, 1, 40], [900, 1200, 64, 40], 32, 8, 128, 16, dtype=torch.bfloat16,
                           device="cuda", generator=gen)
    kw = feature_kwargs(feature, 32, 16, "cuda")
    kw["sliding_window"] = kw.get("sliding_window") and 257
    out = paged_attention_triton(**b, **kw)
    torch.testing.assert_close(out.float(), paged_attention_ref(**b, **kw).float(),
                               atol=TOL[torch.bfloat16], rtol=TOL[torch.bfloat16])


@pytest.mark.parametrize("splits", [2, 8, 16, None])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.gpu
@needs_cuda
def test_split_kv_gpu(poisoned_workspace, splits, dtype):
    # Few long sequences: the shape the default heuristic splits.
    gen = torch.Generator().manual_seed(5)
    seq_lens = [1, 16, 4000, 1537]
    b = random_paged_batch([1] * 4, seq_lens, 32, 8, 128, 16, dtype=dtype, device="cuda", generator=gen)
    out = torch.full_like(b["q"], float("nan"))
    paged_attention_triton(**b, out=out, num_splits=splits)
    torch.testing.assert_close(out.float(), paged_attention_ref(**b).float(), atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16])
def test_long_prefill_gpu(dtype):
    gen = torch.Generator().manual_seed(6)
    b = random_paged_batch([1, 1000, 1, 300], [700, 1500, 64, 300], 32, 8, 128, 16, dtype=dtype,
                           device="cuda", generator=gen)
    out = torch.full_like(b["q"], float("nan"))
    paged_attention_triton(**b, out=out)
    torch.testing.assert_close(out.float(), paged_attention_ref(**b).float(), atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype,cache_dtype,bs", [
    (torch.bfloat16, torch.bfloat16, 16), (torch.float32, torch.bfloat16, 32), (torch.float16, torch.float16, 8)])
def test_cache_write_matches_reference_gpu(dtype, cache_dtype, bs):
    run_cache_write(dtype, cache_dtype, bs, "cuda")
