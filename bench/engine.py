"""Offline throughput: pagoda's engine against transformers, at equal KV-cache memory.

Three systems, one process, one model, one seeded ShareGPT-like workload (ignore_eos, greedy):
- pagoda: LLM.generate over all requests (continuous batching, paged KV, chunked prefill);
- hf-cb: transformers' own continuous batching (ContinuousBatchingManager, the engine
  behind generate_batch) with its paged cache sized to the same number of 16-token blocks;
- hf-static: transformers generate() on padded static batches, each batch as large as fits
  the budget when every request reserves its maximum length (prompt + output, padded).

Prints a markdown table: output tokens/s, pagoda's ratio to each peer, KV utilisation
(tokens stored / slots allocated, sampled every step; pagoda's from EngineStats) and pool
occupancy.

    python bench/engine.py            # the recorded run (about 11 min on 2 cores)
    python bench/engine.py --quick    # smoke run, seconds
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import (  # noqa: E402
    KVSampler,
    Workload,
    build_model,
    command_line,
    hook_hf_cb_kv,
    kv_bytes_per_token,
    machine,
    markdown_table,
    now,
    set_threads,
    sharegpt_like,
)

SYSTEMS = ("pagoda", "hf-cb", "hf-static")


class Result:
    def __init__(self, name: str, how: str, wall: float, workload: Workload, sampler: KVSampler,
                 outputs: list[list[int]], extra: str = ""):
        self.name, self.how, self.wall, self.sampler = name, how, wall, sampler
        self.outputs = outputs
        self.output_tokens = workload.output_tokens
        self.total_tokens = workload.output_tokens + workload.prompt_tokens
        self.extra = extra

    @property
    def tok_s(self) -> float:
        return self.output_tokens / self.wall


# ---- pagoda ------------------------------------------------------------------------------

def run_pagoda(model_dir: str, wl: Workload, budget_blocks: int, args) -> Result:
    from pagoda.gpu_worker import LLM, SamplingParams
    llm = LLM(model=model_dir, device="cpu", block_size=args.block_size, num_kv_blocks=budget_blocks,
              max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
              max_model_len=args.max_model_len)
    warm = [r.prompt[:16] for r in wl.requests[:4]]
    llm.generate(warm, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    sampler = KVSampler(budget_blocks * args.block_size)
    params = [SamplingParams(temperature=0.0, max_tokens=r.output_len, ignore_eos=True) for r in wl.requests]
    engine = llm.engine
    t0 = time.perf_counter()

    def run() -> list[list[int]]:
        """The engine driven step by step, so that KV use is read from EngineStats after each."""
        out: list[list[int]] = [[] for _ in wl.requests]
        for i, (r, p) in enumerate(zip(wl.requests, params)):
            engine.add_request(str(i), r.prompt, p)
        while engine.has_unfinished_requests():
            for d in engine.step():
                out[int(d.request_id)].extend(d.token_ids)
            st = engine.stats()
            sampler.add(st.tokens_stored, st.blocks_held * st.block_size, time.perf_counter() - t0)
        return out

    t0 = time.perf_counter()
    if args.profile:
        import cProfile
        import pstats
        prof = cProfile.Profile()
        tokens = prof.runcall(run)
        wall = time.perf_counter() - t0
        prof.dump_stats(args.profile)
        pstats.Stats(prof, stream=sys.stderr).sort_stats("tottime").print_stats(25)
    else:
        tokens = run()
        wall = time.perf_counter() - t0
    st = engine.stats()
    extra = f"preemptions {st.preemptions}"
    del llm
    gc.collect()
    return Result("pagoda", "continuous batching, paged KV", wall, wl, sampler, tokens, extra)


# ---- transformers ------------------------------------------------------------------------

def load_hf(model_dir: str):
    import torch
    import transformers
    transformers.logging.set_verbosity_error()
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return model.eval()


def run_hf_cb(model_dir: str, wl: Workload, budget_blocks: int, args, pad_id: int) -> Result:
    import torch
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig
    model = load_hf(model_dir)
    gen = GenerationConfig(do_sample=False, eos_token_id=-1, pad_token_id=pad_id,
                           max_new_tokens=max(r.output_len for r in wl.requests))

    def cb_config():
        # Same block size, same number of blocks, same per-step token budget and sequence cap.
        return ContinuousBatchingConfig(page_size=args.block_size, num_blocks=budget_blocks,
                                        max_batch_tokens=args.max_num_batched_tokens,
                                        max_requests_per_batch=args.max_num_seqs)

    with torch.no_grad():
        warm = [r.prompt[:16] for r in wl.requests[:4]]
        model.generate_batch(warm, generation_config=gen, continuous_batching_config=cb_config(),
                             warmup=False, max_new_tokens=4)
        model.destroy_cached_continuous_batching_manager()
        manager = model.init_continuous_batching(generation_config=gen, continuous_batching_config=cb_config())
        # Build the processor here (start() reuses it) so that the sampler hooks it before any step.
        manager.batch_processor = manager._create_batch_processor()
        capacity = manager.batch_processor.cache.num_blocks * args.block_size
        sampler = KVSampler(capacity)
        t0 = time.perf_counter()
        hook_hf_cb_kv(manager.batch_processor, sampler, lambda: time.perf_counter() - t0)
        manager.start()
        try:
            t0 = time.perf_counter()
            ids = [manager.add_request(r.prompt, request_id=f"r{i}", max_new_tokens=r.output_len, eos_token_id=-1)
                   for i, r in enumerate(wl.requests)]
            done: dict[str, list[int]] = {}
            while len(done) < len(ids):
                res = manager.get_result(timeout=1)
                if res is None:
                    if not manager.is_running():
                        raise RuntimeError("transformers continuous batching stopped early")
                    continue
                if res.is_finished():
                    if res.error is not None:
                        raise RuntimeError(f"transformers continuous batching: {res.error}")
                    done[res.request_id] = list(res.generated_tokens)
            wall = time.perf_counter() - t0
        finally:
            manager.stop(block=True, timeout=10)
            manager.destroy()
    tokens = [done[f"r{i}"] for i in range(len(wl.requests))]
    extra = f"cache {capacity} token slots"
    model = manager = None   # free before the next system loads (closures hold the names)
    gc.collect()
    return Result("hf-cb", "transformers continuous batching", wall, wl, sampler, tokens, extra)


def static_batches(wl: Workload, budget_tokens: int) -> list[list[int]]:
    """Arrival-order batches, each the longest run whose padded reservation
    len(batch) * (longest prompt + longest output) fits the budget."""
    batches, cur, p_max, o_max = [], [], 0, 0
    for i, r in enumerate(wl.requests):
        p, o = max(p_max, len(r.prompt)), max(o_max, r.output_len)
        if cur and (len(cur) + 1) * (p + o) > budget_tokens:
            batches.append(cur)
            cur, p, o = [], len(r.prompt), r.output_len
        cur.append(i)
        p_max, o_max = p, o
    if cur:
        batches.append(cur)
    return batches


def run_hf_static(model_dir: str, wl: Workload, budget_tokens: int, args, pad_id: int) -> Result:
    import torch
    from transformers import GenerationConfig, LogitsProcessor, LogitsProcessorList
    model = load_hf(model_dir)
    model.generation_config.eos_token_id = None    # ignore_eos: run every row to max_new_tokens
    sampler = KVSampler(budget_tokens)
    t0 = time.perf_counter()

    class Probe(LogitsProcessor):
        """Called once per decoding step: records what the batch's KV holds vs. reserves."""
        def __init__(self, prompt_lens, out_lens, pad_len):
            self.p, self.o, self.pad_len = prompt_lens, out_lens, pad_len
            self.reserved = len(prompt_lens) * (max(prompt_lens) + max(out_lens))

        def __call__(self, input_ids, scores):
            k = input_ids.shape[1] - self.pad_len     # tokens generated so far
            stored = sum(p + min(k, o - 1) for p, o in zip(self.p, self.o))
            sampler.add(stored, self.reserved, time.perf_counter() - t0)
            return scores

    def generate(idx: list[int], probe: bool):
        reqs = [wl.requests[i] for i in idx]
        p_max = max(len(r.prompt) for r in reqs)
        o_max = max(r.output_len for r in reqs)
        ids = torch.full((len(reqs), p_max), pad_id, dtype=torch.long)
        mask = torch.zeros((len(reqs), p_max), dtype=torch.long)
        for row, r in enumerate(reqs):    # left padding, as decoder-only generation needs
            ids[row, p_max - len(r.prompt):] = torch.tensor(r.prompt)
            mask[row, p_max - len(r.prompt):] = 1
        procs = LogitsProcessorList([Probe([len(r.prompt) for r in reqs], [r.output_len for r in reqs], p_max)]
                                    if probe else [])
        cfg = GenerationConfig(do_sample=False, max_new_tokens=o_max, min_new_tokens=o_max,
                               pad_token_id=pad_id, eos_token_id=None)
        out = model.generate(input_ids=ids, attention_mask=mask, generation_config=cfg, logits_processor=procs)
        return [out[row, p_max:p_max + r.output_len].tolist() for row, r in enumerate(reqs)]

    batches = static_batches(wl, budget_tokens)
    with torch.no_grad():
        generate(list(range(min(4, len(wl.requests)))), probe=False)     # warm-up
        tokens: list[list[int]] = [[] for _ in wl.requests]
        t0 = time.perf_counter()
        for idx in batches:
            for i, toks in zip(idx, generate(idx, probe=True)):
                tokens[i] = toks
        wall = time.perf_counter() - t0
    sizes = [len(b) for b in batches]
    extra = f"{len(batches)} batches of {min(sizes)}-{max(sizes)} (mean {sum(sizes) / len(sizes):.1f})"
    model = None
    gc.collect()
    return Result("hf-static", "transformers generate, static batches", wall, wl, sampler, tokens, extra)


