"""Batched multi-LoRA on CUDA: the segment matmuls of pagoda.kernels.reference.lora_shrink_ref /
lora_expand_ref as two Triton kernels (Punica's SGMV shape: tokens grouped by adapter).

Both launch one program per (adapter group, BLOCK_M of its rows[, BLOCK_N of outputs]); a group's
rows are gathered through `order`, so tokens need not be contiguous per adapter. Shrink keeps the
rank-R intermediate in fp32; expand adds h @ B^T, rounded to y's dtype, into y's column slice in
place (each token row belongs to one group, so no two programs write one element). A program
past its group's end returns at once: the grid is sized by the longest group, known on the host.
fp32 inputs use IEEE dots (no TF32), so the interpreter twin and a CUDA fp32 run match the torch
path to rounding.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagoda.kernels.launch import for_tensor
from pagoda.kernels.reference import LoRASegments

BLOCK_M = 16


@triton.jit
def _shrink_kernel(x, a, h, order, seg_start, seg_slot, stride_x, stride_as, stride_ar, stride_h, K, R,
                   BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr):
    g = tl.program_id(0)
    start = tl.load(seg_start + g)
    end = tl.load(seg_start + g + 1)
    m0 = start + tl.program_id(1) * BLOCK_M
    if m0 < end:
        slot = tl.load(seg_slot + g).to(tl.int64)
        offs_m = m0 + tl.arange(0, BLOCK_M)
        m_ok = offs_m < end
        rows = tl.load(order + offs_m, mask=m_ok, other=0).to(tl.int64)
        offs_r = tl.program_id(2) * BLOCK_R + tl.arange(0, BLOCK_R)
        r_ok = offs_r < R
        acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            k_ok = offs_k < K
            xt = tl.load(x + rows[:, None] * stride_x + offs_k[None, :], mask=m_ok[:, None] & k_ok[None, :],
                         other=0.0)
            at = tl.load(a + slot * stride_as + offs_r[None, :] * stride_ar + offs_k[:, None],
                         mask=k_ok[:, None] & r_ok[None, :], other=0.0)
            if IEEE:
                acc += tl.dot(xt, at, input_precision="ieee")
            else:
                acc += tl.dot(xt, at)
        tl.store(h + rows[:, None] * stride_h + offs_r[None, :], acc, mask=m_ok[:, None] & r_ok[None, :])


@triton.jit
def _expand_kernel(h, b, y, order, seg_start, seg_slot, stride_h, stride_bs, stride_bn, stride_y, offset, N, R,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr):
    g = tl.program_id(0)
    start = tl.load(seg_start + g)
    end = tl.load(seg_start + g + 1)
    m0 = start + tl.program_id(1) * BLOCK_M
    if m0 < end:
        slot = tl.load(seg_slot + g).to(tl.int64)
        offs_m = m0 + tl.arange(0, BLOCK_M)
        m_ok = offs_m < end
        rows = tl.load(order + offs_m, mask=m_ok, other=0).to(tl.int64)
        offs_n = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = offs_n < N
        delta = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for r0 in range(0, R, BLOCK_R):         # large ranks (fused slices stack theirs) in chunks
            offs_r = r0 + tl.arange(0, BLOCK_R)
            r_ok = offs_r < R
            ht = tl.load(h + rows[:, None] * stride_h + offs_r[None, :], mask=m_ok[:, None] & r_ok[None, :],
                         other=0.0)
            bt = tl.load(b + slot * stride_bs + offs_n[None, :] * stride_bn + offs_r[:, None],
                         mask=r_ok[:, None] & n_ok[None, :], other=0.0).to(tl.float32)
            delta += tl.dot(ht, bt, input_precision="ieee")
        ptr = y + rows[:, None] * stride_y + offset + offs_n[None, :]
        mask = m_ok[:, None] & n_ok[None, :]
        old = tl.load(ptr, mask=mask, other=0.0)
        tl.store(ptr, old + delta.to(old.dtype), mask=mask)


def _check(name: str, t: torch.Tensor, dims: int) -> None:
    if t.dim() != dims or t.stride(-1) != 1:
        raise ValueError(f"{name}: expected {dims} dimensions with a contiguous last one (got {tuple(t.shape)})")


def _block(n: int, floor: int = 16, cap: int = 64) -> int:
    """A power-of-two tile for n, at least `floor` (tl.dot's minimum), at most `cap` (registers)."""
    return min(cap, max(floor, triton.next_power_of_2(n)))


def lora_shrink_triton(x: torch.Tensor, a: torch.Tensor, seg: LoRASegments) -> torch.Tensor:
    """As lora_shrink_ref: h [T, R] fp32, x[t] @ A[slot(t)]^T, zero where no adapter."""
    _check("x", x, 2)
    _check("a", a, 3)
    if a.shape[2] != x.shape[1]:
        raise ValueError(f"a: expected [S, R, {x.shape[1]}], got {tuple(a.shape)}")
    t, k = x.shape
    r = a.shape[1]
    h = torch.zeros(t, r, dtype=torch.float32, device=x.device)
    groups = len(seg.host_slot)
    if groups and t:
        block_r = _block(r)
        grid = (groups, triton.cdiv(seg.max_seg_len, BLOCK_M), triton.cdiv(r, block_r))
        for_tensor(_shrink_kernel, x)[grid](
            x, a, h, seg.order, seg.seg_start, seg.seg_slot, x.stride(0), a.stride(0), a.stride(1), h.stride(0),
            k, r, BLOCK_M=BLOCK_M, BLOCK_R=block_r, BLOCK_K=_block(k, 32), IEEE=x.dtype == torch.float32)
    return h


def lora_expand_triton(h: torch.Tensor, b: torch.Tensor, seg: LoRASegments, y: torch.Tensor,
                       offset: int = 0) -> None:
    """As lora_expand_ref: y[t, offset:offset + N] += h[t] @ B[slot(t)]^T, in place."""
    _check("h", h, 2)
    _check("b", b, 3)
    _check("y", y, 2)
    n, r = b.shape[1], b.shape[2]
    if h.shape[1] != r or offset + n > y.shape[1] or h.shape[0] != y.shape[0]:
        raise ValueError(f"b: [S, {n}, {r}] does not fit h {tuple(h.shape)} and y {tuple(y.shape)} at offset {offset}")
    groups = len(seg.host_slot)
    if groups and y.shape[0]:
        block_n = _block(n)
        grid = (groups, triton.cdiv(seg.max_seg_len, BLOCK_M), triton.cdiv(n, block_n))
        for_tensor(_expand_kernel, y)[grid](
            h, b, y, seg.order, seg.seg_start, seg.seg_slot, h.stride(0), b.stride(0), b.stride(1), y.stride(0),
            offset, n, r, BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_R=_block(r))
