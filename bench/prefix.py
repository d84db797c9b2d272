"""Time to first token with and without prefix caching, for requests sharing a system prompt.

Every request is one shared system prompt (1024 tokens by default) plus its own user turn.
Two arrival patterns, each on a fresh engine with caching on and one with it off:
- sequential: one request at a time, so TTFT is the prefill alone; the first request is
  cold (it fills the cache), the others find the system prompt's blocks cached;
- burst: all requests arrive together; TTFT includes waiting behind the others' prefill.
A sweep over shared-prefix lengths draws TTFT against prefix length (bench/prefix_ttft.png).

    python bench/prefix.py            # the recorded run
    python bench/prefix.py --quick    # smoke run, seconds
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import random
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import build_model, command_line, machine, markdown_table, now, set_threads  # noqa: E402


def make_requests(prefix_len: int, n: int, vocab: int, seed: int, suffix=(32, 96)) -> list[list[int]]:
    """n prompts = one random shared prefix + a random unique suffix each."""
    rng = random.Random(seed)
    system = [rng.randrange(5, vocab) for _ in range(prefix_len)]
    return [system + [rng.randrange(5, vocab) for _ in range(rng.randint(*suffix))] for _ in range(n)]


def sequential(engine, prompts: list[list[int]], params, tag: str) -> list[float]:
    """TTFT of each request run alone, in order."""
    ttfts = []
    for i, p in enumerate(prompts):
        rid = f"{tag}-s{i}"
        t0 = time.perf_counter()
        engine.add_request(rid, p, params)
        first = None
        while engine.has_unfinished_requests():
            for d in engine.step():
                if first is None and d.request_id == rid and d.token_ids:
                    first = time.perf_counter() - t0
        ttfts.append(first)
    return ttfts


def burst(engine, prompts: list[list[int]], params, tag: str) -> list[float]:
    """TTFT of each request when all arrive at once."""
    firsts: dict[str, float] = {}
    t0 = time.perf_counter()
    for i, p in enumerate(prompts):
        engine.add_request(f"{tag}-b{i}", p, params)
    while engine.has_unfinished_requests():
        for d in engine.step():
            if d.token_ids and d.request_id not in firsts:
                firsts[d.request_id] = time.perf_counter() - t0
    return [firsts[f"{tag}-b{i}"] for i in range(len(prompts))]


def hit_rate(engine, before) -> float:
    s = engine.stats()
    q = s.prefix_cache_queries - before.prefix_cache_queries
    return (s.prefix_cache_hits - before.prefix_cache_hits) / q if q else 0.0


def p90(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(0.9 * (len(xs) - 1))))]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="tiny model and prompts, for smoke tests")
    ap.add_argument("--prefix-len", type=int, default=None, help="shared system prompt tokens (default 1024)")
    ap.add_argument("--num-requests", type=int, default=None, help="requests per pattern (default 16)")
    ap.add_argument("--max-tokens", type=int, default=4, help="output tokens per request")
    ap.add_argument("--sweep", default=None, help="comma list of prefix lengths for the plot")
    ap.add_argument("--kv-tokens", type=int, default=32768)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads, every system")
    ap.add_argument("--model-dir", default=None)
    ap.add_argument("--plot", default=None, help="PNG path (default bench/prefix_ttft.png; none with --quick)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)

    set_threads(args.threads)
    from pagoda.gpu_worker import LLM, SamplingParams
    prefix_len = args.prefix_len or (128 if args.quick else 1024)
    n = args.num_requests or (4 if args.quick else 16)
    sweep = ([int(x) for x in args.sweep.split(",")] if args.sweep
             else [] if args.quick else [128, 256, 512, 1024, 1536])
    model_dir = args.model_dir or os.path.join(
        os.environ.get("TMPDIR", "/tmp"), "pagoda-bench-" + ("quick" if args.quick else "llama-8x512"))
    build_model(model_dir, quick=args.quick)
    with open(os.path.join(model_dir, "config.json")) as f:
        vocab = json.load(f)["vocab_size"]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    block_size = 16

    engines = {}
    for caching in (True, False):
        llm = LLM(model=model_dir, device="cpu", block_size=block_size, num_kv_blocks=args.kv_tokens // block_size,
                  max_model_len=2048, enable_prefix_caching=caching)
        llm.generate([[7] * 8], SamplingParams(temperature=0.0, max_tokens=2))    # warm-up
        engines[caching] = llm.engine

    rows, figures = [], {}
    # Distinct seeds per pattern: a burst must not find the sequential run's prefix cached.
    for pattern, fn, seed in (("sequential", sequential, args.seed), ("burst", burst, args.seed + 1)):
        prompts = make_requests(prefix_len, n, vocab, seed)
        res = {}
        for caching in (True, False):
            eng = engines[caching]
            before = eng.stats()
            t = fn(eng, prompts, params, f"{pattern}-{caching}")
            res[caching] = (t, hit_rate(eng, before))
        off_mean = statistics.mean(res[False][0])
        for caching in (True, False):
            t, hits = res[caching]
            warm = t[1:] if pattern == "sequential" else t
            rows.append([pattern, "on" if caching else "off", f"{1000 * t[0]:.0f}",
                         f"{1000 * statistics.mean(warm):.0f}", f"{1000 * statistics.median(warm):.0f}",
                         f"{1000 * p90(warm):.0f}", f"{1000 * statistics.mean(t):.0f}",
                         f"{off_mean / statistics.mean(t):.2f}", f"{100 * hits:.0f}%"])
            figures[f"{pattern}-{'on' if caching else 'off'}"] = {"ttft_s": t, "hit_rate": hits}

    curve = {True: [], False: []}
    for i, plen in enumerate(sweep):
        prompts = make_requests(plen, max(3, n // 2), vocab, args.seed + 100 + i)
        for caching in (True, False):
            t = sequential(engines[caching], prompts, params, f"sweep{plen}-{caching}")
            curve[caching].append(statistics.median(t[1:]))
    del engines
    gc.collect()

    table = markdown_table(
        ["arrival", "prefix caching", "TTFT first (ms)", "TTFT rest mean (ms)", "rest p50 (ms)",
         "rest p90 (ms)", "TTFT all mean (ms)", "speed-up vs off", "prefix hit rate"], rows)
    print(f"Command: `{command_line()}`  \nDate: {now()}  \nMachine: {machine()}  \n"
          f"Workload: {n} requests per pattern, each a shared {prefix_len}-token system prompt plus a "
          f"random 32-96-token user turn, {args.max_tokens} output tokens, greedy; KV pool "
          f"{args.kv_tokens} tokens, block size {block_size}. \"rest\" = every request after the first "
          f"(sequential) or all of them (burst).\n")
    print(table)
    if sweep:
        print()
        print(markdown_table(["shared prefix tokens", "TTFT median, caching on (ms)", "TTFT median, caching off (ms)", "speed-up"],
                             [[p, f"{1000 * a:.0f}", f"{1000 * b:.0f}", f"{b / a:.2f}"]
                              for p, a, b in zip(sweep, curve[True], curve[False])]))
    plot_path = args.plot or (None if args.quick or not sweep else os.path.join(os.path.dirname(__file__),
                                                                                "prefix_ttft.png"))
    if plot_path and sweep:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(figsize=(7, 4.2))
        ax.plot(sweep, [1000 * x for x in curve[False]], "o-", label="prefix caching off")
        ax.plot(sweep, [1000 * x for x in curve[True]], "o-", label="prefix caching on (warm)")
        ax.set_xlabel("shared system-prompt tokens (+ 32-96 unique tokens per request)")
        ax.set_ylabel("time to first token (ms, median)")
        ax.set_title("TTFT of one request at a time, 8-layer 512-hidden Llama, CPU")
        ax.legend()
        ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(plot_path, dpi=110)
    if args.json:
        figures["sweep"] = {"prefix_len": sweep, "on_s": curve[True], "off_s": curve[False]}
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=2)


if __name__ == "__main__":
    main()