# ---- report ------------------------------------------------------------------------------

def agreement(a: list[list[int]], b: list[list[int]]) -> float:
    """Share of requests whose greedy outputs are identical (a sanity check, not a metric)."""
    return sum(x == y for x, y in zip(a, b)) / len(a)


def report(results: dict[str, Result], wl: Workload, args, budget_tokens: int, kv_per_tok: int) -> str:
    base = results.get("pagoda")
    rows = []
    for r in results.values():
        if len(r.outputs) != len(wl.requests) or any(len(t) != q.output_len for t, q in zip(r.outputs, wl.requests)):
            raise RuntimeError(f"{r.name}: output lengths differ from the requested ones")
        ratio = base.tok_s / r.tok_s if base else float("nan")
        same = agreement(base.outputs, r.outputs) if base else float("nan")
        rows.append([r.name, r.how, f"{r.tok_s:.1f}", f"{r.total_tokens / r.wall:.1f}", f"{r.wall:.1f}",
                     "1.00" if r is base else f"{ratio:.2f}", f"{100 * r.sampler.utilisation():.1f}%",
                     f"{100 * r.sampler.occupancy():.1f}%", r.sampler.steps, f"{100 * same:.0f}%", r.extra])
    table = markdown_table(
        ["system", "batching", "output tok/s", "total tok/s", "wall s", "pagoda ×", "KV util",
         "pool occupancy", "steps", "same tokens as pagoda", "notes"], rows)
    head = (f"Command: `{command_line()}`  \nDate: {now()}  \nMachine: {machine()}  \n"
            f"Workload: {wl.describe()}; {wl.prompt_tokens} prompt + {wl.output_tokens} output tokens.  \n"
            f"KV budget: {budget_tokens} tokens = {budget_tokens // args.block_size} blocks of "
            f"{args.block_size} = {budget_tokens * kv_per_tok / 2**20:.1f} MiB for every system; "
            f"token budget per step {args.max_num_batched_tokens}, at most {args.max_num_seqs} sequences.\n")
    return head + "\n" + table + "\n"


