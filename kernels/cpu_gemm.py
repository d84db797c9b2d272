"""Linears of more than a few rows on a CPU: kernels/csrc/gemm_cpu.c on the kernels' pool.

The weight is packed once into 16-column panels (pack, cached per parameter by the caller:
pagoda.gpu_worker.models.parallel) and every call multiplies the rows with it in 6 x 16 register tiles
(csrc/gemm_micro.h). At a step's batch sizes this runs as fast as oneDNN's fp32 matmul, and on
the same thread pool as the attention and elementwise kernels: the pool's threads stay awake
from one kernel of a step to the next, where oneDNN's OpenMP threads fell asleep between calls
and each call paid their wake-up (bench/cpu_forward.py). fp32, bf16 or fp16: a bf16/fp16 weight
is packed in its own dtype and each panel slice becomes fp32 in L1 as it is used; sums are fp32.
"""
from __future__ import annotations

import torch

from pagoda.kernels.cpu_lib import KINDS, kernel_threads, load_library


def takes(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether linear() computes this call: 2-D contiguous CPU rows, weight and bias all fp32,
    all bf16 or all fp16."""
    return (x.dim() == 2 and x.shape[0] > 0 and x.dtype in KINDS and weight.dtype == x.dtype
            and x.device.type == "cpu" and weight.device.type == "cpu" and x.is_contiguous()
            and weight.is_contiguous() and weight.dim() == 2 and x.shape[1] == weight.shape[1]
            and weight.shape[0] > 0 and weight.shape[1] > 0
            and (bias is None or (bias.dtype == x.dtype and bias.is_contiguous()
                                  and bias.shape == (weight.shape[0],)))
            and load_library() is not None)


def pack(weight: torch.Tensor) -> torch.Tensor:
    """`weight` [N, K] in gemm_cpu.c's panel layout (a flat tensor of its dtype)."""
    lib = load_library()
    assert lib is not None, "the CPU kernels' library did not build"
    if weight.dtype not in KINDS:
        raise ValueError(f"weight: dtype {weight.dtype} is not one of {', '.join(map(str, KINDS))}")
    n, k = weight.shape
    w = weight.detach().contiguous()
    packed = torch.empty(lib.gemm_packed_size(n, k), dtype=w.dtype)
    lib.gemm_pack(w.data_ptr(), k, n, k, packed.data_ptr(), KINDS[w.dtype])
    return packed


def linear(x: torch.Tensor, packed: torch.Tensor, n: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ W.T (+ bias) for what takes() accepts, W [n, x.shape[1]] given packed, in x's dtype;
    no autograd."""
    m, k = x.shape
    if packed.numel() != load_library().gemm_packed_size(n, k) or packed.dtype != x.dtype:  # type: ignore[union-attr]
        raise ValueError(f"packed: not a packed [{n}, {k}] {x.dtype} weight ({packed.numel()} {packed.dtype})")
    y = torch.empty((m, n), dtype=x.dtype)
    rc = load_library().gemm_cpu(  # type: ignore[union-attr]
        x.data_ptr(), k, packed.data_ptr(), None if bias is None else bias.data_ptr(), y.data_ptr(), n,
        m, k, n, kernel_threads(), KINDS[x.dtype])
    if rc:
        raise (MemoryError if rc == 2 else RuntimeError)(
            f"gemm_cpu: kernel refused the shapes {tuple(x.shape)} x [{n}, {k}] ({x.dtype})")
    return y
