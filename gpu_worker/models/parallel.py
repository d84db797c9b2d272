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
from typing import Callable, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from pagoda.kernels import cpu_gemm, cpu_gemv, cpu_lib, cpu_tune
from pagoda.kernels.cpu_lib import GEMV_MAX_M

CPU_GEMMS = ("auto", "c", "onednn", "torch")
# The implementations a CPU linear can run (kernels/cpu_tune.py times them per shape and bucket):
# the C GEMV (1 to GEMV_MAX_M rows), the C GEMM on a packed weight (both fp32, bf16 or fp16, summed
# in fp32), oneDNN's matmul on a weight in its blocked layout, and F.linear (MKL's sgemm for fp32
# in the PyPI build).
IMPLS = ("gemv", "gemm", "onednn", "torch")


def _cpu_gemm() -> str:
    """How CPU linears are computed (PAGODA_CPU_GEMM): auto (the default) takes, per linear shape
    and row bucket, whichever implementation tune_linears timed fastest at model load (untuned
    shapes: c); c forces the C kernels, kernels/cpu_gemv.py for 1-8 rows and kernels/cpu_gemm.py
    above, both on the CPU kernels' thread pool (fp32, bf16, fp16); onednn forces oneDNN's
    matmul for every batch (on torch's OpenMP threads; F.linear where oneDNN lacks the dtype on
    this CPU); torch forces F.linear."""
    choice = os.environ.get("PAGODA_CPU_GEMM", "auto")
    if choice not in CPU_GEMMS:
        raise ValueError(f"PAGODA_CPU_GEMM: must be one of {', '.join(CPU_GEMMS)} (got {choice!r})")
    if choice == "onednn" and not (torch.backends.mkldnn.is_available()
                                   and hasattr(torch.ops.mkldnn, "_linear_pointwise")):
        return "torch"
    return choice


_CPU_GEMM = _cpu_gemm()
_ONEDNN = _CPU_GEMM == "onednn"
_POOL = _CPU_GEMM in ("auto", "c")
# The step's GEMMs run on the kernels' pool: its threads may spin from one kernel to the next.
# In auto, run_linear follows what runs each large linear: the pool's GEMM turns the spin on,
# oneDNN or F.linear (OpenMP's threads) turn it off; tune_linears keeps one family per row bucket.
cpu_lib.set_spin_always(_POOL)
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# (out features, in features, dtype) -> the implementation per bucket of cpu_tune.BUCKETS.
Choices = dict[tuple[int, int, torch.dtype], tuple[str, ...]]
_choices: Choices = {}
_generation = 0         # bumped whenever _choices changes (tuning_generation)


@functools.lru_cache(maxsize=None)
def onednn_takes(dtype: torch.dtype) -> bool:
    """Whether oneDNN's prepacked matmul runs `dtype` on this CPU (bf16 and fp16 need AVX-512 or
    AVX-NE-CONVERT; the reorder says so by refusing)."""
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")):
        return False
    try:
        w = torch.ops.mkldnn._reorder_linear_weight(torch.ones(16, 16, dtype=dtype), 1)
        torch.ops.mkldnn._linear_pointwise(torch.ones(1, 16, dtype=dtype), w, None, "none", [], "")
    except RuntimeError:
        return False
    return True


def _bucket(rows: int) -> int:
    return 0 if rows <= 1 else 1 if rows <= 8 else 2 if rows <= 64 else 3     # cpu_tune.bucket_index


