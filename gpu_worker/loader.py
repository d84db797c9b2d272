"""Load a Hugging Face checkpoint directory into a native model: config, dtype, safetensors weights.

HF names map onto ours by dropping the `model.` prefix; q/k/v and gate/up are stacked into the
model's fused projections (LlamaForCausalLM.stacked_params). Every parameter must come from the
checkpoint: the model is built on the meta device, so a missed one would be garbage, not random.
"""
from __future__ import annotations

import glob
import json
import logging
import os

import torch

from gpu_worker.models import model_class

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """auto: float32 on CPU, bfloat16 on CUDA (float16 where bf16 is missing)."""
    if name == "auto":
        if device.type != "cuda":
            return torch.float32
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    if name not in _DTYPES:
        raise ValueError(f"dtype: must be auto, float32, float16 or bfloat16 (got {name!r})")
    return _DTYPES[name]


def load_hf_config(path: str):
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ValueError(f"model: no config.json in {path!r}")
    from transformers import AutoConfig
    return AutoConfig.from_pretrained(path)


def checkpoint_files(path: str) -> list[str]:
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            names = sorted(set(json.load(f)["weight_map"].values()))
        return [os.path.join(path, n) for n in names]
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise ValueError(f"model: no .safetensors weights in {path!r}")
    return files


def iter_weights(path: str, shard_of=None):
    """(hf_name, cpu tensor) for every tensor in the checkpoint, one at a time. shard_of(name) ->
    (dim, start, length) or None: read only that slice (a tensor-parallel rank's shard)."""
    from safetensors import safe_open
    for file in checkpoint_files(path):
        with safe_open(file, framework="pt", device="cpu") as f:
            for name in f.keys():
                spec = shard_of(name) if shard_of is not None else None
                if spec is None:
                    yield name, f.get_tensor(name)
                    continue
                dim, start, length = spec
                index = (slice(None),) * dim + (slice(start, start + length),)
                yield name, f.get_slice(name)[index]


def load_model(path: str, hf_config, device: torch.device, dtype: torch.dtype, shard=None) -> torch.nn.Module:
    """Build the model on the meta device and load its weights (only `shard`'s slices, if given)."""
    from gpu_worker.models.parallel import Shard, shard_slice, sharding
    shard = shard or Shard()
    cls = model_class(hf_config)
    with torch.device("meta"), sharding(shard):
        model = cls(hf_config)
    model = model.to(dtype).to_empty(device=device)
    names = None if shard.size == 1 else (lambda name: shard_slice(hf_config, name, shard))
    load_weights(model, iter_weights(path, names))
    return model.eval()


def load_weights(model: torch.nn.Module, weights) -> None:
    params = dict(model.named_parameters())
    stacked: dict[str, tuple[str, ...]] = getattr(model, "stacked_params", {})   # fused param -> its HF parts
    fused_of = {part: (fused, i) for fused, parts in stacked.items()
                for i, part in enumerate(parts)}
    pending: dict[str, dict[int, torch.Tensor]] = {}
    loaded: set[str] = set()
    for hf_name, tensor in weights:
        if "rotary_emb." in hf_name:
            continue
        name = hf_name[len("model."):] if hf_name.startswith("model.") else hf_name
        if name == "lm_head.weight" and name not in params:
            continue   # tied: the embedding serves as the output projection
        *prefix, module, leaf = name.split(".")
        if module in fused_of:
            fused, i = fused_of[module]
            target = ".".join([*prefix, fused, leaf])
            pieces = pending.setdefault(target, {})
            pieces[i] = tensor
            if len(pieces) < len(stacked[fused]):
                continue
            tensor = torch.cat([pieces[j] for j in range(len(pieces))], dim=0)
            del pending[target]
            name = target
        if name not in params:
            log.warning("checkpoint tensor %s has no place in the model; ignored", hf_name)
            continue
        param = params[name]
        if tuple(param.shape) != tuple(tensor.shape):
            raise ValueError(f"model: checkpoint tensor {hf_name} has shape {tuple(tensor.shape)}, "
                             f"expected {tuple(param.shape)}")
        with torch.no_grad():
            param.copy_(tensor)
        loaded.add(name)
    missing = sorted(set(params) - loaded)
    if missing:
        raise ValueError(f"model: checkpoint lacks weights for {', '.join(missing[:8])}"
                         f"{' ...' if len(missing) > 8 else ''}")
