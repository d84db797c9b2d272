"""Relay cost: the router's CPU per relayed token and per chunk, beside the worker's, by front door.

    python bench/relay.py [--quick] [--concurrency 1,8,64] [--fronts worker,grpc,http] [--rounds 3]
                          [--stream-intervals 1,4,8]

One real stack: redis-server, --workers CPU workers on pagoda up's tiny model, one router with
its OpenAI HTTP front. C streams at once, each request --tokens tokens long (greedy, ignore_eos,
a short prompt), go through one front door:

- worker: gRPC straight to a worker, no router (what the worker alone spends per token);
- grpc: through the router's gRPC front (proxy mode);
- http: through the router's OpenAI front, streaming (/v1/completions with stream=true);
- direct: the router's Route call, then the stream straight from the chosen worker (clients/
  in direct mode);
- floor: through a relay that does nothing but pass a worker's responses on, as bytes, in the
  same grpc.aio calls (relay_floor() here): what one read and one write per chunk cost in Python
  gRPC, under the router's figures.

With --stream-intervals 1,4,8 each interval gets its own --workers workers (`--stream-interval N`,
serving model relay-siN), all behind the one router, and every front runs against each: the
variants are measured side by side in one run, each front's CPU counted on its own variant's
workers (and floor relay).

With --compare DIR a second router runs from another checkout (e.g. `git archive` of an older
commit) beside this one, over the same workers: its fronts are grpc@base and http@base, and
alternate with the others, so that before and after are measured side by side in one run.

Each process's CPU time (user + system, all threads) is read from /proc/<pid>/stat before and
after a run, the router's and the workers' side by side, and divided by the tokens the client
received and by the chunks (gRPC messages, or SSE events) that carried them. Fronts alternate
within each round and the medians over --rounds are reported, since one run on a shared machine
moves by a third.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import aiohttp  # noqa: E402
import grpc  # noqa: E402
import redis  # noqa: E402

from bench.routing import LocalRedis  # noqa: E402
from pagoda.clients.up import DEFAULT_CACHE, default_model, free_port, wait_serving  # noqa: E402
from pagoda.protos import redis_schema as rs  # noqa: E402
from pagoda.protos.pagoda.v1 import pagoda_pb2 as pb  # noqa: E402
from pagoda.protos.pagoda.v1 import pagoda_pb2_grpc as pb_grpc  # noqa: E402

FRONTS = ("worker", "grpc", "http", "direct", "floor", "grpc@base", "http@base")
PROMPT = "Tell me a long story about the sea, the mountains and the stars."


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="smoke run: concurrency 1,4, 16 tokens, 1 round")
    p.add_argument("--model", default=None, help="checkpoint directory (default: pagoda up's tiny model)")
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--concurrency", default="1,8,64")
    p.add_argument("--fronts", default="worker,grpc,http")
    p.add_argument("--tokens", type=int, default=128, help="output tokens per request")
    p.add_argument("--requests", type=int, default=4, help="requests per stream in a run (at least)")
    p.add_argument("--min-tokens", type=int, default=16384,
                   help="tokens per run at least (more requests per stream at low concurrency): CPU time "
                        "is counted in clock ticks of 10 ms")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--stream-intervals", default="1",
                   help="worker --stream-interval variants, each on its own workers (model relay-siN)")
    p.add_argument("--router-flags", default="", help="extra router flags, as one string")
    p.add_argument("--worker-flags", default="", help="extra worker flags, as one string")
    p.add_argument("--compare", default=None, metavar="DIR",
                   help="also run a router from this checkout (fronts grpc@base, http@base)")
    p.add_argument("--timeout", type=float, default=240.0)
    p.add_argument("--json", default=None, help="write every run here")
    return p


def cpu_seconds(pid: int) -> float:
    """User + system CPU of every thread of the process so far."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Stack:
    """redis (given) + workers + one router, each its own process group, killed on exit."""

    def __init__(self, model: str, redis_url: str, a, log_dir: str):
        self.model, self.redis_url, self.a, self.log_dir = model, redis_url, a, log_dir
        self.procs: dict[str, subprocess.Popen] = {}
        self.workers: list[str] = []
        self.router = f"127.0.0.1:{free_port()}"
        self.http_port = free_port()
        self.base_router = f"127.0.0.1:{free_port()}"
        self.base_http_port = free_port()

    def _spawn(self, name: str, cmd: list[str], path: str | None = None) -> subprocess.Popen:
        log = open(os.path.join(self.log_dir, f"{name}.log"), "ab")
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        if path:
            env["PYTHONPATH"] = path
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True, env=env, cwd=path)
        self.procs[name] = proc
        return proc

    def start(self) -> None:
        a = self.a
        blocks = max(256, 64 * (a.tokens // 16 + 4) // a.workers * 2)
        self.workers_of: dict[int, list[str]] = {}
        self.floors: dict[int, str] = {}
        for si in a.intervals:
            for i in range(a.workers):
                port = free_port()
                self._spawn(f"worker{i}@si{si}", [
                    sys.executable, "-m", "pagoda.gpu_worker", "--model", self.model, "--device", "cpu",
                    "--served-model-name", f"relay-si{si}", "--stream-interval", str(si),
                    "--host", "127.0.0.1", "--port", str(port), "--metrics-port", "0",
                    "--num-kv-blocks", str(blocks), "--redis-url", self.redis_url,
                    "--worker-id", f"relay-w{i}-si{si}", "--advertise-address", f"127.0.0.1:{port}",
                    "--log-level", "WARNING", *a.worker_flags.split()])
                self.workers_of.setdefault(si, []).append(f"127.0.0.1:{port}")
                self.workers.append(f"127.0.0.1:{port}")
        for si, addrs in self.workers_of.items():
            for i, addr in enumerate(addrs):
                wait_serving(addr, self.procs[f"worker{i}@si{si}"], f"worker at {addr}", a.timeout)
            self.floors[si] = f"127.0.0.1:{free_port()}"
            self._spawn(f"floor@si{si}", [sys.executable, os.path.abspath(__file__), "--floor-relay",
                                          self.floors[si], addrs[0]])
        r = redis.Redis.from_url(self.redis_url)
        deadline = time.monotonic() + a.timeout
        while len(list(r.scan_iter(match=rs.LEASE_PATTERN))) < len(self.workers):
            if time.monotonic() > deadline:
                raise TimeoutError("workers never published their leases")
            time.sleep(0.1)
        routers = [("router", self.router, self.http_port, None)]
        if a.compare:
            routers.append(("router@base", self.base_router, self.base_http_port, os.path.abspath(a.compare)))
        for name, address, http_port, path in routers:
            proc = self._spawn(name, [sys.executable, "-m", "pagoda.router", "--host", "127.0.0.1",
                                      "--port", address.rsplit(":", 1)[1], "--metrics-port", "0",
                                      "--http-port", str(http_port), "--redis-url", self.redis_url,
                                      "--log-level", "WARNING", *a.router_flags.split()], path)
            wait_serving(address, proc, name, a.timeout)

    def pids(self) -> dict[str, int]:
        return {name: p.pid for name, p in self.procs.items()}

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, 15)
                except ProcessLookupError:
                    pass
        for proc in self.procs.values():
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, 9)
                proc.wait()


