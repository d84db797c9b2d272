"""The CPU attention path: paged attention that reads K/V in place from the block pool.

kernels/csrc/paged_attention_cpu.c walks each sequence's blocks through its block table and
never gathers a context (the reference's per-step index_select of every sequence's blocks was
a third of a CPU decode step, bench/cpu_attention.py). It is part of the CPU kernels' C library
(kernels/cpu_lib.py: built at first use, called through ctypes) and splits its work over
torch.get_num_threads() threads of that library's pool.

paged_attention_cpu has paged_attention_ref's signature and semantics (kernels/reference.py)
and falls back to it for what the C kernel does not take: fp8 or non-fp32 caches or queries,
head_dim not a multiple of 8, non-CPU tensors, or no working C compiler (logged once).
"""
from __future__ import annotations

import numpy as np
import torch

from kernels.cpu_lib import GEMV_MAX_M, QTILE, available, kernel_threads, load_library
from kernels.reference import paged_attention_ref

MAX_D, MAX_ROWS = 256, 256


def supports(q: torch.Tensor, k_cache: torch.Tensor, sinks: torch.Tensor | None = None) -> bool:
    """Whether the C kernel takes this call (else paged_attention_cpu uses the reference)."""
    hq, hkv, d = q.shape[1], k_cache.shape[2], k_cache.shape[3]
    return (q.device.type == "cpu" and k_cache.device.type == "cpu"
            and q.dtype == torch.float32 and k_cache.dtype == torch.float32
            and d % 8 == 0 and d <= MAX_D and hq % hkv == 0 and (hq // hkv) * QTILE <= MAX_ROWS
            and (sinks is None or sinks.device.type == "cpu") and available())


def _items(starts: np.ndarray, lens: np.ndarray, num_groups: int) -> np.ndarray:
    """Work items (seq << 32 | tile << 8 | KV head group), the most keys first so the threads
    finish together."""
    q_lens = np.diff(starts)
    tiles = -(-q_lens // QTILE)
    seq = np.repeat(np.arange(len(lens), dtype=np.int64), tiles)
    first = np.repeat(np.cumsum(tiles) - tiles, tiles)
    tile = np.arange(len(seq), dtype=np.int64) - first
    # keys read by a tile ~ the last position it holds
    rows = np.minimum(QTILE, q_lens[seq] - tile * QTILE)
    cost = (lens[seq] - q_lens[seq] + tile * QTILE + rows) * rows
    order = np.argsort(-cost, kind="stable")
    seq, tile = seq[order], tile[order]
    heads = np.arange(num_groups, dtype=np.int64)
    return ((seq[:, None] << 32) | (tile[:, None] << 8) | heads[None, :]).reshape(-1)


def paged_attention_cpu(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        block_tables: torch.Tensor, seq_lens: torch.Tensor,
                        query_start_loc: torch.Tensor, scale: float,
                        out: torch.Tensor | None = None, *, max_seq_len: int | None = None,
                        sliding_window: int | None = None, softcap: float | None = None,
                        sinks: torch.Tensor | None = None, k_scale: float = 1.0,
                        v_scale: float = 1.0, heads_per_item: int | None = None) -> torch.Tensor:
    """paged_attention_ref's contract, computed in place over the pool (see the module doc).

    heads_per_item: KV heads one work item covers (default: all of them, which reads each
    block's heads as one contiguous run, unless that leaves too few items for the threads)."""
    if not supports(q, k_cache, sinks) or v_cache.dtype != k_cache.dtype:
        return paged_attention_ref(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc,
                                   scale, out, max_seq_len=max_seq_len, sliding_window=sliding_window,
                                   softcap=softcap, sinks=sinks, k_scale=k_scale, v_scale=v_scale)
    if out is None:
        out = torch.empty_like(q)
    if q.stride(-1) != 1 or out.stride(-1) != 1:
        raise ValueError("q/out: the head dimension must be contiguous")
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("k_cache/v_cache: the head dimension must be contiguous")
    tables = block_tables if block_tables.dtype == torch.int32 and block_tables.stride(-1) == 1 \
        else block_tables.to(torch.int32).contiguous()
    lens_t = seq_lens.to(torch.int32).contiguous()
    starts_t = query_start_loc.to(torch.int32).contiguous()
    starts_np, lens_np = starts_t.numpy().astype(np.int64), lens_t.numpy().astype(np.int64)
    hq, hkv = q.shape[1], k_cache.shape[2]
    threads = kernel_threads()
    if heads_per_item is None:
        tiles = int((-(-np.diff(starts_np) // QTILE)).sum())
        fits = hq * QTILE <= MAX_ROWS
        heads_per_item = hkv if fits and tiles >= 4 * threads else 1
    items = _items(starts_np, lens_np, hkv // heads_per_item)
    sinks_f = None if sinks is None else sinks.detach().float().contiguous()
    rc = load_library().paged_attention_cpu(  # type: ignore[union-attr]
        q.data_ptr(), q.stride(0), q.stride(1), out.data_ptr(), out.stride(0), out.stride(1),
        k_cache.data_ptr(), *k_cache.stride()[:3], v_cache.data_ptr(), *v_cache.stride()[:3],
        tables.data_ptr(), tables.stride(0), lens_t.data_ptr(), starts_t.data_ptr(),
        None if sinks_f is None else sinks_f.data_ptr(), hq, hkv, k_cache.shape[3],
        k_cache.shape[1], int(sliding_window or 0), float(scale), float(softcap or 0.0),
        heads_per_item, items.ctypes.data, len(items), threads,
        # a step of a few tokens keeps the pool's threads awake through it (cpu_lib.py)
        int(q.shape[0] <= GEMV_MAX_M))
    if rc:
        raise RuntimeError(f"paged_attention_cpu: kernel refused the shapes (code {rc})")
    return out
