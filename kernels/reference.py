"""Plain-torch references for the paged-KV kernels: the CPU path, and the oracle the Triton
kernels are tested against.

Layout shared by every backend:
  k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim], one pair per layer,
  indexed through their strides. The pool is stored head-major (new_kv_cache: each block holds
  one [block_size, head_dim] run per KV head), so that gathering a sequence's blocks yields
  [Hkv, L, D] directly: SDPA on a CPU is about three times slower on the transposed view that a
  token-major pool gives. Every function here and in the Triton kernels takes any strides.
  slot_mapping[t] = block_id * block_size + offset for new token t, or -1 to skip it.
  A step is a flat batch of T query tokens from S sequences; sequence s owns query rows
  query_start_loc[s]:query_start_loc[s+1], has seq_lens[s] tokens of context including
  those rows (so its first query sits at position seq_lens[s] - q_len), and its KV lives
  in blocks block_tables[s, :ceil(seq_lens[s] / block_size)].

Attention features, the same keywords for every backend (HF semantics, so that parity holds):
  sliding_window W: the query at position p sees keys p - W < k <= p (W keys, itself included).
  softcap c: scores (already scaled) become c * tanh(score / c) before masking and softmax.
  sinks [Hq]: one extra logit per query head in the softmax denominator, with no value row
  (gpt-oss); it takes probability mass away from every key.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from pagoda.kernels.fp8 import FP8_DTYPE, dequantize_fp8, quantize_fp8


def new_kv_cache(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """A zeroed pool of the shared logical shape, stored head-major (see the layout above)."""
    store = torch.zeros(num_blocks, num_kv_heads, block_size, head_dim, dtype=dtype, device=device)
    return store.permute(0, 2, 1, 3)


def write_kv_cache_ref(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                       v_cache: torch.Tensor, slot_mapping: torch.Tensor, *, k_scale: float = 1.0,
                       v_scale: float = 1.0) -> None:
    """Scatter key/value [T, Hkv, D] into the paged caches at slot_mapping [T] (fp8 caches:
    quantised with the per-tensor scales, kernels/fp8.py)."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    block_size = k_cache.shape[1]
    blocks, offsets = slots // block_size, slots % block_size
    if k_cache.dtype == FP8_DTYPE:
        k_cache[blocks, offsets] = quantize_fp8(key[keep], k_scale)
        v_cache[blocks, offsets] = quantize_fp8(value[keep], v_scale)
        return
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
                        out: torch.Tensor | None = None, *, max_seq_len: int | None = None,
                        sliding_window: int | None = None, softcap: float | None = None,
                        sinks: torch.Tensor | None = None, k_scale: float = 1.0,
                        v_scale: float = 1.0) -> torch.Tensor:
    """Causal attention of q [T, Hq, D] over each sequence's paged KV; returns [T, Hq, D].

    max_seq_len: accepted for the kernels' contract (a split-KV hint); lengths come from seq_lens.

    Single-token queries (decode) are computed together in one flat pass; longer ones (prefill
    chunks) with one SDPA call each (written out when soft-capping or sinks need the scores).
    A Python loop over decodes made attention two thirds of a CPU decode step.
    """
    if out is None:
        out = torch.empty_like(q)
    if k_cache.dtype == FP8_DTYPE:  # the oracle dequantises whole pools: simple, not fast
        k_cache, v_cache = dequantize_fp8(k_cache, k_scale), dequantize_fp8(v_cache, v_scale)
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    gqa = q.shape[1] != k_cache.shape[2]
    decodes = [s for s in range(len(lens)) if starts[s + 1] - starts[s] == 1]
    if decodes:
        _decode_batched(q, k_cache, v_cache, block_tables, decodes, [starts[s] for s in decodes],
                        [lens[s] for s in decodes], scale, out, sliding_window, softcap, sinks)
    for s, seq_len in enumerate(lens):
        q_len = starts[s + 1] - starts[s]
        if q_len <= 1:
            continue
        q_s = q[starts[s]:starts[s + 1]]
        k = gather_kv(k_cache, block_tables[s], seq_len)
        v = gather_kv(v_cache, block_tables[s], seq_len)
        # Query i sits at position seq_len - q_len + i and sees keys 0..that position.
        q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)
        k_pos = torch.arange(seq_len, device=q.device)[None, :]
        mask = k_pos <= q_pos[:, None]
        if sliding_window:
            mask &= k_pos > q_pos[:, None] - sliding_window
        qf, kf, vf = q_s.transpose(0, 1).float(), k.transpose(0, 1).float(), v.transpose(0, 1).float()
        if softcap or sinks is not None:
            o = _dense_attention(qf, kf, vf, mask, scale, softcap, sinks)
        else:
            o = F.scaled_dot_product_attention(qf, kf, vf, attn_mask=mask, scale=scale, enable_gqa=gqa)
        out[starts[s]:starts[s + 1]] = o.transpose(0, 1).to(out.dtype)
    return out


