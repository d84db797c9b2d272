"""Triton paged attention for mixed batches: prefill chunks over a cached prefix, and decode.

Same contract as pagoda.kernels.reference.paged_attention_ref (layout described there). Design:
- One program per (query tile, KV head[, KV split]). A query tile holds BLOCK_Q tokens of one
  sequence times all query heads of the KV head's GQA group, so the group shares every K/V load.
- Query tiles of all sequences are numbered without a host sync: sequence s owns tiles
  from qsl[s] // BLOCK_Q + s on, which over-counts by at most one per sequence; a program finds
  its sequence by binary search over query_start_loc and spare tiles exit at once.
- The program walks its sequence's block table in tiles of BLOCK_N keys with an online
  (flash-decoding) softmax in fp32, masking keys past each row's causal position.
- Split-KV: for few sequences with long contexts the key range is cut into NUM_SPLITS segments
  handled by separate programs that write partial (max, sum, unnormalised output); a merge
  kernel combines them. Empty segments write the neutral partial (m=-1e30, l=0, acc=0).
- Features (constexpr switches, so plain attention compiles as before): a sliding window masks
  keys at or before q_pos - window and starts the walk at the first key tile any row of the tile
  can see; soft-capping applies c * tanh(s / c) to the scaled scores; sinks seed the online
  softmax with one extra logit per head (m = sink, l = 1, no value), in split 0 only.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from pagoda.kernels.launch import for_tensor

_NEG = tl.constexpr(-1.0e30)  # finite "minus infinity": keeps exp2(m_old - m_new) at 1, not NaN, for empty rows
_LOG2E = 1.4426950408889634


# Step-varying integers: specialising them (a value of 1 becomes a constant, multiples of 16 get
# a divisibility hint) would compile new variants mid-serving (gpu_worker/runner/warmup.py).
STEP_VARYING = ("num_seqs", "num_tokens", "stride_bt")


@triton.jit(do_not_specialize=STEP_VARYING)
def _paged_attn_kernel(
        q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, out, part_acc, part_ml,
        scale_log2, v_scale, window, softcap, sinks, num_seqs, num_tokens, num_q_heads,
        stride_qt, stride_qh, stride_ot, stride_oh, stride_cb, stride_cs, stride_ch, stride_bt,
        BLOCK_SIZE: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
        BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
        NUM_SPLITS: tl.constexpr, DOT_PREC: tl.constexpr,
        HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_SINKS: tl.constexpr, FP8_KV: tl.constexpr):
    BLOCK_M: tl.constexpr = BLOCK_Q * GROUP_PAD
    tile = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)

    # Largest s with qsl[s] // BLOCK_Q + s <= tile (that numbering is non-decreasing in s).
    lo = tile * 0
    hi = lo + num_seqs - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        first = tl.load(query_start_loc + mid) // BLOCK_Q + mid
        lo = tl.where(first <= tile, mid, lo)
        hi = tl.where(first <= tile, hi, mid - 1)
    seq = lo
    q_begin = tl.load(query_start_loc + seq)
    q_len = tl.load(query_start_loc + seq + 1) - q_begin
    q_tok0 = (tile - (q_begin // BLOCK_Q + seq)) * BLOCK_Q
    if q_tok0 >= q_len:
        return
    seq_len = tl.load(seq_lens + seq)
    ctx_len = seq_len - q_len

    rows = tl.arange(0, BLOCK_M)
    tok = q_tok0 + rows // GROUP_PAD
    head = kvh * GROUP + rows % GROUP_PAD
    row_ok = (tok < q_len) & (rows % GROUP_PAD < GROUP)
    q_pos = ctx_len + tok
    d = tl.arange(0, D_PAD)
    d_ok = d < HEAD_DIM
    t_idx = (q_begin + tok).to(tl.int64)
    q_tile = tl.load(q + t_idx[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                     mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    # fp8 K/V are converted to q's dtype (exact): the K scale is folded into scale_log2, V's into
    # the output (kernels/fp8.py).
    if not FP8_KV:
        q_tile = q_tile.to(k_cache.dtype.element_ty)

    # Keys this tile can see end at its last token's position.
    kv_end = tl.minimum(seq_len, ctx_len + q_tok0 + BLOCK_Q)
    # ... and, under a window, start at the first key its first token can see.
    t_first = 0
    if HAS_WINDOW:
        t_first = tl.maximum(ctx_len + q_tok0 - window + 1, 0) // BLOCK_N
    num_kv_tiles = tl.cdiv(kv_end, BLOCK_N) - t_first
    if NUM_SPLITS == 1:
        t_lo = t_first
        t_hi = t_first + num_kv_tiles
    else:
        per_split = tl.cdiv(num_kv_tiles, NUM_SPLITS)
        t_lo = t_first + split * per_split
        t_hi = tl.minimum(t_lo + per_split, t_first + num_kv_tiles)

    m_i = tl.full([BLOCK_M], _NEG, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    if HAS_SINKS:
        # The sink is a key with logit sinks[head] and a zero value row, counted in split 0 only.
        sink = tl.load(sinks + head, mask=row_ok, other=0.0).to(tl.float32) * 1.4426950408889634
        m_i = tl.where(split == 0, sink, m_i)
        l_i = tl.where(split == 0, l_i + 1.0, l_i)
    acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)
    bt_row = block_tables + seq.to(tl.int64) * stride_bt
    cols = tl.arange(0, BLOCK_N)
    for t in range(t_lo, t_hi):
        n = t * BLOCK_N + cols
        n_ok = n < kv_end
        blk = tl.load(bt_row + n // BLOCK_SIZE, mask=n_ok, other=0).to(tl.int64)
        kv_off = blk * stride_cb + (n % BLOCK_SIZE) * stride_cs + kvh * stride_ch
        kv_mask = n_ok[:, None] & d_ok[None, :]
        k = tl.load(k_cache + kv_off[:, None] + d[None, :], mask=kv_mask, other=0.0).to(q_tile.dtype)
        s = tl.dot(q_tile, tl.trans(k), input_precision=DOT_PREC) * scale_log2
        if HAS_SOFTCAP:
            # c * tanh(x / c) in natural units (scale_log2 carries log2 e): tanh(y) = 1 - 2 / (e^2y + 1).
            y = s * (0.6931471805599453 / softcap)
            s = softcap * (1.0 - 2.0 / (tl.exp(2.0 * y) + 1.0)) * 1.4426950408889634
        visible = (n[None, :] <= q_pos[:, None]) & n_ok[None, :]
        if HAS_WINDOW:
            visible = visible & (n[None, :] > q_pos[:, None] - window)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_cache + kv_off[:, None] + d[None, :], mask=kv_mask, other=0.0).to(q_tile.dtype)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PREC)
        m_i = m_new

    store_mask = row_ok[:, None] & d_ok[None, :]
    if FP8_KV:
        acc = acc * v_scale
    if NUM_SPLITS == 1:
        o = acc / l_i[:, None]
        tl.store(out + t_idx[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
                 o.to(out.dtype.element_ty), mask=store_mask)
    else:
        row = (split * num_tokens + t_idx) * num_q_heads + head
        tl.store(part_acc + row[:, None] * HEAD_DIM + d[None, :], acc, mask=store_mask)
        tl.store(part_ml + row * 2, m_i, mask=row_ok)
        tl.store(part_ml + row * 2 + 1, l_i, mask=row_ok)


@triton.jit(do_not_specialize=["num_tokens"])
def _merge_splits_kernel(part_acc, part_ml, out, num_tokens, num_q_heads, stride_ot, stride_oh,
                         HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, NUM_SPLITS: tl.constexpr,
                         HEADS_BLOCK: tl.constexpr):
    tok = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1) * HEADS_BLOCK + tl.arange(0, HEADS_BLOCK)
    d = tl.arange(0, D_PAD)
    h_ok = head < num_q_heads
    mask = h_ok[:, None] & (d < HEAD_DIM)[None, :]
    m_run = tl.full([HEADS_BLOCK], _NEG, tl.float32)
    l_run = tl.zeros([HEADS_BLOCK], tl.float32)
    o_run = tl.zeros([HEADS_BLOCK, D_PAD], tl.float32)
    for sp in range(NUM_SPLITS):
        row = (sp * num_tokens + tok) * num_q_heads + head
        m_s = tl.load(part_ml + row * 2, mask=h_ok, other=_NEG)
        l_s = tl.load(part_ml + row * 2 + 1, mask=h_ok, other=0.0)
        a_s = tl.load(part_acc + row[:, None] * HEAD_DIM + d[None, :], mask=mask, other=0.0)
        m_new = tl.maximum(m_run, m_s)
        c_run = tl.exp2(m_run - m_new)
        c_s = tl.exp2(m_s - m_new)
        l_run = l_run * c_run + l_s * c_s
        o_run = o_run * c_run[:, None] + a_s * c_s[:, None]
        m_run = m_new
    o = o_run / l_run[:, None]
    tl.store(out + tok * stride_ot + head[:, None] * stride_oh + d[None, :], o.to(out.dtype.element_ty),
             mask=mask)


def split_workspace(num_splits: int, num_tokens: int, num_q_heads: int, head_dim: int,
                    device) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 partial outputs and (max, sum) pairs for split-KV; a function so tests can poison it."""
    acc = torch.empty(num_splits, num_tokens, num_q_heads, head_dim, dtype=torch.float32, device=device)
    ml = torch.empty(num_splits, num_tokens, num_q_heads, 2, dtype=torch.float32, device=device)
    return acc, ml