def _impl(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> str:
    """Which of IMPLS computes this call (one that takes it)."""
    if _CPU_GEMM == "auto":
        picked = _choices.get((weight.shape[0], weight.shape[1], x.dtype))
        if picked is not None:
            impl = picked[_bucket(x.shape[0])]
            if impl == "torch" or (impl == "onednn" and onednn_takes(x.dtype)) \
                    or (impl == "gemm" and cpu_gemm.takes(x, weight, bias)) \
                    or (impl == "gemv" and cpu_gemv.takes(x, weight, bias)):
                return impl
    elif _CPU_GEMM == "onednn":
        return "onednn" if onednn_takes(x.dtype) else "torch"
    elif _CPU_GEMM == "torch":
        return "torch"
    return _default_name(x, weight, bias)


def impl_for(rows: int, weight: torch.Tensor, bias: torch.Tensor | None) -> str:
    """Which of IMPLS dense_linear runs for `rows` rows of input against `weight` (CPU, no
    autograd) as things stand: its answer changes only when tuning_generation() does."""
    return _impl(torch.empty(rows, weight.shape[1], dtype=weight.dtype), weight, bias)


def gemm_packed(weight: torch.Tensor) -> torch.Tensor:
    """`weight` in the C GEMM's panel layout (kernels/cpu_gemm.py), packed once and kept."""
    return _packed(weight, cpu_gemm.pack)


def tuning_generation() -> int:
    """A number that changes whenever tune_linears changes a choice."""
    return _generation


def run_linear(impl: str, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight.T (+ bias) by one of IMPLS, which must take the call (dense_linear's checks)."""
    if impl == "gemv":
        return cpu_gemv.small_linear(x, weight, bias)
    if impl == "gemm":
        if not cpu_lib._spin_always:      # a large step on the pool: its threads spin kernel to kernel
            cpu_lib.set_spin_always(True)
        packed = _packed(weight, cpu_gemm.pack) if isinstance(weight, nn.Parameter) else cpu_gemm.pack(weight)
        return cpu_gemm.linear(x, packed, weight.shape[0], bias)
    if cpu_lib._spin_always and x.shape[0] > GEMV_MAX_M:
        cpu_lib.set_spin_always(False)    # ... on OpenMP's threads: the pool's must not spin beside them
    if impl == "onednn":
        w = _packed(weight, _onednn_layout) if isinstance(weight, nn.Parameter) else weight
        return torch.ops.mkldnn._linear_pointwise(x, w, bias, "none", [], "")
    return F.linear(x, weight, bias)


def dense_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear, for 2-D fp32, bf16 or fp16 rows on a CPU by the implementation _impl picks: what
    tune_linears measured fastest for this shape and row count on this machine, or the one
    PAGODA_CPU_GEMM forces, or for an untuned shape the C kernels (kernels/cpu_gemv.py at 1-8
    rows, a decode step streaming the weights; kernels/cpu_gemm.py above, on a weight packed
    once, _packed). All sum in fp32 at least; results differ from
    F.linear's in the last bits, as any other blocking of the sum would. Anything else, or with
    autograd recording, is F.linear."""
    if (x.dim() == 2 and x.device.type == "cpu" and x.dtype in _DTYPES and weight.dtype == x.dtype
            and weight.device.type == "cpu" and x.is_contiguous() and weight.is_contiguous()
            and (bias is None or bias.dtype == x.dtype)
            and not (torch.is_grad_enabled() and (weight.requires_grad or x.requires_grad))):
        return run_linear(_impl(x, weight, bias), x, weight, bias)
    return F.linear(x, weight, bias)


def _candidates(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> list[str]:
    """The implementations that take this call, in IMPLS order."""
    out = []
    if cpu_gemv.takes(x, weight, bias):
        out.append("gemv")
    if cpu_gemm.takes(x, weight, bias):
        out.append("gemm")
    if onednn_takes(x.dtype):
        out.append("onednn")
    return out + ["torch"]


def tune_linears(weights: Sequence[tuple[torch.Tensor, torch.Tensor | None]]) -> Choices:
    """Time every implementation at each distinct (weight shape, dtype) of `weights` (a model's
    linears: a weight and its bias) and the row counts of cpu_tune.BUCKETS, keep the fastest
    (cached on disk, logged: kernels/cpu_tune.py) and use it in dense_linear from now on. Nothing
    is timed when PAGODA_CPU_GEMM forces a choice, or for weights off the CPU."""
    if _CPU_GEMM != "auto":
        return {}
    by_shape: dict[tuple[int, int, torch.dtype], tuple[torch.Tensor, torch.Tensor | None]] = {}
    for w, b in weights:
        if w.dim() == 2 and w.device.type == "cpu" and w.dtype in _DTYPES and w.is_contiguous():
            by_shape.setdefault((w.shape[0], w.shape[1], w.dtype), (w, b))
    tuned: Choices = {}
    for dtype in _DTYPES:
        shapes = {key: wb for key, wb in by_shape.items() if key[2] == dtype}
        if not shapes:
            continue
        key = cpu_tune.cache_key(dtype, [(n, k) for n, k, _ in shapes])
        work, gen = [], torch.Generator().manual_seed(0)
        for (n, k, _), (w, b) in shapes.items():
            for rows in cpu_tune.BUCKETS:
                x = torch.randn(rows, k, generator=gen).to(dtype)
                # A step of at most GEMV_MAX_M rows keeps the kernels' pool spinning from one
                # kernel to the next (cpu_lib.py): oneDNN's or F.linear's OpenMP threads would share
                # the cores with the spinners and sleep between their calls. Timed alone they can
                # win; in such a step they lost 5x (bench/RESULTS.md, "small steps"). Only the
                # pool's own kernels are candidates there.
                names = [n for n in _candidates(x, w, b) if rows > GEMV_MAX_M or n in cpu_tune.POOL_IMPLS]

                def call(impl: str, x: torch.Tensor = x, w: torch.Tensor = w, b: torch.Tensor | None = b):
                    with torch.inference_mode():
                        return run_linear(impl, x, w, b)
                work.append(cpu_tune.Work(n, k, rows, {i: functools.partial(call, i) for i in names},
                                          _default_name(x, w, b)))
        picked = cpu_tune.tune(key, work, cpu_tune.budget_s(), one_family_above=GEMV_MAX_M)
        for (n, k, _), (w, _b) in shapes.items():
            tuned[(n, k, dtype)] = tuple(picked[f"{n}x{k}@{rows}"] for rows in cpu_tune.BUCKETS)
            # The timed packings that lost: one weight's worth each, not kept.
            for impl, fn in (("gemm", cpu_gemm.pack), ("onednn", _onednn_layout)):
                if impl not in tuned[(n, k, dtype)]:
                    _packs.pop((id(w), fn), None)
    global _generation
    _choices.update(tuned)
    _generation += 1
    return tuned


def pack_linears(weights: Sequence[tuple[torch.Tensor, torch.Tensor | None]]) -> int:
    """Pack each CPU linear weight now, at model load, into the layout of every GEMM that _impl
    will run it with at some row bucket (the C GEMM's panels, oneDNN's blocks), rather than in the
    first batch past GEMV_MAX_M rows: packing a Qwen2.5-0.5B shape's 2 GB of fp32 linears takes
    1.2 s on a 2-core Zen 3, which a server without a warm-up put inside one request's time to
    first token. Only what _packed keeps (nn.Parameters) is packed. Returns how many packings
    were made."""
    made = 0
    for w, b in weights:
        if not (isinstance(w, nn.Parameter) and w.dim() == 2 and w.device.type == "cpu" and w.dtype in _DTYPES):
            continue
        impls = {impl_for(rows, w, b) for rows in cpu_tune.BUCKETS}
        for impl, fn in (("gemm", cpu_gemm.pack), ("onednn", _onednn_layout)):
            if impl in impls:
                made += (id(w), fn) not in _packs
                _packed(w, fn)
    return made


def _default_name(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> str:
    """What _impl runs for an untuned shape."""
    if x.shape[0] <= GEMV_MAX_M and cpu_gemv.takes(x, weight, bias):
        return "gemv"
    return "gemm" if cpu_gemm.takes(x, weight, bias) else "torch"


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
