"""Tenant fairness on one worker: tenant A's burst of 1,024 prompts against tenant B's interactive requests.

    python bench/fairness.py            # the recorded run
    python bench/fairness.py --quick    # smoke run

For each mode (--scheduling-fairness tenant, then fifo) a fresh CPU worker process starts with API
keys for tenants A and B (and an admin key to read its load). A sends all its prompts at once
(short random prompts, few output tokens, greedy, ignore_eos); once the worker holds them, B sends
one request at a time, each when the last one is done, until A's burst has finished. Both modes
get the same seeded prompts.

Figures per mode: B's TTFT p50/p99 as B's client sees it (and how many B got in), A's burst wall
time, output tok/s and TTFT p50, and the worker's CPU seconds over the burst (less at the mercy of
a loaded machine than wall time); then tenant / fifo as ratios.
"""
from __future__ import annotations

import argparse
import asyncio
import math
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import build_model, command_line, lscpu_lines, markdown_table, now  # noqa: E402
from bench.vs_vllm import tree_cpu_seconds  # noqa: E402
from pagoda.clients.client import AsyncPagodaClient  # noqa: E402
from pagoda.clients.up import free_port, wait_serving  # noqa: E402

KEYS = "a-key A\nb-key B\nops-key ops admin\n"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="a 64-prompt burst on a 2-layer model: seconds")
    p.add_argument("--burst", type=int, default=None, help="tenant A's prompts (default 1024; 64 with --quick)")
    p.add_argument("--prompt-tokens", type=int, default=16, help="tokens of each prompt, A's and B's")
    p.add_argument("--max-tokens", type=int, default=None, help="output tokens of each of A's requests (default 4; "
                   "16 with --quick)")
    p.add_argument("--b-max-tokens", type=int, default=4, help="output tokens of each of B's requests")
    p.add_argument("--max-num-seqs", type=int, default=None, help="the worker's (default 256; 4 with --quick)")
    p.add_argument("--modes", default="tenant,fifo", help="--scheduling-fairness values, in order")
    p.add_argument("--no-neighbour", action="store_true", help="A's burst alone: what fairness costs one tenant")
    p.add_argument("--model-dir", default=None)
    p.add_argument("--rounds", type=int, default=None,
                   help="rounds over the modes, every other one in reverse order (default 3; 1 with --quick)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=900.0, help="seconds one mode may take")
    return p


class Worker:
    """One `python -m pagoda.gpu_worker` process group with keys; killed on exit."""

    def __init__(self, model: str, mode: str, a, log_dir: str):
        keys = Path(log_dir, "keys")
        keys.write_text(KEYS)
        self.address = f"127.0.0.1:{free_port()}"
        blocks_per_seq = -(-(a.prompt_tokens + max(a.max_tokens, a.b_max_tokens)) // 16)
        cmd = [sys.executable, "-m", "pagoda.gpu_worker", "--model", model, "--device", "cpu",
               "--host", "127.0.0.1", "--port", self.address.rsplit(":", 1)[1], "--metrics-port", "0",
               "--block-size", "16", "--num-kv-blocks", str((a.max_num_seqs + 8) * blocks_per_seq),
               "--max-num-seqs", str(a.max_num_seqs), "--max-waiting", str(a.burst + 64),
               "--api-keys-file", str(keys), "--scheduling-fairness", mode, "--log-level", "WARNING"]
        self.log = open(Path(log_dir, f"worker-{mode}.log"), "ab")
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     start_new_session=True, env=env)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, 15)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, 9)
                self.proc.wait()
        self.log.close()


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))] if xs else float("nan")


async def timed(client: AsyncPagodaClient, prompt: list[int], max_tokens: int) -> tuple[float, float, int]:
    """(seconds to the first token, seconds to the end, output tokens) of one request."""
    t0 = time.perf_counter()
    first, tokens = None, 0
    async for c in client.generate(prompt, max_tokens=max_tokens, ignore_eos=True, temperature=0.0):
        if first is None:
            first = time.perf_counter() - t0
        tokens += len(c.token_ids)
    return first if first is not None else float("nan"), time.perf_counter() - t0, tokens


async def run_mode(w: "Worker", a, prompts_a: list[list[int]], prompts_b: list[list[int]]) -> dict:
    address = w.address
    async with AsyncPagodaClient(address, api_key="a-key", retries=0) as ca, \
            AsyncPagodaClient(address, api_key="b-key", retries=0) as cb, \
            AsyncPagodaClient(address, api_key="ops-key", retries=0) as ops:
        for c in (ca, cb):                       # warm: the first requests of a process pay for imports
            await timed(c, prompts_b[0], 2)
        cpu0, t0 = tree_cpu_seconds(w.proc.pid), time.perf_counter()
        burst = [asyncio.create_task(timed(ca, p, a.max_tokens)) for p in prompts_a]
        # B starts once the worker holds the burst (or what is left of it).
        while True:
            load = await ops.load()
            if load.running + load.waiting >= len(prompts_a) - sum(t.done() for t in burst) - 1:
                break
            await asyncio.sleep(0.005)
        queued_at = time.perf_counter() - t0
        b_ttft = []
        i = 0
        while not a.no_neighbour and not all(t.done() for t in burst):
            first, _, _ = await timed(cb, prompts_b[i % len(prompts_b)], a.b_max_tokens)
            b_ttft.append(first)
            i += 1
        results = await asyncio.gather(*burst)
        wall = max(end for _, end, _ in results)
        cpu = tree_cpu_seconds(w.proc.pid) - cpu0
    return dict(b_ttft=b_ttft, a_wall=wall, a_tok_s=sum(n for _, _, n in results) / wall, cpu=cpu,
                a_ttft=[f for f, _, _ in results], queued_at=queued_at)


