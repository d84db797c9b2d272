"""The torch reference attention (the CPU path) against a float64 softmax written out by hand."""
import pytest
import torch

from kernels.reference import gather_kv, paged_attention_ref, random_paged_batch


def dense_attention(b):
    """Per sequence, in float64: softmax(q k^T * scale + causal mask) v, GQA by repetition."""
    out = torch.empty_like(b["q"], dtype=torch.float64)
    starts = b["query_start_loc"].tolist()
    group = b["q"].shape[1] // b["k_cache"].shape[2]
    for s, seq_len in enumerate(b["seq_lens"].tolist()):
        q = b["q"][starts[s]:starts[s + 1]].double()
        k = gather_kv(b["k_cache"], b["block_tables"][s], seq_len).double().repeat_interleave(group, 1)
        v = gather_kv(b["v_cache"], b["block_tables"][s], seq_len).double().repeat_interleave(group, 1)
        scores = torch.einsum("qhd,khd->hqk", q, k) * b["scale"]
        q_pos = torch.arange(seq_len - q.shape[0], seq_len)[:, None]
        scores = scores.masked_fill(torch.arange(seq_len)[None, :] > q_pos, float("-inf"))
        out[starts[s]:starts[s + 1]] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)
    return out


@pytest.mark.parametrize("q_lens,seq_lens", [
    ([1, 1, 1], [1, 16, 45]),                  # decode only: the batched path
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
