"""Beam search on CPU: KV blocks held and beam tokens per second of width-4 beam search with
blocks shared among beams (copy-on-write of the partial block) against a fork that copies
every block (what a pool without reference counts would have to do), and against vLLM's way
(a driver outside the engine: each step, every beam is a fresh one-token request with
logprobs = 2 * width, sharing full blocks with its siblings through the prefix cache).

The engine variants run the same requests through one LLMEngine (its KV manager's
share_on_fork toggled, prefix caching off), the driver through a second one with prefix
caching on; they alternate over --rounds, all searches of a round together; per variant: the
peak of blocks held during the search (sampled once each step is scheduled), the blocks copied,
single-thread CPU time (time.process_time) per round and the beams' tokens per CPU second, and
whether the beams came out identical.

    PYTHONPATH=$PWD python bench/beam.py [--rounds 3] [--prompt-len 512] [--max-tokens 64]
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

VARIANTS = (("shared", True), ("copied", False), ("driver", None))


class Peak:
    """Blocks held, at their peak: sampled right after each step is scheduled (its blocks
    allocated), before its requests can end and free them."""

    def __init__(self, engine):
        self.engine, self.value = engine, 0
        schedule = engine.scheduler.schedule

        def watched():
            out = schedule()
            self.value = max(self.value, engine.num_blocks - engine.kv.pool.num_free_blocks())
            return out
        engine.scheduler.schedule = watched

    def take(self) -> int:
        value, self.value = self.value, 0
        return value


def search(engine, prompts, params) -> tuple[list, int, int, float, int]:
    """(beams per prompt, peak blocks held, blocks copied, CPU s, beam tokens)."""
    copies0, tokens0 = engine.kv.num_copies, engine.generation_tokens
    finals: dict[str, dict[int, list[int]]] = {}
    t0 = time.process_time()
    for i, p in enumerate(prompts):
        engine.add_request(f"b{i}", p, params)
    while engine.has_unfinished_requests():
        for d in engine.step():
            if d.finished:
                finals.setdefault(d.request_id, {})[d.index] = d.token_ids
    cpu = time.process_time() - t0
    beams = [[finals[f"b{i}"][j] for j in sorted(finals[f"b{i}"])] for i in range(len(prompts))]
    return beams, engine.peak.take(), engine.kv.num_copies - copies0, cpu, engine.generation_tokens - tokens0


def drive(engine, prompts, width: int, max_tokens: int) -> tuple[list, int, int, float, int]:
    """vLLM's LLM.beam_search loop, written for this engine (ignore_eos): the same figures as
    search()."""
    from pagoda.gpu_worker.core.sampling_params import SamplingParams
    from pagoda.gpu_worker.features import beam_search
    one = SamplingParams(temperature=0.0, max_tokens=1, logprobs=2 * width, ignore_eos=True)
    beams = [[(list(p), 0.0)] for p in prompts]
    tokens = 0
    t0 = time.process_time()
    for step in range(max_tokens):
        lps: dict[str, tuple[int, object]] = {}
        for i, group in enumerate(beams):
            for j, (toks, _) in enumerate(group):
                engine.add_request(f"d{step}.{i}.{j}", toks, one)
        while engine.has_unfinished_requests():
            for d in engine.step():
                if d.token_ids:
                    lps[d.request_id] = (d.token_ids[0], d.logprobs[0])
        for i, group in enumerate(beams):
            offered = [(cum, *lps[f"d{step}.{i}.{j}"]) for j, (_, cum) in enumerate(group)]
            cands = beam_search.candidates(offered)
            run, _ = beam_search.select(cands, [0] * len(cands), width)     # no stop flags: ignore_eos
            tokens += len(group)
            beams[i] = [(group[c.parent][0] + [c.token], c.cum_logprob) for c, _ in run]
    cpu = time.process_time() - t0
    out = [[toks[len(p):] for toks, _ in group] for p, group in zip(prompts, beams)]
    return out, engine.peak.take(), 0, cpu, tokens


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=4, help="beam searches run together")
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--width", type=int, default=4)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--quick", action="store_true", help="a tiny run (the smoke test)")
    ap.add_argument("--json", default=None, help="also write the figures here")
    a = ap.parse_args(argv)
    if a.quick:
        a.rounds, a.prompts, a.prompt_len, a.max_tokens, a.layers, a.hidden = 1, 2, 40, 8, 2, 64
    import torch
    torch.set_num_threads(a.threads)
    from pagoda.gpu_worker.core.config import EngineConfig
    from pagoda.gpu_worker.core.sampling_params import SamplingParams
    from pagoda.gpu_worker.engine.llm_engine import LLMEngine
    from pagoda.gpu_worker.testing.tiny_model import make_tiny_model

    tmp = tempfile.mkdtemp(prefix="beam-bench-")
    model = make_tiny_model(os.path.join(tmp, "model"), hidden_size=a.hidden, intermediate_size=a.hidden * 11 // 4,
                            num_hidden_layers=a.layers, num_attention_heads=8, num_key_value_heads=4,
                            head_dim=a.hidden // 8, max_position_embeddings=4096)
    def make_engine(caching: bool) -> LLMEngine:
        return LLMEngine(EngineConfig(model=model, device="cpu", block_size=a.block_size, num_kv_blocks=2048,
                                      max_num_seqs=max(8, a.prompts * a.width), enable_prefix_caching=caching))
    engine, driver_engine = make_engine(False), make_engine(True)
    for e in (engine, driver_engine):
        e.peak = Peak(e)
    rng = random.Random(0)
    prompts = [[rng.randrange(5, engine.vocab_size) for _ in range(a.prompt_len)] for _ in range(a.prompts)]
    params = SamplingParams(n=a.width, use_beam_search=True, max_tokens=a.max_tokens, ignore_eos=True)
    figures: dict[str, dict] = {name: {"cpu": []} for name, _ in VARIANTS}
    for r in range(a.rounds):
        for name, share in VARIANTS:     # alternating, so drift on a shared machine hits all alike
            if share is None:
                driver_engine.kv.pool.reset_prefix_cache()     # each round starts cold, as the others
                beams, peak, copies, cpu, tokens = drive(driver_engine, prompts, a.width, a.max_tokens)
            else:
                engine.kv.share_on_fork = share
                beams, peak, copies, cpu, tokens = search(engine, prompts, params)
            f = figures[name]
            f["cpu"].append(cpu)
            f.update(peak=peak, copies=copies, tokens=tokens, beams=beams)
        print(f"round {r + 1}/{a.rounds} done", file=sys.stderr, flush=True)
    same = figures["shared"]["beams"] == figures["copied"]["beams"] == figures["driver"]["beams"]
    print(f"Llama {a.layers} layers, hidden {a.hidden}, block size {a.block_size}, fp32; {a.prompts} beam searches "
          f"together, width {a.width}, {a.prompt_len}-token prompts, {a.max_tokens} tokens; prefix caching off "
          f"(on for the driver); median of {a.rounds} rounds, CPU s ({a.threads} thread(s))")
    print("| variant | peak blocks held | blocks copied | CPU s | beam tok/s | same beams |")
    print("|---|---|---|---|---|---|")
    rows = []
    for name, _ in VARIANTS:
        f = figures[name]
        cpu = statistics.median(f["cpu"])
        row = dict(variant=name, peak_blocks=f["peak"], blocks_copied=f["copies"], cpu_s=round(cpu, 3),
                   beam_tok_per_s=round(f["tokens"] / cpu, 1), same_beams=same)
        rows.append(row)
        print(f"| {name} | {f['peak']} | {f['copies']} | {cpu:.2f} | {row['beam_tok_per_s']} | {same} |")
    s = rows[0]
    for other in rows[1:]:
        print(f"shared / {other['variant']}: {s['peak_blocks'] / other['peak_blocks']:.2f}x the blocks, "
              f"{s['beam_tok_per_s'] / other['beam_tok_per_s']:.2f}x the tok/s")
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(rows, fh, indent=1)
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
