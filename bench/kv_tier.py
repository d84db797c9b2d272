"""Time to first token with and without the host KV tier (issue 23), on a multi-tenant workload
whose prefixes together exceed the device pool.

T tenants each have their own long system prompt (their own cache salt, so tenants never share
blocks); requests visit the tenants in turn, each its tenant's prompt plus a short unique user
turn. The prompts together need more blocks than the device pool holds, so with the device pool
alone LRU evicts every tenant's prompt before that tenant comes back (the classic cyclic thrash)
and each request prefills its whole prompt again; with the tier, the evicted blocks wait in host
memory and come back by copy. One engine of each kind (same device pool), the same requests, run
alternately request by request so that load on the machine falls on both alike; TTFT is that of a
request run alone (no queueing), reported over the requests after the first round (every tenant
seen once). CPU time of the process is given beside wall time (more robust on a shared machine).

A second table (--preemption) runs many long generations through a pool too small for all of them
at once, so the scheduler preempts: recompute (the default) against swap to the host tier, both
engines with the tier (so recompute too finds the evicted full blocks there), as output tokens
per second of CPU time and of wall time, with greedy outputs compared.

    python bench/kv_tier.py               # the recorded run (CPU)
    python bench/kv_tier.py --preemption  # swap against recompute
    python bench/kv_tier.py --quick       # smoke run, seconds
    python bench/kv_tier.py --gpu --rounds 2 --prefix-len 2048    # on CUDA (bench/gpu_check.sh):
                                          # a Llama-3.2-1B-shaped random model in bf16
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import build_model, command_line, kv_bytes_per_token, machine, markdown_table, now, set_threads  # noqa: E402

# --gpu: Llama-3.2-1B's shape (16 layers, hidden 2048, GQA 32/8 of 64), random weights.
GPU_MODEL = dict(num_hidden_layers=16, hidden_size=2048, intermediate_size=8192, num_attention_heads=32,
                 num_key_value_heads=8, head_dim=64, max_position_embeddings=8192)


def workload(tenants: int, prefix_len: int, rounds: int, vocab: int, seed: int) -> list[tuple[str, list[int]]]:
    """(cache salt, prompt) per request: the tenants in turn, `rounds` times."""
    rng = random.Random(seed)
    systems = [[rng.randrange(5, vocab) for _ in range(prefix_len)] for _ in range(tenants)]
    return [(f"tenant-{t}", systems[t] + [rng.randrange(5, vocab) for _ in range(rng.randint(16, 48))])
            for _ in range(rounds) for t in range(tenants)]


def first_token(engine, rid: str, prompt: list[int], salt: str, params) -> tuple[float, float, int]:
    """(wall s, CPU s, cached tokens) to the request's first token, run alone; then drained."""
    t0, c0 = time.perf_counter(), time.process_time()
    engine.add_request(rid, prompt, params, cache_salt=salt)
    out = None
    while engine.has_unfinished_requests():
        for d in engine.step():
            if out is None and d.request_id == rid and d.token_ids:
                out = (time.perf_counter() - t0, time.process_time() - c0, d.num_cached_tokens)
    assert out is not None
    return out


