"""Speculative decoding on a copy-heavy workload (edit / summarise a given text), on CPU.

A random checkpoint does not copy its prompt, so the target here is built to: a Llama of the
bench's usual size (8 layers, hidden 512) whose layers run at full cost but write almost
nothing into the residual stream (o_proj and down_proj scaled to 2%), and whose lm_head maps
each token's embedding to a chosen successor. Its greedy output follows a successor map:
the document with some tokens replaced (edit), or spans of the document in order (summarise).
That is what an instruction-tuned model does on these tasks, to the token; the acceptance
rate is the workload's, the time per verification step this CPU's.

Each configuration (no speculation; n-gram lookup at several k; a 2-layer draft model with
the same successor map) runs the same requests through LLMEngine, alternating over --rounds,
with single-thread CPU time (time.process_time) per request and greedy outputs compared.

    PYTHONPATH=$PWD python bench/spec_decode.py [--rounds 3] [--doc-len 320] [--requests 2]
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


def make_copy_model(path: str, successor: dict[int, int], seed: int = 0, mix: float = 0.02,
                    alpha: float = 1.0, **overrides) -> str:
    """A tiny Llama checkpoint (make_tiny_model) whose greedy next token after t is
    successor[t] (where given): embeddings are unit-variance random vectors, lm_head's row for
    successor[t] is alpha times t's normalised embedding, and every layer's output projections
    are scaled by `mix`, so that the layers cost what they cost but barely move the argmax."""
    import numpy as np
    from safetensors.numpy import load_file, save_file

    from pagoda.gpu_worker.testing.tiny_model import make_tiny_model
    make_tiny_model(path, seed=seed, **overrides)
    f = os.path.join(path, "model.safetensors")
    w = load_file(f)
    rng = np.random.default_rng(seed + 1)
    vocab, hidden = w["model.embed_tokens.weight"].shape
    emb = rng.standard_normal((vocab, hidden)).astype(np.float32)
    head = (rng.standard_normal((vocab, hidden)) / np.sqrt(hidden)).astype(np.float32)
    for t, nxt in successor.items():
        head[nxt] = alpha * emb[t] / np.linalg.norm(emb[t])
    w["model.embed_tokens.weight"], w["lm_head.weight"] = emb, head
    w["model.norm.weight"] = np.ones(hidden, np.float32)
    for name in list(w):
        if name.endswith(("self_attn.o_proj.weight", "mlp.down_proj.weight")):
            w[name] = (w[name] * mix).astype(np.float32)
    save_file(w, f, metadata={"format": "pt"})
    return path


def workloads(vocab: int, doc_len: int, requests: int, seed: int = 0):
    """(name, prompts, expected outputs, successor map): every token of every document and
    edit is distinct, so that one successor map serves them all."""
    rng = random.Random(seed)
    pool = list(range(8, vocab))
    rng.shuffle(pool)
    take = iter(pool)
    successor: dict[int, int] = {}
    out = []
    for name in ("edit", "summarise"):
        prompts, expected = [], []
        for _ in range(requests):
            doc = [next(take) for _ in range(doc_len)]
            instr = [next(take) for _ in range(12)]
            if name == "edit":      # about one token in 25 replaced by a new one
                target = [next(take) if rng.random() < 0.04 else t for t in doc]
            else:                   # spans of 6-20 tokens in order, about a third of the text
                target, i = [], 0
                while i < doc_len:
                    n = rng.randrange(6, 21)
                    target += doc[i:i + n]
                    i += n + rng.randrange(2 * n, 3 * n)
            for a, b in zip(target, target[1:]):
                successor[a] = b
            # The prompt ends with the answer's first token, as a template would start it.
            prompts.append(instr + doc + instr[:2] + target[:1])
            expected.append(target[1:])
        out.append((name, prompts, expected))
    return out, successor


CONFIGS = [
    ("no speculation", None),
    ("ngram k=2", {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3, "prompt_lookup_min": 1}),
    ("ngram k=4", {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}),
    ("ngram k=8", {"method": "ngram", "num_speculative_tokens": 8, "prompt_lookup_max": 3, "prompt_lookup_min": 1}),
    ("draft model k=4", "draft"),
]


def run(engine, prompts, max_tokens, temperature=0.0):
    from pagoda.gpu_worker.core.sampling_params import SamplingParams
    sp = SamplingParams(temperature=temperature, max_tokens=max_tokens, ignore_eos=True, seed=1)
    outs: dict[str, list[int]] = {}
    cpu = []
    steps0 = engine.num_steps
    for i, p in enumerate(prompts):     # one stream at a time: the latency case
        rid = f"r{i}-{time.monotonic_ns()}"
        engine.add_request(rid, p, sp)
        t0 = time.process_time()
        toks: list[int] = []
        while engine.has_unfinished_requests():
            for d in engine.step():
                toks.extend(d.token_ids)
        cpu.append(time.process_time() - t0)
        outs[rid] = toks
    return list(outs.values()), cpu, engine.num_steps - steps0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--doc-len", type=int, default=320)
    ap.add_argument("--requests", type=int, default=2, help="requests per workload (run one at a time)")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--json", default=None, help="also write the figures here")
    a = ap.parse_args(argv)
    import torch
    torch.set_num_threads(1)
    from pagoda.gpu_worker.core.config import EngineConfig
    from pagoda.gpu_worker.engine.llm_engine import LLMEngine

    vocab = 4096
    loads, successor = workloads(vocab, a.doc_len, a.requests)
    tmp = tempfile.mkdtemp(prefix="spec-bench-")
    size = dict(hidden_size=a.hidden, intermediate_size=a.hidden * 11 // 4, num_hidden_layers=a.layers,
                num_attention_heads=8, num_key_value_heads=4, head_dim=a.hidden // 8,
                max_position_embeddings=2048)
    target = make_copy_model(os.path.join(tmp, "target"), successor, vocab_size=vocab, **size)
    draft = make_copy_model(os.path.join(tmp, "draft"), successor, seed=1, vocab_size=vocab,
                            **dict(size, num_hidden_layers=2, hidden_size=128, intermediate_size=352,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=32))
    engines = {}
    for name, spec in CONFIGS:
        if spec == "draft":
            spec = {"model": draft, "num_speculative_tokens": 4}
        engines[name] = LLMEngine(EngineConfig(model=target, device="cpu", num_kv_blocks=512,
                                               max_num_seqs=8, speculative_config=spec))
    figures: dict = {}
    for r in range(a.rounds):
        for name, _ in CONFIGS:      # alternating, so drift on a shared machine hits all alike
            eng = engines[name]
            for wname, prompts, expected in loads:
                st0 = eng.stats()
                outs, cpu, steps = run(eng, prompts, max(len(e) for e in expected), a.temperature)
                st1 = eng.stats()
                f = figures.setdefault((wname, name), {"cpu": [], "tokens": 0, "steps": 0, "match": True,
                                                        "copied": 0, "drafted": 0, "accepted": 0})
                f["cpu"].append(sum(cpu))
                f["tokens"] = sum(len(o) for o in outs)
                f["steps"] = steps
                f["copied"] = sum(sum(x == y for x, y in zip(o, e)) for o, e in zip(outs, expected))
                f["expected"] = sum(len(e) for e in expected)
                if st1.spec_num_drafts is not None:
                    f["drafted"] = st1.spec_num_draft_tokens - st0.spec_num_draft_tokens
                    f["accepted"] = st1.spec_num_accepted_tokens - st0.spec_num_accepted_tokens
                base = figures.get((wname, "no speculation"))
                if base is not None and "outputs" in base:
                    f["match"] = f["match"] and outs == base["outputs"]
                if name == "no speculation":
                    f["outputs"] = outs
        print(f"round {r + 1}/{a.rounds} done", file=sys.stderr, flush=True)
    print(f"target: Llama {a.layers} layers, hidden {a.hidden}, vocab {vocab}; draft: 2 layers, hidden 128; "
          f"{a.requests} requests per workload, one at a time, {a.doc_len}-token documents, "
          f"temperature {a.temperature}; median of {a.rounds} rounds, CPU s (1 thread)")
    print(f"{'workload':10} {'config':16} {'cpu s':>7} {'tok/s':>7} {'speed-up':>8} {'steps':>6} "
          f"{'tok/step':>8} {'accept':>7} {'same as plain':>13}")
    rows = []
    for wname, _, _ in loads:
        base_cpu = statistics.median(figures[(wname, "no speculation")]["cpu"])
        for name, _ in CONFIGS:
            f = figures[(wname, name)]
            cpu = statistics.median(f["cpu"])
            acc = f["accepted"] / f["drafted"] if f["drafted"] else float("nan")
            row = dict(workload=wname, config=name, cpu_s=round(cpu, 3), tok_per_s=round(f["tokens"] / cpu, 1),
                       speedup=round(base_cpu / cpu, 2), steps=f["steps"], tokens_per_step=round(f["tokens"] / f["steps"], 2),
                       acceptance=round(acc, 3), same_output=f["match"],
                       follows_successor_map=f"{f['copied']}/{f['expected']}")
            rows.append(row)
            print(f"{wname:10} {name:16} {cpu:7.2f} {row['tok_per_s']:7.1f} {row['speedup']:7.2f}x {f['steps']:6d} "
                  f"{row['tokens_per_step']:8.2f} {acc:7.2f} {str(f['match']):>13}")
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(rows, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