def _dense_attention(q, k, v, mask, scale, softcap, sinks):
    """q [..., Hq, L, D], k/v [..., Hkv, S, D] fp32, mask broadcastable to [..., Hq, L, S]
    -> [..., Hq, L, D], with the scores in hand."""
    group = q.shape[-3] // k.shape[-3]
    k, v = k.repeat_interleave(group, -3), v.repeat_interleave(group, -3)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is None:
        return torch.matmul(scores.softmax(-1), v)
    sink = sinks.float().view(-1, 1, 1).expand(*scores.shape[:-1], 1)
    probs = torch.cat([scores, sink], dim=-1).softmax(-1)[..., :-1]
    return torch.matmul(probs, v)


_scratch = threading.local()


def _scratch_buffer(name: str, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A flat buffer of at least numel elements, kept per thread and reused across steps. A
    fresh multi-megabyte tensor every step costs a page fault per 4 KiB on a CPU (glibc maps
    large blocks anew), which made the gather 5x slower than the copy."""
    # A buffer made under inference_mode cannot be written outside it (tests call this bare).
    key = (name, device, dtype, torch.is_inference_mode_enabled())
    buf = getattr(_scratch, "buffers", {}).get(key)
    if buf is None or buf.numel() < numel:
        buf = torch.empty(max(numel, 1 << 16), dtype=dtype, device=device)
        _scratch.__dict__.setdefault("buffers", {})[key] = buf
    return buf[:numel]


def _gather_heads(cache: torch.Tensor, block_ids: torch.Tensor, num_seqs: int, name: str) -> torch.Tensor:
    """The blocks block_ids (num_seqs rows of equal width) as fp32 [num_seqs, Hkv, L, D],
    contiguous: on a head-major pool one index_select of (block, head) rows, nothing else."""
    nb, block_size, num_kv_heads, head_dim = cache.shape
    heads = cache.permute(0, 2, 1, 3)
    if not heads.is_contiguous():   # a token-major pool (tests build any layout): one copy
        heads = heads.contiguous()
    rows = heads.view(nb * num_kv_heads, block_size * head_dim)
    width = block_ids.numel() // num_seqs
    ids = (block_ids.view(num_seqs, 1, width) * num_kv_heads
           + torch.arange(num_kv_heads, device=cache.device).view(1, -1, 1)).view(-1)
    out = _scratch_buffer(name, ids.numel() * rows.shape[1], rows.dtype, rows.device).view(ids.numel(), -1)
    torch.index_select(rows, 0, ids, out=out)
    out = out.view(num_seqs, num_kv_heads, width * block_size, head_dim)
    return out if out.dtype == torch.float32 else out.float()


# A bucket of decodes is padded to its longest member; a sequence joins the current bucket
# while it needs at least this share of the bucket's blocks, so padding wastes at most ~25%.
BUCKET_FILL = 0.8


def _decode_batched(q, k_cache, v_cache, block_tables, seqs, rows, lens, scale, out,
                    sliding_window=None, softcap=None, sinks=None) -> None:
    """One query token per sequence, all sequences at once: sequences sorted by how many
    blocks they read and cut into buckets of similar length; per bucket one block gather
    (index_select of whole blocks, the cheap way to gather on a CPU) into a padded
    [S, Hkv, L, D] view and one SDPA call (written out when soft-capping or sinks need the
    scores). Padding columns re-read the sequence's own last block and are masked, so no
    block outside a sequence's table is read; blocks wholly before a sliding window are not
    gathered at all."""
    dev = q.device
    block_size, num_kv_heads, head_dim = k_cache.shape[1], k_cache.shape[2], k_cache.shape[3]
    num_q_heads = q.shape[1]
    n = np.asarray(lens, dtype=np.int64)
    lo = np.maximum(n - sliding_window, 0) if sliding_window else np.zeros_like(n)  # first visible key
    skip = lo // block_size
    nblocks = -(-n // block_size) - skip
    order = np.argsort(-nblocks, kind="stable")
    shortfall = -nblocks[order]                                  # ascending
    seqs_t = torch.as_tensor(np.asarray(seqs, dtype=np.int64), device=dev)
    rows_t = torch.as_tensor(np.asarray(rows, dtype=np.int64), device=dev)
    start = 0
    while start < len(order):
        width = int(nblocks[order[start]])
        end = int(np.searchsorted(shortfall, -BUCKET_FILL * width, side="right"))
        idx = order[start:end]
        start = end
        col = skip[idx, None] + np.minimum(np.arange(width), nblocks[idx, None] - 1)      # [Sb, W]
        token = (skip[idx, None] + np.arange(width))[:, :, None] * block_size + np.arange(block_size)
        valid = (token >= lo[idx, None, None]) & (token < n[idx, None, None])           # [Sb, W, bs]
        idx_t = torch.as_tensor(idx, device=dev)
        tables = block_tables.index_select(0, seqs_t[idx_t]).long()
        block_ids = torch.gather(tables, 1, torch.as_tensor(col, device=dev)).view(-1)
        k = _gather_heads(k_cache, block_ids, len(idx), "k")                            # [Sb, Hkv, L, D]
        v = _gather_heads(v_cache, block_ids, len(idx), "v")
        qb = q.index_select(0, rows_t[idx_t]).float()                                   # [Sb, Hq, D]
        mask = torch.as_tensor(valid.reshape(len(idx), 1, 1, -1), device=dev)
        if softcap or sinks is not None:
            o = _dense_attention(qb.unsqueeze(2), k, v, mask, scale, softcap, sinks)
        else:
            # The query heads that share a KV head go in as that head's query rows (query head
            # h reads KV head h // group, as in transformers' repeat_kv): half the SDPA calls'
            # per-head overhead of enable_gqa at group 2, the same arithmetic.
            o = F.scaled_dot_product_attention(qb.view(len(idx), num_kv_heads, -1, head_dim), k, v,
                                               attn_mask=mask, scale=scale)
        out[rows_t[idx_t]] = o.reshape(len(idx), num_q_heads, head_dim).to(out.dtype)


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
    starts = [0]
    for q in q_lens:
        starts.append(starts[-1] + q)

    def rand(*size):
        if generator is None:
            return torch.randn(*size, dtype=dtype, device=device)
        return torch.randn(*size, generator=generator).to(dtype=dtype, device=device)

    def pool():     # head-major storage, as new_kv_cache lays the engine's pool out
        return rand(num_blocks, num_kv_heads, block_size, head_dim).permute(0, 2, 1, 3)

    return dict(q=rand(starts[-1], num_q_heads, head_dim), k_cache=pool(), v_cache=pool(),
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


# ---- batched LoRA (several adapters in one batch) -------------------------------------------
#
# Every token row t of a step names an adapter slot (slots[t], -1: none). An adapter slot s
# holds per projection A [S, R, in] and B [S, out, R], B already multiplied by the adapter's
# scaling, ranks below R zero-padded (exact zeros: they add nothing). The delta of row t is
# (x[t] @ A[s]^T) @ B[s]^T: "shrink" to rank R in fp32, then "expand" into the projection's
# output columns [offset, offset + out). Tokens are grouped by slot (LoRASegments), so each
# adapter is one matmul over its rows (segment matmuls, as Punica's SGMV), on CPU and in the
# Triton kernels (kernels/triton_lora.py) alike.


@dataclass
class LoRASegments:
    """A step's token rows grouped by adapter slot; rows without an adapter are left out."""
    order: torch.Tensor         # [M] int64: token rows with a slot, grouped by slot
    seg_start: torch.Tensor     # [G + 1] int32: group g is order[seg_start[g]:seg_start[g + 1]]
    seg_slot: torch.Tensor      # [G] int32: its slot
    host_start: list[int]       # the same two, on the host (the torch path loops over groups)
    host_slot: list[int]
    max_seg_len: int
    # Every row, in order, in one group (one adapter for the whole step): the torch path then
    # works on whole tensors, with no gather or scatter.
    whole: bool = False


def lora_segments(token_slots: np.ndarray, upload=torch.from_numpy) -> LoRASegments | None:
    """Group token rows by slot (stable: rows keep their order inside a group); None when no
    row has an adapter, so a base-only step does no LoRA work at all. upload: host array ->
    tensor on the step's device."""
    mapped = np.flatnonzero(token_slots >= 0)
    if not len(mapped):
        return None
    order = mapped[np.argsort(token_slots[mapped], kind="stable")]
    slots, starts, counts = np.unique(token_slots[order], return_index=True, return_counts=True)
    seg_start = np.append(starts, len(order)).astype(np.int32)
    return LoRASegments(upload(order), upload(seg_start), upload(slots.astype(np.int32)), seg_start.tolist(),
                        slots.tolist(), int(counts.max()), len(slots) == 1 and len(order) == len(token_slots))


def lora_shrink_ref(x: torch.Tensor, a: torch.Tensor, seg: LoRASegments) -> torch.Tensor:
    """h [T, R] fp32: x[t] @ A[slot(t)]^T per row, one matmul per slot; zero where no adapter."""
    if seg.whole:
        return x.float() @ a[seg.host_slot[0]].float().t()
    h = torch.zeros(x.shape[0], a.shape[1], dtype=torch.float32, device=x.device)
    for g, slot in enumerate(seg.host_slot):
        rows = seg.order[seg.host_start[g]:seg.host_start[g + 1]]
        h[rows] = x[rows].float() @ a[slot].float().t()
    return h


def lora_expand_ref(h: torch.Tensor, b: torch.Tensor, seg: LoRASegments, y: torch.Tensor,
                    offset: int = 0) -> None:
    """y[t, offset:offset + out] += h[t] @ B[slot(t)]^T, in place, rows with an adapter only."""
    n = b.shape[1]
    if seg.whole:
        y[:, offset:offset + n] += (h @ b[seg.host_slot[0]].float().t()).to(y.dtype)
        return
    for g, slot in enumerate(seg.host_slot):
        rows = seg.order[seg.host_start[g]:seg.host_start[g + 1]]
        delta = (h[rows] @ b[slot].float().t()).to(y.dtype)
        y[rows, offset:offset + n] += delta


def lora_gather_ref(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, token_slots: torch.Tensor
                    ) -> torch.Tensor:
    """The delta [T, out] by gathering every row's own A and B (batched matvecs): the oracle the
    segment path and the Triton kernels are tested against. fp32."""
    use = token_slots >= 0
    s = token_slots.clamp(min=0).long()
    h = torch.einsum("ti,tri->tr", x.float(), a[s].float())
    out = torch.einsum("tr,tor->to", h, b[s].float())
    return out * use[:, None]