def preemption(args, model_dir: str, vocab: int, device: str, common: dict, host_gib: float) -> str:
    """Swap against recompute: the same generations through a pool that holds about half of them
    at once; each variant twice, alternated. Returns the markdown table."""
    from pagoda.gpu_worker import LLM, SamplingParams
    rng = random.Random(args.seed + 7)
    n, prompt_len, out_len = (8, 32, 48) if args.quick else (32, 256, 256)
    prompts = [[rng.randrange(5, vocab) for _ in range(prompt_len)] for _ in range(n)]
    blocks = n * (prompt_len + out_len) // 16 // 2
    params = SamplingParams(temperature=0.0, max_tokens=out_len, ignore_eos=True)
    llms = {mode: LLM(model=model_dir, **{**common, "num_kv_blocks": blocks}, max_num_seqs=n,
                      kv_offloading_size=host_gib, preemption_mode=mode) for mode in ("recompute", "swap")}
    runs: dict[str, list[tuple[float, float]]] = {m: [] for m in llms}
    outputs = {}
    for rep in range(2):
        for mode in (("recompute", "swap") if rep % 2 == 0 else ("swap", "recompute")):
            llm = llms[mode]
            sync(device)
            t0, c0 = time.perf_counter(), time.process_time()
            outs = llm.generate(prompts, params)
            sync(device)
            runs[mode].append((time.perf_counter() - t0, time.process_time() - c0))
            outputs[mode] = [o.outputs[0].token_ids for o in outs]
    tokens = n * out_len
    rows = []
    for mode, llm in llms.items():
        st = llm.engine.stats()
        wall = statistics.mean(w for w, _ in runs[mode])
        cpu = statistics.mean(c for _, c in runs[mode])
        rows.append([mode, f"{tokens / wall:.0f}", f"{tokens / cpu:.0f}", st.preemptions // 2, st.swaps // 2,
                     st.num_steps // 2, st.kv_copied_blocks // 2])
    same = outputs["swap"] == outputs["recompute"]
    return (f"{n} requests x {prompt_len} prompt + {out_len} output tokens, greedy; device pool {blocks} blocks "
            f"of 16 (about half the requests' final size); 2 runs each, alternated; greedy outputs equal: {same}\n\n"
            + markdown_table(["preemption", "output tok/s (wall)", "output tok/s (CPU)", "preemptions per run",
                              "swaps per run", "steps per run", "blocks copied per run"], rows))


def sync(device: str) -> None:
    if device == "cuda":
        import torch
        torch.cuda.synchronize()


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="tiny model and prompts, for smoke tests")
    ap.add_argument("--gpu", action="store_true", help="CUDA, a Llama-3.2-1B-shaped model in bf16")
    ap.add_argument("--tenants", type=int, default=8)
    ap.add_argument("--prefix-len", type=int, default=None, help="tokens of each tenant's prompt")
    ap.add_argument("--rounds", type=int, default=None, help="visits of each tenant")
    ap.add_argument("--device-tokens", type=int, default=None,
                    help="device pool, tokens (default: half of all tenants' prompts)")
    ap.add_argument("--host-gib", type=float, default=None, help="host tier (default: room for every prompt)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model-dir", default=None)
    ap.add_argument("--json", default=None)
    ap.add_argument("--out", default=None, help="also write the markdown table here")
    ap.add_argument("--preemption", action="store_true", help="also run swap against recompute preemption")
    args = ap.parse_args(argv)

    set_threads(args.threads)
    from pagoda.gpu_worker import LLM, SamplingParams
    device = "cuda" if args.gpu else "cpu"
    prefix_len = args.prefix_len or (96 if args.quick else 4096 if args.gpu else 1024)
    rounds = args.rounds or (2 if args.quick else 3)
    block = 16
    model_dir = args.model_dir or os.path.join(os.environ.get("TMPDIR", "/tmp"), "pagoda-bench-" + (
        "quick" if args.quick else "llama-1b-shape" if args.gpu else "llama-8x512"))
    if args.gpu and not os.path.exists(os.path.join(model_dir, "config.json")):
        from pagoda.gpu_worker.testing.tiny_model import make_tiny_model
        make_tiny_model(model_dir, family="llama", seed=0, **GPU_MODEL)
    else:
        build_model(model_dir, quick=args.quick)
    with open(os.path.join(model_dir, "config.json")) as f:
        vocab = json.load(f)["vocab_size"]
    total = args.tenants * (prefix_len + 64)
    device_tokens = args.device_tokens or total // 2
    elem = 2 if args.gpu else 4
    host_gib = args.host_gib if args.host_gib is not None else \
        2 * total * kv_bytes_per_token(model_dir) * elem / 4 / 2**30
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    # On CUDA without decode graphs: TTFT is a prefill, and capturing them twice would take most
    # of the GPU check's minute.
    common = dict(device=device, block_size=block, num_kv_blocks=device_tokens // block,
                  max_model_len=prefix_len + 128, dtype="bfloat16" if args.gpu else "auto",
                  enforce_eager=args.gpu)
    engines = {}
    for name, extra in (("device only", {}), ("host tier", {"kv_offloading_size": host_gib})):
        llm = LLM(model=model_dir, **common, **extra)
        llm.generate([[7] * 8], SamplingParams(temperature=0.0, max_tokens=2))     # warm-up
        engines[name] = llm.engine
    requests = workload(args.tenants, prefix_len, rounds, vocab, args.seed)
    res: dict[str, list[tuple[float, float, int]]] = {n: [] for n in engines}
    names = list(engines)
    for i, (salt, prompt) in enumerate(requests):
        for name in (names if i % 2 == 0 else names[::-1]):       # alternate who goes first
            sync(device)
            res[name].append(first_token(engines[name], f"{name}-{i}", prompt, salt, params))

    warm = slice(args.tenants, None)          # after every tenant was seen once
    base = statistics.mean(w for w, _, _ in res["device only"][warm])
    base_cpu = statistics.mean(c for _, c, _ in res["device only"][warm])
    rows, figures = [], {}
    for name, eng in engines.items():
        r = res[name][warm]
        wall, cpu = [w for w, _, _ in r], [c for _, c, _ in r]
        cached = sum(k for _, _, k in r) / sum(len(p) for _, p in requests[warm])
        st = eng.stats()
        rows.append([name, f"{1000 * statistics.mean(wall):.1f}", f"{1000 * statistics.median(wall):.1f}",
                     f"{1000 * sorted(wall)[int(0.9 * (len(wall) - 1))]:.1f}", f"{1000 * statistics.mean(cpu):.1f}",
                     f"{base / statistics.mean(wall):.2f}", f"{base_cpu / statistics.mean(cpu):.2f}",
                     f"{100 * cached:.0f}%", st.kv_copied_blocks])
        figures[name] = {"ttft_s": [w for w, _, _ in res[name]], "cpu_s": [c for _, c, _ in res[name]],
                         "cached_tokens": [k for _, _, k in res[name]], "copied_blocks": st.kv_copied_blocks,
                         "copy_seconds": st.kv_copy_seconds}
    table = markdown_table(["engine", "TTFT mean ms", "median ms", "p90 ms", "CPU ms", "speed-up (wall)",
                            "speed-up (CPU)", "prompt tokens cached", "blocks copied"], rows)
    head = (f"{now()}, {machine()}, device {device}\n"
            f"{args.tenants} tenants x {prefix_len}-token prompts (+16-48 own tokens), {rounds} rounds; "
            f"device pool {device_tokens} tokens ({device_tokens // block} blocks of {block}), "
            f"host tier {host_gib:.3f} GiB; warm requests: {len(requests) - args.tenants}\n")
    print(head)
    print(table)
    swap_table = preemption(args, model_dir, vocab, device, common, host_gib) if args.preemption else ""
    if swap_table:
        print("\n" + swap_table)
    print(f"\n`{command_line()}`")
    if args.out:
        with open(args.out, "w") as f:
            f.write(head + "\n" + table + "\n" + (swap_table and "\n" + swap_table + "\n"))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "figures": figures}, f)


if __name__ == "__main__":
    main()
