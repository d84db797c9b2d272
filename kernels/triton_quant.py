"""Triton dequantize-matmuls: y = x @ W^T with W in the int4 or fp8 layouts of kernels/quant_ref.py.

fp8 (fp8_matmul_triton): e4m3 W [N, K] with block scales [ceil(N / bn), ceil(K / bk)] (per-channel
scales are blocks of 1 x K): each tile is dequantized in fp32, rounded to x's dtype as
dequantize_fp8_weight does, and multiplied with fp32 accumulation (weight-only: the activations
stay in their dtype). It serves block-wise checkpoints (DeepSeek / Qwen3-FP8's 128x128) and the
per-channel layers torch._scaled_mm cannot take (fp16 activations, dims not multiples of 16).

int4 (int4_matmul_triton):

Contract: pagoda.kernels.quant_ref.int4_linear_ref (without bias): x [..., K] in fp32, fp16 or bf16;
qweight int32 [K/8, N] (row 8i + j in bits 4j), zeros uint8 [G, N], scales [G, N] (any float
dtype), g_idx int32 [K]. Each program owns a BLOCK_M x BLOCK_N tile of y and walks K in
BLOCK_K steps: it loads the packed words of its K rows (eight rows share a word), shifts out each
row's nibble, looks up the row's group (g_idx: act-order checkpoints need not have contiguous
groups), and forms (q - zero) * scale in fp32, rounded once to x's dtype exactly as the
reference dequantizes, before one tl.dot with fp32 accumulation. The weight is read from memory
as 4 bits per value, which is the point: decode is bound by weight bytes.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagoda.kernels.launch import for_tensor


@triton.jit(do_not_specialize=["M"])
def _int4_matmul_kernel(x, qweight, zeros, scales, g_idx, out, M, N, K, stride_xm, stride_om,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        IEEE: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = rm < M
    n_ok = rn < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        k_ok = rk < K
        a = tl.load(x + rm[:, None].to(tl.int64) * stride_xm + rk[None, :],
                    mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        wmask = k_ok[:, None] & n_ok[None, :]
        packed = tl.load(qweight + (rk[:, None] // 8).to(tl.int64) * N + rn[None, :], mask=wmask, other=0)
        q = (packed >> ((rk[:, None] % 8) * 4)) & 0xF
        g = tl.load(g_idx + rk, mask=k_ok, other=0).to(tl.int64)
        z = tl.load(zeros + g[:, None] * N + rn[None, :], mask=wmask, other=0).to(tl.int32)
        s = tl.load(scales + g[:, None] * N + rn[None, :], mask=wmask, other=0.0).to(tl.float32)
        w = ((q - z).to(tl.float32) * s).to(a.dtype)
        if IEEE:     # fp32 activations: no TF32 rounding, as the reference computes
            acc += tl.dot(a, w, input_precision="ieee")
        else:
            acc += tl.dot(a, w)
    tl.store(out + rm[:, None].to(tl.int64) * stride_om + rn[None, :], acc.to(out.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


def launch_config(m: int, n: int) -> dict:
    """Tile sizes: decode (a few rows) wants narrow M tiles and many N tiles so every SM streams
    its share of the weight; prefill wants square-ish tiles that reuse each dequantized tile."""
    if m <= 16:
        return {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 64, "num_warps": 4}
    if m <= 64:
        return {"BLOCK_M": 32, "BLOCK_N": 64, "BLOCK_K": 64, "num_warps": 4}
    return {"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 32, "num_warps": 8}


def int4_matmul_triton(x: torch.Tensor, qweight: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor,
                       g_idx: torch.Tensor) -> torch.Tensor:
    """x [..., K] @ W^T -> [..., N] in x's dtype (see the module docstring for the layout)."""
    k = x.shape[-1]
    n = qweight.shape[1]
    if qweight.shape[0] * 8 != k or g_idx.shape[0] != k:
        raise ValueError(f"qweight/g_idx: {tuple(qweight.shape)} / {tuple(g_idx.shape)} do not fit K = {k}")
    if zeros.shape != scales.shape or zeros.shape[1] != n:
        raise ValueError(f"zeros/scales: {tuple(zeros.shape)} / {tuple(scales.shape)} do not fit N = {n}")
    x2 = x.reshape(-1, k)
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return out.reshape(*x.shape[:-1], n)
    cfg = launch_config(m, n)
    grid = (triton.cdiv(m, cfg["BLOCK_M"]), triton.cdiv(n, cfg["BLOCK_N"]))
    for_tensor(_int4_matmul_kernel, x2)[grid](
        x2, qweight, zeros, scales, g_idx, out, m, n, k, x2.stride(0), out.stride(0),
        BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"],
        IEEE=x.dtype == torch.float32, num_warps=cfg["num_warps"])
    return out.reshape(*x.shape[:-1], n)


@triton.jit(do_not_specialize=["M"])
def _fp8_matmul_kernel(x, weight, scales, out, M, N, K, stride_xm, stride_om, stride_sn, SCALE_ROWS, SCALE_COLS,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = rm < M
    n_ok = rn < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        k_ok = rk < K
        a = tl.load(x + rm[:, None].to(tl.int64) * stride_xm + rk[None, :],
                    mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        wmask = k_ok[:, None] & n_ok[None, :]
        # W^T tile [BLOCK_K, BLOCK_N] of the row-major [N, K] weight.
        w8 = tl.load(weight + rn[None, :].to(tl.int64) * K + rk[:, None], mask=wmask, other=0.0)
        s = tl.load(scales + (rn[None, :] // SCALE_ROWS) * stride_sn + rk[:, None] // SCALE_COLS,
                    mask=wmask, other=0.0)
        w = (w8.to(tl.float32) * s).to(a.dtype)
        if IEEE:
            acc += tl.dot(a, w, input_precision="ieee")
        else:
            acc += tl.dot(a, w)
    tl.store(out + rm[:, None].to(tl.int64) * stride_om + rn[None, :], acc.to(out.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


def fp8_matmul_triton(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                      block: tuple[int, int] | None = None) -> torch.Tensor:
    """x [..., K] @ W^T -> [..., N] for e4m3 W [N, K]: fp32 scales per channel [N] (block None) or
    per block [ceil(N / bn), ceil(K / bk)]."""
    n, k = weight.shape
    if x.shape[-1] != k:
        raise ValueError(f"weight: {tuple(weight.shape)} does not fit x's K = {x.shape[-1]}")
    if block is None:
        scales, rows, cols = scale.reshape(n, 1), 1, k
    else:
        rows, cols = block
        scales = scale
        if tuple(scales.shape) != (-(-n // rows), -(-k // cols)):
            raise ValueError(f"scale: {tuple(scales.shape)} does not fit blocks {block} of {(n, k)}")
    scales = scales.float().contiguous()
    x2 = x.reshape(-1, k)
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return out.reshape(*x.shape[:-1], n)
    cfg = launch_config(m, n)
    grid = (triton.cdiv(m, cfg["BLOCK_M"]), triton.cdiv(n, cfg["BLOCK_N"]))
    for_tensor(_fp8_matmul_kernel, x2)[grid](
        x2, weight.contiguous(), scales, out, m, n, k, x2.stride(0), out.stride(0), scales.stride(0), rows, cols,
        BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"],
        IEEE=x.dtype == torch.float32, num_warps=cfg["num_warps"])
    return out.reshape(*x.shape[:-1], n)
