"""The torch reference attention (the CPU path) against a float64 softmax written out by hand."""
import pytest
import torch

from pagoda.kernels.reference import gather_kv, paged_attention_ref, random_paged_batch


def dense_attention(b, sliding_window=None, softcap=None, sinks=None):
    """Per sequence, in float64: softmax(q k^T * scale + causal mask) v, GQA by repetition;
    optionally a sliding window, tanh soft-capping and a per-head sink logit."""
    out = torch.empty_like(b["q"], dtype=torch.float64)
    starts = b["query_start_loc"].tolist()
    group = b["q"].shape[1] // b["k_cache"].shape[2]
    for s, seq_len in enumerate(b["seq_lens"].tolist()):
        q = b["q"][starts[s]:starts[s + 1]].double()
        k = gather_kv(b["k_cache"], b["block_tables"][s], seq_len).double().repeat_interleave(group, 1)
        v = gather_kv(b["v_cache"], b["block_tables"][s], seq_len).double().repeat_interleave(group, 1)
        scores = torch.einsum("qhd,khd->hqk", q, k) * b["scale"]
        if softcap:
            scores = softcap * torch.tanh(scores / softcap)
        q_pos = torch.arange(seq_len - q.shape[0], seq_len)[:, None]
        k_pos = torch.arange(seq_len)[None, :]
        hidden = k_pos > q_pos
        if sliding_window:
            hidden |= k_pos <= q_pos - sliding_window
        scores = scores.masked_fill(hidden, float("-inf"))
        if sinks is not None:
            sink = sinks.double().view(-1, 1, 1).expand(-1, q.shape[0], 1)
            probs = torch.cat([scores, sink], -1).softmax(-1)[..., :-1]
        else:
            probs = scores.softmax(-1)
        out[starts[s]:starts[s + 1]] = torch.einsum("hqk,khd->qhd", probs, v)
    return out


@pytest.mark.parametrize("q_lens,seq_lens", [
    ([1, 1, 1], [1, 16, 45]),                  # decode only: the batched path
    ([1] * 9, [3, 170, 17, 64, 65, 140, 129, 33, 160]),   # decode buckets of several widths
    ([1, 7, 1, 16, 1], [33, 7, 2, 48, 17]),    # mixed: prefill chunks over cached prefixes
])
def test_reference_matches_float64_softmax(q_lens, seq_lens):
    b = random_paged_batch(q_lens, seq_lens, 8, 2, 32, 16, generator=torch.Generator().manual_seed(1))
    # Poison every block no sequence owns: padding in the batched decode must not read it.
    owned = b["block_tables"][b["block_tables"] >= 0].long()
    spare = torch.ones(b["k_cache"].shape[0], dtype=torch.bool)
    spare[owned] = False
    b["k_cache"][spare] = float("nan")
    b["v_cache"][spare] = float("nan")
    out = paged_attention_ref(**b, out=torch.full_like(b["q"], float("nan")))
    assert not out.isnan().any()
    torch.testing.assert_close(out.double(), dense_attention(b), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("feature", ["window", "softcap", "sinks", "all"])
@pytest.mark.parametrize("q_lens,seq_lens", [
    ([1, 1, 1, 1], [1, 16, 45, 70]),           # decode: blocks before the window are skipped
    ([1, 7, 1, 16, 1], [33, 7, 2, 48, 17]),    # mixed
])
def test_reference_features_match_float64(feature, q_lens, seq_lens):
    gen = torch.Generator().manual_seed(2)
    b = random_paged_batch(q_lens, seq_lens, 8, 2, 32, 16, generator=gen)
    b["q"] *= 3   # sharp scores, so that the cap and the window change the output visibly
    kw = {}
    if feature in ("window", "all"):
        kw["sliding_window"] = 20   # not a multiple of the block size
    if feature in ("softcap", "all"):
        kw["softcap"] = 2.0
    if feature in ("sinks", "all"):
        kw["sinks"] = torch.randn(8, generator=gen)
    out = paged_attention_ref(**b, **kw)
    expected = dense_attention(b, **kw)
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)
    # The feature matters: plain attention differs.
    assert not torch.allclose(paged_attention_ref(**b).double(), expected, atol=1e-3)


def test_reference_takes_any_pool_layout():
    """The engine's pool is head-major (new_kv_cache); a token-major pool of the same logical
    shape must give the same output (the decode gather copies it to head-major first)."""
    b = random_paged_batch([1, 1, 5, 1], [3, 40, 21, 70], 8, 2, 32, 16, generator=torch.Generator().manual_seed(4))
    assert b["k_cache"].permute(0, 2, 1, 3).is_contiguous()
    token_major = {**b, "k_cache": b["k_cache"].contiguous(), "v_cache": b["v_cache"].contiguous()}
    assert token_major["k_cache"].is_contiguous()
    torch.testing.assert_close(paged_attention_ref(**token_major), paged_attention_ref(**b), rtol=0, atol=0)
    torch.testing.assert_close(paged_attention_ref(**b).double(), dense_attention(b), rtol=1e-5, atol=1e-5)
