"""Linears of a few rows on a CPU: kernels/csrc/gemv_cpu.c through the CPU kernels' library.

A decode step of one to GEMV_MAX_M sequences multiplies each weight by that many rows: it is a
stream of the weights from memory. oneDNN's and MKL's GEMMs pack and block for large batches
and read the weights at about half of what this machine's memory gives one thread
(bench/cpu_forward.py); gemv_cpu.c reads them at memory speed, on the kernels' thread pool.
fp32, bf16 or fp16: a bf16/fp16 weight is read as it is (half the bytes of fp32) and summed in
fp32. Larger batches stay with dense_linear's GEMM.
"""
from __future__ import annotations

import torch

from pagoda.kernels.cpu_lib import GEMV_MAX_M, KINDS, kernel_threads, load_library


def takes(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether small_linear computes this call: 1..GEMV_MAX_M contiguous CPU rows, weight and
    bias all fp32, all bf16 or all fp16."""
    return (x.dim() == 2 and 0 < x.shape[0] <= GEMV_MAX_M and x.dtype in KINDS
            and weight.dtype == x.dtype and x.device.type == "cpu" and weight.device.type == "cpu"
            and x.is_contiguous() and weight.is_contiguous() and weight.dim() == 2
            and x.shape[1] == weight.shape[1]
            and (bias is None or (bias.dtype == x.dtype and bias.is_contiguous()
                                  and bias.shape == (weight.shape[0],)))
            and load_library() is not None)


def small_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight.T (+ bias) for what takes() accepts, in x's dtype; no autograd."""
    m, k = x.shape
    n = weight.shape[0]
    y = torch.empty((m, n), dtype=x.dtype)
    rc = load_library().gemv_cpu(  # type: ignore[union-attr]
        x.data_ptr(), k, weight.data_ptr(), k, None if bias is None else bias.data_ptr(),
        y.data_ptr(), n, m, k, n, kernel_threads(), KINDS[x.dtype])
    if rc:
        raise (MemoryError if rc == 2 else RuntimeError)(
            f"gemv_cpu: kernel refused the shapes {tuple(x.shape)} x {tuple(weight.shape)} ({x.dtype})")
    return y
