"""Engine overhead: pagoda against transformers' static-batch generate on a near-zero model.

With 1 layer of hidden size 64 the model costs almost nothing, so what is measured is each
system's own per-step work (scheduling, input building, sampling, output processing). Same
requests for both, in one process: N prompts of 64 random tokens, 96 output tokens each
(ignore_eos), all submitted at once; greedy and top-p (temperature 1, top_p 0.9).

Prints output tokens/s per system, pagoda's ratio, and pagoda's mean per-step split:
schedule, prepare (inputs built and copied), forward (the model), sample, outputs (the rest:
progress, stops, detokenisation, deltas); "outside" is everything but the forward.

    python bench/overhead.py                 # the recorded run: 64 and 256 requests, 3 rounds
    python bench/overhead.py --requests 16 --rounds 1   # smoke run

Each round runs transformers then pagoda on the same requests; the table gives each system's
median over the rounds, the median of the rounds' ratios, and the split of pagoda's median round
(on a shared 2-core VM one run's figures swing by a third).
"""
from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import time
from collections import defaultdict

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import command_line, machine, markdown_table, now, set_threads  # noqa: E402

NEAR_ZERO = dict(num_hidden_layers=1, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, max_position_embeddings=512)
PROMPT, OUTPUT = 64, 96
MODES = {"greedy": dict(temperature=0.0), "top-p": dict(temperature=1.0, top_p=0.9)}


class StepTimer:
    """Wraps the engine's parts to time each step: schedule, prepare, forward, sample, outputs."""

    def __init__(self, engine):
        self.totals: dict[str, float] = defaultdict(float)
        self.steps = 0
        runner = engine.runner
        self._wrap(engine.scheduler, "schedule", "schedule")
        self._wrap(runner.batch, "prepare", "prepare")
        self._wrap(runner.batch, "sampling_batch", "sample")
        self._wrap(runner.sampler, "draw", "sample")
        self._wrap(runner.sampler, "to_host", "sample")
        self._wrap(runner.model, "forward", "forward")
        self._wrap(runner.model, "compute_logits", "forward")
        inner = engine.step

        def step():
            t = time.perf_counter()
            out = inner()
            self.totals["step"] += time.perf_counter() - t
            self.steps += 1
            return out
        engine.step = step

    def _wrap(self, obj, name: str, part: str) -> None:
        inner = getattr(obj, name)

        def timed(*a, **kw):
            t = time.perf_counter()
            try:
                return inner(*a, **kw)
            finally:
                self.totals[part] += time.perf_counter() - t
        setattr(obj, name, timed)

    def split_ms(self) -> dict[str, float]:
        n = max(self.steps, 1)
        parts = {k: self.totals[k] / n * 1e3 for k in ("schedule", "prepare", "forward", "sample")}
        parts["outputs"] = self.totals["step"] / n * 1e3 - sum(parts.values())
        parts["outside"] = self.totals["step"] / n * 1e3 - parts["forward"]
        return parts


def requests(n: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(5, vocab) for _ in range(PROMPT)] for _ in range(n)]


def run_pagoda(model_dir: str, prompts: list[list[int]], mode: str):
    from pagoda.gpu_worker import LLM, SamplingParams
    n = len(prompts)
    blocks = n * -(-(PROMPT + OUTPUT) // 16) + 16
    llm = LLM(model_dir, device="cpu", num_kv_blocks=blocks, max_num_seqs=max(n, 1),
              max_num_batched_tokens=max(2048, PROMPT * 8))
    sp = SamplingParams(max_tokens=OUTPUT, ignore_eos=True, seed=None, **MODES[mode])
    llm.generate(prompts[:4], SamplingParams(max_tokens=4, ignore_eos=True, **MODES[mode]))   # warm-up
    timer = StepTimer(llm.engine)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, sp)
    wall = time.perf_counter() - t0
    assert all(len(o.outputs[0].token_ids) == OUTPUT for o in outs)
    return n * OUTPUT / wall, timer.split_ms(), timer.steps, [o.outputs[0].token_ids for o in outs]


def run_hf(model_dir: str, prompts: list[list[int]], mode: str):
    import torch
    import transformers
    from transformers import GenerationConfig
    transformers.logging.set_verbosity_error()
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    m = MODES[mode]
    cfg = GenerationConfig(do_sample=m["temperature"] > 0, max_new_tokens=OUTPUT, min_new_tokens=OUTPUT,
                           pad_token_id=0, eos_token_id=None,
                           **({"temperature": m["temperature"], "top_p": m["top_p"], "top_k": 0}
                              if m["temperature"] > 0 else {}))
    ids = torch.tensor(prompts)
    with torch.no_grad():
        model.generate(input_ids=ids[:4], attention_mask=torch.ones_like(ids[:4]), generation_config=cfg)
        t0 = time.perf_counter()
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), generation_config=cfg)
        wall = time.perf_counter() - t0
    return len(prompts) * OUTPUT / wall, [row[PROMPT:].tolist() for row in out]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, nargs="+", default=[64, 256])
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=3, help="alternating runs of both systems; medians reported")
    ap.add_argument("--model-dir", default=os.path.join(tempfile.gettempdir(), "pagoda-bench-near-zero"))
    args = ap.parse_args(argv)
    set_threads(args.threads)
    from pagoda.gpu_worker.testing.tiny_model import make_tiny_model
    if not os.path.exists(os.path.join(args.model_dir, "config.json")):
        make_tiny_model(args.model_dir, family="llama", seed=0, **NEAR_ZERO)
    import json
    with open(os.path.join(args.model_dir, "config.json")) as f:
        vocab = json.load(f)["vocab_size"]
    rows = []
    for n in args.requests:
        prompts = requests(n, vocab)
        for mode in args.modes:
            runs = []
            for _ in range(max(args.rounds, 1)):
                hf_tps, hf_out = run_hf(args.model_dir, prompts, mode)
                runs.append((run_pagoda(args.model_dir, prompts, mode), hf_tps))
            hf_tps = statistics.median(h for _, h in runs)
            ratio = statistics.median(p[0] / h for p, h in runs)
            (tps, split, steps, out), _ = sorted(runs, key=lambda r: r[0][0])[len(runs) // 2]
            same = sum(a == b for a, b in zip(out, hf_out)) / n if mode == "greedy" else float("nan")
            rows.append([n, mode, f"{tps:,.0f}", f"{hf_tps:,.0f}", f"{ratio:.2f}x", steps,
                         *(f"{split[k]:.2f}" for k in ("schedule", "prepare", "forward", "sample",
                                                       "outputs", "outside")),
                         "n/a" if mode != "greedy" else f"{same:.0%}"])
            print(f"# {n} {mode}: pagoda {tps:,.0f} tok/s, transformers {hf_tps:,.0f} tok/s", file=sys.stderr)
    print(f"{now()} on {machine()}, {args.threads} torch thread(s), {args.rounds} round(s); `{command_line()}`\n")
    print(markdown_table(["requests", "mode", "pagoda tok/s", "transformers tok/s", "ratio", "steps",
                          "schedule ms", "prepare ms", "forward ms", "sample ms", "outputs ms",
                          "outside forward ms", "greedy ids equal"], rows))


if __name__ == "__main__":
    main()
