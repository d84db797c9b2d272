"""Optional fused small ops for the model path: residual add + RMSNorm, and rotary embedding.

Same contracts as pagoda.kernels.reference.add_rms_norm_ref / rotary_ref. Each replaces a chain of
elementwise torch ops (several kernel launches and round trips through memory per layer) with
one pass; whether that matters is for bench/gpu_kernels.py on a GPU to show.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagoda.kernels.launch import for_tensor


@triton.jit
def _add_rms_norm_kernel(x, residual, weight, out, res_out, stride_x, stride_r, stride_o, stride_ro,
                         n_cols, eps, HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    h = tl.load(x + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        # Summed in the activation dtype, as the unfused model does, so both round alike.
        h = h + tl.load(residual + row * stride_r + cols, mask=mask, other=0.0)
        tl.store(res_out + row * stride_ro + cols, h, mask=mask)
    hf = h.to(tl.float32)
    inv = tl.rsqrt(tl.sum(hf * hf, 0) / n_cols + eps)
    normed = (hf * inv).to(x.dtype.element_ty)
    w = tl.load(weight + cols, mask=mask, other=0.0)
    tl.store(out + row * stride_o + cols, (w * normed).to(out.dtype.element_ty), mask=mask)


def add_rms_norm_triton(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                        eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(RMSNorm(x + residual), x + residual) for x [T, H]; residual None: plain RMSNorm."""
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError("x: expected [T, H] with contiguous rows")
    if residual is not None and (residual.shape != x.shape or residual.stride(1) != 1):
        raise ValueError(f"residual: expected shape {tuple(x.shape)} with contiguous rows")
    if weight.shape != (x.shape[1],):
        raise ValueError(f"weight: expected [{x.shape[1]}], got {tuple(weight.shape)}")
    out = torch.empty(x.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    if residual is None:
        res_out, res_in = x, x
    else:
        res_out, res_in = torch.empty_like(x), residual
    if x.shape[0]:
        for_tensor(_add_rms_norm_kernel, x)[(x.shape[0],)](
            x, res_in, weight, out, res_out, x.stride(0), res_in.stride(0), out.stride(0),
            res_out.stride(0), x.shape[1], eps, HAS_RESIDUAL=residual is not None,
            BLOCK=triton.next_power_of_2(x.shape[1]), num_warps=8 if x.shape[1] >= 4096 else 4)
    return out, res_out


@triton.jit
def _rotate_heads(x, t, stride_t, stride_h, num_heads, c, s,
                  HALF: tl.constexpr, HALF_PAD: tl.constexpr, HEADS_PAD: tl.constexpr):
    h = tl.arange(0, HEADS_PAD)[:, None]
    i = tl.arange(0, HALF_PAD)[None, :]
    mask = (h < num_heads) & (i < HALF)
    ptr = x + t * stride_t + h * stride_h + i
    x1 = tl.load(ptr, mask=mask, other=0.0)
    x2 = tl.load(ptr + HALF, mask=mask, other=0.0)
    # Products rounded to the activation dtype before the sum, as the unfused model does.
    tl.store(ptr, (x1 * c).to(x1.dtype) - (x2 * s).to(x1.dtype), mask=mask)
    tl.store(ptr + HALF, (x2 * c).to(x1.dtype) + (x1 * s).to(x1.dtype), mask=mask)


@triton.jit
def _rotary_kernel(positions, q, k, cos, sin, stride_qt, stride_qh, stride_kt, stride_kh, stride_cos,
                   num_q_heads, num_kv_heads, HALF: tl.constexpr, HALF_PAD: tl.constexpr,
                   HEADS_PAD: tl.constexpr):
    # One program per token rotates all its q and k heads in place with one cos/sin row.
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions + t).to(tl.int64)
    i = tl.arange(0, HALF_PAD)
    i_ok = i < HALF
    c = tl.load(cos + pos * stride_cos + i, mask=i_ok, other=0.0).to(q.dtype.element_ty)[None, :]
    s = tl.load(sin + pos * stride_cos + i, mask=i_ok, other=0.0).to(q.dtype.element_ty)[None, :]
    _rotate_heads(q, t, stride_qt, stride_qh, num_q_heads, c, s, HALF, HALF_PAD, HEADS_PAD)
    _rotate_heads(k, t, stride_kt, stride_kh, num_kv_heads, c, s, HALF, HALF_PAD, HEADS_PAD)


def rotary_triton(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                  sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q [T, Hq, D] and k [T, Hkv, D] in place by position; returns (q, k).

    cos/sin: [max_positions, D] fp32 tables whose two halves are equal (only the first is read).
    """
    num_tokens, num_q_heads, head_dim = q.shape
    if k.shape[0] != num_tokens or k.shape[2] != head_dim or head_dim % 2:
        raise ValueError(f"k: expected [{num_tokens}, Hkv, {head_dim}] with an even head_dim")
    if q.stride(2) != 1 or k.stride(2) != 1 or cos.stride(1) != 1 or cos.stride() != sin.stride():
        raise ValueError("q/k/cos/sin: the last axis must be contiguous, cos and sin alike")
    if positions.shape != (num_tokens,):
        raise ValueError(f"positions: expected [{num_tokens}], got {tuple(positions.shape)}")
    if num_tokens:
        half = head_dim // 2
        for_tensor(_rotary_kernel, q)[(num_tokens,)](
            positions, q, k, cos, sin, q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos.stride(0),
            num_q_heads, k.shape[1], HALF=half, HALF_PAD=triton.next_power_of_2(half),
            HEADS_PAD=triton.next_power_of_2(max(num_q_heads, k.shape[1])))
    return q, k
