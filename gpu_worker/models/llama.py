"""Native Llama-family decoder (Llama, Mistral, Qwen2, Qwen3) over a flat, paged batch.

One implementation with the family differences as flags read from the HF config: q/k/v bias
(Qwen2, or attention_bias), per-head q/k RMSNorm (Qwen3), explicit head_dim, tied embeddings,
rope_theta / rope scaling (default, linear, llama3), and per-layer sliding windows (Mistral,
Qwen2/3 with use_sliding_window). Inputs are flat token rows [T] with
their positions; attention goes through the paged KV cache (pagoda.gpu_worker.models.attention).

q/k/v and gate/up are fused into one matmul each; the loader stacks the HF weights to match.
Arithmetic mirrors transformers' (fp32 RMSNorm variance, rope tables in fp32 cast to the
activation dtype) so that the CPU fp32 path reproduces it.
"""
from __future__ import annotations

import logging
import math
import os
from typing import Callable, cast

import torch
import torch.nn.functional as F
from torch import nn

from pagoda.gpu_worker.models import parallel
from pagoda.gpu_worker.models.attention import AttentionMetadata, PagedAttention
from pagoda.gpu_worker.models.parallel import (
    Linear,
    RowParallelLinear,
    VocabParallelEmbedding,
    current_shard,
    head_dim_of,
    local_heads,
    pack_linears,
    parallel_logits,
    tune_linears,
)
from pagoda.kernels import cpu_attention, cpu_lib, cpu_tune
from pagoda.kernels.cpu_decode import DecodeProgram, LayerTensors
from pagoda.kernels.cpu_lib import GEMV_MAX_M, kernel_threads
from pagoda.kernels.cpu_ops import add_rms_norm_cpu, rotary_cpu, silu_mul_cpu, write_kv_cache_cpu
from pagoda.kernels.reference import add_rms_norm_ref, rotary_ref

log = logging.getLogger(__name__)


