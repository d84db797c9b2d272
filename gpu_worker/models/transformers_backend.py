"""Any decoder-only transformers model on pagoda's paged KV pool (the long tail of architectures).

transformers' own modeling code runs every layer; its attention calls reach pagoda through the
public attention interface: the model is loaded with attn_implementation="pagoda", registered
here, and that function writes the step's K/V into the pool and attends with pagoda's kernels.
So prefix caching, chunked prefill, preemption and the Triton kernels apply as for native models.

A step is one batch row: input_ids [1, T] with position_ids [1, T], no HF cache (use_cache=False)
and no mask: "pagoda" is not in transformers' mask registry, so none is built, and the kernels
mask by the step's metadata. Per-call features come from the modeling code's own keywords:
scaling (query_pre_attn_scalar, Granite's multiplier), sliding_window (per layer), softcap
(Gemma 2) and s_aux (attention sinks).

Which step the attention function serves is set around each forward (a forward context), since
the modeling code passes our metadata no further than its own signature allows.
"""
from __future__ import annotations

import contextlib
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from pagoda.gpu_worker.models.attention import AttentionMetadata, PagedAttention

ATTN_IMPLEMENTATION = "pagoda"

# (metadata, attention layers) of the step running now; None outside a forward.
_step: tuple[AttentionMetadata, nn.ModuleList] | None = None


def pagoda_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask, scaling: float | None = None, sliding_window: int | None = None,
                     softcap: float | None = None, s_aux: torch.Tensor | None = None, **kwargs):
    """transformers' attention signature: query [1, Hq, T, D], key/value [1, Hkv, T, D] (rope
    applied) -> ([1, T, Hq, D], no weights). The mask is ignored: pagoda's metadata carries it."""
    if _step is None:
        raise RuntimeError("pagoda attention called outside TransformersForCausalLM.forward")
    meta, layers = _step
    index: int = getattr(module, "layer_idx")   # getattr: typed as a Module attribute otherwise
    layer = cast(PagedAttention, layers[index])
    q, k, v = (x[0].transpose(0, 1) for x in (query, key, value))
    if k.shape[1:] != (layer.num_kv_heads, layer.head_dim):
        raise ValueError(f"model: layer {index} has K/V of shape {tuple(k.shape[1:])}, "
                         f"the pool holds {(layer.num_kv_heads, layer.head_dim)} per token")
    out = layer(q, k, v, meta, scale=scaling, sliding_window=sliding_window, softcap=softcap, sinks=s_aux)
    return out.unsqueeze(0), None


def register() -> None:
    from transformers import AttentionInterface  # lazy: transformers takes seconds to import; only this backend
    AttentionInterface.register(ATTN_IMPLEMENTATION, pagoda_attention)


@contextlib.contextmanager
def _forward_context(meta: AttentionMetadata, layers: nn.ModuleList):
    global _step
    previous, _step = _step, (meta, layers)
    try:
        yield
    finally:
        _step = previous


def text_config(hf_config):
    """The decoder's config (multimodal wrappers keep it under text_config)."""
    return getattr(hf_config, "text_config", None) or hf_config


class TransformersForCausalLM(nn.Module):
    """forward(ids, positions, meta) -> hidden [T, H]; compute_logits(hidden rows) -> fp32 logits;
    the same contract as the native models."""

    # Modeling code may sync with the host mid-forward (MoE routing picks experts by their
    # token counts), which a CUDA graph cannot capture: decode runs eagerly.
    cuda_graphs_ok = False

    def __init__(self, hf_model: Any):
        super().__init__()
        self.hf = hf_model
        cfg = text_config(hf_model.config)
        self.decoder = getattr(hf_model, hf_model.base_model_prefix)
        num_heads = cfg.num_attention_heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // num_heads
        num_kv_heads = getattr(cfg, "num_key_value_heads", None) or num_heads
        # One pool layer per decoder layer; window, cap and scale arrive with each call.
        self.paged = nn.ModuleList(PagedAttention(num_heads, num_kv_heads, head_dim, head_dim ** -0.5)
                                   for _ in range(cfg.num_hidden_layers))
        self._post = logits_post_processing(hf_model, cfg)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        with _forward_context(meta, self.paged):
            out = self.decoder(input_ids=input_ids[None], position_ids=positions[None], use_cache=False)
        return out.last_hidden_state[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = F.linear(hidden, self.hf.get_output_embeddings().weight)
        return self._post(logits).float()

    def attention_layers(self) -> list[PagedAttention]:
        return cast(list[PagedAttention], list(self.paged))


def logits_post_processing(hf_model: Any, cfg):
    """What the CausalLM heads of transformers do to logits after lm_head, by config field:
    Granite divides by logits_scaling, Cohere multiplies by logit_scale, Gemma 2/3 soft-cap."""
    head = hf_model.get_output_embeddings()
    if getattr(head, "bias", None) is not None:
        raise ValueError("model: an output projection with a bias is not supported")
    divide = float(getattr(cfg, "logits_scaling", None) or 1.0)
    multiply = float(getattr(hf_model, "logit_scale", None) or getattr(cfg, "logit_scale", None) or 1.0)
    cap = getattr(cfg, "final_logit_softcapping", None)

    def post(logits: torch.Tensor) -> torch.Tensor:
        if divide != 1.0:
            logits = logits / divide
        if multiply != 1.0:
            logits = logits * multiply
        if cap:
            logits = torch.tanh(logits / cap) * cap
        return logits

    return post


def load_transformers_model(path: str, hf_config, device: torch.device,
                            dtype: torch.dtype) -> TransformersForCausalLM:
    from transformers import MODEL_FOR_CAUSAL_LM_MAPPING, AutoModelForCausalLM  # lazy: as register()
    cls: Any = MODEL_FOR_CAUSAL_LM_MAPPING[type(hf_config)]
    if not getattr(cls, "_supports_attention_backend", False):
        raise ValueError(f"model: {cls.__name__}'s modeling code does not route attention through "
                         "transformers' attention interface, so its KV cannot be paged")
    register()
    hf_model: Any = AutoModelForCausalLM.from_pretrained(path, config=hf_config, dtype=dtype,
                                                         attn_implementation=ATTN_IMPLEMENTATION)
    return TransformersForCausalLM(hf_model.to(device).eval())
