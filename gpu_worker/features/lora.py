"""Multi-LoRA: PEFT adapters loaded on the host, a few device slots, and the batched delta.

An adapter (PEFT format: adapter_config.json + adapter_model.safetensors) is read once into host
memory when registered (--lora-modules at start, or load_lora_adapter at run time) and checked
against the base model: rank at most --max-lora-rank, targets among the seven Llama projections,
shapes that fit. The device holds at most --max-loras adapters, one per slot. A slot is stacked
per projection, A [S, R, in] and B [S, out, R], B pre-multiplied by the adapter's scaling
(lora_alpha / r, or / sqrt(r) with use_rslora) and ranks below R zero-padded, so that any mix of
adapters in a batch is one segment matmul per adapter (pagoda.kernels.reference.lora_shrink_ref /
lora_expand_ref on CPU, kernels/triton_lora.py on CUDA).

Slots: a request's adapter is made resident when its row enters the runner's batch. A resident
adapter is reused; otherwise a free slot, else the least recently used slot that no row in the
batch uses. Loading a slot zeroes all of it first, so nothing of its previous adapter survives
(a projection the new adapter does not target contributes exactly zero). The scheduler admits at
most --max-loras distinct adapters into the batch, so a slot is always there.

Fused projections (q/k/v, gate/up) stack their slices' A matrices and lay their B matrices out
block-diagonally (LoRAProjection), so each projection is one shrink and one expand whatever the
adapter mix. Adapters never share cached blocks with the base model or with each other: the
adapter is part of the block-hash namespace (LoRAAdapter.cache_key). The engine thread alone
calls into a manager.
"""
from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass, field
from typing import Callable, Optional

import numpy as np
import torch
from safetensors.torch import load_file

from pagoda.kernels.reference import LoRASegments, lora_expand_ref, lora_segments, lora_shrink_ref
from pagoda.protos.redis_schema import MAX_ADAPTER_NAME

# HF projection -> (our module attribute, the fused projection it is part of, its slice index).
TARGETS = {"q_proj": ("lora_qkv", 0), "k_proj": ("lora_qkv", 1), "v_proj": ("lora_qkv", 2),
           "o_proj": ("lora_o", 0), "gate_proj": ("lora_gate_up", 0), "up_proj": ("lora_gate_up", 1),
           "down_proj": ("lora_down", 0)}
# Published adapters use alpha of a few times the rank (PEFT's default is 8 at rank 8); far above
# that the delta outgrows fp16's range on ordinary weights.
MAX_LORA_ALPHA = 65536.0
_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.[\w-]+)?\.weight$")


@dataclass(eq=False)
class LoRAAdapter:
    """One PEFT adapter on the host: per (layer, HF projection) its A [r, in] and scaled B [out, r].
    Compared and hashed by identity: an adapter loaded again under the same name is another one
    (requests admitted before keep the old weights; the new ones get a fresh slot)."""
    name: str
    path: str
    rank: int
    scaling: float
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    # The adapter's part of its requests' block-hash namespace (LoRAManager.add): its name, as the
    # router hashes it, unless an earlier adapter of that name was loaded in this process; then
    # the name and a load count, so that blocks cached with the old weights are never hit.
    cache_key: str = ""


def model_shapes(cfg) -> dict[str, tuple[int, int]]:
    """HF projection -> (in_features, out_features) of the (unsharded) base model."""
    hidden, inter = cfg.hidden_size, cfg.intermediate_size
    head_dim = getattr(cfg, "head_dim", None) or hidden // cfg.num_attention_heads
    q = cfg.num_attention_heads * head_dim
    kv = (getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads) * head_dim
    return {"q_proj": (hidden, q), "k_proj": (hidden, kv), "v_proj": (hidden, kv), "o_proj": (q, hidden),
            "gate_proj": (hidden, inter), "up_proj": (hidden, inter), "down_proj": (inter, hidden)}


