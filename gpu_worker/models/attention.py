"""Paged attention layer: write a step's K/V into the block pool by slot mapping, then attend.

The backend is picked once per model from config.attention_backend: "cpu" reads K/V in place
from the pool with kernels/cpu_attention.py (a C kernel built at start; it falls back to the
reference by itself for what it does not take, fp8 pools among them), "torch" uses the
pagoda.kernels.reference functions (the exact oracle, always available), "triton" the Triton kernels
(imported lazily), "auto" Triton on CUDA and cpu elsewhere.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn

from pagoda.kernels import cpu_attention
from pagoda.kernels.cpu_ops import write_kv_cache_cpu
from pagoda.kernels.reference import paged_attention_ref, write_kv_cache_ref


@dataclass
class AttentionMetadata:
    """The flat step as every attention layer sees it (see kernels/reference.py for the layout)."""
    slot_mapping: torch.Tensor      # [T] int64, -1 = do not write
    block_tables: torch.Tensor      # [S, max_blocks] int32
    seq_lens: torch.Tensor          # [S] int32, context length including this step's tokens
    query_start_loc: torch.Tensor   # [S + 1] int32
    # Longest seq_lens entry, known on the host when the step is built: split-KV sizes its
    # segments from it (None: assume the longest possible context).
    max_seq_len: int | None = None
    # What a backend works out from the step once and reuses in every layer (the CPU kernel's
    # work list and shared-prefix groups); lives as long as this object, one step.
    memo: dict = field(default_factory=dict)


BACKENDS = ("auto", "cpu", "torch", "triton")


def resolve_backend(name: str, device: torch.device) -> str:
    """auto -> triton on CUDA, cpu elsewhere; the model's fused ops follow the same choice."""
    if name == "auto":
        return "triton" if device.type == "cuda" else "cpu"
    return name


def select_backend(name: str, device: torch.device) -> tuple[Callable, Callable]:
    """(write_kv_cache, paged_attention) for a backend name and the device it runs on."""
    name = resolve_backend(name, device)
    if name == "torch":
        return write_kv_cache_ref, paged_attention_ref
    if name == "cpu":
        # Built now, during start-up, not in the first step; without a compiler this warns once
        # and every call takes the reference.
        cpu_attention.available()
        return write_kv_cache_cpu, cpu_attention.paged_attention_cpu
    if name == "triton":
        # Off CUDA the kernels run under Triton's interpreter (kernels/launch.py): exact but
        # slow, for the CPU twins of the GPU tests.
        from pagoda.kernels.triton_attention import paged_attention_triton  # lazy: triton, only with its backend
        from pagoda.kernels.triton_cache import write_kv_cache_triton  # lazy: triton, only with its backend
        return write_kv_cache_triton, paged_attention_triton
    raise ValueError(f"attention_backend: must be one of {', '.join(BACKENDS)} (got {name!r})")


class PagedAttention(nn.Module):
    """Attention over the paged KV cache; holds this layer's cache views, not the pool itself.

    sliding_window / softcap / sinks: this layer's attention features (kernels/reference.py),
    fixed per layer; forward's keywords override them per call (the transformers backend passes
    what the modeling code asks for).
    """

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                 sliding_window: int | None = None, softcap: float | None = None):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = scale
        self.sliding_window, self.softcap = sliding_window, softcap
        self.k_cache: torch.Tensor | None = None
        self.v_cache: torch.Tensor | None = None
        self.write_fn, self.attend_fn = write_kv_cache_ref, paged_attention_ref
        self.takes_memo = False
        # Per-tensor scales of an fp8 cache (kernels/fp8.py); 1.0 without calibration data.
        self.k_scale = self.v_scale = 1.0

    def bind(self, k_cache: torch.Tensor, v_cache: torch.Tensor,
             write_fn: Callable, attend_fn: Callable) -> None:
        self.k_cache, self.v_cache = k_cache, v_cache
        self.write_fn, self.attend_fn = write_fn, attend_fn
        self.takes_memo = bool(getattr(attend_fn, "takes_memo", False))

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                meta: AttentionMetadata, **features) -> torch.Tensor:
        """q [T, Hq, D], k/v [T, Hkv, D] -> [T, Hq, D]. features: scale, sliding_window,
        softcap, sinks for this call (default: the layer's)."""
        if self.k_cache is None or self.v_cache is None:
            raise RuntimeError("KV cache not allocated: call ModelRunner.allocate_kv_cache first")
        self.write_fn(k, v, self.k_cache, self.v_cache, meta.slot_mapping, k_scale=self.k_scale,
                      v_scale=self.v_scale)
        scale = features.pop("scale", None) or self.scale
        features.setdefault("sliding_window", self.sliding_window)
        features.setdefault("softcap", self.softcap)
        # Only features in use reach the kernel, so plain layers take the plain path.
        used: dict[str, Any] = {name: x for name, x in features.items() if isinstance(x, torch.Tensor) or x}
        if self.takes_memo:
            used["memo"] = meta.memo
        return self.attend_fn(q, self.k_cache, self.v_cache, meta.block_tables, meta.seq_lens,
                              meta.query_start_loc, scale, max_seq_len=meta.max_seq_len,
                              k_scale=self.k_scale, v_scale=self.v_scale, **used)