def ratio(x: float, y: float) -> str:
    return f"{x / y:.3f}" if y and not math.isnan(x) and not math.isnan(y) else "n/a"


def summary(runs: list[dict]) -> dict:
    """One mode's rounds: B's TTFTs pooled, A's figures as the median round's."""
    b = [x for r in runs for x in r["b_ttft"]]
    med = sorted(runs, key=lambda r: r["a_wall"])[len(runs) // 2]
    return dict(b_n=len(b), b_p50=pct(b, 0.5), b_p99=pct(b, 0.99), a_wall=med["a_wall"], a_tok_s=med["a_tok_s"],
                cpu=sorted(r["cpu"] for r in runs)[len(runs) // 2],
                a_ttft_p50=pct(med["a_ttft"], 0.5), queued_at=med["queued_at"])


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    a.burst = a.burst or (64 if a.quick else 1024)
    a.max_num_seqs = a.max_num_seqs or (4 if a.quick else 256)
    a.max_tokens = a.max_tokens or (16 if a.quick else 4)
    a.rounds = a.rounds or (1 if a.quick else 3)
    modes = [m for m in a.modes.split(",") if m]
    bad = [m for m in modes if m not in ("tenant", "fifo")]
    if bad or not modes:
        raise SystemExit(f"--modes: tenant and/or fifo, comma-separated (got {a.modes!r})")
    if min(a.burst, a.prompt_tokens, a.max_tokens, a.b_max_tokens, a.max_num_seqs, a.rounds) < 1:
        raise SystemExit("--burst, --prompt-tokens, --max-tokens, --b-max-tokens, --max-num-seqs, --rounds: "
                         "must be at least 1")
    model = a.model_dir or os.path.join(os.environ.get("TMPDIR", "/tmp"),
                                        "pagoda-bench-" + ("quick" if a.quick else "llama-8x512"))
    build_model(model, quick=a.quick)
    rng = random.Random(a.seed)
    prompts_a = [[rng.randrange(5, 500) for _ in range(a.prompt_tokens)] for _ in range(a.burst)]
    prompts_b = [[rng.randrange(5, 500) for _ in range(a.prompt_tokens)] for _ in range(64)]
    load_before = os.getloadavg()
    runs: dict[str, list[dict]] = {m: [] for m in modes}
    with tempfile.TemporaryDirectory(prefix="pagoda-fairness-") as logs:
        for i in range(a.rounds):
            for mode in modes if i % 2 == 0 else modes[::-1]:      # the machine's load drifts: alternate
                with Worker(model, mode, a, logs) as w:
                    try:
                        wait_serving(w.address, w.proc, f"worker ({mode})", 300)
                        run = asyncio.run(asyncio.wait_for(run_mode(w, a, prompts_a, prompts_b), a.timeout))
                    except BaseException:
                        w.log.flush()
                        print(Path(logs, f"worker-{mode}.log").read_text(errors="replace")[-3000:], file=sys.stderr)
                        raise
                runs[mode].append(run)
                print(f"round {i + 1} {mode}: B TTFT ms {[round(x * 1e3) for x in run['b_ttft']]}, "
                      f"A burst {run['a_wall']:.1f} s, worker CPU {run['cpu']:.1f} s, "
                      f"load {os.getloadavg()[0]:.1f}", file=sys.stderr, flush=True)
    rows = {m: summary(r) for m, r in runs.items()}
    load_after = os.getloadavg()
    print(f"Command: `{command_line()}`  \nDate: {now()}  \n"
          f"Load average (1/5/15 min): before {' '.join(f'{x:.2f}' for x in load_before)}, "
          f"after {' '.join(f'{x:.2f}' for x in load_after)}  \n"
          f"Workload: tenant A sends {a.burst} prompts of {a.prompt_tokens} random tokens at once, "
          f"{a.max_tokens} output tokens each; "
          + ("no neighbour (--no-neighbour)" if a.no_neighbour else
             f"tenant B sends {a.prompt_tokens}-token prompts for {a.b_max_tokens} tokens one after another "
             "until A's burst is done")
          + f"; {a.rounds} round(s), B's TTFTs "
          f"pooled over them, A's figures from the median round. One CPU worker "
          f"(OMP_NUM_THREADS=1), max_num_seqs {a.max_num_seqs}, model {Path(model).name}, greedy, ignore_eos.\n")
    print("\n".join(lscpu_lines()) + "\n")
    table = [[m, r["b_n"], r["b_p50"] * 1e3, r["b_p99"] * 1e3, r["a_wall"], r["a_tok_s"], r["a_ttft_p50"] * 1e3,
              r["cpu"], r["queued_at"]] for m, r in rows.items()]
    if "tenant" in rows and "fifo" in rows:
        t, f = rows["tenant"], rows["fifo"]
        table.append(["tenant / fifo"] + [ratio(t[k], f[k]) for k in ("b_n", "b_p50", "b_p99", "a_wall", "a_tok_s",
                                                                      "a_ttft_p50", "cpu")] + [""])
    print(markdown_table(["fairness", "B requests", "B TTFT p50 (ms)", "B TTFT p99 (ms)", "A burst (s)",
                          "A output tok/s", "A TTFT p50 (ms)", "worker CPU s (median)", "A queued after (s)"], table))
    return 0


if __name__ == "__main__":
    sys.exit(main())
