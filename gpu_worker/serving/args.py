"""Command-line flags of `python -m pagoda.gpu_worker` (and `pagoda worker`).

Kept free of torch and of the engine (config.py imports neither) so that `--help` is instant
and the CLI can share it.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import secrets
import socket

from pagoda.gpu_worker.core.config import QUANTIZATION_METHODS, EngineConfig
from pagoda.gpu_worker.core.spec_config import parse_speculative_config
from pagoda.protos import limits
from pagoda.protos.redis_schema import KV_ROLES
from pagoda.runtime import security
from pagoda.runtime.cli_help import DefaultsHelpFormatter

# The engine's defaults live in EngineConfig alone; the flags read them from there.
_D = {f.name: f.default for f in dataclasses.fields(EngineConfig)}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pagoda worker", description="Serve one model over gRPC (pagoda.v1).",
                                formatter_class=DefaultsHelpFormatter)
    p.add_argument("--model", required=True,
                   help="Hugging Face checkpoint directory, or a hub id (downloaded into the HF cache; HF_TOKEN honoured)")
    p.add_argument("--revision", default=None, help="hub ids: branch, tag or commit to load (default: main)")
    p.add_argument("--served-model-name", default=None, help="name clients ask for (default: the directory's name)")
    p.add_argument("--host", default="0.0.0.0", help="address the gRPC server listens on")
    p.add_argument("--port", type=int, default=50051, help="gRPC port (pagoda.v1.Generation and Admin)")
    p.add_argument("--metrics-port", type=int, default=None,
                   help="Prometheus HTTP port (default: --port + 10000, so workers differing only in --port "
                        "never collide); 0 turns it off")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default=_D["device"],
                   help="where the model runs (auto: cuda when a GPU is visible)")
    p.add_argument("--dtype", choices=["auto", "float32", "float16", "bfloat16"], default=_D["dtype"],
                   help="weights and activations (auto: the checkpoint's torch_dtype)")
    p.add_argument("--block-size", type=int, default=_D["block_size"], help="tokens per KV-cache block")
    pool = p.add_argument_group("KV-cache pool size (the first given wins: blocks, bytes, GPU fraction)")
    pool.add_argument("--kv-cache-memory", default=None, help="bytes for the pool, e.g. 2GiB")
    pool.add_argument("--num-kv-blocks", type=int, default=None, help="blocks in the pool")
    pool.add_argument("--gpu-memory-utilization", type=float, default=_D["gpu_memory_utilization"],
                      help="CUDA: fraction of GPU memory for weights, activations and the pool together")
    pool.add_argument("--kv-offloading-size", type=_gib, default=_D["kv_offloading_size"], metavar="GIB",
                      help="host-memory KV tier in GiB (pinned on CUDA; 0 = off): prefix-cache blocks evicted "
                           "from the device pool are kept there and copied back on a hit")
    p.add_argument("--preemption-mode", choices=["recompute", "swap"], default=_D["preemption_mode"],
                   help="swap: a preempted request's KV goes to the host tier (--kv-offloading-size) and back "
                        "instead of being recomputed (recompute when the tier is full)")
    p.add_argument("--tensor-parallel-size", type=int, default=_D["tensor_parallel_size"],
                   help="split the model over this many ranks (one GPU each; gloo processes on CPU)")
    p.add_argument("--max-num-seqs", type=int, default=_D["max_num_seqs"], help="sequences running in one step at most")
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="token budget of one step (prefill chunks and decodes); default: chosen from the model and device")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="prompt plus completion tokens of one sequence (default: the model's own context length)")
    p.add_argument("--no-prefix-caching", action="store_true", help="never reuse cached blocks of an earlier prompt")
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs: decode steps run eagerly")
    p.add_argument("--model-impl", choices=["auto", "native", "transformers"], default=_D["model_impl"],
                   help="native Llama-family code or transformers' modeling code (auto: native where it exists)")
    p.add_argument("--kv-cache-dtype", choices=["auto", "fp8"], default=_D["kv_cache_dtype"],
                   help="fp8: e4m3 K/V with per-tensor scales, half the memory of bf16")
    p.add_argument("--quantization", "-q", choices=QUANTIZATION_METHODS, default=None,
                   help="quantized weights: fp8 quantizes a bf16/fp16/fp32 checkpoint at load (e4m3 per output "
                        "channel); a checkpoint quantized already (compressed-tensors fp8 or int4, GPTQ or AWQ int4) is "
                        "found from its config.json, and a value given must match it")
    p.add_argument("--scheduling-policy", choices=["fcfs", "priority"], default=_D["scheduling_policy"],
                   help="priority: requests' priority field orders admission and picks preemption victims")
    p.add_argument("--scheduling-fairness", choices=["tenant", "fifo"], default=_D["scheduling_fairness"],
                   help="tenant: within a priority, the tenant running the fewest sequences is admitted next and "
                        "the one running the most is preempted first, so one tenant's burst cannot starve "
                        "another's requests; fifo: arrival order across tenants")
    p.add_argument("--async-scheduling", choices=["auto", "on", "off"], default=_D["async_scheduling"],
                   help="schedule and launch the next step before this one's tokens are back, and work "
                        "out its text while the next runs (auto: on with CUDA)")
    p.add_argument("--speculative-config", default=None, metavar="JSON", type=_speculative_config,
                   help='speculative decoding, as vLLM\'s JSON: {"method": "ngram", "num_speculative_tokens": 4, '
                        '"prompt_lookup_max": 4, "prompt_lookup_min": 2} or {"model": DRAFT_DIR, '
                        '"num_speculative_tokens": 4} (a draft of the same tokenizer)')
    p.add_argument("--stream-interval", type=_positive_int, default=_D["stream_interval"], metavar="N",
                   help="send a stream's tokens once N wait (its first token at once, its last flushes): "
                        "fewer, larger messages, less CPU per token here and at the router. 1: every step")
    lora = p.add_argument_group("multi-LoRA (PEFT adapters; a request names one as its model or `adapter`)")
    lora.add_argument("--enable-lora", action="store_true", help="serve LoRA adapters beside the base model")
    lora.add_argument("--lora-modules", nargs="+", default=None, metavar="NAME=PATH",
                      help="adapters to load at start: name=path of a PEFT adapter directory, one or more "
                           "(more at run time: Admin LoadLoRAAdapter, the router's /v1/load_lora_adapter)")
    lora.add_argument("--max-loras", type=int, default=_D["max_loras"],
                      help="adapters on the device at once (slots, least recently used evicted); distinct "
                           "adapters in one batch")
    lora.add_argument("--max-lora-rank", type=int, default=_D["max_lora_rank"],
                      help="the largest adapter rank accepted (slots are sized for it)")
    p.add_argument("--max-waiting", type=int, default=_D["max_waiting"],
                   help="requests queued beyond this are refused with RESOURCE_EXHAUSTED (with tenant "
                        "fairness, not those of a tenant below its share of the worker: another's burst "
                        "cannot lock it out)")
    p.add_argument("--redis-url", default=None, help="publish load and cached blocks here (password: REDIS_PASSWORD)")
    p.add_argument("--advertise-address", default=None, help="HOST:PORT routers dial (default: hostname:port)")
    p.add_argument("--worker-id", default=None, help="default: hostname-port-pid-random")
    p.add_argument("--worker-name", default=None,
                   help="stable name for metric labels across restarts (default: $POD_NAME, else the worker "
                        "id when given, else hostname-port)")
    p.add_argument("--metrics-prefix", choices=["pagoda", "vllm"], default="pagoda",
                   help="vllm: publish metrics under vLLM's own names and labels (its dashboards work as is)")
    p.add_argument("--heartbeat-interval", type=float, default=0.5, help="seconds between lease refreshes in Redis")
    p.add_argument("--snapshot-interval", type=float, default=5.0,
                   help="seconds between full snapshots of the cached blocks in Redis")
    p.add_argument("--drain-grace-seconds", type=float, default=30.0,
                   help="after SIGTERM, how long running streams may take to finish")
    p.add_argument("--max-concurrent-streams", type=int, default=2048,
                   help="HTTP/2 streams one connection may hold open (the router multiplexes on one)")
    p.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING or ERROR")
    g = p.add_argument_group("KV transfer between workers (gpu_worker/serving/kv_transfer.py)")
    g.add_argument("--kv-peer-api-key-file", default=None,
                   help="file holding the key sent to peers when fetching KV blocks (an admin key in their "
                        "--api-keys-file)")
    g.add_argument("--kv-fetch-max-blocks", type=_positive_int, default=512,
                   help="most blocks one fetch moves, served or pulled")
    g.add_argument("--kv-fetch-timeout", type=_positive_seconds, default=10.0,
                   help="seconds a fetch may take before the request recomputes instead")
    g.add_argument("--kv-role", choices=KV_ROLES, default="both",
                   help="prefill/decode disaggregation: where routers send this worker's share of a request "
                        "when the model has both prefill and decode workers live (prefill: prompts only, "
                        "their KV then fetched by a decode worker; decode: streams, fetching the prompt's "
                        "KV); both: whole requests, as every worker serves otherwise")
    limits.add_flags(p)
    security.add_flags(p, worker_side=True)
    return p


def _gib(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number of GiB >= 0 (got {text!r})")
    return value


def _speculative_config(text: str):
    # Checked while parsing, so a bad key is named before the model loads.
    try:
        return parse_speculative_config(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer (got {text!r})")
    return value


def _positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds (got {text!r})")
    return value


def default_worker_id(port: int) -> str:
    # Unique per process even when a pod restarts with the same hostname and pid.
    return f"{socket.gethostname()}-{port}-{os.getpid()}-{secrets.token_hex(3)}"


def worker_name(args: argparse.Namespace, port: int) -> str:
    return args.worker_name or os.environ.get("POD_NAME") or args.worker_id or f"{socket.gethostname()}-{port}"


def advertise_address(args: argparse.Namespace) -> str:
    if args.advertise_address:
        return args.advertise_address
    host = args.host if args.host not in ("0.0.0.0", "::", "[::]") else socket.gethostname()
    return f"{host}:{args.port}"


def engine_config_kwargs(args: argparse.Namespace) -> dict:
    """The EngineConfig keywords these flags set (the caller builds the config, importing the engine)."""
    return dict(model=args.model, revision=args.revision, served_model_name=args.served_model_name,
                device=args.device, dtype=args.dtype,
                block_size=args.block_size, num_kv_blocks=args.num_kv_blocks, kv_cache_memory=args.kv_cache_memory,
                gpu_memory_utilization=args.gpu_memory_utilization, max_num_seqs=args.max_num_seqs,
                max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=args.max_model_len,
                enable_prefix_caching=not args.no_prefix_caching, scheduling_policy=args.scheduling_policy,
                scheduling_fairness=args.scheduling_fairness,
                max_waiting=args.max_waiting, enforce_eager=args.enforce_eager,
                tensor_parallel_size=args.tensor_parallel_size, model_impl=args.model_impl,
                kv_cache_dtype=args.kv_cache_dtype, async_scheduling=args.async_scheduling,
                speculative_config=args.speculative_config, enable_lora=args.enable_lora,
                lora_modules=args.lora_modules, max_loras=args.max_loras, max_lora_rank=args.max_lora_rank,
                quantization=args.quantization, kv_offloading_size=args.kv_offloading_size,
                preemption_mode=args.preemption_mode,
                stream_interval=args.stream_interval)
