"""Megatron-style sharding of the Llama-family layers over tensor-parallel ranks.

Column-parallel: q/k/v and gate/up keep only this rank's output rows (its attention heads, its
slice of the intermediate size), so attention and the activation need no communication.
Row-parallel: o_proj and down_proj keep the matching input columns and sum their partial outputs
with one all-reduce each. The vocabulary is split in contiguous ranges: the embedding looks up
the ids in its range and all-reduces (other rows are zero), the LM head computes its range of
logits and rank 0 gathers them. KV heads split like the query heads when they divide by the
rank count; when there are fewer KV heads than ranks each rank holds the one KV head its query
heads read (replicated).

Layers learn their rank and size when built, inside `sharding(rank, size)`, and keep them: no
global is read in a forward, so unsharded models can live beside a group in one process. At one
rank every layer computes exactly what an unsharded nn.Linear / nn.Embedding would.
The loader asks `shard_slice` which slice of each checkpoint tensor this rank reads.
"""
from __future__ import annotations

import contextlib
import functools
import os
import weakref
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from pagoda.kernels import cpu_gemm, cpu_gemv, cpu_lib
from pagoda.kernels.cpu_lib import GEMV_MAX_M

CPU_GEMMS = ("auto", "onednn", "torch")


def _cpu_gemm() -> str:
    """How fp32 CPU linears are computed (PAGODA_CPU_GEMM): auto (the default) takes
    kernels/cpu_gemv.py for 1-8 rows and kernels/cpu_gemm.py above, both on the CPU kernels'
    thread pool; onednn takes oneDNN's matmul for every batch (on torch's OpenMP threads); torch
    takes F.linear (MKL's sgemm in the PyPI build)."""
    choice = os.environ.get("PAGODA_CPU_GEMM", "auto")
    if choice not in CPU_GEMMS:
        raise ValueError(f"PAGODA_CPU_GEMM: must be one of {', '.join(CPU_GEMMS)} (got {choice!r})")
    if choice == "onednn" and not (torch.backends.mkldnn.is_available()
                                   and hasattr(torch.ops.mkldnn, "_linear_pointwise")):
        return "torch"
    return choice


_CPU_GEMM = _cpu_gemm()
_ONEDNN = _CPU_GEMM == "onednn"
_POOL = _CPU_GEMM == "auto"
# The step's GEMMs run on the kernels' pool: its threads may spin from one kernel to the next.
cpu_lib.set_spin_always(_POOL)


