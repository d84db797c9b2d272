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
    """Causal attention of q [T, Hq, D] over each sequence's paged KV; returns [T, Hq, D].

    Single-token queries (decode) go through one padded, masked SDPA call together; longer ones
    (prefill chunks) one call each. A Python loop over decodes made attention two thirds of a
    CPU decode step.
    """
    if out is None:
        out = torch.empty_like(q)
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    gqa = q.shape[1] != k_cache.shape[2]
    decodes = [s for s in range(len(lens)) if starts[s + 1] - starts[s] == 1]
    if decodes:
        _decode_batched(q, k_cache, v_cache, block_tables, decodes, [starts[s] for s in decodes],
                        [lens[s] for s in decodes], scale, gqa, out)
    for s, seq_len in enumerate(lens):
        q_len = starts[s + 1] - starts[s]
        if q_len <= 1:
            continue
        q_s = q[starts[s]:starts[s + 1]]
        k = gather_kv(k_cache, block_tables[s], seq_len)
        v = gather_kv(v_cache, block_tables[s], seq_len)
        # Query i sits at position seq_len - q_len + i and sees keys 0..that position.
        q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)
        mask = torch.arange(seq_len, device=q.device)[None, :] <= q_pos[:, None]
        o = F.scaled_dot_product_attention(
            q_s.transpose(0, 1).float(), k.transpose(0, 1).float(), v.transpose(0, 1).float(),
            attn_mask=mask, scale=scale, enable_gqa=gqa)
        out[starts[s]:starts[s + 1]] = o.transpose(0, 1).to(out.dtype)
    return out


def _decode_batched(q, k_cache, v_cache, block_tables, seqs, rows, lens, scale, gqa, out) -> None:
    """One query token per sequence: gather every sequence's KV padded to the longest, mask the
    padding, one SDPA call."""
    block_size = k_cache.shape[1]
    max_len = max(lens)
    tables = block_tables[seqs, :-(-max_len // block_size)].long()
    lens_t = torch.tensor(lens, device=q.device)
    valid = torch.arange(max_len, device=q.device)[None, :] < lens_t[:, None]      # [S, L]

    def gather(cache):
        kv = cache[tables].flatten(1, 2)[:, :max_len].float()                     # [S, L, Hkv, D]
        # Padding may hold any bits (unused table entries, stale blocks): zero it so that a
        # masked NaN cannot leak into the weighted sum.
        return kv.masked_fill_(~valid[:, :, None, None], 0).transpose(1, 2)

    rows_t = torch.tensor(rows, device=q.device)
    o = F.scaled_dot_product_attention(q[rows_t].float().unsqueeze(2), gather(k_cache), gather(v_cache),
                                       attn_mask=valid[:, None, None, :], scale=scale, enable_gqa=gqa)
    out[rows_t] = o.squeeze(2).to(out.dtype)


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
