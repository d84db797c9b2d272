"""End-to-end decode throughput on a GPU with random weights shaped like real checkpoints.

For each shape (Llama-3.2-1B, Llama-3-8B) and batch size, the offline engine generates a fixed
number of tokens per request in three modes: CUDA graphs with async scheduling (the
worker's default), the same with --async-scheduling off (sync), and --enforce-eager. It reports tok/s,
the mean decode step (wall time per engine.step), the model forward's GPU time (CUDA events, so
nothing waits that the worker would not), the rest ("host": the GPU idle per step, which async
output should shrink), and for decode the memory-bound limit: the weights plus the K/V read once
per step at the H200's 4.3 TB/s.

Weights are random (normal, std 0.02) and initialised on the device, so nothing large is written
to disk; config.json carries the real shapes, the tokenizer is the tiny test one (generated ids
past its vocabulary decode to nothing, which costs the detokenizer the same).

  python bench/gpu_e2e.py --out DIR               # on a GPU (bench/gpu_check.sh runs this)
  python bench/gpu_e2e.py --dry-run --out DIR     # tiny shape on the CPU: checks the harness
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

LLAMA3_ROPE = dict(rope_type="llama3", factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=8192, rope_theta=500000.0)
SHAPES = {
    "llama-3.2-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                         num_key_value_heads=8, head_dim=64, vocab_size=128256, tie_word_embeddings=True,
                         max_position_embeddings=131072, rope_scaling=LLAMA3_ROPE, rope_theta=500000.0),
    "llama-3-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                       num_key_value_heads=8, head_dim=128, vocab_size=128256, tie_word_embeddings=False,
                       max_position_embeddings=8192, rope_theta=500000.0),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, vocab_size=1000, max_position_embeddings=1024),
}
HBM_BYTES_PER_S = 4.3e12  # H200


def make_checkpoint(path: str, shape: str) -> str:
    """config.json with the shape's dimensions and the tiny tokenizer; no weight files."""
    from pagoda.gpu_worker.testing.tiny_model import make_tiny_model
    make_tiny_model(path, family="llama", **{**SHAPES["tiny"], "vocab_size": 1000})
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    cfg.update(SHAPES[shape])
    cfg["torch_dtype"] = "bfloat16"
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f, indent=1)
    os.remove(os.path.join(path, "model.safetensors"))
    return path


def random_model(path: str, hf_config, device: torch.device, dtype: torch.dtype, shard=None,
                 model_impl: str = "auto", quant=None) -> torch.nn.Module:
    """Stands in for pagoda.gpu_worker.runner.loader.load_model: the real module tree (this rank's shard of it
    under tensor parallelism; always the native model), random weights on device (unquantized:
    bench/quant.py measures quantized layers)."""
    if quant is not None:
        raise ValueError("quantization: bench/gpu_e2e.py builds unquantized random models")
    from pagoda.gpu_worker.models.parallel import Shard, sharding
    from pagoda.gpu_worker.models.registry import model_class
    with torch.device("meta"), sharding(shard or Shard()):
        model = model_class(hf_config)(hf_config)
    model = model.to(dtype).to_empty(device=device)
    gen = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=gen)
    return model.eval()


def param_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def run_case(llm, batch: int, prompt_len: int, gen_len: int) -> dict:
    """Generate gen_len tokens for `batch` requests; time each engine step and its forward."""
    from pagoda.gpu_worker.core.sampling_params import SamplingParams
    engine, runner = llm.engine, llm.engine.runner
    # (seconds or a pair of CUDA events, pure decode?). Events, not a synchronize: waiting here
    # would undo the overlap of async scheduling that the step times are to show.
    forwards: list[tuple[Any, bool]] = []
    real_run_model = runner.run_model

    def timed_run_model(ids, pos, meta, logits_indices):
        decode = ids.numel() == meta.seq_lens.numel()
        if not ids.is_cuda:
            t = time.perf_counter()
            out = real_run_model(ids, pos, meta, logits_indices)
            forwards.append((time.perf_counter() - t, decode))
            return out
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = real_run_model(ids, pos, meta, logits_indices)
        end.record()
        forwards.append(((start, end), decode))
        return out

    runner.run_model = timed_run_model
    try:
        params = SamplingParams(temperature=0.0, max_tokens=gen_len, ignore_eos=True)
        prompts = [[5 + (i * 7 + j) % 900 for j in range(prompt_len)] for i in range(batch)]
        for i, p in enumerate(prompts):
            engine.add_request(f"b{batch}-{i}", p, params)
        steps: list[tuple[float, float, bool]] = []   # (step s, forward s, pure decode?)
        start = time.perf_counter()
        while engine.has_unfinished_requests():
            before, t = len(forwards), time.perf_counter()
            engine.step()
            if len(forwards) > before:
                steps.append((time.perf_counter() - t, *forwards[-1]))
        wall = time.perf_counter() - start
    finally:
        runner.run_model = real_run_model
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    steps = [(s, f if isinstance(f, float) else f[0].elapsed_time(f[1]) / 1e3, d) for s, f, d in steps]
    dec = [s for s in steps if s[2]] or steps
    step_ms = 1e3 * sum(s[0] for s in dec) / len(dec)
    fwd_ms = 1e3 * sum(s[1] for s in dec) / len(dec)
    return dict(batch=batch, tokens=batch * gen_len, wall_s=wall, tok_s=batch * gen_len / wall,
                decode_step_ms=step_ms, forward_ms=fwd_ms, host_ms=step_ms - fwd_ms, steps=len(steps))