class RMSNorm(nn.Module):
    """forward(x, residual=None) -> (RMSNorm(x + residual), x + residual): the add is fused in, so
    a decoder layer hands the sum on as the next residual. With `ops` "triton" or "cpu"
    (use_fused_ops) a 2-D input goes through one kernel instead of about eight torch ops: Triton's,
    or kernels/cpu_ops.py's for a few rows on a CPU."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.ops = "torch"

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        if self.ops == "cpu":
            return add_rms_norm_cpu(x, residual, self.weight, self.eps)
        if self.ops == "triton" and x.dim() == 2:
            from pagoda.kernels.triton_norm import add_rms_norm_triton  # lazy: triton, only with its backend
            return add_rms_norm_triton(x, residual, self.weight, self.eps)
        return add_rms_norm_ref(x, residual, self.weight, self.eps)


def use_fused_ops(model: nn.Module, backend: str) -> None:
    """RMSNorm (+ residual add) and rotary of every layer as one kernel each: Triton's
    (kernels/triton_norm.py) with the triton attention backend, the C ones (kernels/cpu_ops.py,
    with SiLU * up too) with the cpu backend, else the torch ops. Chosen once, with the
    attention backend."""
    ops = backend if backend in ("triton", "cpu") else "torch"
    for m in model.modules():
        if isinstance(m, (RMSNorm, RotaryEmbedding)):
            m.ops = ops
        elif isinstance(m, MLP):
            m.ops = "cpu" if ops == "cpu" else "torch"
    if ops == "cpu":
        # The linears' implementations, timed at this model's shapes on this machine (cached).
        linears = [(m.weight, m.bias) for m in model.modules() if isinstance(m, (Linear, RowParallelLinear))]
        embed = getattr(model, "embed_tokens", None)
        if getattr(model, "tie_word_embeddings", False) and embed is not None:
            linears.append((embed.weight, None))        # the LM head's weight
        tune_linears(linears)
        pack_linears(linears)
        if isinstance(model, LlamaForCausalLM):
            model.cpu_decode = CpuDecodeStep.for_model(model)


def rope_parameters(hf_config) -> dict:
    """rope_type / rope_theta / scaling fields, from transformers 5's rope_parameters or the older
    rope_theta + rope_scaling pair."""
    params = dict(getattr(hf_config, "rope_parameters", None) or {})
    if not params:
        params = dict(getattr(hf_config, "rope_scaling", None) or {})
        params.setdefault("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    params["rope_type"] = params.get("rope_type", params.get("type", "default"))
    return params


def rope_inv_freq(head_dim: int, params: dict) -> torch.Tensor:
    base = float(params.get("rope_theta", 10000.0))
    # On the CPU explicitly: the model may be built under a meta-device context.
    steps = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float()
    inv_freq = 1.0 / (base ** (steps / head_dim))
    kind = params["rope_type"]
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / float(params["factor"])
    if kind == "llama3":
        factor = float(params["factor"])
        low, high = float(params["low_freq_factor"]), float(params["high_freq_factor"])
        old_len = float(params["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv_freq
        # Long wavelengths are slowed by `factor`, short ones kept, the band between blended.
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        blended = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < old_len / high) & ~(wavelen > old_len / low)
        return torch.where(medium, blended, scaled)
    raise ValueError(f"rope_scaling: rope_type {kind!r} is not supported (default, linear, llama3)")


class RotaryEmbedding(nn.Module):
    """Neox-style rotary embedding with a cos/sin table indexed by position, built per device."""

    def __init__(self, head_dim: int, max_positions: int, params: dict):
        super().__init__()
        self.head_dim, self.max_positions = head_dim, max_positions
        self.inv_freq = rope_inv_freq(head_dim, params)
        self._table: tuple[torch.Tensor, torch.Tensor] | None = None
        self.ops = "torch"

    def table(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        if self._table is None or self._table[0].device != device:
            pos = torch.arange(self.max_positions, dtype=torch.float32, device=device)
            freqs = torch.outer(pos, self.inv_freq.to(device))
            emb = torch.cat((freqs, freqs), dim=-1)
            self._table = (emb.cos(), emb.sin())
        return self._table

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """q [T, Hq, D], k [T, Hkv, D] rotated by their token's position (in place with `ops`
        "triton" or "cpu")."""
        cos, sin = self.table(q.device)
        if self.ops == "cpu":
            return rotary_cpu(positions, q, k, cos, sin)
        if self.ops == "triton":
            from pagoda.kernels.triton_norm import rotary_triton  # lazy: triton, only with its backend
            return rotary_triton(positions, q, k, cos, sin)
        return rotary_ref(positions, q, k, cos, sin)


def layer_sliding_window(cfg, layer: int) -> int | None:
    """The window of layer `layer` as transformers applies it: the config's sliding_window on
    layers that layer_types marks "sliding_attention" (all layers when it has no layer_types:
    Mistral); None when the config has no window (Qwen2/3 set it to None unless use_sliding_window)."""
    window = getattr(cfg, "sliding_window", None)
    types = getattr(cfg, "layer_types", None)
    if not window or (types and types[layer] != "sliding_attention"):
        return None
    return int(window)


class Attention(nn.Module):
    def __init__(self, cfg, rotary: RotaryEmbedding, layer: int):
        super().__init__()
        # This rank's heads (all of them without tensor parallelism).
        self.num_heads, self.num_kv_heads = local_heads(cfg, current_shard())
        self.head_dim = head_dim_of(cfg)
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        bias = cfg.model_type == "qwen2" or bool(getattr(cfg, "attention_bias", False))
        self.qkv_proj = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=bias)
        self.o_proj = RowParallelLinear(cfg.num_attention_heads * self.head_dim, cfg.hidden_size,
                                        bias=bool(getattr(cfg, "attention_bias", False)))
        self.qk_norm = cfg.model_type == "qwen3"
        if self.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.rotary = rotary
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, self.head_dim, self.head_dim ** -0.5,
                                   sliding_window=layer_sliding_window(cfg, layer))
        # Multi-LoRA (pagoda.gpu_worker.features.lora.LoRAManager sets them): add the step's adapter deltas.
        self.lora_qkv = self.lora_o = None

    def forward(self, positions: torch.Tensor, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        qkv = self.qkv_proj(x)
        if self.lora_qkv is not None:
            self.lora_qkv(x, qkv)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.reshape(-1, self.num_heads, self.head_dim)
        k = k.reshape(-1, self.num_kv_heads, self.head_dim)
        v = v.reshape(-1, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q)[0], self.k_norm(k)[0]
        q, k = self.rotary(positions, q, k)
        out = self.attn(q, k, v, meta).reshape(-1, self.q_size)
        y = self.o_proj(out)
        if self.lora_o is not None:
            self.lora_o(out, y)
        return y


class MLP(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        if getattr(cfg, "hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act: only silu is supported (got {cfg.hidden_act!r})")
        self.intermediate = cfg.intermediate_size // current_shard().size     # this rank's slice
        bias = bool(getattr(cfg, "mlp_bias", False))
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * self.intermediate, bias=bias)
        self.down_proj = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size, bias=bias)
        self.lora_gate_up = self.lora_down = None      # as Attention's
        self.ops = "torch"                              # "cpu": one C pass (use_fused_ops)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if self.lora_gate_up is not None:
            self.lora_gate_up(x, gate_up)
        if self.ops == "cpu":
            act = silu_mul_cpu(gate_up)
        else:
            gate, up = gate_up.split(self.intermediate, dim=-1)
            act = F.silu(gate) * up
        y = self.down_proj(act)
        if self.lora_down is not None:
            self.lora_down(act, y)
        return y


class DecoderLayer(nn.Module):
    def __init__(self, cfg, rotary: RotaryEmbedding, layer: int):
        super().__init__()
        self.self_attn = Attention(cfg, rotary, layer)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, positions, h, residual, meta):
        """(this layer's output, the residual stream before it); the next norm adds the two."""
        x, residual = self.input_layernorm(h, residual)
        x, residual = self.post_attention_layernorm(self.self_attn(positions, x, meta), residual)
        return self.mlp(x), residual


class LlamaForCausalLM(nn.Module):
    """forward(ids, positions, meta) -> hidden [T, H]; compute_logits(hidden rows) -> fp32 logits."""

    # Fused parameter -> the HF parameters stacked into it, in order (dim 0).
    stacked_params = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
    # Its layers shard over tensor-parallel ranks (pagoda.gpu_worker.models.parallel).
    tensor_parallel = True

    def __init__(self, cfg):
        super().__init__()
        self.config = cfg
        num_heads = cfg.num_attention_heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // num_heads
        rotary = RotaryEmbedding(head_dim, cfg.max_position_embeddings, rope_parameters(cfg))
        self.shard = current_shard()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, rotary, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.tie_word_embeddings = bool(getattr(cfg, "tie_word_embeddings", False))
        if not self.tie_word_embeddings:
            self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size // self.shard.size, bias=False)
        # Decode steps of a few rows as one C call (use_fused_ops sets it with the cpu backend).
        self.cpu_decode: CpuDecodeStep | None = None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        if self.cpu_decode is not None:
            return self.cpu_decode.forward(input_ids, positions, meta, self.forward_modules)
        return self.forward_modules(input_ids, positions, meta)

    def forward_modules(self, input_ids: torch.Tensor, positions: torch.Tensor,
                        meta: AttentionMetadata) -> torch.Tensor:
        """forward through the layers' modules (not the C decode step)."""
        h, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            h, residual = layer(positions, h, residual, meta)
        return self.norm(h, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        weight = self.embed_tokens.weight if self.tie_word_embeddings else self.lm_head.weight
        return parallel_logits(hidden, weight, self.shard)

    def attention_layers(self) -> list[PagedAttention]:
        return [layer.self_attn.attn for layer in self.decoder_layers()]

    def decoder_layers(self) -> list[DecoderLayer]:
        # nn.ModuleList yields Modules to a type checker; these are the DecoderLayers built above.
        return cast(list[DecoderLayer], list(self.layers))


class CpuDecodeStep:
    """A LlamaForCausalLM's steps of 1 to GEMV_MAX_M rows as one call into the C kernels
    (kernels/cpu_decode.py): the modules' kernels with their arguments, without the ~50 module
    and ~40 ctypes calls between them (about 2 ms of a 5 ms one-sequence step of
    bench/vs_vllm.py's tiny model on a 2-core Zen 3 and Zen 4).

    Per row bucket (1 row; 2 to GEMV_MAX_M: cpu_tune.BUCKETS) each linear runs what the tuner
    chose for it, as in the modules: the C GEMV or the C GEMM on its packed weight inside the C
    call, or oneDNN / F.linear, which C cannot call, from here between two C calls (the step
    resumes after it). So the step is the modules' to the bit: a request's tokens and logprobs
    never depend on which of the two ran it.

    A step comes here only if: no LoRA adapter hooks, no autograd, and its attention is
    paged_attention_cpu.c alone (no cascade group or prefill chunk for gemm_attention_cpu.c). The
    model must be plain: one rank, no q/k norm (Qwen3), C fused ops, Linear/RowParallelLinear
    weights (not quantized), a cache of the model's dtype. Anything else runs the modules.
    PAGODA_CPU_DECODE_STEP=off never uses it."""

    MODES = ("on", "off")

    def __init__(self, model: LlamaForCausalLM):
        self.model = model
        self.layers = model.decoder_layers()
        # per bucket: (tuning generation, the first layer's caches then, program or None, its
        # function for the linears C does not run)
        self._built: dict[int, tuple[int, tuple, DecodeProgram | None, Callable | None]] = {}
        self.steps = 0                                    # steps computed in C (tests, stats)

    @classmethod
    def for_model(cls, model: LlamaForCausalLM) -> CpuDecodeStep | None:
        """One for `model`, or None (logged) when the model is not plain or it is turned off."""
        mode = os.environ.get("PAGODA_CPU_DECODE_STEP", "on")
        if mode not in cls.MODES:
            raise ValueError(f"PAGODA_CPU_DECODE_STEP: must be one of {', '.join(cls.MODES)} (got {mode!r})")
        why = "PAGODA_CPU_DECODE_STEP=off" if mode == "off" else cls.refusal(model)
        if why:
            log.info("CPU decode step in C: off (%s)", why)
            return None
        return cls(model)

    @staticmethod
    def refusal(model: LlamaForCausalLM) -> str | None:
        """Why `model` cannot take the C decode step, or None."""
        if model.shard.size != 1:
            return "tensor parallel"
        if not all(p.device.type == "cpu" for p in model.parameters()):
            return "not on the CPU"
        for layer in model.decoder_layers():
            attn, mlp = layer.self_attn, layer.mlp
            if attn.qk_norm:
                return "q/k norm"
            if not (type(attn.qkv_proj) is Linear and type(attn.o_proj) is RowParallelLinear
                    and type(mlp.gate_up_proj) is Linear and type(mlp.down_proj) is RowParallelLinear):
                return "quantized or replaced linears"
            if not (layer.input_layernorm.ops == layer.post_attention_layernorm.ops == mlp.ops
                    == attn.rotary.ops == "cpu"):
                return "not the C fused ops"
            if attn.attn.softcap:
                return "soft-capped attention"
        return None

    def _program(self, bucket: int) -> tuple[DecodeProgram | None, Callable | None]:
        """The bucket's C tables and the function that computes its external linears (rebuilt when
        the caches or the tuner's choices change); None when the caches or attention functions are
        not what the C step runs."""
        a0 = self.layers[0].self_attn.attn
        generation = parallel.tuning_generation()
        built = self._built.get(bucket)
        # the runner binds every layer's caches at once: the first layer's stand for all
        if built is not None and built[0] == generation and a0.k_cache is built[1][0] and a0.v_cache is built[1][1]:
            return built[2], built[3]
        attns = [layer.self_attn.attn for layer in self.layers]
        program, linear = self._build(bucket, attns, [(a.k_cache, a.v_cache) for a in attns])
        self._built[bucket] = (generation, (a0.k_cache, a0.v_cache), program, linear)
        return program, linear

    def _build(self, bucket: int, attns: list[PagedAttention],
               caches: list) -> tuple[DecodeProgram | None, Callable | None]:
        dtype = self.model.norm.weight.dtype
        if any(k is None or v is None or k.dtype != dtype or v.dtype != dtype for k, v in caches) or any(
                a.attend_fn is not cpu_attention.paged_attention_cpu or a.write_fn is not write_kv_cache_cpu
                for a in attns):
            return None, None
        a0 = attns[0]
        probe = torch.empty(1, a0.num_heads, a0.head_dim, dtype=dtype)
        if not cpu_attention.supports(probe, cast(torch.Tensor, a0.k_cache)) or len({a.scale for a in attns}) != 1:
            return None, None
        rows = cpu_tune.BUCKETS[bucket]
        # (layer, linear) -> what the modules run there, for those C does not: oneDNN, F.linear
        outside: dict[tuple[int, int], tuple[str, torch.Tensor, torch.Tensor | None]] = {}
        tables = []
        for i, (layer, a) in enumerate(zip(self.layers, attns)):
            attn, mlp = layer.self_attn, layer.mlp
            lins: tuple[Linear | RowParallelLinear, ...] = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
            impls = [parallel.impl_for(rows, lin.weight, lin.bias) for lin in lins]
            external = 0
            for j, (impl, lin) in enumerate(zip(impls, lins)):
                if impl not in cpu_tune.POOL_IMPLS:
                    outside[(i, j)] = (impl, lin.weight, lin.bias)
                    external |= 1 << j
            packed = [parallel.gemm_packed(lin.weight) if impl == "gemm" else None for impl, lin in zip(impls, lins)]
            tables.append(LayerTensors(
                layer.input_layernorm.weight, layer.post_attention_layernorm.weight,
                attn.qkv_proj.weight, attn.qkv_proj.bias, attn.o_proj.weight, attn.o_proj.bias,
                mlp.gate_up_proj.weight, mlp.gate_up_proj.bias, mlp.down_proj.weight, mlp.down_proj.bias,
                cast(torch.Tensor, a.k_cache), cast(torch.Tensor, a.v_cache), int(a.sliding_window or 0),
                p_qkv=packed[0], p_o=packed[1], p_gu=packed[2], p_down=packed[3],
                external=external))
        cos, sin = self.layers[0].self_attn.rotary.table(torch.device("cpu"))

        def linear(layer: int, which: int, x: torch.Tensor) -> torch.Tensor:
            impl, weight, bias = outside[(layer, which)]
            return parallel.run_linear(impl, x, weight, bias)
        return DecodeProgram(tables, self.model.norm.weight, self.model.norm.eps, a0.scale, a0.num_heads,
                             cos, sin), linear if outside else None

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                modules: Callable[[torch.Tensor, torch.Tensor, AttentionMetadata], torch.Tensor]) -> torch.Tensor:
        """The step's final hidden rows: in C when it may, else by `modules`."""
        m = ids.shape[0]
        if not 0 < m <= GEMV_MAX_M or torch.is_grad_enabled() or ids.device.type != "cpu":
            return modules(ids, positions, meta)
        first = self.layers[0]
        if first.self_attn.lora_qkv is not None or first.self_attn.lora_o is not None \
                or first.mlp.lora_gate_up is not None or first.mlp.lora_down is not None:
            return modules(ids, positions, meta)
        bucket = cpu_tune.bucket_index(m)
        program, linear = self._program(bucket)
        if program is None:
            return modules(ids, positions, meta)
        a0 = first.self_attn.attn
        _, bs, hkv, d = program.cache_shape
        threads = kernel_threads()
        plan, tables, lens, starts = cpu_attention.step_plan(
            meta.block_tables, meta.seq_lens, meta.query_start_loc, a0.num_heads, hkv, d, bs, threads,
            d % 16 == 0, memo=meta.memo)
        if plan.jobs is not None:
            return modules(ids, positions, meta)
        if program.uses_gemm and not cpu_lib._spin_always:
            cpu_lib.set_spin_always(True)       # as run_linear does before the pool's GEMM
        pos = positions if positions.dtype == torch.int64 and positions.is_contiguous() \
            else positions.to(torch.int64).contiguous()
        h = F.embedding(ids, self.model.embed_tokens.weight)      # one rank: the whole vocabulary
        out = program.run(h, pos, meta.slot_mapping, tables, lens, starts, plan.items, plan.heads_per_item, threads,
                          linear)
        self.steps += 1
        return out
