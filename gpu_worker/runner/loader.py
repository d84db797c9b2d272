"""Load a Hugging Face checkpoint directory: config, dtype, and the model on one of two backends.

Backends: "native" (pagoda.gpu_worker.models, the Llama family with fused projections) where the
architecture has one, else "transformers" (pagoda.gpu_worker.models.transformers_backend: transformers'
modeling code with attention on the paged pool); EngineConfig.model_impl forces either.
Only decoder-only causal LMs are served; anything else is refused naming its architecture.

Sources (resolve_model): a local checkpoint directory, or a Hugging Face hub id fetched through
huggingface_hub into its usual cache (HF_HOME / HF_HUB_CACHE, HF_TOKEN and HF_HUB_OFFLINE
honoured, revision pinnable); a snapshot already in the cache loads offline.

Native weights: HF names map onto ours by dropping the `model.` prefix; q/k/v and gate/up are
stacked into the model's fused projections (LlamaForCausalLM.stacked_params). Every parameter
must come from the checkpoint: the model is built on the meta device, so a missed one would be
garbage, not random.
"""
from __future__ import annotations

import glob
import json
import logging
import os

import torch
from safetensors import safe_open

from pagoda.gpu_worker.core.config import cpu_auto_dtype
from pagoda.gpu_worker.features.quantization import quant_layers, quantize_model
from pagoda.gpu_worker.models.parallel import Shard, shard_slice, sharding
from pagoda.gpu_worker.models.registry import MODEL_REGISTRY, model_class
from pagoda.gpu_worker.models.transformers_backend import load_transformers_model

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """auto: bfloat16 on CUDA (float16 where bf16 is missing); on a CPU bfloat16 where it has
    native bf16 arithmetic, else float32 (config.cpu_auto_dtype, logged)."""
    if name == "auto":
        if device.type != "cuda":
            dtype, why = cpu_auto_dtype()
            log.info("%s", why)
            return _DTYPES[dtype]
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    if name not in _DTYPES:
        raise ValueError(f"dtype: must be auto, float32, float16 or bfloat16 (got {name!r})")
    return _DTYPES[name]


# What a checkpoint needs: config, generation config, tokenizer files and safetensors weights
# (not .bin/.pth duplicates, which double the download).
_HUB_PATTERNS = ["*.json", "*.safetensors", "*.model", "*.txt", "*.tiktoken", "*.jinja"]


def resolve_model(model: str, revision: str | None = None) -> str:
    """The local checkpoint directory for --model: the directory itself, or a hub id's snapshot."""
    if os.path.isdir(model):
        return model
    if model.startswith((".", "/", "~")) or model.count("/") > 1:
        raise ValueError(f"model: {model!r} is not a directory (pass --model a checkpoint directory or a hub id)")
    # lazy: huggingface_hub takes half a second to import; only a hub id needs it
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HFValidationError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )
    at = f"{model}@{revision}" if revision else model
    try:
        return snapshot_download(model, revision=revision, allow_patterns=_HUB_PATTERNS)
    except GatedRepoError:
        raise ValueError(f"model: {at} is gated on the hub; set HF_TOKEN to a token with access, "
                         "or pass --model a local directory") from None
    except RevisionNotFoundError:
        raise ValueError(f"model: revision {revision!r} of {model} does not exist on the hub (--revision)") from None
    except RepositoryNotFoundError:
        raise ValueError(f"model: {at} is neither a local directory nor a hub repository "
                         "(private? set HF_TOKEN); pass --model a checkpoint directory or hub id") from None
    except LocalEntryNotFoundError:
        raise ValueError(f"model: {at} is not a local directory, not in the Hugging Face cache, and "
                         "the hub cannot be reached (offline); pass --model a checkpoint directory") from None
    except HFValidationError:
        raise ValueError(f"model: {model!r} is neither a directory nor a valid hub id (--model)") from None


def load_hf_config(path: str):
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ValueError(f"model: no config.json in {path!r}")
    from transformers import AutoConfig  # lazy: transformers takes seconds to import; only to read a checkpoint
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