@functools.lru_cache(maxsize=None)
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _choose_splits(q: torch.Tensor, num_seqs: int, num_kv_heads: int, block_n: int,
                   decode_only: bool, max_seq_len: int | None) -> int:
    if not q.is_cuda or not decode_only:
        return 1
    sms = _num_sms(q.device.index if q.device.index is not None else torch.cuda.current_device())
    return num_kv_splits(num_seqs, num_kv_heads, sms, block_n, max_seq_len)


def num_kv_splits(num_seqs: int, num_kv_heads: int, num_sms: int, block_n: int,
                  max_seq_len: int | None) -> int:
    """Split-KV segments for a decode batch: only when it leaves most SMs idle, and only as many
    as the longest context fills (max_seq_len None: up to 16)."""
    programs = num_seqs * num_kv_heads
    if programs >= num_sms:
        return 1
    splits = triton.next_power_of_2(triton.cdiv(2 * num_sms, programs))
    if max_seq_len is not None:
        # Each segment should keep at least a few key tiles, or the merge costs more than it saves.
        tiles_per_4 = max_seq_len // (4 * block_n)
        splits = min(splits, 1 << max(0, tiles_per_4.bit_length() - 1))
    return max(1, min(splits, 16))


def launch_config(num_tokens: int, num_seqs: int, num_q_heads: int, num_kv_heads: int, head_dim: int,
                  block_size: int, cache_dtype: torch.dtype, on_cuda: bool,
                  block_n: int | None = None) -> dict:
    """The attention kernel's compile-time parameters (less NUM_SPLITS) and num_warps for a batch."""
    group = num_q_heads // num_kv_heads
    group_pad = triton.next_power_of_2(group)
    # Without a sync we only know whether every sequence could be a single decode token; a
    # decode tile needs few rows, but tl.dot wants at least 16.
    fp32 = cache_dtype == torch.float32
    decode = num_tokens <= num_seqs
    # fp32 uses exact (ieee) dots, whose larger operands spill at 64 x 64 tiles on sm_90:
    # smaller tiles and more warps (checked by tests/test_kernels_compile.py).
    block_m = 16 if decode else 32 if fp32 else 64
    block_q = max(1, block_m // group_pad)
    if block_n is None:
        # Under the interpreter every tile costs milliseconds whatever its size: keep them small.
        block_n = (32 if fp32 and not decode else 64) if on_cuda else max(16, min(32, block_size))
    return dict(BLOCK_SIZE=block_size, GROUP=group, GROUP_PAD=group_pad, BLOCK_Q=block_q, BLOCK_N=block_n,
                HEAD_DIM=head_dim, D_PAD=triton.next_power_of_2(head_dim),
                DOT_PREC="ieee" if fp32 else "tf32", FP8_KV=cache_dtype == torch.float8_e4m3fn,
                num_warps=8 if fp32 or block_q * group_pad >= 128 else 4)


def paged_attention_triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor,
                           query_start_loc: torch.Tensor, scale: float,
                           out: torch.Tensor | None = None, *, num_splits: int | None = None,
                           max_seq_len: int | None = None, block_n: int | None = None,
                           sliding_window: int | None = None, softcap: float | None = None,
                           sinks: torch.Tensor | None = None, k_scale: float = 1.0,
                           v_scale: float = 1.0) -> torch.Tensor:
    """Causal attention of q [T, Hq, D] over each sequence's paged KV; returns out [T, Hq, D].

    sliding_window / softcap / sinks as in pagoda.kernels.reference.paged_attention_ref.

    Optional, keyword only: num_splits forces the split-KV segment count (default: chosen from
    the batch shape and the GPU's SM count); max_seq_len, if the caller knows it, keeps short
    contexts from being split; block_n overrides the key tile (for tuning); k_scale/v_scale
    dequantise an fp8 cache (kernels/fp8.py).
    """
    num_tokens, num_q_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    num_seqs = seq_lens.shape[0]
    _check(q, k_cache, v_cache, block_tables, query_start_loc, num_seqs)
    if sinks is not None and (sinks.shape != (num_q_heads,) or sinks.device != q.device):
        raise ValueError(f"sinks: expected [{num_q_heads}] on {q.device}, got {tuple(sinks.shape)}")
    if out is None:
        out = torch.empty_like(q)
    elif out.shape != q.shape or out.stride(2) != 1:
        raise ValueError(f"out: expected shape {tuple(q.shape)} with a contiguous last axis")
    if num_tokens == 0 or num_seqs == 0:
        return out
    cfg = launch_config(num_tokens, num_seqs, num_q_heads, num_kv_heads, head_dim, block_size,
                        k_cache.dtype, q.is_cuda, block_n)
    if num_splits is None:
        num_splits = _choose_splits(q, num_seqs, num_kv_heads, cfg["BLOCK_N"], num_tokens <= num_seqs,
                                    max_seq_len)
    if num_splits > 1:
        part_acc, part_ml = split_workspace(num_splits, num_tokens, num_q_heads, head_dim, q.device)
    else:
        part_acc = part_ml = out  # unused by the kernel when NUM_SPLITS == 1
    num_warps = cfg.pop("num_warps")
    for_tensor(_paged_attn_kernel, q)[(num_tokens // cfg["BLOCK_Q"] + num_seqs, num_kv_heads, num_splits)](
        q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, out, part_acc, part_ml,
        scale * k_scale * _LOG2E, v_scale, int(sliding_window or 0), float(softcap or 0.0),
        sinks if sinks is not None else q, num_seqs, num_tokens, num_q_heads,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        NUM_SPLITS=num_splits, HAS_WINDOW=bool(sliding_window), HAS_SOFTCAP=bool(softcap),
        HAS_SINKS=sinks is not None, num_warps=num_warps, num_stages=2, **cfg)
    if num_splits > 1:
        # Per head on a GPU, for parallelism; all heads per token under the interpreter, where
        # each program costs milliseconds.
        heads = 1 if q.is_cuda else triton.next_power_of_2(num_q_heads)
        for_tensor(_merge_splits_kernel, q)[(num_tokens, triton.cdiv(num_q_heads, heads))](
            part_acc, part_ml, out, num_tokens, num_q_heads, out.stride(0), out.stride(1),
            HEAD_DIM=head_dim, D_PAD=triton.next_power_of_2(head_dim), NUM_SPLITS=num_splits,
            HEADS_BLOCK=heads, num_warps=1)
    return out


def _check(q, k_cache, v_cache, block_tables, query_start_loc, num_seqs) -> None:
    """Shape checks that need no device sync; each error names the argument at fault."""
    if q.dim() != 3 or k_cache.dim() != 4:
        raise ValueError("q: expected [T, Hq, D] and k_cache [num_blocks, block_size, Hkv, D]")
    if k_cache.shape != v_cache.shape or k_cache.stride() != v_cache.stride():
        raise ValueError("v_cache: must have k_cache's shape and strides")
    if q.shape[2] != k_cache.shape[3]:
        raise ValueError(f"q: head_dim {q.shape[2]} differs from the cache's {k_cache.shape[3]}")
    if q.shape[1] % k_cache.shape[2]:
        raise ValueError(f"q: {q.shape[1]} query heads is not a multiple of {k_cache.shape[2]} KV heads")
    if q.stride(2) != 1 or k_cache.stride(3) != 1:
        raise ValueError("q/k_cache: the head_dim axis must be contiguous")
    if query_start_loc.shape[0] != num_seqs + 1:
        raise ValueError(f"query_start_loc: expected {num_seqs + 1} entries, got {query_start_loc.shape[0]}")
    if block_tables.dim() != 2 or block_tables.shape[0] != num_seqs:
        raise ValueError(f"block_tables: expected [{num_seqs}, max_blocks], got {tuple(block_tables.shape)}")
