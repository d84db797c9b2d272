"""Plain-torch quantized-weight matmuls: the CPU path, and the oracle the CUDA paths are tested against.

Two weight layouts, whatever format the checkpoint came in (gpu_worker/features/quantization.py converts):
- fp8 (e4m3): weight [N, K] fp8 with fp32 scales, per output channel [N] or per block
  [ceil(N / bn), ceil(K / bk)] (block (i, j) covers rows i*bn.., columns j*bk..).
  W = fp8 * scale.
- int4: qweight int32 [K / 8, N], eight 4-bit values of consecutive input rows per word (row
  8i + j in bits 4j..4j+3: GPTQ's packing); zeros uint8 [G, N], the integer zero point of each
  group and output column; scales [G, N]; g_idx int32 [K], the group of each input row.
  W[n, k] = (q[k, n] - zeros[g_idx[k], n]) * scales[g_idx[k], n].

Every dequantisation is computed in fp32 and cast to the activation dtype once, so that a model
built from the dequantized weights (the tests' reference) holds exactly the same numbers and an
fp32 forward on CPU reproduces it bit for bit.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from pagoda.kernels.fp8 import FP8_DTYPE, FP8_MAX

_TINY = 1e-12     # floor for a scale: an all-zero row quantises to zeros, not NaN


def quantize_fp8_per_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 [N, K], fp32 scales [N]) with each row's largest magnitude mapped to 448."""
    scale = (w.float().abs().amax(dim=1) / FP8_MAX).clamp(min=_TINY)
    q = (w.float() / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale


def dequantize_fp8_weight(q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None = None,
                          dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """W [N, K] from fp8 and its per-channel scales [N] (block None) or block scales."""
    w = q.float()
    if block is None:
        return (w * scale.float().reshape(-1, 1)).to(dtype)
    bn, bk = block
    n, k = w.shape
    s = scale.float().repeat_interleave(bn, dim=0)[:n].repeat_interleave(bk, dim=1)[:, :k]
    return (w * s).to(dtype)


def fp8_linear_ref(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
                   block: tuple[int, int] | None = None) -> torch.Tensor:
    """x @ W^T + bias with W dequantized (weight-only: activations stay in their dtype)."""
    return F.linear(x, dequantize_fp8_weight(q, scale, block, x.dtype), bias)


def quantize_fp8_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 [M, K], fp32 scales [M, 1]): the dynamic activation quantisation of the CUDA path."""
    scale = (x.float().abs().amax(dim=-1, keepdim=True) / FP8_MAX).clamp(min=_TINY)
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale


def fp8_w8a8_ref(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """What torch._scaled_mm computes on CUDA (per-token fp8 activations, per-channel fp8
    weights, fp32 accumulation), in plain torch: the oracle of the GPU test."""
    xq, xs = quantize_fp8_per_token(x.reshape(-1, x.shape[-1]))
    out = (xq.float() @ q.float().t()) * xs * scale.float().reshape(1, -1)
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype).reshape(*x.shape[:-1], q.shape[0])


def unpack_int4_rows(qweight: torch.Tensor) -> torch.Tensor:
    """int32 [K / 8, N] -> int32 [K, N] values 0..15 (row 8i + j from bits 4j..4j+3)."""
    shifts = torch.arange(0, 32, 4, device=qweight.device, dtype=torch.int32)
    q = (qweight.unsqueeze(1) >> shifts.view(1, 8, 1)) & 0xF
    return q.reshape(-1, qweight.shape[1])


def pack_int4_rows(q: torch.Tensor) -> torch.Tensor:
    """int [K, N] values 0..15 -> int32 [K / 8, N]: the inverse of unpack_int4_rows."""
    k, n = q.shape
    if k % 8:
        raise ValueError(f"pack_int4_rows: {k} rows is not a multiple of 8")
    q = q.to(torch.int64).reshape(k // 8, 8, n)
    shifts = torch.arange(0, 32, 4, device=q.device, dtype=torch.int64).view(1, 8, 1)
    word = (q << shifts).sum(dim=1)
    # Two's complement: the top nibble's bit 31 is the int32 sign bit.
    return torch.where(word >= 2**31, word - 2**32, word).to(torch.int32)


def dequantize_int4_weight(qweight: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor,
                           g_idx: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """W [N, K] from the int4 layout of the module docstring."""
    q = unpack_int4_rows(qweight)                         # [K, N]
    k, n = q.shape
    groups = zeros.shape[0]
    if k % groups == 0 and torch.equal(g_idx, _contiguous_groups(k, groups, g_idx.device)):
        # Contiguous groups (no act order): broadcast each group's row of zeros and scales
        # instead of gathering K rows; the same arithmetic, so the same numbers.
        qg = q.view(groups, k // groups, n)
        w = ((qg - zeros.to(torch.int32).unsqueeze(1)).float() * scales.float().unsqueeze(1)).view(k, n)
    else:
        g = g_idx.long()
        w = (q - zeros[g].to(torch.int32)).float() * scales[g].float()
    return w.t().to(dtype).contiguous()   # as a model stores it: the GEMM then rounds the same


def _contiguous_groups(k: int, groups: int, device) -> torch.Tensor:
    return torch.arange(k, device=device, dtype=torch.int32) // (k // groups)


def int4_linear_ref(x: torch.Tensor, qweight: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor,
                    g_idx: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ W^T + bias with W dequantized (weight-only)."""
    return F.linear(x, dequantize_int4_weight(qweight, zeros, scales, g_idx, x.dtype), bias)
