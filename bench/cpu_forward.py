"""The CPU forward of bench/vs_vllm.py's model, variant against variant (issue 22).

One decode step (--batch sequences of --context tokens, the shape of vs_vllm's throughput
workloads in steady state) and one prefill chunk (--prefill tokens of fresh prompts), each run in
a fresh process per variant so that process-wide settings (OpenMP's wait policy is read once, when
torch loads) are what that variant says. Reports CPU ms (the process's user + system time, robust
to other load) and wall ms per step, mean over --reps steps after a warm-up; the machine's load
average beside each.

Variants (--variants, default all):
    spin         OMP_WAIT_POLICY=ACTIVE: idle OpenMP threads spin; linears through F.linear (MKL)
    default      libgomp's own wait policy (spins a while, then sleeps), F.linear: pagoda until
                 2026-12-03
    passive-mkl  OMP_WAIT_POLICY=PASSIVE (what gpu_worker sets before torch loads), F.linear
    passive      PASSIVE and fp32 linears through oneDNN (pagoda.gpu_worker.models.parallel.dense_linear):
                 pagoda until the small-batch kernel
    onednn       GOMP_SPINCOUNT=1000 (a few microseconds of spin, then sleep), linears through
                 kernels/cpu_gemv.py at 1-8 rows and oneDNN above: pagoda until the C GEMM
    short-spin   the same spin, linears through kernels/cpu_gemv.py at 1-8 rows and
                 kernels/cpu_gemm.py above, on the kernels' pool: pagoda's defaults now

    python bench/cpu_forward.py                 # 2 threads, batch 64 x 350, prefill 2048
    python bench/cpu_forward.py --quick         # smoke run
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MKL = {"PAGODA_CPU_GEMM": "torch"}
VARIANTS = {"spin": {"OMP_WAIT_POLICY": "ACTIVE", "GOMP_SPINCOUNT": None, **MKL},
            "default": {"OMP_WAIT_POLICY": None, "GOMP_SPINCOUNT": None, **MKL},
            "passive-mkl": {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": None, **MKL},
            "passive": {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": None, "PAGODA_CPU_GEMM": "onednn"},
            "onednn": {"OMP_WAIT_POLICY": None, "GOMP_SPINCOUNT": "1000", "PAGODA_CPU_GEMM": "onednn"},
            "short-spin": {"OMP_WAIT_POLICY": None, "GOMP_SPINCOUNT": "1000", "PAGODA_CPU_GEMM": "auto"}}


def child(args) -> None:
    """One variant: build the runner over the model, time decode and prefill steps, print JSON."""
    sys.path.insert(0, REPO)
    import torch
    torch.set_num_threads(args.threads)
    from pagoda.gpu_worker.core.config import EngineConfig
    from pagoda.gpu_worker.core.outputs import NewRequest, ScheduledRequest, SchedulerOutput
    from pagoda.gpu_worker.runner.model_runner import ModelRunner
    r = ModelRunner(EngineConfig(model=args.model_dir, device="cpu", dtype=args.dtype, max_num_seqs=256,
                                 max_num_batched_tokens=max(4096, args.prefill), max_model_len=2048))
    bs = r.block_size
    nb = -(-max(args.context, args.prefill) // bs)
    r.allocate_kv_cache(nb * args.batch + nb)
    result = {}
    for kind in ("decode", "prefill"):
        r.batch.update(SchedulerOutput([], finished_req_ids=set(r.batch.req_ids)))
        if kind == "decode":
            lens, first = [args.context] * args.batch, args.context - 1
        else:
            lens, first = [args.prefill], 0
        new = [NewRequest(f"{kind}-{i}", [7 + i % 100] * n, n, None, list(range(i * nb, (i + 1) * nb)))
               for i, n in enumerate(lens)]
        r.batch.update(SchedulerOutput([], new=new))
        sched = [ScheduledRequest(x.req_id, n - first, first, True, []) for x, n in zip(new, lens)]

        def step():
            with torch.inference_mode():
                inputs = r.batch.prepare(sched)
                h = r.model(inputs.input_ids, inputs.positions, inputs.meta)
                return r.model.compute_logits(h[inputs.logits_indices])
        for _ in range(2):
            step()
        c, w = time.process_time(), time.perf_counter()
        for _ in range(args.reps):
            step()
        result[kind] = dict(cpu_ms=(time.process_time() - c) / args.reps * 1e3,
                            wall_ms=(time.perf_counter() - w) / args.reps * 1e3,
                            load=os.getloadavg()[0])
    from bench.common import pagoda_cpu_kernels
    result["kernels"] = pagoda_cpu_kernels()
    print(json.dumps(result))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtypes", nargs="+", choices=("float32", "bfloat16", "float16"), default=["float32"],
                    help="model dtypes to run each variant in (default float32)")
    ap.add_argument("--dtype", default="float32", help=argparse.SUPPRESS)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--context", type=int, default=350)
    ap.add_argument("--prefill", type=int, default=2048)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=2, help="each variant this many times, interleaved")
    ap.add_argument("--quick", action="store_true", help="tiny model and sizes: a smoke run")
    ap.add_argument("--cache-dir", default=os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "pagoda-bench", "vs_vllm"))
    ap.add_argument("--model-dir", help=argparse.SUPPRESS)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        return child(args)
    sys.path.insert(0, REPO)
    from bench.common import command_line, lscpu_lines, machine, markdown_table, now
    from bench.vs_vllm import build_model
    if args.quick:
        args.batch, args.context, args.prefill, args.reps, args.rounds = 4, 40, 64, 2, 1
    model = build_model(os.path.join(args.cache_dir, "model-quick" if args.quick else "model"),
                        "quick" if args.quick else "tiny")
    rows, kernels = [], {}
    for _ in range(args.rounds):
        for dtype in args.dtypes:
            for name in args.variants:
                env = {k: v for k, v in {**os.environ, **VARIANTS[name]}.items() if v is not None}
                out = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", "--model-dir", model,
                                      "--threads", str(args.threads), "--batch", str(args.batch), "--context",
                                      str(args.context), "--prefill", str(args.prefill), "--reps", str(args.reps),
                                      "--dtype", dtype], env=env, capture_output=True, text=True, check=True)
                res = json.loads(out.stdout.strip().splitlines()[-1])
                kernels[(name, dtype)] = res.pop("kernels")
                rows.append([name, dtype] + [f"{res[k][f]:.1f}" for k in ("decode", "prefill")
                                             for f in ("cpu_ms", "wall_ms", "load")])
                print(f"# {name} {dtype}: {res}", file=sys.stderr, flush=True)
    print(f"{now()} on {machine()}; `{command_line()}`; {args.threads} threads, decode {args.batch} x "
          f"{args.context} tokens, prefill {args.prefill} tokens\n")
    print("\n".join(lscpu_lines()))
    for (name, dtype), text in kernels.items():
        print(f"- pagoda's CPU kernels ({name}, {dtype}): {text}")
    print()
    print(markdown_table(["variant", "dtype", "decode CPU ms", "decode wall ms", "load", "prefill CPU ms",
                          "prefill wall ms", "load"], rows))


if __name__ == "__main__":
    main()
