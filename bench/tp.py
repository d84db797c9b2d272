"""Tensor parallelism on CPU: the same offline workload at TP=1 and TP=2 (gloo), side by side.

On CPU the ranks are processes sharing the machine's cores, so the figures show what the
collectives and the per-step broadcast cost, not the speed-up a second GPU brings. Per step the
bench records the tokens and sampled rows rank 0 runs, and from them the communication volume:
the pickled step broadcast (measured), the all-reduces (2 per layer + 1 for the embedding, each
of T x hidden fp32) and the logits gather (sampled rows x vocab / N fp32 from each other rank).
Both runs must produce the same tokens (greedy).

    python bench/tp.py            # the recorded run
    python bench/tp.py --quick    # smoke run on the tiny model
"""
from __future__ import annotations

import argparse
import os
import random
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import build_model, command_line, machine, markdown_table, now, set_threads  # noqa: E402


def run(path: str, tp: int, prompts: list[list[int]], max_tokens: int):
    from pagoda.gpu_worker.core.sampling_params import SamplingParams
    from pagoda.gpu_worker.engine.llm import LLM
    llm = LLM(path, device="cpu", enable_prefix_caching=False, tensor_parallel_size=tp)
    runner = llm.engine.runner
    steps: list[tuple[int, int]] = []          # (tokens, sampled rows) per step
    inner = runner.run_model

    def counted(ids, pos, meta, rows):
        steps.append((int(ids.shape[0]), len(rows)))
        return inner(ids, pos, meta, rows)

    runner.run_model = counted
    llm.generate(prompts[:2], SamplingParams(temperature=0.0, max_tokens=4))    # warm-up
    steps.clear()
    sent = runner.tp.bytes_sent if runner.tp else 0
    start = time.perf_counter()
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
    wall = time.perf_counter() - start
    broadcast = (runner.tp.bytes_sent - sent) if runner.tp else 0
    runner.close()
    return [o.outputs[0].token_ids for o in outs], wall, steps, broadcast, llm.engine.runner.hf_config


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--model-dir", default="/tmp/pagoda-bench-model")
    a = p.parse_args()
    set_threads(1)
    path = build_model(a.model_dir + ("-quick" if a.quick else ""), quick=a.quick)
    n, plen, gen = (4, 16, 8) if a.quick else (a.requests, a.prompt_len, a.max_tokens)
    rng = random.Random(0)
    prompts = [[rng.randrange(5, 600) for _ in range(plen)] for _ in range(n)]
    rows, tokens = [], {}
    for tp in (1, 2):
        out, wall, steps, broadcast, cfg = run(path, tp, prompts, gen)
        tokens[tp] = out
        generated = sum(len(t) for t in out)
        per_step_tokens = sum(t for t, _ in steps) / len(steps)
        layers, hidden, vocab = cfg.num_hidden_layers, cfg.hidden_size, cfg.vocab_size
        allreduce = (2 * layers + 1) * sum(t for t, _ in steps) * hidden * 4 if tp > 1 else 0
        gather = sum(r for _, r in steps) * vocab // tp * 4 * (tp - 1)
        rows.append([f"TP={tp}", generated / wall, wall, len(steps), per_step_tokens,
                     broadcast / len(steps) / 1024, allreduce / len(steps) / 1024, gather / len(steps) / 1024,
                     (2 * layers + 1) if tp > 1 else 0])
    assert tokens[1] == tokens[2], "TP=2 greedy tokens differ from TP=1"
    rows[1].append(f"{rows[1][1] / rows[0][1]:.2f}x")
    rows[0].append("1.00x")
    print(f"{now()} · {machine()} · `{command_line()}`")
    print(f"{n} requests x {plen} prompt tokens, {gen} output tokens each (greedy, ignore_eos); "
          f"model {layers} layers, hidden {hidden}, vocab {vocab}, fp32; one torch thread per rank; "
          "TP=2 tokens identical to TP=1\n")
    print(markdown_table(["setup", "output tok/s", "wall s", "steps", "tokens/step", "broadcast KiB/step",
                          "all-reduce KiB/step", "gather KiB/step", "all-reduces/step", "vs TP=1"], rows))


if __name__ == "__main__":
    main()
