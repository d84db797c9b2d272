"""End-to-end benchmark: the real stack (redis-server, 2 CPU workers, 1 router) under shared prompts.

    python bench/e2e.py [--quick] [--model DIR] [--policies prefix_aware,round_robin]

For each policy a fresh cluster starts (`python -m pagoda.gpu_worker` x2, `python -m pagoda.router`, one
redis-server), each worker is warmed directly, then a client (clients.AsyncPagodaClient) sends
chat requests through the router: P system prompts, R requests each, in shuffled rounds, with
C requests in flight. Each worker's KV pool holds about half of the system prompts, so only a
router that keeps each prompt on one worker keeps them all cached.

Figures per policy: prefix hit rate (cached / prompt tokens, as the workers report), that rate
against what could have been cached after each prompt's first request, the busiest worker's
share of requests, TTFT p50/p99 and request latency p50 as the client sees them, throughput.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import platform
import random
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import redis  # noqa: E402

from bench.routing import LocalRedis  # noqa: E402
from pagoda.clients.client import AsyncPagodaClient  # noqa: E402
from pagoda.clients.up import DEFAULT_CACHE, default_model, free_port, wait_serving  # noqa: E402
from pagoda.protos import redis_schema as rs  # noqa: E402

BLOCK = 16


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="smoke run: 4 prompts x 3 requests")
    p.add_argument("--model", default=None, help="checkpoint directory (default: pagoda up's tiny model)")
    p.add_argument("--policies", default="prefix_aware,round_robin")
    p.add_argument("--prompts", type=int, default=None, help="system prompts (default 8; quick 4)")
    p.add_argument("--per-prompt", type=int, default=None, help="requests per system prompt (default 6; quick 3)")
    p.add_argument("--system-tokens", type=int, default=400, help="about this many tokens per system prompt")
    p.add_argument("--max-tokens", type=int, default=4)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--num-kv-blocks", type=int, default=None,
                   help="per worker (default: room for about half the system prompts plus the running ones)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=180.0, help="seconds for each process to start serving")
    return p


@dataclass
class Outcome:
    ttft: float
    latency: float
    prompt_tokens: int
    cached: int
    possible: int
    output_tokens: int
    worker: str


class Stack:
    """redis-server (given) + 2 workers + 1 router as process groups, killed on exit."""

    def __init__(self, model: str, redis_url: str, policy: str, num_kv_blocks: int, log_dir: str, timeout: float,
                 http_port: int = 0):
        self.procs: list[subprocess.Popen] = []
        self.log_dir, self.timeout, self.redis_url = log_dir, timeout, redis_url
        self.workers = []
        for i in range(2):
            port = free_port()
            self._spawn(f"worker{i}", [sys.executable, "-m", "pagoda.gpu_worker", "--model", model, "--device", "cpu",
                                       "--host", "127.0.0.1", "--port", str(port), "--metrics-port", "0",
                                       "--num-kv-blocks", str(num_kv_blocks), "--block-size", str(BLOCK),
                                       "--redis-url", redis_url, "--worker-id", f"bench-w{i}",
                                       "--advertise-address", f"127.0.0.1:{port}", "--log-level", "WARNING"])
            self.workers.append(f"127.0.0.1:{port}")
        self.router = f"127.0.0.1:{free_port()}"
        self.policy, self.http_port = policy, http_port

    def _spawn(self, name: str, cmd: list[str]) -> subprocess.Popen:
        log = open(os.path.join(self.log_dir, f"{name}.log"), "ab")
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)
        self.procs.append(proc)
        return proc

    def start(self) -> None:
        for proc, addr in zip(self.procs, self.workers):
            wait_serving(addr, proc, f"worker at {addr}", self.timeout)
        r = redis.Redis.from_url(self.redis_url)
        deadline = time.monotonic() + self.timeout
        while len(list(r.scan_iter(match=rs.LEASE_PATTERN))) < 2:   # the router must see both at once
            if time.monotonic() > deadline:
                raise TimeoutError("workers never published their leases")
            time.sleep(0.1)
        port = self.router.rsplit(":", 1)[1]
        proc = self._spawn("router", [sys.executable, "-m", "pagoda.router", "--host", "127.0.0.1", "--port", port,
                                      "--metrics-port", "0", "--http-port", str(self.http_port),
                                      "--redis-url", self.redis_url,
                                      "--policy", self.policy, "--log-level", "WARNING"])
        wait_serving(self.router, proc, "router", self.timeout)

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, 15)
                except ProcessLookupError:
                    pass
        for proc in self.procs:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, 9)
                proc.wait()


def _words(rng: random.Random, n: int) -> str:
    return " ".join("".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 7)))
                    for _ in range(n))


async def make_requests(client: AsyncPagodaClient, a, rng: random.Random):
    """Chat requests in shuffled rounds, with the tokens each could at best find cached."""
    probe = _words(rng, 100)
    per_word = len(await client.tokenize(probe)) / 100
    systems = [_words(rng, int(a.system_tokens / per_word)) for _ in range(a.prompts)]
    order = []
    for r in range(a.per_prompt):
        order += rng.sample(range(a.prompts), a.prompts)
    first: dict[int, list[int]] = {}
    requests = []
    for i, s in enumerate(order):
        messages = [{"role": "system", "content": systems[s]},
                    {"role": "user", "content": f"question {i}: {_words(rng, 8)}"}]
        ids = await client.tokenize(messages=messages)
        possible = 0
        if s in first:
            lcp = next((k for k, (x, y) in enumerate(zip(ids, first[s])) if x != y), min(len(ids), len(first[s])))
            possible = min(lcp, len(ids) - 1) // BLOCK * BLOCK
        else:
            first[s] = ids
        requests.append((messages, possible))
    return requests


async def warm(address: str, rng: random.Random) -> None:
    # The first forward passes of a process are slow (allocator, kernels): keep them out of the figures.
    async with AsyncPagodaClient(address) as c:
        await c.complete(_words(rng, 150), max_tokens=2, temperature=0.0, cache_salt="warmup")


async def drive(a, router: str, requests) -> tuple[list[Outcome], float]:
    sem = asyncio.Semaphore(a.concurrency)
    out: list[Outcome] = []

    async def one(messages, possible):
        async with sem:
            t0 = time.perf_counter()
            ttft, usage, worker, n = None, None, "", 0
            async for chunk in client.generate(messages=messages, max_tokens=a.max_tokens, temperature=0.0,
                                               ignore_eos=True, timeout=600):
                ttft = ttft if ttft is not None else time.perf_counter() - t0
                n += len(chunk.token_ids)
                if chunk.finished:
                    usage, worker = chunk.usage, chunk.worker_id
            out.append(Outcome(ttft, time.perf_counter() - t0, usage.prompt_tokens, usage.cached_prompt_tokens,
                               possible, n, worker))

    async with AsyncPagodaClient(router) as client:
        t0 = time.perf_counter()
        tasks = []
        for messages, possible in requests:
            tasks.append(asyncio.create_task(one(messages, possible)))
            await asyncio.sleep(0)        # issue in order
        await asyncio.gather(*tasks)
        return out, time.perf_counter() - t0


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))]


async def run_policy(a, model: str, redis_url: str, policy: str, log_dir: str) -> dict:
    redis.Redis.from_url(redis_url).flushdb()
    stack = Stack(model, redis_url, policy, a.num_kv_blocks, log_dir, a.timeout)
    try:
        await asyncio.to_thread(stack.start)
        rng = random.Random(a.seed)
        for addr in stack.workers:
            await warm(addr, rng)
        async with AsyncPagodaClient(stack.router) as c:
            requests = await make_requests(c, a, random.Random(a.seed))
        await asyncio.sleep(1.0)          # warm-up blocks reach the router before the first decision
        outs, wall = await drive(a, stack.router, requests)
    finally:
        stack.stop()
    counts: dict[str, int] = {}
    for o in outs:
        counts[o.worker] = counts.get(o.worker, 0) + 1
    prompt, cached, possible = (sum(getattr(o, f) for o in outs) for f in ("prompt_tokens", "cached", "possible"))
    return dict(policy=policy, requests=len(outs), prompt_tokens=prompt / len(outs), hit_rate=cached / prompt,
                of_possible=cached / possible if possible else float("nan"),
                max_share=max(counts.values()) / len(outs),
                ttft_p50=pct([o.ttft for o in outs], 0.5), ttft_p99=pct([o.ttft for o in outs], 0.99),
                latency_p50=pct([o.latency for o in outs], 0.5), req_per_s=len(outs) / wall,
                tok_per_s=sum(o.output_tokens for o in outs) / wall)


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    a.prompts = a.prompts or (4 if a.quick else 8)
    a.per_prompt = a.per_prompt or (3 if a.quick else 6)
    if min(a.prompts, a.per_prompt, a.system_tokens, a.max_tokens, a.concurrency) < 1:
        raise SystemExit("prompts, per-prompt, system-tokens, max-tokens and concurrency: must be at least 1")
    if a.num_kv_blocks is None:
        # Half the system prompts, plus each in-flight request's own blocks, plus slack.
        per_prompt = a.system_tokens // BLOCK + 2
        a.num_kv_blocks = (a.prompts + 1) // 2 * per_prompt + a.concurrency * 4 + 8
    policies = [p for p in a.policies.split(",") if p]
    # A copy of its own: tests that rebuild the shared cache must not pull it from under running workers.
    model = a.model or default_model(DEFAULT_CACHE / "bench")
    print(f"# e2e: {' '.join(sys.argv)}")
    print(f"# {time.strftime('%Y-%m-%d %H:%M')} on {platform.node()} ({os.cpu_count()} CPUs), model {Path(model).name}, "
          f"{a.prompts} prompts x {a.per_prompt}, ~{a.system_tokens} system tokens, max_tokens {a.max_tokens}, "
          f"concurrency {a.concurrency}, {a.num_kv_blocks} KV blocks per worker")
    rows = []
    with LocalRedis() as url, tempfile.TemporaryDirectory(prefix="pagoda-e2e-") as logs:
        for pol in policies:
            try:
                rows.append(asyncio.run(run_policy(a, model, url, pol, logs)))
            except Exception:
                for f in sorted(os.listdir(logs)):
                    print(f"--- {f} (tail)\n" + Path(logs, f).read_text(errors="replace")[-2000:], file=sys.stderr)
                raise
    print("\n| policy | requests | prompt tokens | hit rate | of possible | busiest worker | TTFT p50 ms | "
          "TTFT p99 ms | latency p50 ms | req/s | output tok/s |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['policy']} | {r['requests']} | {r['prompt_tokens']:.0f} | {r['hit_rate']:.3f} | "
              f"{r['of_possible']:.3f} | {r['max_share']:.0%} | {r['ttft_p50'] * 1e3:.0f} | {r['ttft_p99'] * 1e3:.0f} | "
              f"{r['latency_p50'] * 1e3:.0f} | {r['req_per_s']:.2f} | {r['tok_per_s']:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
