"""Multi-LoRA throughput: a batch with 0, 1 or 4 adapters mixed in, against the base model.

CPU (default): the benchmark Llama (bench/common.py: 8 layers, hidden 512, fp32) and four random
rank-16 PEFT adapters on all seven projections (pagoda.gpu_worker.testing.tiny_model.make_tiny_lora). Variants,
each decoding the same greedy batch (--batch prompts of --prompt-len tokens, --tokens new each):

  base          an engine without --enable-lora
  lora, 0       --enable-lora --max-loras 4, every request on the base model
  lora, 1       every request on one adapter
  lora, 4       the requests spread over four adapters (a quarter each), in one batch

Every engine loads once and runs one untimed round; then rounds alternate the variants (order
reversed every other round), timed in process CPU time (robust on a shared machine) and wall
time. Reported: output tok/s per CPU second and its ratio to base (median of the rounds).

--gpu: one Llama-3-8B decoder layer's projections (q/k/v fused 4096 -> 6144, o 4096 -> 4096,
gate/up 4096 -> 28672, down 14336 -> 4096) at M = 1, 16, 256 token rows, bf16: the base F.linear
against base + the LoRA Triton kernels (rank 16) with 1 and 4 adapters mixed, CUDA-event timed.
bench/gpu_check.sh runs it.

    python bench/lora.py [--quick] [--gpu] [--out FILE]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import build_model  # noqa: E402

_LINES: list[str] = []


def emit(line: str = "") -> None:
    print(line, flush=True)
    _LINES.append(line)


def cpu_bench(args) -> None:
    import torch

    from pagoda.gpu_worker.core.sampling_params import SamplingParams
    from pagoda.gpu_worker.engine.llm import LLM
    from pagoda.gpu_worker.testing.tiny_model import make_tiny_lora
    torch.set_num_threads(args.threads)
    root = args.model_dir or tempfile.mkdtemp(prefix="pagoda-lora-")
    src = build_model(os.path.join(root, "model"), quick=args.quick)
    names = [f"lora{i}" for i in range(4)]
    paths = {}
    for i, name in enumerate(names):
        path = os.path.join(root, name)
        if not os.path.exists(os.path.join(path, "adapter_config.json")):
            make_tiny_lora(path, src, seed=i, rank=args.rank, alpha=2.0 * args.rank)
        paths[name] = path
    base = LLM(src, device="cpu", num_kv_blocks=512)
    lora = LLM(src, device="cpu", num_kv_blocks=512, enable_lora=True, max_loras=4, max_lora_rank=args.rank,
               lora_modules=paths)
    prompts = [[5 + (7 * i + 3 * j) % 500 for j in range(args.prompt_len)] for i in range(args.batch)]
    params = SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True)
    variants = {"base": (base, None), "lora, 0 adapters": (lora, None), "lora, 1 adapter": (lora, names[0]),
                "lora, 4 adapters mixed": (lora, [names[i % 4] for i in range(args.batch)])}
    cpu: dict[str, list[float]] = {n: [] for n in variants}
    wall: dict[str, list[float]] = {n: [] for n in variants}
    for llm, req in variants.values():      # warm-up round (adapters reach their slots), untimed
        llm.generate(prompts, params, lora_request=req)
    for r in range(args.rounds):
        order = list(variants) if r % 2 == 0 else list(reversed(variants))
        for name in order:
            llm, req = variants[name]
            c0, w0 = time.process_time(), time.perf_counter()
            llm.generate(prompts, params, lora_request=req)
            cpu[name].append(time.process_time() - c0)
            wall[name].append(time.perf_counter() - w0)
    tokens = args.batch * args.tokens
    base_cpu = statistics.median(cpu["base"])
    emit(f"model: {'quick' if args.quick else 'bench'} Llama, fp32, {args.threads} thread(s); adapters rank "
         f"{args.rank} on q/k/v/o/gate/up/down; {args.batch} prompts x {args.prompt_len} tokens, {args.tokens} "
         f"new each, greedy; {args.rounds} rounds alternated")
    emit()
    emit("| variant | tok/s (CPU s) | x base | tok/s (wall) |")
    emit("|---|---|---|---|")
    for name in variants:
        c, w = statistics.median(cpu[name]), statistics.median(wall[name])
        emit(f"| {name} | {tokens / c:.1f} | {base_cpu / c:.3f} | {tokens / w:.1f} |")


def gpu_bench(args) -> None:
    import numpy as np
    import torch
    import torch.nn.functional as F

    from pagoda.kernels.reference import lora_segments
    from pagoda.kernels.triton_lora import lora_expand_triton, lora_shrink_triton
    dev = torch.device("cuda")
    # fused projection: (in, [out slices])
    shapes = {"qkv": (4096, [4096, 1024, 1024]), "o": (4096, [4096]), "gate_up": (4096, [14336, 14336]),
              "down": (14336, [4096])}
    if args.quick:
        shapes = {"qkv": (512, [512, 128, 128]), "down": (1408, [512])}
    g = torch.Generator(device=dev).manual_seed(0)
    r, slots = args.rank, 4

    def timed(fn, reps=20):
        fn()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / reps * 1e3     # us

    emit(f"{torch.cuda.get_device_name()}: one Llama-3-8B layer's projections, bf16, LoRA rank {r}; "
         "us per call (x the base linear)")
    emit()
    emit("| projection (K -> N) | M | base | + LoRA, 1 adapter | + LoRA, 4 adapters mixed |")
    emit("|---|---|---|---|---|")
    for name, (k, outs) in shapes.items():
        n = sum(outs)
        w = torch.randn(n, k, device=dev, generator=g, dtype=torch.bfloat16) * 0.02
        # As pagoda.gpu_worker.features.lora.LoRAProjection holds them: the slices' A stacked, their B block-diagonal.
        a = torch.randn(slots, len(outs) * r, k, device=dev, generator=g, dtype=torch.bfloat16) * 0.02
        b = torch.randn(slots, n, len(outs) * r, device=dev, generator=g, dtype=torch.bfloat16) * 0.02
        for m in (1, 16, 256):
            x = torch.randn(m, k, device=dev, generator=g, dtype=torch.bfloat16)
            segs = [lora_segments(np.zeros(m, np.int64), lambda t: torch.from_numpy(t).to(dev)),
                    lora_segments(np.arange(m, dtype=np.int64) % slots, lambda t: torch.from_numpy(t).to(dev))]

            def with_lora(seg):
                y = F.linear(x, w)
                lora_expand_triton(lora_shrink_triton(x, a, seg), b, seg, y, 0)
                return y

            t0 = timed(lambda: F.linear(x, w))
            t1, t4 = (timed(lambda s=s: with_lora(s)) for s in segs)
            emit(f"| {name} ({k} -> {n}) | {m} | {t0:.1f} | {t1:.1f} ({t1 / t0:.2f}) | {t4:.1f} ({t4 / t0:.2f}) |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--gpu", action="store_true", help="the CUDA layer benchmark instead of the CPU decode one")
    p.add_argument("--quick", action="store_true", help="tiny model, one round: a smoke run")
    p.add_argument("--model-dir", default=None, help="where the checkpoint and adapters are written (reused)")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default=None, help="also write the report (markdown) here")
    args = p.parse_args()
    if args.quick:
        args.batch, args.tokens, args.rounds, args.prompt_len = 4, 4, 1, 8
    gpu_bench(args) if args.gpu else cpu_bench(args)
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(_LINES) + "\n")


if __name__ == "__main__":
    main()
