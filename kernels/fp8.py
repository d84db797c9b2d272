"""fp8 (e4m3) KV cache: quantise on write, dequantise on read, one scale per tensor.

A cached value x is stored as e4m3(clamp(x / scale, +-448)) and read back as e4m3 * scale. e4m3
keeps 3 mantissa bits (relative error at most 2^-4 after rounding) over a range of +-448, so with
the default scale 1.0 (no calibration data) K/V of ordinary magnitude round-trip within 6.25%.
Casting past 448 would give NaN in torch, hence the clamp. Every e4m3 value is exact in bf16,
fp16 and fp32, so the kernels convert loaded K/V to the query's dtype and fold the scales into
the softmax scale (K) and the output (V): the dot products accumulate in fp32 as before.
"""
from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0


def quantize_fp8(x: torch.Tensor, scale: float) -> torch.Tensor:
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def dequantize_fp8(q: torch.Tensor, scale: float, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return (q.float() * scale).to(dtype)


def kv_cache_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The pool's dtype for --kv-cache-dtype: auto = the model's, fp8 = e4m3."""
    if name == "auto":
        return model_dtype
    if name == "fp8":
        return FP8_DTYPE
    raise ValueError(f"kv_cache_dtype: must be auto or fp8 (got {name!r})")