def memory_bound_ms(weights: int, hf: dict, batch: int, ctx: int, elem: int) -> float:
    kv = 2 * hf["num_hidden_layers"] * hf["num_key_value_heads"] * hf["head_dim"] * elem * batch * ctx
    return 1e3 * (weights + kv) / HBM_BYTES_PER_S


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", nargs="+", default=["llama-3.2-1b", "llama-3-8b"], choices=sorted(SHAPES))
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 64, 256])
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--gen-len", type=int, default=64)
    # graphs: CUDA graphs with async scheduling (the default worker); sync: the same with
    # --async-scheduling off; eager: no graphs.
    ap.add_argument("--modes", nargs="+", default=["graphs", "sync", "eager"], choices=["graphs", "sync", "eager"])
    ap.add_argument("--out", required=True, help="directory for e2e.jsonl and e2e.md")
    ap.add_argument("--dry-run", action="store_true", help="tiny shape, batches 1 and 3, on the CPU")
    args = ap.parse_args(argv)
    if args.dry_run:
        args.shapes, args.batches, args.prompt_len, args.gen_len = ["tiny"], [1, 3], 8, 4
    device = "cpu" if args.dry_run else "cuda"
    os.makedirs(args.out, exist_ok=True)
    import tempfile

    from pagoda.gpu_worker import LLM
    from pagoda.gpu_worker.runner import model_runner
    model_runner.load_model = random_model  # type: ignore[assignment]
    rows = []
    with open(os.path.join(args.out, "e2e.jsonl"), "w") as log:
        for shape in args.shapes:
            ckpt = make_checkpoint(tempfile.mkdtemp(prefix=f"pagoda-{shape}-"), shape)
            for mode in args.modes:
                llm = LLM(ckpt, device=device, dtype="float32" if args.dry_run else "bfloat16",
                          max_num_seqs=max(args.batches), max_model_len=args.prompt_len + args.gen_len + 16,
                          gpu_memory_utilization=0.85, enforce_eager=mode == "eager",
                          async_scheduling="off" if mode == "sync" else "auto",
                          num_kv_blocks=64 if args.dry_run else None)
                weights = param_bytes(llm.engine.runner.model)
                for batch in args.batches:
                    r = run_case(llm, batch, args.prompt_len, args.gen_len)
                    ctx = args.prompt_len + args.gen_len // 2
                    r.update(shape=shape, mode=mode, weights_gib=weights / 2**30,
                             bound_ms=memory_bound_ms(weights, SHAPES[shape], batch, ctx, 2))
                    r["bound_share"] = r["bound_ms"] / r["decode_step_ms"]
                    rows.append(r)
                    log.write(json.dumps(r) + "\n")
                    log.flush()
                    print(json.dumps(r), flush=True)
                del llm
                if device == "cuda":
                    torch.cuda.empty_cache()
    lines = ["| shape | mode | batch | tok/s | decode step ms | forward ms | host ms | memory-bound ms | share |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['shape']} | {r['mode']} | {r['batch']} | {r['tok_s']:.0f} | {r['decode_step_ms']:.2f} | "
                     f"{r['forward_ms']:.2f} | {r['host_ms']:.2f} | {r['bound_ms']:.2f} | {r['bound_share']:.0%} |")
    with open(os.path.join(args.out, "e2e.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