def load_peft_adapter(name: str, path: str, cfg, max_rank: int) -> LoRAAdapter:
    """Read and check a PEFT adapter directory against the base model; ValueError names the field."""
    where = f"lora adapter {name!r} ({path})"
    config_file = os.path.join(path, "adapter_config.json")
    weights_file = os.path.join(path, "adapter_model.safetensors")
    if not os.path.isdir(path):
        raise ValueError(f"lora_path: {where}: no such directory")
    for f in (config_file, weights_file):
        if not os.path.isfile(f):
            raise ValueError(f"lora_path: {where} has no {os.path.basename(f)} (PEFT format expected)")
    try:
        with open(config_file, encoding="utf-8") as fh:
            conf = json.load(fh)
    except (OSError, ValueError) as e:
        raise ValueError(f"lora_path: {where}: adapter_config.json is not valid JSON ({e})") from None
    if not isinstance(conf, dict):
        raise ValueError(f"lora_path: {where}: adapter_config.json must hold an object")
    r = conf.get("r")
    if not isinstance(r, int) or isinstance(r, bool) or r < 1:
        raise ValueError(f"r: {where}: rank must be a positive integer (got {r!r})")
    if r > max_rank:
        raise ValueError(f"max_lora_rank: {where} has rank {r}, more than --max-lora-rank {max_rank}")
    alpha = conf.get("lora_alpha", r)
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
        raise ValueError(f"lora_alpha: {where}: must be a number (got {alpha!r})")
    # A NaN, infinite or absurd alpha would serve garbage (or inf) to every request of the adapter.
    if not (math.isfinite(alpha) and 0 < alpha <= MAX_LORA_ALPHA):
        raise ValueError(f"lora_alpha: {where}: must be finite, positive and at most {MAX_LORA_ALPHA:g} (got {alpha!r})")
    for key, ok in (("bias", conf.get("bias", "none") == "none"), ("fan_in_fan_out", not conf.get("fan_in_fan_out")),
                    ("use_dora", not conf.get("use_dora")), ("modules_to_save", not conf.get("modules_to_save")),
                    ("rank_pattern", not conf.get("rank_pattern")), ("alpha_pattern", not conf.get("alpha_pattern"))):
        if not ok:
            raise ValueError(f"{key}: {where}: {conf.get(key)!r} is not supported")
    targets = conf.get("target_modules") or []
    if isinstance(targets, str):
        targets = [targets]
    bad = [t for t in targets if t not in TARGETS]
    if bad:
        raise ValueError(f"target_modules: {where} targets {', '.join(map(str, bad))}; pagoda serves adapters "
                         f"of {', '.join(TARGETS)}")
    scaling = float(alpha) / (math.sqrt(r) if conf.get("use_rslora") else r)

    try:
        tensors = load_file(weights_file, device="cpu")
    except Exception as e:   # a truncated or foreign file: name it, do not crash the worker
        raise ValueError(f"lora_path: {where}: cannot read adapter_model.safetensors ({e})") from None
    shapes = model_shapes(cfg)
    halves: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        m = _KEY.search(key)
        if m is None or m.group(2) not in TARGETS:
            raise ValueError(f"target_modules: {where}: tensor {key!r} is not a LoRA weight of a supported projection")
        layer, proj, half = int(m.group(1)), m.group(2), m.group(3)
        if layer >= cfg.num_hidden_layers:
            raise ValueError(f"target_modules: {where}: tensor {key!r} names layer {layer}; the model has "
                             f"{cfg.num_hidden_layers}")
        fan_in, fan_out = shapes[proj]
        want = (r, fan_in) if half == "A" else (fan_out, r)
        if tuple(t.shape) != want:
            raise ValueError(f"r: {where}: tensor {key!r} has shape {tuple(t.shape)}, expected {want} "
                             "for this base model")
        t = t.float()
        if not torch.isfinite(t).all():
            raise ValueError(f"lora_path: {where}: tensor {key!r} holds NaN or infinite values")
        halves.setdefault((layer, proj), {})[half] = t
    adapter = LoRAAdapter(name, path, r, scaling)
    for (layer, proj), ab in sorted(halves.items()):
        if set(ab) != {"A", "B"}:
            raise ValueError(f"target_modules: {where}: layer {layer} {proj} has lora_{next(iter(ab))} "
                             "without its other half")
        adapter.weights[(layer, proj)] = (ab["A"].contiguous(), (ab["B"] * scaling).contiguous())
    if not adapter.weights:
        raise ValueError(f"lora_path: {where}: adapter_model.safetensors holds no LoRA weights")
    return adapter