class Fronts:
    """One stream of each front door: -> (tokens, chunks) it received."""

    def __init__(self, stack: Stack, a):
        self.stack, self.a = stack, a
        self.si = a.intervals[0]         # the variant the next calls are for (run() sets it)
        self.reqs = {si: pb.GenerateRequest(text=PROMPT, model=f"relay-si{si}", sampling=pb.SamplingParams(
            max_tokens=a.tokens, temperature=0.0, ignore_eos=True)) for si in a.intervals}
        self.bodies = {si: {"model": f"relay-si{si}", "prompt": PROMPT, "max_tokens": a.tokens, "temperature": 0,
                            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
                       for si in a.intervals}

    @property
    def req(self) -> pb.GenerateRequest:
        return self.reqs[self.si]

    @property
    def body(self) -> dict:
        return self.bodies[self.si]

    async def __aenter__(self):
        self.wch_of = {si: [grpc.aio.insecure_channel(w) for w in ws] for si, ws in self.stack.workers_of.items()}
        self.wch = [ch for chs in self.wch_of.values() for ch in chs]
        self.rch = grpc.aio.insecure_channel(self.stack.router)
        self.base_rch = grpc.aio.insecure_channel(self.stack.base_router)
        self.floor_of = {si: grpc.aio.insecure_channel(f) for si, f in self.stack.floors.items()}
        self.http = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
        self.url = f"http://127.0.0.1:{self.stack.http_port}/v1/completions"
        self.base_url = f"http://127.0.0.1:{self.stack.base_http_port}/v1/completions"
        self.direct_client = None
        if "direct" in self.a.fronts:
            from pagoda.clients.client import AsyncPagodaClient
            self.direct_client = AsyncPagodaClient(self.stack.router, direct=True)
        return self

    async def __aexit__(self, *exc):
        for ch in self.wch + [self.rch, self.base_rch, *self.floor_of.values()]:
            await ch.close()
        await self.http.close()
        if self.direct_client is not None:
            await self.direct_client.close()

    async def worker(self, k: int) -> tuple[int, int]:
        chs = self.wch_of[self.si]
        return await self._grpc(pb_grpc.GenerationStub(chs[k % len(chs)]))

    async def grpc(self, k: int) -> tuple[int, int]:
        return await self._grpc(pb_grpc.GenerationStub(self.rch))

    async def floor(self, k: int) -> tuple[int, int]:
        return await self._grpc(pb_grpc.GenerationStub(self.floor_of[self.si]))

    async def grpc_base(self, k: int) -> tuple[int, int]:
        return await self._grpc(pb_grpc.GenerationStub(self.base_rch))

    async def _grpc(self, stub) -> tuple[int, int]:
        tokens = chunks = 0
        async for r in stub.Generate(self.req, timeout=600):
            tokens += len(r.token_ids)
            chunks += 1
        return tokens, chunks

    async def direct(self, k: int) -> tuple[int, int]:
        assert self.direct_client is not None
        tokens = chunks = 0
        async for c in self.direct_client.generate_request(self.req, timeout=600):
            tokens += len(c.token_ids)
            chunks += 1
        return tokens, chunks

    async def http_(self, k: int, url: str | None = None) -> tuple[int, int]:
        tokens = chunks = 0
        async with self.http.post(url or self.url, json=self.body) as resp:
            assert resp.status == 200, await resp.text()
            async for line in resp.content:
                if not line.startswith(b"data: {"):
                    continue
                event = json.loads(line[6:])
                if event.get("choices"):
                    chunks += 1
                if event.get("usage"):
                    tokens = event["usage"]["completion_tokens"]
        return tokens, chunks

    def call(self, front: str):
        if front == "http@base":
            return lambda k: self.http_(k, self.base_url)
        return self.http_ if front == "http" else getattr(self, front.replace("@", "_"))


async def run(fronts: Fronts, front: str, concurrency: int, a, si: int = 1) -> dict:
    fronts.si = si
    call = fronts.call(front)
    # Only this variant's workers and floor relay (the others idle) and the routers.
    pids = {n: p for n, p in fronts.stack.pids().items()
            if "@si" not in n or n.endswith(f"@si{si}")}

    requests = max(a.requests, -(-a.min_tokens // (concurrency * a.tokens)))

    async def stream(k: int) -> tuple[int, int]:
        t = c = 0
        for _ in range(requests):
            dt, dc = await call(k)
            t, c = t + dt, c + dc
        return t, c

    await asyncio.gather(*(call(k) for k in range(min(concurrency, 4))))    # warm: connections, caches
    before = {n: cpu_seconds(p) for n, p in pids.items()}
    me0, t0 = time.process_time(), time.perf_counter()
    got = await asyncio.gather(*(stream(k) for k in range(concurrency)))
    wall, me = time.perf_counter() - t0, time.process_time() - me0
    used = {n: cpu_seconds(p) - before[n] for n, p in pids.items()}
    tokens, chunks = sum(t for t, _ in got), sum(c for _, c in got)
    assert tokens == concurrency * requests * a.tokens, (front, tokens)
    workers = sum(v for n, v in used.items() if n.startswith("worker"))
    router = used["router@base" if front.endswith("@base") else f"floor@si{si}" if front == "floor" else "router"]
    return dict(front=front, stream_interval=si, concurrency=concurrency, tokens=tokens, chunks=chunks, wall_s=wall,
                tok_per_s=tokens / wall, router_us_per_token=router / tokens * 1e6,
                router_us_per_request=router / (concurrency * requests) * 1e6,
                router_us_per_chunk=router / chunks * 1e6, worker_us_per_token=workers / tokens * 1e6,
                client_us_per_token=me / tokens * 1e6, tokens_per_chunk=tokens / chunks)


def median_rows(runs: list[dict]) -> list[dict]:
    keys = sorted({(r["concurrency"], FRONTS.index(r["front"]), r.get("stream_interval", 1)) for r in runs})
    out = []
    for c, f, si in keys:
        group = [r for r in runs if r["concurrency"] == c and r["front"] == FRONTS[f]
                 and r.get("stream_interval", 1) == si]
        row = dict(group[0])
        for k in ("wall_s", "tok_per_s", "router_us_per_token", "router_us_per_request", "router_us_per_chunk",
                  "worker_us_per_token",
                  "client_us_per_token", "tokens_per_chunk"):
            row[k] = statistics.median(r[k] for r in group)
        out.append(row)
    return out


def print_table(rows: list[dict]) -> None:
    print("| concurrency | front | stream interval | tokens/s | router CPU us/token | router CPU us/chunk | "
          "router CPU us/request | tokens/chunk | worker CPU us/token | client CPU us/token |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        router = ("-", "-", "-") if r["front"] == "worker" else \
            (f"{r['router_us_per_token']:.1f}", f"{r['router_us_per_chunk']:.1f}", f"{r['router_us_per_request']:,.0f}")
        print(f"| {r['concurrency']} | {r['front']} | {r.get('stream_interval', 1)} | {r['tok_per_s']:,.0f} | "
              f"{router[0]} | {router[1]} | {router[2]} | "
              f"{r['tokens_per_chunk']:.2f} | {r['worker_us_per_token']:.0f} | {r['client_us_per_token']:.0f} |")


async def main_async(a, model: str) -> list[dict]:
    fronts_wanted = [f for f in a.fronts.split(",") if f]
    bad = [f for f in fronts_wanted if f not in FRONTS]
    if bad or not fronts_wanted:
        raise SystemExit(f"fronts: must be among {', '.join(FRONTS)} (got {a.fronts!r})")
    concurrencies = [int(x) for x in a.concurrency.split(",") if x]
    runs = []
    with LocalRedis() as url, tempfile.TemporaryDirectory(prefix="pagoda-relay-") as logs:
        stack = Stack(model, url, a, logs)
        try:
            await asyncio.to_thread(stack.start)
            async with Fronts(stack, a) as fronts:
                for rnd in range(a.rounds):
                    for c in concurrencies:
                        variants = [(f, si) for si in a.intervals for f in fronts_wanted]
                        for front, si in variants if rnd % 2 == 0 else variants[::-1]:
                            runs.append(await run(fronts, front, c, a, si))
        except Exception:
            for f in sorted(os.listdir(logs)):
                with open(os.path.join(logs, f), errors="replace") as fh:
                    print(f"--- {f} (tail)\n{fh.read()[-2000:]}", file=sys.stderr)
            raise
        finally:
            stack.stop()
    return runs


def relay_floor(listen: str, upstream: str) -> None:
    """The least a relay can do: each response of the worker's Generate passed on as it came."""
    async def serve() -> None:
        channel = grpc.aio.insecure_channel(upstream)
        generate = channel.unary_stream("/pagoda.v1.Generation/Generate", request_serializer=None,
                                        response_deserializer=None)

        async def relay(request: bytes, context) -> None:
            async for raw in generate(request):
                await context.write(raw)
        handler = grpc.unary_stream_rpc_method_handler(relay, request_deserializer=None, response_serializer=None)
        server = grpc.aio.server()
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("pagoda.v1.Generation",
                                                                              {"Generate": handler}),))
        server.add_insecure_port(listen)
        await server.start()
        await server.wait_for_termination()
    asyncio.run(serve())


def main(argv: list[str] | None = None) -> int:
    if argv is None and sys.argv[1:2] == ["--floor-relay"]:
        relay_floor(sys.argv[2], sys.argv[3])
        return 0
    a = build_parser().parse_args(argv)
    if a.quick:
        a.concurrency, a.tokens, a.rounds, a.requests = "1,4", 16, 1, 2
    if min(a.workers, a.tokens, a.requests, a.rounds) < 1:
        raise SystemExit("workers, tokens, requests and rounds: must be at least 1")
    try:
        a.intervals = sorted({int(x) for x in a.stream_intervals.split(",") if x})
    except ValueError:
        a.intervals = []
    if not a.intervals or min(a.intervals) < 1:
        raise SystemExit(f"stream-intervals: positive integers, comma-separated (got {a.stream_intervals!r})")
    model = a.model or default_model(DEFAULT_CACHE / "bench")
    with open("/proc/loadavg") as f:
        load = f.read().split()[:3]
    print(f"# relay: {' '.join(sys.argv)}")
    print(f"# {time.strftime('%Y-%m-%d %H:%M')}, {os.cpu_count()} CPUs, load average {' '.join(load)}, "
          f"{a.workers} worker(s), {a.tokens} tokens x {a.requests} requests per stream, {a.rounds} round(s)")
    runs = asyncio.run(main_async(a, model))
    print_table(median_rows(runs))
    with open("/proc/loadavg") as f:
        print(f"# load average after: {' '.join(f.read().split()[:3])}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(runs, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
