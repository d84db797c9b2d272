"""Native Llama path against the transformers backend on the same checkpoint and workload.

Both run in this process on pagoda's engine with the same pool, scheduler and attention kernels;
only the model code differs (fused native layers vs transformers' modeling code called through
the attention interface). Rounds alternate the two so that machine load drifts hit both alike;
the figure is generated tokens per second of wall time, and the ratio native / transformers.

    python bench/backends.py [--requests 32] [--rounds 3] [--quick]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import build_model, command_line, machine, set_threads, sharegpt_like  # noqa: E402


def run_once(llm, workload) -> float:
    from pagoda.gpu_worker.core.sampling_params import SamplingParams
    params = [SamplingParams(temperature=0.0, max_tokens=r.output_len, ignore_eos=True) for r in workload.requests]
    start = time.perf_counter()
    outs = llm.generate([r.prompt for r in workload.requests], params)
    elapsed = time.perf_counter() - start
    return sum(len(o.outputs[0].token_ids) for o in outs) / elapsed


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="tiny model and workload, for smoke tests")
    ap.add_argument("--model-dir", default=os.path.join(tempfile.gettempdir(), "pagoda-bench-llama"))
    args = ap.parse_args(argv)
    set_threads(1)
    from pagoda.gpu_worker.engine.llm import LLM
    path = build_model(args.model_dir + ("-quick" if args.quick else ""), quick=args.quick)
    workload = sharegpt_like(args.requests, 600, seed=0, scale=0.25 if args.quick else 1.0)
    # Pool sized for the whole batch at once: no preemption, both backends do the same work.
    blocks = sum(-(-(len(r.prompt) + r.output_len) // 16) for r in workload.requests) + 16
    engines = {impl: LLM(path, device="cpu", num_kv_blocks=blocks, model_impl=impl)
               for impl in ("native", "transformers")}
    for llm in engines.values():
        run_once(llm, sharegpt_like(2, 600, seed=1, scale=0.25))   # warm-up
    rates: dict[str, list[float]] = {impl: [] for impl in engines}
    for _ in range(args.rounds):
        for impl, llm in engines.items():
            rates[impl].append(run_once(llm, workload))
    native, hf = statistics.median(rates["native"]), statistics.median(rates["transformers"])
    print(f"machine: {machine()}")
    print(f"command: {command_line()}")
    print(f"workload: {workload.describe()}")
    for impl, r in rates.items():
        print(f"{impl:>12}: median {statistics.median(r):,.1f} tok/s over {args.rounds} rounds "
              f"({', '.join(f'{x:,.1f}' for x in r)})")
    print(f"native / transformers: {native / hf:.2f}x")


if __name__ == "__main__":
    main()
