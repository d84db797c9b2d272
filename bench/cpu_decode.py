"""Offline decode throughput on CPU by linear implementation: the engine, not a bare forward.

bench/cpu_forward.py times one model forward in a tight loop; this runs the whole offline engine
(LLM.generate: scheduler, sampler, detokenizer, the C kernels' thread pool between torch's
OpenMP linears) over --seqs sequences behind one shared --prefix-token prompt, --out tokens each,
on bench/vs_vllm.py's tiny model. Each (dtype, PAGODA_CPU_GEMM) runs in a fresh process, --rounds
times interleaved, and reports output tokens/s and the linears the tuner chose. To compare two
checkouts, run the script from each: it imports the pagoda beside it.

    python bench/cpu_decode.py                        # float32 and bfloat16, auto onednn c, 2 rounds
    python bench/cpu_decode.py --quick                # smoke run
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def child(a) -> None:
    sys.path.insert(0, REPO)
    import torch
    torch.set_num_threads(a.threads)
    from pagoda.gpu_worker.core.sampling_params import SamplingParams
    from pagoda.gpu_worker.engine.llm import LLM
    llm = LLM(a.model_dir, device="cpu", dtype=a.dtype, max_num_seqs=256, max_num_batched_tokens=4096,
              max_model_len=2048, num_kv_blocks=(a.prefix + a.out + 32) // 16 * (a.seqs + 1))
    prefix = [5 + (i * 7) % 900 for i in range(a.prefix)]
    prompts = [prefix + [10 + i, 11 + i] for i in range(a.seqs)]
    sp = SamplingParams(temperature=0.0, max_tokens=a.out, ignore_eos=True)
    llm.generate(prompts[:1], sp)                       # the prefix cached, the kernels warm
    start = time.perf_counter()
    llm.generate(prompts, sp)
    wall = time.perf_counter() - start
    from bench.common import pagoda_cpu_kernels
    print(json.dumps(dict(tok_s=a.seqs * a.out / wall, load=os.getloadavg()[0], kernels=pagoda_cpu_kernels())))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--gemms", nargs="+", default=["auto", "onednn", "c"], help="PAGODA_CPU_GEMM values")
    ap.add_argument("--seqs", type=int, default=64)
    ap.add_argument("--prefix", type=int, default=1008)
    ap.add_argument("--out", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="tiny model and sizes: a smoke run")
    ap.add_argument("--cache-dir", default=os.path.join(os.path.expanduser("~"), ".cache", "pagoda-bench"))
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--model-dir", help=argparse.SUPPRESS)
    ap.add_argument("--dtype", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        return child(a)
    sys.path.insert(0, REPO)
    from bench.common import lscpu_lines
    from bench.vs_vllm import build_model
    if a.quick:
        a.seqs, a.prefix, a.out, a.rounds, a.gemms = 4, 48, 8, 1, a.gemms[:1]
    model = build_model(os.path.join(a.cache_dir, "model-quick" if a.quick else "model"),
                        "quick" if a.quick else "tiny")
    rows = []
    for r in range(a.rounds):
        for dtype in a.dtypes:
            for gemm in a.gemms:
                out = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", "--model-dir", model,
                                      "--dtype", dtype, "--seqs", str(a.seqs), "--prefix", str(a.prefix),
                                      "--out", str(a.out), "--threads", str(a.threads)],
                                     env={**os.environ, "PAGODA_CPU_GEMM": gemm}, capture_output=True, text=True,
                                     timeout=900)
                if out.returncode:
                    raise SystemExit(f"{dtype} {gemm} failed:\n{out.stderr[-3000:]}")
                res = json.loads(out.stdout.strip().splitlines()[-1])
                rows.append((r + 1, dtype, gemm, res))
                print(f"# round {r + 1} {dtype} {gemm}: {res['tok_s']:.0f} tok/s; {res['kernels']}", flush=True)
    print(f"\n{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, commit "
          f"{subprocess.run(['git', 'rev-parse', '--short', 'HEAD'], cwd=REPO, capture_output=True, text=True).stdout.strip()}"
          f"; `python bench/cpu_decode.py {' '.join(sys.argv[1:])}`; {a.seqs} sequences behind a {a.prefix}-token "
          f"prefix, {a.out} out, {a.threads} threads\n")
    for line in lscpu_lines():
        print(f"- {line}")
    print("\n| round | dtype | PAGODA_CPU_GEMM | tok/s | load |\n|---|---|---|---|---|")
    for r, dtype, gemm, res in rows:
        print(f"| {r} | {dtype} | {gemm} | {res['tok_s']:,.0f} | {res['load']:.1f} |")


if __name__ == "__main__":
    main()