def dense_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear, for 2-D fp32 rows on a CPU through the CPU kernels' library: kernels/cpu_gemv.py
    when there are at most 8 of them (a decode step of a few sequences streams the weights: 1.8x
    faster than oneDNN at one row here, bench/cpu_forward.py) and kernels/cpu_gemm.py above (a
    model's weights packed once, _packed); PAGODA_CPU_GEMM=onednn puts every batch on oneDNN's
    fp32 matmul instead. All are IEEE fp32; results differ from F.linear's in the last bits, as
    any other blocking of the sum would. Anything else, or with autograd recording, is F.linear."""
    if ((_POOL or _ONEDNN) and x.dim() == 2 and x.device.type == "cpu" and x.dtype == torch.float32
            and weight.dtype == torch.float32 and x.is_contiguous() and weight.is_contiguous()
            and not (torch.is_grad_enabled() and (weight.requires_grad or x.requires_grad))):
        if _POOL:
            if x.shape[0] <= GEMV_MAX_M and cpu_gemv.takes(x, weight, bias):
                return cpu_gemv.small_linear(x, weight, bias)
            if cpu_gemm.takes(x, weight, bias):
                packed = _packed(weight, cpu_gemm.pack) if isinstance(weight, nn.Parameter) \
                    else cpu_gemm.pack(weight)
                return cpu_gemm.linear(x, packed, weight.shape[0], bias)
            return F.linear(x, weight, bias)
        if isinstance(weight, nn.Parameter):
            weight = _packed(weight, _onednn_layout)
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return F.linear(x, weight, bias)


def _onednn_layout(weight: torch.Tensor) -> torch.Tensor:
    """`weight` reordered into oneDNN's blocked layout (oneDNN otherwise reorders it on every
    call: 7-10% of a large-batch CPU run of bench/vs_vllm.py's greedy workload)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 256)


# A model's weights in a GEMM's layout, made at first use: (id(parameter), the packing) -> (a
# weak reference to it, its version then, the packed copy). The entry goes with the parameter;
# a weight written in place since is packed again.
_packs: dict[tuple[int, Callable], tuple[weakref.ref, int, torch.Tensor]] = {}


def _forget_packed(key: tuple[int, Callable], _ref: object) -> None:
    _packs.pop(key, None)


def _packed(weight: torch.Tensor, pack: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """`weight` packed by `pack`, once. The plain weight stays for the small-batch kernel and
    everything else: a CPU model's linear weights are held twice."""
    key = (id(weight), pack)
    hit = _packs.get(key)
    if hit is None or hit[0]() is not weight or hit[1] != weight._version:
        hit = (weakref.ref(weight, functools.partial(_forget_packed, key)), weight._version, pack(weight))
        _packs[key] = hit
    return hit[2]


class Linear(nn.Linear):
    """nn.Linear computed by dense_linear."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return dense_linear(x, self.weight, self.bias)


@dataclass(frozen=True)
class Shard:
    rank: int = 0
    size: int = 1


_building = Shard()


@contextlib.contextmanager
def sharding(shard: Shard):
    """Layers built inside take this rank and size."""
    global _building
    previous, _building = _building, shard
    try:
        yield
    finally:
        _building = previous


def current_shard() -> Shard:
    return _building


def kv_heads_of(cfg) -> int:
    return getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads


def head_dim_of(cfg) -> int:
    return getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads


def local_heads(cfg, shard: Shard) -> tuple[int, int]:
    """(query heads, KV heads) held by one rank."""
    return cfg.num_attention_heads // shard.size, max(kv_heads_of(cfg) // shard.size, 1)


def shard_slice(cfg, name: str, shard: Shard) -> tuple[int, int, int] | None:
    """(dim, start, length) of checkpoint tensor `name` that `shard` loads, or None for all of it."""
    if shard.size == 1:
        return None
    r, n = shard.rank, shard.size
    parts = name.split(".")
    module, leaf = (parts[-2], parts[-1]) if len(parts) >= 2 else ("", name)
    d = head_dim_of(cfg)
    if module in ("embed_tokens", "lm_head"):
        per = cfg.vocab_size // n
        return 0, r * per, per
    if module == "q_proj":
        per = cfg.num_attention_heads // n * d
        return 0, r * per, per
    if module in ("k_proj", "v_proj"):
        kv = kv_heads_of(cfg)
        if kv % n == 0:
            return 0, r * (kv // n) * d, (kv // n) * d
        return 0, (r * kv // n) * d, d       # fewer KV heads than ranks: the one this rank's queries read
    if module in ("gate_proj", "up_proj"):
        per = cfg.intermediate_size // n
        return 0, r * per, per
    if module == "o_proj" and leaf == "weight":
        per = cfg.num_attention_heads // n * d
        return 1, r * per, per
    if module == "down_proj" and leaf == "weight":
        per = cfg.intermediate_size // n
        return 1, r * per, per
    return None     # norms, row-parallel biases: every rank holds them whole


# The model's collectives, over the default group (runner/distributed.py forms it).
def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum x over the ranks in place (row-parallel outputs, vocab-parallel embeddings)."""
    dist.all_reduce(x)
    return x


def gather_last_dim(x: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    """Concatenate every rank's x along the last dim on rank 0 (vocab-parallel logits); other ranks
    get their own x back, which they do not use."""
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(size)] if rank == 0 else None
    dist.gather(x, parts, dst=0)
    return torch.cat(parts, dim=-1) if parts is not None else x


class RowParallelLinear(nn.Module):
    """y = x_local @ W_local^T summed over ranks, then the (replicated) bias."""

    def __init__(self, in_features: int, out_features: int, bias: bool):
        super().__init__()
        self.shard = current_shard()
        self.weight = nn.Parameter(torch.empty(out_features, in_features // self.shard.size))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.shard.size == 1:
            return dense_linear(x, self.weight, self.bias)
        y = all_reduce(dense_linear(x, self.weight))
        return y + self.bias if self.bias is not None else y


class VocabParallelEmbedding(nn.Module):
    """Each rank holds vocab_size / N contiguous rows; ids outside them contribute zeros."""

    def __init__(self, vocab_size: int, hidden: int):
        super().__init__()
        self.shard = current_shard()
        self.per_rank = vocab_size // self.shard.size
        self.start = self.shard.rank * self.per_rank
        self.weight = nn.Parameter(torch.empty(self.per_rank, hidden))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.shard.size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.start
        outside = (local < 0) | (local >= self.per_rank)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        return all_reduce(out.masked_fill(outside.unsqueeze(-1), 0))


def parallel_logits(hidden: torch.Tensor, weight: torch.Tensor, shard: Shard) -> torch.Tensor:
    """fp32 logits over the whole vocabulary on rank 0 (each rank computes its vocab range)."""
    logits = dense_linear(hidden, weight)
    if shard.size > 1:
        logits = gather_last_dim(logits, shard.rank, shard.size)
    return logits.float()