def plot(results: dict[str, Result], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(9, 6.5), sharex=True)
    for r in results.values():
        s = r.sampler
        cap = s.capacity_tokens
        ax1.plot(s.times, [a / cap for a in s.allocated], lw=1, label=f"{r.name} allocated")
        ax2.plot(s.times, [x / a for x, a in zip(s.stored, s.allocated)], lw=1, label=r.name)
    ax1.set_ylabel("KV slots allocated / budget")
    ax1.set_ylim(0, 1.05)
    ax1.legend(loc="lower right", fontsize=8)
    ax2.set_ylabel("tokens stored / slots allocated")
    ax2.set_xlabel("seconds since the first request")
    ax2.set_ylim(0, 1.05)
    ax2.legend(loc="lower right", fontsize=8)
    fig.suptitle("KV memory over one run of the workload (same budget for all)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="tiny model and workload, for smoke tests")
    ap.add_argument("--num-requests", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads, every system")
    ap.add_argument("--kv-tokens", type=int, default=None, help="KV budget in tokens, every system")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma list of {SYSTEMS}")
    ap.add_argument("--model-dir", default=None, help="where the random checkpoint is built or reused")
    ap.add_argument("--plot", default=None, help="PNG of KV use over time (default bench/engine_kv.png)")
    ap.add_argument("--json", default=None, help="write the figures as JSON here")
    ap.add_argument("--profile", default=None, help="cProfile pagoda's run into this file")
    args = ap.parse_args(argv)

    set_threads(args.threads)
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    for s in systems:
        if s not in SYSTEMS:
            ap.error(f"--systems: unknown system {s!r}; choose from {', '.join(SYSTEMS)}")
    n = args.num_requests or (12 if args.quick else 256)
    kv_tokens = args.kv_tokens or (1024 if args.quick else 16384)
    if kv_tokens % args.block_size:
        ap.error("--kv-tokens: must be a multiple of --block-size")
    model_dir = args.model_dir or os.path.join(
        os.environ.get("TMPDIR", "/tmp"), "pagoda-bench-" + ("quick" if args.quick else "llama-8x512"))
    build_model(model_dir, quick=args.quick)
    with open(os.path.join(model_dir, "config.json")) as f:
        cfg = json.load(f)
    wl = sharegpt_like(n, cfg["vocab_size"], seed=args.seed, scale=0.25 if args.quick else 1.0)
    if wl.max_len > kv_tokens:
        ap.error(f"--kv-tokens: {kv_tokens} cannot hold the longest request ({wl.max_len} tokens)")
    pad_id = cfg.get("pad_token_id") or 0
    blocks = kv_tokens // args.block_size

    results: dict[str, Result] = {}
    for s in systems:
        print(f"[bench] running {s} ...", file=sys.stderr, flush=True)
        if s == "pagoda":
            results[s] = run_pagoda(model_dir, wl, blocks, args)
        elif s == "hf-cb":
            results[s] = run_hf_cb(model_dir, wl, blocks, args, pad_id)
        else:
            results[s] = run_hf_static(model_dir, wl, kv_tokens, args, pad_id)
        print(f"[bench] {s}: {results[s].tok_s:.1f} output tok/s in {results[s].wall:.1f}s",
              file=sys.stderr, flush=True)
    print(report(results, wl, args, kv_tokens, kv_bytes_per_token(model_dir)))
    plot_path = args.plot or (None if args.quick else os.path.join(os.path.dirname(__file__), "engine_kv.png"))
    if plot_path:
        plot(results, plot_path)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({k: {"output_tok_s": r.tok_s, "wall_s": r.wall, "kv_util": r.sampler.utilisation(),
                           "occupancy": r.sampler.occupancy(), "steps": r.sampler.steps}
                       for k, r in results.items()}, f, indent=2)


if __name__ == "__main__":
    main()