def choose_backend(hf_config, model_impl: str = "auto") -> tuple[str, str]:
    """(native | transformers, why) for a checkpoint; ValueError naming the architecture if
    pagoda cannot serve it."""
    # By model_type, not config class: tensor-parallel ranks get the config as a plain namespace.
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES  # lazy: as load_hf_config
    archs = list(getattr(hf_config, "architectures", None) or [])
    name = archs[0] if archs else f"(none; model_type {hf_config.model_type})"
    causal = [a for a in archs if a.endswith(("ForCausalLM", "LMHeadModel"))]
    if (not causal or getattr(hf_config, "is_encoder_decoder", False)
            or hf_config.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES):
        raise ValueError(f"model: architecture {name} (model_type {hf_config.model_type}) is not a "
                         "decoder-only causal LM; pagoda serves *ForCausalLM checkpoints")
    native = any(a in MODEL_REGISTRY for a in archs)
    if model_impl == "native":
        if not native:
            raise ValueError(f"model_impl: native has no implementation of {name} "
                             f"(native: {', '.join(MODEL_REGISTRY)}); use auto or transformers")
        return "native", "model_impl=native"
    if model_impl == "transformers":
        return "transformers", "model_impl=transformers"
    if native:
        return "native", f"{name} has a native implementation (fused projections, faster)"
    return "transformers", f"no native implementation of {name}"


def load_model(path: str, hf_config, device: torch.device, dtype: torch.dtype, shard=None,
               model_impl: str = "auto", quant=None) -> torch.nn.Module:
    """Build the model on the meta device and load its weights (only `shard`'s slices, if given:
    native models only); `quant` (a pagoda.gpu_worker.features.quantization.QuantConfig) quantizes its linears."""
    shard = shard or Shard()
    backend, why = choose_backend(hf_config, model_impl)
    log.info("model %s: %s backend (%s)", getattr(hf_config, "architectures", None), backend, why)
    if quant is not None and backend != "native":
        raise ValueError(f"quantization: {quant.method} needs the native backend ({why}); "
                         "pass --model-impl auto or native with a Llama-family checkpoint")
    if quant is not None and quant.prequantized and shard.size > 1:
        raise ValueError(f"tensor_parallel_size: {shard.size} with a pre-quantized ({quant.method}) checkpoint "
                         "is not supported yet; run it on one rank (--quantization fp8 of a bf16 checkpoint shards)")
    if backend == "transformers":
        if shard.size > 1:
            raise ValueError(f"tensor_parallel_size: {shard.size} needs the native backend; "
                             "the transformers backend runs on one rank")
        return load_transformers_model(path, hf_config, device, dtype)
    cls = model_class(hf_config)
    with torch.device("meta"), sharding(shard):
        model = cls(hf_config)
    model = model.to(dtype)
    if quant is not None:
        quantize_model(model, quant, dtype)
    model = model.to_empty(device=device)
    names = None if shard.size == 1 else (lambda name: shard_slice(hf_config, name, shard))
    load_weights(model, iter_weights(path, names), device)
    return model.eval()


def load_weights(model: torch.nn.Module, weights, device: torch.device | None = None) -> None:
    """Copy checkpoint tensors into the model's parameters; a quantized layer
    (pagoda.gpu_worker.features.quantization.QuantLinear) takes its own tensors and converts them."""
    params = dict(model.named_parameters())
    quant = quant_layers(model)
    if device is None:
        device = next(model.parameters()).device
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
            ordered = [pieces[j] for j in range(len(pieces))]
            if len({p.dtype for p in ordered}) > 1:
                raise ValueError(f"model: the checkpoint tensors stacked into {target} differ in dtype "
                                 f"({', '.join(str(p.dtype) for p in ordered)}; the last read: {hf_name})")
            qlayer = quant.get(".".join([*prefix, fused]))
            if qlayer is not None and target not in params:
                tensor = qlayer.fuse(leaf, ordered)
            else:
                tensor = torch.cat(ordered, dim=0)
            del pending[target]
            name = target
            module = fused
        qlayer = quant.get(".".join([*prefix, module]))
        if qlayer is not None and name not in params:
            if leaf == "bias":      # GPTQ writers store zero biases for layers that have none
                if tensor.count_nonzero():
                    raise ValueError(f"model: checkpoint tensor {hf_name} is a bias the model's config has no place for")
                continue
            qlayer.load(leaf, tensor, hf_name, device)
            continue
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
    for qname, qlayer in quant.items():
        missing += [f"{qname}.{leaf}" for leaf in qlayer.missing()]
        if not qlayer.missing():
            qlayer.finish()
    if missing:
        raise ValueError(f"model: checkpoint lacks weights for {', '.join(missing[:8])}"
                         f"{' ...' if len(missing) > 8 else ''}")