class LoRAProjection:
    """The LoRA side of one base projection (fused or not), as one shrink and one expand. The
    slices of a fused projection (q/k/v, gate/up) read the same input: their A matrices stack
    into one [S, slices * R, in], and their B matrices into one block-diagonal
    [S, sum(out_j), slices * R] (slice j's B in rows of its output columns and columns of its
    rank-R part of h, exact zeros elsewhere), so that the whole fused output takes its delta in
    one matmul per adapter: a few wasted multiplications by zero, against two or three times
    fewer calls, which is what a decode step pays for."""

    def __init__(self, manager: "LoRAManager", fan_in: int, fan_out: list[int]):
        self.manager = manager
        s, r = manager.max_loras, manager.max_rank
        dev, dt = manager.device, manager.dtype
        self.rank = r
        self.a = torch.zeros(s, len(fan_out) * r, fan_in, device=dev, dtype=dt)
        self.b = torch.zeros(s, sum(fan_out), len(fan_out) * r, device=dev, dtype=dt)
        self.offsets = np.cumsum([0] + fan_out).tolist()

    def __call__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        seg = self.manager.segments
        if seg is None:
            return
        self.manager.expand(self.manager.shrink(x, self.a, seg), self.b, seg, y, 0)


class LoRAManager:
    """Host registry of adapters, device slots, and the step's token grouping (module docstring)."""

    def __init__(self, model, cfg, max_loras: int, max_rank: int, device: torch.device, dtype: torch.dtype,
                 backend: str = "torch"):
        self.cfg, self.max_loras, self.max_rank = cfg, max_loras, max_rank
        self.device, self.dtype = device, dtype
        self.adapters: dict[str, LoRAAdapter] = {}
        self.slot_adapter: list[Optional[LoRAAdapter]] = [None] * max_loras   # resident per slot
        self.slot_of: dict[LoRAAdapter, int] = {}
        self.last_used = [0] * max_loras
        self.clock = 0
        self.loads = 0                  # slot loads so far (tests, metrics)
        self._names_seen: set[str] = set()
        self._registrations = 0
        self.segments: Optional[LoRASegments] = None
        self.warm = False
        self.shrink: Callable = lora_shrink_ref
        self.expand: Callable = lora_expand_ref
        if backend == "triton":
            from pagoda.kernels.triton_lora import lora_expand_triton, lora_shrink_triton  # lazy: triton, only with its backend
            self.shrink, self.expand = lora_shrink_triton, lora_expand_triton
        shapes = model_shapes(cfg)
        self.layers: list[dict[str, LoRAProjection]] = []
        for layer in model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            projs = {}
            for attr, owner, names in (("lora_qkv", attn, ("q_proj", "k_proj", "v_proj")), ("lora_o", attn, ("o_proj",)),
                                       ("lora_gate_up", mlp, ("gate_proj", "up_proj")), ("lora_down", mlp, ("down_proj",))):
                projs[attr] = LoRAProjection(self, shapes[names[0]][0], [shapes[n][1] for n in names])
                setattr(owner, attr, projs[attr])
            self.layers.append(projs)

    # ---- registry (host) -----------------------------------------------------------------

    def add(self, adapter: LoRAAdapter) -> None:
        name = adapter.name
        # Bounded as the lease bounds the names it carries (pagoda.protos.redis_schema), which a longer
        # one would make routers refuse whole.
        if not isinstance(name, str) or not 0 < len(name) <= MAX_ADAPTER_NAME or not name.isprintable() \
                or name != name.strip():
            raise ValueError(f"lora_name: must be 1 to {MAX_ADAPTER_NAME} printable characters without "
                             f"surrounding spaces (got {name!r:.80})")
        if adapter.name in self.adapters:
            raise ValueError(f"lora_name: adapter {adapter.name!r} is already loaded")
        self._registrations += 1
        again = adapter.name in self._names_seen
        adapter.cache_key = f"{adapter.name}\x00{self._registrations}" if again else adapter.name
        self._names_seen.add(adapter.name)
        self.adapters[adapter.name] = adapter

    def load(self, name: str, path: str) -> LoRAAdapter:
        adapter = load_peft_adapter(name, path, self.cfg, self.max_rank)
        self.add(adapter)
        return adapter

    def remove(self, name: str) -> None:
        """Forget an adapter: new requests cannot name it. Requests already admitted with it run
        to their end on its slot, which LRU reclaims once no row uses it."""
        if name not in self.adapters:
            raise ValueError(f"lora_name: no adapter {name!r} is loaded")
        del self.adapters[name]

    def resident(self) -> list[str]:
        """Names of the registered adapters now in device slots."""
        return [a.name for a in self.slot_adapter if a is not None and self.adapters.get(a.name) is a]

    # ---- device slots --------------------------------------------------------------------

    def slot_for(self, adapter: LoRAAdapter, busy: np.ndarray) -> int:
        """The slot holding `adapter`, loading it into a free or the least recently used idle
        slot. busy: the slots of the rows in the batch (-1 entries ignored)."""
        self.clock += 1
        slot = self.slot_of.get(adapter)
        if slot is None:
            in_use = set(busy[busy >= 0].tolist())
            idle = [s for s in range(self.max_loras) if s not in in_use]
            if not idle:
                raise RuntimeError(f"max_loras: all {self.max_loras} adapter slots are used by running requests")
            free = [s for s in idle if self.slot_adapter[s] is None]
            slot = free[0] if free else min(idle, key=lambda s: self.last_used[s])
            old = self.slot_adapter[slot]
            if old is not None:
                del self.slot_of[old]
            self._write_slot(slot, adapter)
            self.slot_adapter[slot], self.slot_of[adapter] = adapter, slot
        self.last_used[slot] = self.clock
        return slot

    def _write_slot(self, slot: int, adapter: LoRAAdapter) -> None:
        self.loads += 1
        for i, projs in enumerate(self.layers):
            for attr, proj in projs.items():
                names = [n for n, (a, _) in TARGETS.items() if a == attr]
                proj.a[slot].zero_()
                proj.b[slot].zero_()
                for j, hf in enumerate(names):
                    w = adapter.weights.get((i, hf))
                    if w is not None:
                        r, k = w[0].shape[0], j * proj.rank
                        proj.a[slot, k:k + r].copy_(w[0])
                        proj.b[slot, proj.offsets[j]:proj.offsets[j + 1], k:k + r].copy_(w[1])

    def set_step(self, token_slots: Optional[np.ndarray], upload: Callable[[np.ndarray], torch.Tensor],
                 num_tokens: int = 0) -> None:
        """The step's per-token slots (-1: base model), grouped for the forward that follows.
        With `warm` set (ModelRunner.warm_up) every row runs on slot 0, so that the kernels
        compile before serving."""
        if token_slots is None and self.warm:
            token_slots = np.zeros(num_tokens, np.int64)
        self.segments = None if token_slots is None else lora_segments(token_slots, upload)
        if self.segments is not None:
            for s in self.segments.host_slot:
                self.last_used[s] = self.clock
