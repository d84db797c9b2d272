"""A decoder layer's elementwise parts on a CPU: RMSNorm with its residual add, rotary
embedding, the KV-cache write and SiLU(gate) * up, each one call into csrc/small_ops_cpu.c (the
CPU kernels' library, kernels/cpu_lib.py) instead of a chain of torch ops: one pass over the rows
instead of four to eight, no per-op dispatch, rows split over the kernels' thread pool.

Same contracts as pagoda.kernels.reference's add_rms_norm_ref, rotary_ref (here in place, as the Triton
twin), write_kv_cache_ref, and F.silu(gate) * up. fp32, bf16 or fp16 rows on the CPU (one dtype
per call; rotary's cos/sin tables fp32) with a contiguous last dimension, computed in fp32 and
rounded once (RMSNorm rounds where the reference does); anything else goes to the reference.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from pagoda.kernels.cpu_lib import KINDS, kernel_threads, load_library
from pagoda.kernels.reference import add_rms_norm_ref, rotary_ref, write_kv_cache_ref


def _same_cpu(*ts: torch.Tensor) -> bool:
    """All on the CPU, of one dtype the kernels take."""
    return ts[0].dtype in KINDS and all(t.dtype == ts[0].dtype and t.device.type == "cpu" for t in ts)


def add_rms_norm_cpu(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """add_rms_norm_ref's (RMSNorm(x + residual), x + residual)."""
    rows = (x,) if residual is None else (x, residual)
    if not (x.dim() == 2 and _same_cpu(*rows, weight)
            and all(r.stride(-1) == 1 for r in rows) and weight.is_contiguous()
            and (residual is None or residual.shape == x.shape) and load_library() is not None):
        return add_rms_norm_ref(x, residual, weight, eps)
    t, d = x.shape
    out = torch.empty((t, d), dtype=x.dtype)
    h = x if residual is None else torch.empty((t, d), dtype=x.dtype)
    load_library().add_rms_norm_f32(  # type: ignore[union-attr]
        x.data_ptr(), x.stride(0), None if residual is None else residual.data_ptr(),
        0 if residual is None else residual.stride(0), weight.data_ptr(), eps, out.data_ptr(), d,
        h.data_ptr(), d, t, d, KINDS[x.dtype], kernel_threads())
    return out, h


def rotary_cpu(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
               sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """rotary_ref's rotated (q, k), computed in place."""
    if not (q.dim() == 3 and k.dim() == 3 and _same_cpu(q, k) and _same_cpu(cos, sin) and cos.dtype == torch.float32
            and q.stride(-1) == 1 and k.stride(-1) == 1 and cos.is_contiguous() and sin.is_contiguous()
            and positions.device.type == "cpu" and q.shape[-1] % 2 == 0 and q.shape[-1] <= 1024
            and cos.shape == sin.shape and cos.shape[-1] == q.shape[-1] and load_library() is not None):
        return rotary_ref(positions, q, k, cos, sin)
    pos = positions if positions.dtype == torch.int64 and positions.is_contiguous() \
        else positions.to(torch.int64).contiguous()
    rc = load_library().rotary_neox_f32(  # type: ignore[union-attr]
        pos.data_ptr(), q.data_ptr(), q.stride(0), q.stride(1), q.shape[1], k.data_ptr(), k.stride(0),
        k.stride(1), k.shape[1], cos.data_ptr(), sin.data_ptr(), cos.stride(0), cos.shape[0],
        q.shape[0], q.shape[-1], KINDS[q.dtype], kernel_threads())
    if rc:
        raise IndexError(f"positions: outside the rotary table's {cos.shape[0]} positions")
    return q, k


def write_kv_cache_cpu(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                       v_cache: torch.Tensor, slot_mapping: torch.Tensor, *, k_scale: float = 1.0,
                       v_scale: float = 1.0) -> None:
    """write_kv_cache_ref's scatter of key/value [T, Hkv, D] to slot_mapping (-1: skipped)."""
    if not (_same_cpu(key, value, k_cache, v_cache)
            and key.stride(-1) == value.stride(-1) == k_cache.stride(-1) == v_cache.stride(-1) == 1
            and slot_mapping.dtype == torch.int64 and slot_mapping.is_contiguous()
            and slot_mapping.device.type == "cpu" and load_library() is not None):
        return write_kv_cache_ref(key, value, k_cache, v_cache, slot_mapping, k_scale=k_scale, v_scale=v_scale)
    rc = load_library().write_kv_f32(  # type: ignore[union-attr]
        key.data_ptr(), key.stride(0), key.stride(1), value.data_ptr(), value.stride(0), value.stride(1),
        k_cache.data_ptr(), *k_cache.stride()[:3], v_cache.data_ptr(), *v_cache.stride()[:3],
        slot_mapping.data_ptr(), k_cache.shape[0] * k_cache.shape[1], key.shape[0], key.shape[1],
        key.shape[2], k_cache.shape[1], KINDS[key.dtype], kernel_threads())
    if rc:
        raise IndexError(f"slot_mapping: a slot past the cache's {k_cache.shape[0] * k_cache.shape[1]} slots")


def silu_mul_cpu(gate_up: torch.Tensor) -> torch.Tensor:
    """F.silu(gate) * up of gate_up [T, 2I] = cat(gate, up), as one pass: [T, I]."""
    t, two_i = gate_up.shape
    if not (gate_up.dim() == 2 and two_i % 2 == 0 and _same_cpu(gate_up) and gate_up.stride(-1) == 1
            and load_library() is not None):
        gate, up = gate_up.split(two_i // 2, dim=-1)
        return F.silu(gate) * up
    out = torch.empty((t, two_i // 2), dtype=gate_up.dtype)
    load_library().silu_mul_f32(  # type: ignore[union-attr]
        gate_up.data_ptr(), gate_up.stride(0), out.data_ptr(), two_i // 2, t, two_i // 2, KINDS[gate_up.dtype],
        kernel_threads())
    return out
