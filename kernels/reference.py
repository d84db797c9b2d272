"""Plain-torch references for the paged-KV kernels: the CPU path, and the oracle the Triton
kernels are tested against.

Layout shared by every backend:
  k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim], one pair per layer.
  slot_mapping[t] = block_id * block_size + offset for new token t, or -1 to skip it.
  A step is a flat batch of T query tokens from S sequences; sequence s owns query rows
  query_start_loc[s]:query_start_loc[s+1], has seq_lens[s] tokens of context including
  those rows (so its first query sits at position seq_lens[s] - q_len), and its KV lives
  in blocks block_tables[s, :ceil(seq_lens[s] / block_size)].
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def write_kv_cache_ref(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                       v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Scatter key/value [T, Hkv, D] into the paged caches at slot_mapping [T]."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    block_size = k_cache.shape[1]
    blocks, offsets = slots // block_size, slots % block_size
    k_cache[blocks, offsets] = key[keep].to(k_cache.dtype)
    v_cache[blocks, offsets] = value[keep].to(v_cache.dtype)


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, seq_len: int) -> torch.Tensor:
    """The first seq_len tokens of one sequence's KV: [seq_len, Hkv, D]."""
    block_size = cache.shape[1]
    num_blocks = -(-seq_len // block_size)
    blocks = cache[block_table[:num_blocks].long()]
    return blocks.reshape(-1, *cache.shape[2:])[:seq_len]


def paged_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        block_tables: torch.Tensor, seq_lens: torch.Tensor,
                        query_start_loc: torch.Tensor, scale: float,
                        out: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of q [T, Hq, D] over each sequence's paged KV; returns [T, Hq, D]."""
    if out is None:
        out = torch.empty_like(q)
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    num_q_heads, num_kv_heads = q.shape[1], k_cache.shape[2]
    for s, seq_len in enumerate(lens):
        q_s = q[starts[s]:starts[s + 1]]
        q_len = q_s.shape[0]
        if q_len == 0:
            continue
        k = gather_kv(k_cache, block_tables[s], seq_len)
        v = gather_kv(v_cache, block_tables[s], seq_len)
        # Query i sits at position seq_len - q_len + i and sees keys 0..that position.
        q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)
        mask = torch.arange(seq_len, device=q.device)[None, :] <= q_pos[:, None]
        o = F.scaled_dot_product_attention(
            q_s.transpose(0, 1).float(), k.transpose(0, 1).float(), v.transpose(0, 1).float(),
            attn_mask=mask, scale=scale, enable_gqa=num_q_heads != num_kv_heads)
        out[starts[s]:starts[s + 1]] = o.transpose(0, 1).to(out.dtype)
    return out


def random_paged_batch(q_lens: list[int], seq_lens: list[int], num_q_heads: int, num_kv_heads: int,
                       head_dim: int, block_size: int, dtype=torch.float32, device="cpu",
                       spare_blocks: int = 3, generator: torch.Generator | None = None) -> dict:
    """A random step for tests and benchmarks: q, caches and a scattered (permuted) block table.

    Sequence s has q_lens[s] query rows at the end of seq_lens[s] tokens of context. The pool has
    spare_blocks unused blocks on top, and unused block-table entries hold -1, so a kernel that
    reads past a sequence's blocks touches the wrong memory or faults instead of passing.
    """
    if len(q_lens) != len(seq_lens) or any(q > s for q, s in zip(q_lens, seq_lens)):
        raise ValueError("q_lens: each must be at most its seq_lens entry, one per sequence")
    blocks = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(blocks) + spare_blocks
    perm = torch.randperm(num_blocks, generator=generator).to(torch.int32)
    table = torch.full((len(seq_lens), max(blocks + [1])), -1, dtype=torch.int32)
    used = 0
    for s, n in enumerate(blocks):
        table[s, :n] = perm[used:used + n]
        used += n
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    starts = [0]
    for q in q_lens:
        starts.append(starts[-1] + q)

    def rand(*size):
        if generator is None:
            return torch.randn(*size, dtype=dtype, device=device)
        return torch.randn(*size, generator=generator).to(dtype=dtype, device=device)

    return dict(q=rand(starts[-1], num_q_heads, head_dim), k_cache=rand(*shape), v_cache=rand(*shape),
                block_tables=table.to(device), seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
                query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
                scale=head_dim ** -0.5)


def add_rms_norm_ref(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(RMSNorm(x + residual), x + residual); residual None means plain RMSNorm of x.

    Arithmetic as transformers' LlamaRMSNorm: the sum in x's dtype, the variance in fp32, the
    normalised row cast back to x's dtype before the weight multiplies it.
    """
    h = x if residual is None else x + residual
    hf = h.float()
    normed = (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return weight * normed, h


def rotary_ref(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
               sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Neox-style rotary embedding of q [T, Hq, D] and k [T, Hkv, D] by position.

    cos/sin: [max_positions, D] fp32 tables with the two halves equal (cat(freqs, freqs)).
    """
    c = cos[positions].unsqueeze(1).to(q.dtype)
    s = sin[positions].unsqueeze(1).to(q.dtype)

    def rotate(x):
        half = x.shape[-1] // 2
        return x * c + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * s

    return rotate(q), rotate(k)
