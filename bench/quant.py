"""Quantized weights: bytes held and decode speed per format, against the unquantized model.

CPU (default): the benchmark Llama (bench/common.py: 8 layers, hidden 512, fp32) unquantized,
with --quantization fp8 at load, and as pre-quantized checkpoints written by pagoda.gpu_worker.testing.tiny_quant
(compressed-tensors fp8 per channel, vLLM fp8 with 128x128 blocks, GPTQ, AWQ and compressed-tensors
int4, group 128).
Every variant loads once; then rounds alternate the variants, each decoding the same greedy batch
(--batch prompts, --tokens new tokens each), timed in process CPU time (/proc, robust on a shared
machine) and wall time. Reported: weight bytes (as the worker logs them), decode tok/s per CPU
second with its ratio to the unquantized model (median of the rounds), and how many greedy tokens
agree with the unquantized model's. On CPU quantized layers dequantize per call (the exact
twin of the CUDA kernels), so they trade speed for memory here; the memory is the figure that
carries over to a GPU.

--gpu: one Llama-3-8B decoder layer's linears (q/k/v fused 4096x6144, o 4096x4096, gate/up
4096x28672, down 14336x4096) at M = 1, 16, 256 rows: bf16 F.linear against fp8 torch._scaled_mm
(per-token activations), the fp8 128x128-block and the int4 Triton kernels, CUDA-event timed, with weight GB/s (decode is
bound by weight bytes: 4.8 TB/s on an H200). bench/gpu_check.sh runs it.
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

# name: (format for tiny_quant or None, its options, --quantization flag)
VARIANTS = {
    "none": (None, {}, None),
    "fp8 (at load)": (None, {}, "fp8"),
    "compressed-tensors fp8 channel": ("compressed-tensors", {"strategy": "channel"}, None),
    "fp8 block 128x128": ("fp8", {"block": (128, 128)}, None),
    "gptq int4 g128": ("gptq", {"group_size": 128}, None),
    "awq int4 g128": ("awq", {"group_size": 128}, None),
    "compressed-tensors int4 g128": ("compressed-tensors-w4a16", {"group_size": 128}, None),
}


_LINES: list[str] = []


def emit(line: str = "") -> None:
    """Print a line of the report; main writes them all to --out too."""
    print(line, flush=True)
    _LINES.append(line)


def cpu_bench(args) -> None:
    import torch

    from pagoda.gpu_worker.core.sampling_params import SamplingParams
    from pagoda.gpu_worker.engine.llm import LLM
    from pagoda.gpu_worker.testing.tiny_quant import quantize_checkpoint
    torch.set_num_threads(args.threads)
    root = args.model_dir or tempfile.mkdtemp(prefix="pagoda-quant-")
    src = build_model(os.path.join(root, "model"), quick=args.quick)
    variants = {k: v for k, v in VARIANTS.items() if not args.only or k == "none" or k in args.only}
    if args.quick:     # the quick model's 64-wide layers take no 128 blocks or groups
        variants = {k: (f, {**o, "group_size": 32} if "group_size" in o else {"block": (32, 32)} if "block" in o else o, q)
                    for k, (f, o, q) in variants.items()}
    llms = {}
    for name, (fmt, opts, flag) in variants.items():
        path = src
        if fmt is not None:
            path = os.path.join(root, name.replace(" ", "-"))
            if not os.path.exists(os.path.join(path, "config.json")):
                path = quantize_checkpoint(src, path, fmt, **opts)[0]
        llms[name] = LLM(path, device="cpu", num_kv_blocks=512, quantization=flag)
    prompts = [[5 + (7 * i + 3 * j) % 500 for j in range(args.prompt_len)] for i in range(args.batch)]
    params = SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True)
    outs: dict[str, list] = {}
    cpu: dict[str, list[float]] = {n: [] for n in llms}
    wall: dict[str, list[float]] = {n: [] for n in llms}
    for name, llm in llms.items():      # warm-up round, untimed
        outs[name] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    for r in range(args.rounds):
        order = list(llms) if r % 2 == 0 else list(reversed(llms))
        for name in order:
            c0, w0 = time.process_time(), time.perf_counter()
            llms[name].generate(prompts, params)
            cpu[name].append(time.process_time() - c0)
            wall[name].append(time.perf_counter() - w0)
    # Teacher-forced agreement: every variant scores the unquantized model's greedy text; its top-1
    # token at each generated position is compared with that text, and its log-probability of the
    # text with the unquantized model's (a random model is chaotic: one flipped greedy token
    # changes all that follows, so the free-running greedy overlap says little).
    seqs = [p + o for p, o in zip(prompts, outs["none"])]
    score = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1)
    forced: dict[str, tuple[int, list[float]]] = {}
    for name, llm in llms.items():
        agree, lps = 0, []
        for p, res in zip(prompts, llm.generate(seqs, score)):
            entries = res.prompt_logprobs or []
            for j in range(len(p), len(res.prompt_token_ids)):
                e = entries[j]
                agree += int(e is not None and e.top[0].token_id == res.prompt_token_ids[j])
                lps.append(e.sampled.logprob if e is not None else float("nan"))
        forced[name] = (agree, lps)
    tokens = args.batch * args.tokens
    base_cpu = statistics.median(cpu["none"])
    base_bytes = llms["none"].engine.runner.weight_bytes
    ref = outs["none"]
    emit(f"model: {'quick' if args.quick else 'bench'} Llama, fp32, {args.threads} thread(s); "
         f"{args.batch} prompts x {args.prompt_len} tokens, {args.tokens} new each, greedy; "
         f"{args.rounds} rounds alternated")
    emit()
    emit("| weights | bytes (MiB) | bytes x none | decode tok/s (CPU s) | tok/s x none | tok/s (wall) | "
         "greedy tokens = none | teacher-forced top-1 = none | mean abs d logprob |")
    emit("|---|---|---|---|---|---|---|---|---|")
    for name, llm in llms.items():
        b = llm.engine.runner.weight_bytes
        c, w = statistics.median(cpu[name]), statistics.median(wall[name])
        agree = sum(_common_prefix(a, z) for a, z in zip(outs[name], ref))
        top1, lps = forced[name]
        dlp = statistics.fmean(abs(a - z) for a, z in zip(lps, forced["none"][1]))
        emit(f"| {name} | {b / 2**20:.2f} | {b / base_bytes:.3f} | {tokens / c:.1f} | {base_cpu / c:.2f} | "
             f"{tokens / w:.1f} | {agree}/{tokens} | {top1}/{tokens} | {dlp:.3f} |")


def _common_prefix(a, b) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def gpu_bench(args) -> None:
    import torch
    import torch.nn.functional as F

    from pagoda.gpu_worker.features.quantization import fp8_scaled_mm
    from pagoda.kernels.quant_ref import pack_int4_rows, quantize_fp8_per_channel
    from pagoda.kernels.triton_quant import fp8_matmul_triton, int4_matmul_triton
    dev = torch.device("cpu" if args.dry_run else "cuda")
    shapes = {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672), "down": (14336, 4096)}
    if args.quick:
        shapes = {"qkv": (512, 768), "down": (1408, 512)}
    if args.dry_run:    # the same calls on the CPU (Triton interpreted), to check the script
        shapes = {"qkv": (256, 128)}
    g = torch.Generator(device=dev).manual_seed(0)

    def timed(fn, reps=10):     # few: gpu_check gives this part 35 s, most of it Triton compiles
        if args.dry_run:
            t0 = time.perf_counter()
            fn()
            return (time.perf_counter() - t0) * 1e6
        fn()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / reps * 1e3     # us

    where = "dry run on the CPU" if args.dry_run else torch.cuda.get_device_name()
    emit(f"{where}: one Llama-3-8B layer's linears, us per call (weight GB/s)")
    emit()
    emit("| linear (K x N) | M | bf16 | fp8 _scaled_mm | fp8 128x128 triton | int4 triton (g128) |")
    emit("|---|---|---|---|---|---|")
    for name, (k, n) in shapes.items():
        w = torch.randn(n, k, device=dev, generator=g, dtype=torch.bfloat16) * 0.02
        q8, s8 = quantize_fp8_per_channel(w)
        sb = s8.reshape(-1, 1)[::128].expand(-(-n // 128), -(-k // 128)).contiguous()    # any block scales
        q4 = torch.randint(0, 16, (k, n), device=dev, generator=g)
        qw = pack_int4_rows(q4)
        zeros = torch.full((k // 128, n), 8, dtype=torch.uint8, device=dev)
        scales = torch.full((k // 128, n), 0.01, dtype=torch.float16, device=dev)
        g_idx = (torch.arange(k, device=dev) // 128).int()
        for m in ((1, 16) if args.dry_run else (1, 16, 256)):
            x = torch.randn(m, k, device=dev, generator=g, dtype=torch.bfloat16)
            t16 = timed(lambda: F.linear(x, w))
            t8 = timed(lambda: fp8_scaled_mm(x, q8, s8))
            tb = timed(lambda: fp8_matmul_triton(x, q8, sb, (128, 128)))
            t4 = timed(lambda: int4_matmul_triton(x, qw, zeros, scales, g_idx))
            gbs = [n * k * b / t / 1e3 for b, t in ((2, t16), (1, t8), (1, tb), (0.5, t4))]
            emit(f"| {name} ({k} x {n}) | {m} | {t16:.1f} ({gbs[0]:.0f}) | {t8:.1f} ({gbs[1]:.0f}) | "
                 f"{tb:.1f} ({gbs[2]:.0f}) | {t4:.1f} ({gbs[3]:.0f}) |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--gpu", action="store_true", help="the CUDA layer benchmark instead of the CPU decode one")
    p.add_argument("--quick", action="store_true", help="tiny model, one round: a smoke run")
    p.add_argument("--model-dir", default=None, help="where checkpoints are written (reused)")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--dry-run", action="store_true", help="with --gpu: run its calls on the CPU at a tiny shape")
    p.add_argument("--out", default=None, help="also write the report (markdown) here")
    p.add_argument("--only", nargs="*", default=None, help="variants beside none (default: all)")
    args = p.parse_args()
    if args.quick:
        args.batch, args.tokens, args.rounds, args.prompt_len = 2, 4, 1, 8
    gpu_bench(args) if args.gpu else cpu_bench(args)
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(_LINES) + "\n")


if __name__ == "__main__":
    main()
