"""Engine configuration: one dataclass, filled from LLM(...) keywords or `pagoda worker` flags."""
from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Any, Optional

from pagoda.gpu_worker.core.spec_config import SpeculativeConfig, parse_speculative_config

# --quantization, vLLM's names (gpu_worker/features/quantization.py).
QUANTIZATION_METHODS = ("fp8", "compressed-tensors", "gptq", "awq")

_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "kib": 1024, "m": 1000**2, "mb": 1000**2,
          "mib": 1024**2, "g": 1000**3, "gb": 1000**3, "gib": 1024**3}


def parse_bytes(value: int | str) -> int:
    """'2GiB', '512MiB', '1e9' or an int -> bytes."""
    if isinstance(value, int):
        return value
    m = re.fullmatch(r"\s*([0-9.eE+]+)\s*([a-zA-Z]*)\s*", str(value))
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"kv_cache_memory: cannot parse {value!r} as a size such as 2GiB")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def parse_lora_modules(items) -> dict[str, str]:
    """--lora-modules name=path ... (or a dict) -> {name: path}; refuses a malformed or repeated name."""
    if not items:
        return {}
    if isinstance(items, dict):
        pairs = list(items.items())
    else:
        pairs = []
        for item in items:
            name, sep, path = str(item).partition("=")
            if not sep or not name.strip() or not path.strip():
                raise ValueError(f"lora_modules: expected name=path (got {item!r})")
            pairs.append((name.strip(), path.strip()))
    out: dict[str, str] = {}
    for name, path in pairs:
        if name in out:
            raise ValueError(f"lora_modules: adapter name {name!r} is given twice")
        out[name] = path
    return out


# CPU flags of native bf16 arithmetic: AVX512-BF16 dot products or AMX tiles (vLLM's CPU
# backend decides on the same). Without them the kernels widen bf16 to fp32 by a shift: that can
# still be faster than fp32 (half the bytes: a Zen 3 in bench/RESULTS.md), but auto does not give
# up fp32's accuracy for it; --dtype bfloat16 does, by name.
CPU_BF16_FLAGS = ("avx512_bf16", "amx_bf16")


