"""Native model implementations by the checkpoint's `architectures` entry, and the
tensor-parallel sizes a model can take."""
from __future__ import annotations

import torch

from pagoda.gpu_worker.models.llama import LlamaForCausalLM
from pagoda.gpu_worker.models.parallel import kv_heads_of

MODEL_REGISTRY = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
}


def model_class(hf_config):
    archs = list(getattr(hf_config, "architectures", None) or [])
    for arch in archs:
        if arch in MODEL_REGISTRY:
            return MODEL_REGISTRY[arch]
    raise ValueError(f"model: architectures {archs} not supported (supported: {', '.join(MODEL_REGISTRY)})")


def check_tensor_parallel(cfg, size: int, device: str) -> None:
    """Refuse, at start, a size the model's shapes or the machine cannot take."""
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        raise ValueError(f"tensor_parallel_size: must be a positive integer (got {size!r})")
    if size == 1:
        return
    if not getattr(model_class(cfg), "tensor_parallel", False):
        raise ValueError(f"tensor_parallel_size: {size} needs a model that shards (native Llama family); "
                         f"{model_class(cfg).__name__} does not")
    heads, kv = cfg.num_attention_heads, kv_heads_of(cfg)
    shapes = [("attention heads (num_attention_heads)", heads),
              ("intermediate_size", cfg.intermediate_size), ("vocab_size", cfg.vocab_size)]
    for what, n in shapes:
        if n % size:
            raise ValueError(f"tensor_parallel_size: {size} does not divide the model's {n} {what}")
    if kv % size and size % kv:
        raise ValueError(f"tensor_parallel_size: {size} and the model's {kv} KV heads must divide one another")
    if device == "cuda" and size > torch.cuda.device_count():
        raise ValueError(f"tensor_parallel_size: {size} ranks need {size} GPUs; "
                         f"{torch.cuda.device_count()} are visible")
