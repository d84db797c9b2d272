"""Triton cache write: scatter a step's new K and V rows into the paged KV pool.

Same contract as pagoda.kernels.reference.write_kv_cache_ref: key/value [T, Hkv, D] (any strides, e.g.
views into a fused QKV output), caches [num_blocks, block_size, Hkv, D], slot_mapping [T] with
-1 for tokens that must not be written (padding, or tokens whose KV is already cached).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagoda.kernels.launch import for_tensor


@triton.jit
def _write_kv_kernel(key, value, k_cache, v_cache, slot_mapping,
                     stride_kt, stride_kh, stride_vt, stride_vh,
                     stride_cb, stride_cs, stride_ch,
                     block_size, num_kv_heads, k_scale, v_scale,
                     HEAD_DIM: tl.constexpr, HEADS_PAD: tl.constexpr, D_PAD: tl.constexpr, FP8: tl.constexpr):
    # One program per token moves all its heads: Hkv runs of D elements, one per head (the
    # pool is stored head-major, kernels/reference.py), each a contiguous store.
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping + t).to(tl.int64)
    if slot < 0:
        return
    blk = slot // block_size
    off = slot % block_size
    h = tl.arange(0, HEADS_PAD)[:, None]
    d = tl.arange(0, D_PAD)[None, :]
    mask = (h < num_kv_heads) & (d < HEAD_DIM)
    dst = blk * stride_cb + off * stride_cs + h * stride_ch + d
    k = tl.load(key + t * stride_kt + h * stride_kh + d, mask=mask)
    v = tl.load(value + t * stride_vt + h * stride_vh + d, mask=mask)
    if FP8:  # kernels/fp8.py: scaled, clamped to e4m3's range (a plain cast past it is NaN)
        k = tl.clamp(k.to(tl.float32) / k_scale, -448.0, 448.0)
        v = tl.clamp(v.to(tl.float32) / v_scale, -448.0, 448.0)
    tl.store(k_cache + dst, k.to(k_cache.dtype.element_ty), mask=mask)
    tl.store(v_cache + dst, v.to(v_cache.dtype.element_ty), mask=mask)


def write_kv_cache_triton(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                          v_cache: torch.Tensor, slot_mapping: torch.Tensor, *, k_scale: float = 1.0,
                          v_scale: float = 1.0) -> None:
    """Scatter key/value [T, Hkv, D] into the paged caches at slot_mapping [T] (-1 skips); fp8
    caches are quantised with the per-tensor scales."""
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    if key.stride(2) != 1 or value.stride(2) != 1:
        raise ValueError("key/value: the head_dim axis must be contiguous")
    if k_cache.shape != v_cache.shape or k_cache.stride() != v_cache.stride():
        raise ValueError("k_cache/v_cache: must have the same shape and strides")
    if k_cache.stride(3) != 1:
        raise ValueError("k_cache: the head_dim axis must be contiguous")
    if slot_mapping.shape[0] != num_tokens:
        raise ValueError(f"slot_mapping: expected {num_tokens} entries, got {slot_mapping.shape[0]}")
    for_tensor(_write_kv_kernel, key)[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        k_cache.shape[1], num_kv_heads, k_scale, v_scale,
        HEAD_DIM=head_dim, HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        D_PAD=triton.next_power_of_2(head_dim), FP8=k_cache.dtype == torch.float8_e4m3fn)