def cpu_flags() -> set[str]:
    """This CPU's feature flags from /proc/cpuinfo (empty where there is none)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return set(line.partition(":")[2].split())
    except OSError:
        pass
    return set()


CPU_DTYPE_ENV = "PAGODA_CPU_DTYPE"


def cpu_auto_dtype(flags: set[str] | None = None) -> tuple[str, str]:
    """(dtype, why) that --dtype auto takes on a CPU: bfloat16 where the CPU has native bf16
    arithmetic, float32 elsewhere. flags: the CPU's flags (default: this CPU's, and then
    $PAGODA_CPU_DTYPE, where set, names the dtype instead: one dtype for a fleet of mixed CPUs,
    whose workers would otherwise serve different numbers and could not share KV blocks)."""
    if flags is None:
        forced = os.environ.get(CPU_DTYPE_ENV, "")
        if forced:
            if forced not in ("float32", "bfloat16", "float16"):
                raise ValueError(f"{CPU_DTYPE_ENV}: must be float32, bfloat16 or float16 (got {forced!r})")
            return forced, f"dtype auto: {forced} on this CPU (set by {CPU_DTYPE_ENV})"
        flags = cpu_flags()
    native = [f for f in CPU_BF16_FLAGS if f in flags]
    if native:
        return "bfloat16", f"dtype auto: bfloat16 on this CPU (native bf16 arithmetic: {', '.join(native)})"
    return "float32", ("dtype auto: float32 on this CPU (no native bf16 arithmetic: none of "
                       f"{', '.join(CPU_BF16_FLAGS)} in its flags)")


@dataclass
class EngineConfig:
    model: str                                  # Hugging Face checkpoint directory or hub id
    revision: Optional[str] = None              # hub ids: branch, tag or commit (default main)
    served_model_name: Optional[str] = None     # defaults to the directory's name
    device: str = "auto"                        # cpu | cuda | auto
    dtype: str = "auto"                         # auto: bfloat16 on CUDA; on CPU cpu_auto_dtype
    block_size: int = 16
    num_kv_blocks: Optional[int] = None
    kv_cache_memory: Optional[int | str] = None  # bytes or '2GiB'
    gpu_memory_utilization: float = 0.9
    max_num_seqs: int = 256
    max_num_batched_tokens: Optional[int] = None  # default: see token_budget
    max_model_len: Optional[int] = None         # default: the checkpoint's
    enable_prefix_caching: bool = True
    scheduling_policy: str = "fcfs"             # fcfs | priority
    # tenant: within a priority, the tenant running the fewest sequences is admitted next (one
    # tenant's burst cannot starve another's request); fifo: arrival order across tenants.
    scheduling_fairness: str = "tenant"         # tenant | fifo
    # auto: Triton kernels on CUDA, the in-place C kernel on CPU (kernels/cpu_attention.py).
    # PAGODA_ATTENTION=torch forces the reference everywhere, for debugging.
    attention_backend: str = "auto"             # auto | cpu | torch | triton
    max_waiting: int = 1024                     # queue bound; beyond it requests are refused
    enforce_eager: bool = False                 # no CUDA graphs for decode (CUDA only)
    tensor_parallel_size: int = 1               # ranks (GPUs) one model is split over
    # auto: native where pagoda has the architecture, transformers' modeling code otherwise.
    model_impl: str = "auto"                    # auto | native | transformers
    kv_cache_dtype: str = "auto"                # auto (the model's) | fp8 (e4m3, for CUDA)
    # Schedule and launch step N+1 before step N's tokens are back, and work out N's text, stop
    # strings and deltas while N+1 runs (engine.step). auto: on with CUDA, where a launched step
    # runs on its own; off on a CPU, where the forward runs in the engine's thread and there is
    # nothing to overlap with.
    async_scheduling: str = "auto"              # auto | on | off
    # vLLM's --speculative-config JSON (text or dict): n-gram lookup or a draft model
    # (gpu_worker/core/spec_config.py); parsed into a SpeculativeConfig here.
    speculative_config: Any = None
    # Multi-LoRA (gpu_worker/features/lora.py), vLLM's flags: adapters in PEFT format, at most max_loras
    # of them on the device at once, ranks up to max_lora_rank.
    enable_lora: bool = False
    lora_modules: Any = None                    # {name: path}, or ["name=path", ...]
    max_loras: int = 1
    max_lora_rank: int = 16
    # Quantized weights (gpu_worker/features/quantization.py): None loads what the checkpoint holds (a
    # quantized one by its config.json quantization_config); fp8 quantizes a bf16/fp16/fp32
    # checkpoint at load; any value must match a quantized checkpoint's quant_method.
    quantization: Optional[str] = None
    # Host-memory KV tier, GiB (vLLM's --kv-offloading-size; 0 = off): prefix-cache blocks the
    # device pool evicts are kept there and copied back on a hit (gpu_worker/core/host_tier.py).
    kv_offloading_size: float = 0.0
    # What a preempted request loses: recompute (its KV, from the prefix cache where it can) or
    # swap (its KV goes to the host tier and back; recompute when the tier is full).
    preemption_mode: str = "recompute"          # recompute | swap
    # vLLM's --stream-interval: a stream sends a sequence's tokens once this many wait (its
    # first token at once, its last delta flushes); 1 sends every step's (gpu_worker/serving/coalesce.py).
    stream_interval: int = 1

    def __post_init__(self):
        if self.served_model_name is None:
            self.served_model_name = os.path.basename(os.path.normpath(self.model))
        if self.block_size not in (8, 16, 32, 64, 128):
            raise ValueError(f"block_size: must be one of 8, 16, 32, 64, 128 (got {self.block_size})")
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise ValueError(f"scheduling_policy: must be fcfs or priority (got {self.scheduling_policy!r})")
        if self.scheduling_fairness not in ("tenant", "fifo"):
            raise ValueError(f"scheduling_fairness: must be tenant or fifo (got {self.scheduling_fairness!r})")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"device: must be cpu, cuda or auto (got {self.device!r})")
        if self.attention_backend not in ("auto", "cpu", "torch", "triton"):
            raise ValueError("attention_backend: must be auto, cpu, torch or triton "
                             f"(got {self.attention_backend!r})")
        if self.model_impl not in ("auto", "native", "transformers"):
            raise ValueError(f"model_impl: must be auto, native or transformers (got {self.model_impl!r})")
        if self.kv_cache_dtype not in ("auto", "fp8"):
            raise ValueError(f"kv_cache_dtype: must be auto or fp8 (got {self.kv_cache_dtype!r})")
        if self.async_scheduling not in ("auto", "on", "off"):
            raise ValueError(f"async_scheduling: must be auto, on or off (got {self.async_scheduling!r})")
        if self.quantization is not None and self.quantization not in QUANTIZATION_METHODS:
            raise ValueError(f"quantization: must be one of {', '.join(QUANTIZATION_METHODS)} "
                             f"(got {self.quantization!r})")
        if isinstance(self.stream_interval, bool) or not isinstance(self.stream_interval, int) \
                or self.stream_interval < 1:
            raise ValueError(f"stream_interval: must be a positive integer (got {self.stream_interval!r})")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs: must be at least 1 (got {self.max_num_seqs})")
        if (not isinstance(self.tensor_parallel_size, int) or isinstance(self.tensor_parallel_size, bool)
                or self.tensor_parallel_size < 1):
            raise ValueError(f"tensor_parallel_size: must be a positive integer (got {self.tensor_parallel_size!r})")
        size = self.kv_offloading_size
        if isinstance(size, bool) or not isinstance(size, (int, float)) or not 0 <= size < float("inf"):
            raise ValueError(f"kv_offloading_size: must be a finite number of GiB >= 0 (got {size!r})")
        if self.preemption_mode not in ("recompute", "swap"):
            raise ValueError(f"preemption_mode: must be recompute or swap (got {self.preemption_mode!r})")
        if self.preemption_mode == "swap" and not size:
            raise ValueError("preemption_mode: swap needs a host tier (kv_offloading_size > 0)")
        if size and self.tensor_parallel_size != 1:
            raise ValueError("kv_offloading_size: not with tensor_parallel_size > 1 (yet)")
        if self.kv_cache_memory is not None:
            self.kv_cache_memory = parse_bytes(self.kv_cache_memory)
        self.speculative_config = parse_speculative_config(self.speculative_config)
        if self.speculative_config is not None:
            # Drafts are proposed from the tokens the last step returned: nothing to overlap.
            if self.async_scheduling == "on":
                raise ValueError("async_scheduling: speculative_config needs it off or auto")
            if self.tensor_parallel_size != 1:
                raise ValueError("speculative_config: not with tensor_parallel_size > 1 (yet)")
            if size and self.speculative_config.method == "draft_model":
                # The draft's own pool shares block ids; its blocks would need the tier too.
                raise ValueError("kv_offloading_size: not with a draft model (speculative_config) yet")
        self._check_lora()
        env = os.environ.get("PAGODA_ATTENTION")
        if env:
            self.attention_backend = env

    def _check_lora(self) -> None:
        self.lora_modules = parse_lora_modules(self.lora_modules)
        for name, value in (("max_loras", self.max_loras), ("max_lora_rank", self.max_lora_rank)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name}: must be a positive integer (got {value!r})")
        if not self.enable_lora:
            if self.lora_modules:
                raise ValueError("lora_modules: adapters need enable_lora (--enable-lora)")
            return
        if self.tensor_parallel_size != 1:
            raise ValueError("enable_lora: not with tensor_parallel_size > 1 (yet)")
        if self.served_model_name in self.lora_modules:
            raise ValueError(f"lora_modules: adapter name {self.served_model_name!r} is the base model's name")
        for name, path in self.lora_modules.items():
            if not os.path.isdir(path):
                raise ValueError(f"lora_modules: adapter {name!r}: {path} is not a directory")

    @property
    def speculative(self) -> Optional[SpeculativeConfig]:
        return self.speculative_config

    def token_budget(self, max_model_len: int) -> int:
        """Tokens per step: the flag, else max(2048, max_model_len) capped to 8192."""
        return self.max_num_batched_tokens or min(max(2048, max_model_len), 8192)

    def resolved_device(self) -> str:
        if self.device != "auto":
            return self.device
        import torch  # lazy: flag parsing (serving/args.py) imports this module and stays torch-free
        return "cuda" if torch.cuda.is_available() else "cpu"
