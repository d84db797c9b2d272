"""Soak: one tenant can never hurt another. A real cluster on loopback (redis-server, 2 CPU workers
on the tiny model, 1 router with its OpenAI HTTP front) under good traffic mixed with everything an
attacker tried, for --minutes:

  good        clients sending completions back to back (streamed or not, distinct prompts, so
              the router's block index churns past --index-max-blocks)
  neighbour   a short streamed request every half second: its TTFT and failures
  cancels     streams dropped after their first event
  batches     /v1/completions lists of prompts with n=2
  hostile     JSON nested 100,000 deep, bodies past --http-max-body-bytes, bodies not UTF-8 (each
              must get its 4xx error object); slowloris connections trickling a header byte at a
              time; idle connections that never send; streams whose client never reads
  chaos       one worker SIGKILLed at 40% of the run and started again 5 s later

It reports good requests lost (failed for any reason but being cut mid-stream by the kill: 0),
neighbours failed (0), hostile requests answered otherwise than expected (0), connections the
router failed to close in time (0), KV blocks leaked (every worker back to all blocks free at the
end: 0), and each process's RSS sampled over the run against the router's bound: its RSS once the
mix has run a fifth of the time (at most a minute), plus its two bounded caches at their bounds,
the block index at --index-max-blocks and the prompt-hash cache (router/hashing.py, 4096 prompts),
each measured here with tracemalloc, plus an allowance for requests in flight. RSS against time
goes to a PNG.

    python bench/soak.py [--minutes M] [--quick] [--model DIR] [--plot PNG]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import aiohttp  # noqa: E402
import grpc  # noqa: E402

from bench.common import REPO, command_line, markdown_table, now, scrape_metrics  # noqa: E402
from pagoda.clients import up  # noqa: E402
from pagoda.protos.pagoda.v1 import pagoda_pb2 as pb  # noqa: E402
from pagoda.protos.pagoda.v1 import pagoda_pb2_grpc as pb_grpc  # noqa: E402
from pagoda.runtime.lifetime import PARENT_PID_ENV  # noqa: E402

MIB = 1 << 20
# The router as the soak runs it: short timeouts, so that hostile connections cycle many times.
ROUTER_FLAGS = {"--http-max-body-bytes": str(MIB), "--http-read-timeout": "2", "--http-idle-timeout": "4",
                "--http-write-timeout": "2", "--http-send-buffer-bytes": "65536",
                "--http-batch-seqs-per-worker": "8"}
WORDS = ("sea mountain river cloud forest stone light winter harbour bridge market lantern orchard "
         "meadow island valley thunder garden copper silver").split()


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=1.0, help="how long the mixed traffic runs (default 1)")
    p.add_argument("--quick", action="store_true", help="smoke run: 15 seconds, fewer clients")
    p.add_argument("--model", default=None, help="checkpoint directory (default: pagoda up's tiny model)")
    p.add_argument("--index-max-blocks", type=int, default=1024)
    p.add_argument("--num-kv-blocks", type=int, default=512)
    p.add_argument("--good-clients", type=int, default=None, help="default 4 (quick 2)")
    p.add_argument("--plot", default=os.path.join(REPO, "bench", "soak_rss.png"))
    p.add_argument("--seed", type=int, default=0)
    return p


# -- the cluster -------------------------------------------------------------------------------

class Cluster:
    def __init__(self, model: str, a, log_dir: str):
        self.model_dir, self.a, self.log_dir = model, a, log_dir
        self.procs: dict[str, subprocess.Popen] = {}
        try:
            self._start(a)
        except BaseException:
            self.stop()
            raise

    def _start(self, a) -> None:
        self.redis_port = up.free_port()
        self.procs["redis"] = self._spawn("redis", up.redis_command(up.find_redis_server(), self.redis_port, self.log_dir))
        up.wait_redis(self.redis_port, self.procs["redis"], 10)
        self.redis_url = f"redis://127.0.0.1:{self.redis_port}/0"
        self.workers = {name: f"127.0.0.1:{up.free_port()}" for name in ("w0", "w1")}
        for name in self.workers:
            self.start_worker(name, wait=False)
        for name, address in self.workers.items():
            up.wait_serving(address, self.procs[name], name, 240)
        grpc_port, self.metrics_port, self.http_port = up.free_port(), up.free_port(), up.free_port()
        flags = [x for kv in ROUTER_FLAGS.items() for x in kv]
        self.procs["router"] = self._spawn("router", [
            sys.executable, "-m", "pagoda.router", "--host", "127.0.0.1", "--port", str(grpc_port),
            "--metrics-port", str(self.metrics_port), "--http-port", str(self.http_port), "--redis-url", self.redis_url,
            "--index-max-blocks", str(a.index_max_blocks), "--log-level", "WARNING", *flags])
        up.wait_serving(f"127.0.0.1:{grpc_port}", self.procs["router"], "router", 120)
        deadline = time.monotonic() + 30
        while self.live() < 2:
            if time.monotonic() > deadline:
                raise TimeoutError("the router did not see both workers")
            time.sleep(0.1)

    def _spawn(self, name: str, cmd: list[str]) -> subprocess.Popen:
        with open(os.path.join(self.log_dir, f"{name}.log"), "ab") as log:
            return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=REPO,
                                    start_new_session=True,
                                    # PARENT_PID_ENV: no server outlives this script, however it ends.
                                    env={**os.environ, "OMP_NUM_THREADS": "1", PARENT_PID_ENV: str(os.getpid())})

    def start_worker(self, name: str, wait: bool = True) -> None:
        address = self.workers[name]
        self.procs[name] = self._spawn(name, [
            sys.executable, "-m", "pagoda.gpu_worker", "--model", self.model_dir, "--device", "cpu",
            "--host", "127.0.0.1", "--port", address.rsplit(":", 1)[1], "--metrics-port", "0",
            "--num-kv-blocks", str(self.a.num_kv_blocks), "--max-model-len", "512", "--redis-url", self.redis_url,
            "--worker-id", name, "--log-level", "WARNING"])
        if wait:
            up.wait_serving(address, self.procs[name], name, 240)

    def kill(self, name: str) -> None:
        os.killpg(self.procs[name].pid, signal.SIGKILL)
        self.procs[name].wait()

    def metrics(self) -> dict[str, float]:
        return scrape_metrics(self.metrics_port)

    def live(self) -> float:
        try:
            return sum(v for k, v in self.metrics().items() if k.startswith("pagoda_router_live_workers{"))
        except OSError:
            return 0.0

    def load(self, name: str) -> pb.LoadReport:
        with grpc.insecure_channel(self.workers[name]) as ch:
            return pb_grpc.AdminStub(ch).GetLoad(pb.LoadRequest(), timeout=5)

    def rss_mb(self) -> dict[str, float]:
        out = {}
        for name, proc in self.procs.items():
            try:
                with open(f"/proc/{proc.pid}/status") as f:
                    out[name] = next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024
            except (OSError, StopIteration):
                pass
        return out

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def index_bytes_per_block(n: int = 50_000) -> float:
    """Memory one block costs the router's index, measured: n hashes held for one worker and half
    of them for a second too (tracemalloc, the hash objects included: the index holds them)."""
    import tracemalloc

    from pagoda.router.index import BlockIndex
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    index = BlockIndex(n)
    hashes = [random.randbytes(16) for _ in range(n)]
    index.add("a", hashes)
    index.add("b", hashes[::2])
    used = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    del index
    return used / n


def hasher_bytes_at_bound(prompt_tokens: int) -> tuple[float, int]:
    """(memory, prompts) the router's prompt-hash cache (router/hashing.py PromptHasher) holds at
    its bound, filled with prompts of `prompt_tokens` tokens (measured as index_bytes_per_block)."""
    import tracemalloc

    from pagoda.router.hashing import PromptHasher
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    hasher = PromptHasher()
    rng = random.Random(0)
    for _ in range(hasher.max_prompts + 16):
        hasher.hashes([rng.randrange(1000) for _ in range(prompt_tokens)], 16, b"r" * 16)
    used = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    return used, len(hasher)


def prompt_tokens(model: str, rng: random.Random) -> int:
    """Tokens of the longest prompt the soak sends, with the model's tokenizer."""
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(os.path.join(model, "tokenizer.json"))
    return max(len(tok.encode(" ".join(rng.choice(WORDS) for _ in range(40))).ids) for _ in range(20))


# -- traffic -----------------------------------------------------------------------------------

@dataclass
class Tally:
    good_ok: int = 0
    good_cut_by_kill: int = 0
    good_lost: list[str] = field(default_factory=list)
    neighbour_ttft: list[float] = field(default_factory=list)
    neighbour_failed: list[str] = field(default_factory=list)
    neighbour_cut_by_kill: int = 0
    cancels: int = 0
    batches_ok: int = 0
    batch_prompts: int = 0
    hostile: dict[str, int] = field(default_factory=dict)
    hostile_wrong: list[str] = field(default_factory=list)
    closed: dict[str, list[float]] = field(default_factory=dict)
    left_open: list[str] = field(default_factory=list)
    killed_at: float | None = None


class Soak:
    def __init__(self, cluster: Cluster, a, seconds: float):
        self.c, self.a, self.seconds = cluster, a, seconds
        self.base = f"http://127.0.0.1:{cluster.http_port}"
        self.model = ""
        self.t = Tally()
        self.rng = random.Random(a.seed)
        self.samples: list[tuple[float, dict[str, float], float]] = []   # (t, RSS MB by process, index blocks)
        self.t0 = 0.0
        self.end = 0.0

    def running(self) -> bool:
        return time.monotonic() < self.end

    def prompt(self, n_words: int = 40) -> str:
        return " ".join(self.rng.choice(WORDS) for _ in range(n_words))

    async def post(self, session, body: dict) -> tuple[int, list[dict]]:
        """(status, the response's objects: the JSON answer, or each SSE event)."""
        async with session.post(self.base + "/v1/completions", json=body) as r:
            if r.headers.get("Content-Type", "").startswith("text/event-stream"):
                events = []
                async for line in r.content:
                    if line.startswith(b"data: {"):
                        events.append(json.loads(line[6:]))
                return r.status, events
            return r.status, [await r.json(content_type=None)]

    def cut_by_kill(self, msg: str) -> bool:
        return "w1" in msg and "mid-stream" in msg and self.t.killed_at is not None

    async def good(self, session, k: int) -> None:
        while self.running():
            body = {"model": self.model, "prompt": self.prompt(), "max_tokens": 8, "ignore_eos": True,
                    "stream": k % 2 == 0}
            try:
                status, objs = await self.post(session, body)
                err = next((o["error"]["message"] for o in objs if "error" in o), None)
                if status != 200 or err:
                    raise RuntimeError(f"{status}: {err or objs}")
                self.t.good_ok += 1
            except (RuntimeError, aiohttp.ClientError, asyncio.TimeoutError) as e:
                if self.cut_by_kill(str(e)):
                    self.t.good_cut_by_kill += 1
                else:
                    self.t.good_lost.append(f"{time.monotonic() - self.t0:.1f}s {e!r}"[:300])

    async def neighbour(self, session) -> None:
        while self.running():
            t0 = time.monotonic()
            first = None
            try:
                async with session.post(self.base + "/v1/completions", json={
                        "model": self.model, "prompt": "A neighbour asks: " + self.prompt(8), "max_tokens": 4,
                        "stream": True}) as r:
                    async for line in r.content:
                        if line.startswith(b"data: {"):
                            first = first or time.monotonic() - t0
                            if b'"error"' in line:
                                raise RuntimeError(line.decode()[:200])
                    if r.status != 200 or first is None:
                        raise RuntimeError(f"status {r.status}")
                self.t.neighbour_ttft.append(first)
            except (RuntimeError, aiohttp.ClientError, asyncio.TimeoutError) as e:
                if self.cut_by_kill(str(e)):
                    self.t.neighbour_cut_by_kill += 1
                else:
                    self.t.neighbour_failed.append(f"{time.monotonic() - self.t0:.1f}s {e!r}"[:300])
            await asyncio.sleep(0.5)

    async def canceller(self, session) -> None:
        while self.running():
            try:
                async with session.post(self.base + "/v1/completions", json={
                        "model": self.model, "prompt": self.prompt(), "max_tokens": 200, "ignore_eos": True,
                        "stream": True}) as r:
                    await r.content.readline()          # the first event, then the client goes
                self.t.cancels += 1
            except (aiohttp.ClientError, asyncio.TimeoutError):
                pass
            await asyncio.sleep(0.3)

    async def batcher(self, session) -> None:
        while self.running():
            prompts = [self.prompt(20) for _ in range(48)]
            try:
                status, objs = await self.post(session, {"model": self.model, "prompt": prompts, "n": 2,
                                                         "max_tokens": 6, "ignore_eos": True})
                if status == 200 and len(objs[0]["choices"]) == 96:
                    self.t.batches_ok += 1
                    self.t.batch_prompts += 48
            except (aiohttp.ClientError, asyncio.TimeoutError):
                pass
            await asyncio.sleep(1.0)

    async def hostile(self, session) -> None:
        deep = b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
        huge = b'{"prompt": "' + b"a" * (2 * MIB) + b'"}'
        cases = [("deep JSON", "/v1/completions", deep, 400), ("deep JSON", "/tokenize", deep, 400),
                 ("huge body", "/v1/completions", huge, 413), ("not UTF-8", "/v1/chat/completions",
                                                                 b'{"messages": "\xff\xfe\xfa"}', 400)]
        while self.running():
            name, path, body, want = self.rng.choice(cases)
            try:
                async with session.post(self.base + path, data=body,
                                        headers={"Content-Type": "application/json"}) as r:
                    got = await r.json(content_type=None)
                    if r.status != want or "error" not in got:
                        self.t.hostile_wrong.append(f"{name} {path}: {r.status} {str(got)[:200]}")
            except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:
                self.t.hostile_wrong.append(f"{name} {path}: {e!r}")
            self.t.hostile[name] = self.t.hostile.get(name, 0) + 1
            await asyncio.sleep(0.2)

    async def held_connection(self, kind: str, limit: float) -> None:
        """Connections that hold the router: `slowloris` trickles a header byte each 0.3 s, `idle`
        sends nothing, `stalled` asks for a long stream and never reads. Each must be closed by
        the router within `limit` seconds; then the next one opens."""
        loop = asyncio.get_running_loop()
        while self.running():
            s = socket.socket()
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            s.setblocking(False)
            await loop.sock_connect(s, ("127.0.0.1", self.c.http_port))
            t0 = time.monotonic()
            if kind == "stalled":
                raw = json.dumps({"model": self.model, "prompt": self.prompt(), "max_tokens": 400, "ignore_eos": True,
                                  "logprobs": 20, "stream": True}).encode()
                await loop.sock_sendall(s, b"POST /v1/completions HTTP/1.1\r\nHost: soak\r\nContent-Type: "
                                           b"application/json\r\nContent-Length: %d\r\n\r\n" % len(raw) + raw)
            head = b"GET /health HTTP/1.1\r\nHost: soak\r\nX-Slow: " + b"z" * 200 + b"\r\n\r\n"
            closed = False
            i = 0
            while time.monotonic() - t0 < limit and self.running():
                if kind == "slowloris":
                    try:
                        await loop.sock_sendall(s, head[i % len(head):i % len(head) + 1])
                    except OSError:
                        closed = True
                        break
                    i += 1
                await asyncio.sleep(0.3)
                if kind != "stalled" and _peer_closed(s):
                    closed = True
                    break
                if kind == "stalled" and _reset(s):
                    closed = True
                    break
            if closed:
                self.t.closed.setdefault(kind, []).append(time.monotonic() - t0)
            elif self.running():
                self.t.left_open.append(f"{kind} open {time.monotonic() - t0:.1f}s")
            s.close()

    def baseline(self) -> None:
        self.warm_rss = self.c.rss_mb()

    async def chaos(self) -> None:
        await asyncio.sleep(self.t0 + 0.4 * self.seconds - time.monotonic())
        self.t.killed_at = time.monotonic() - self.t0
        await asyncio.to_thread(self.c.kill, "w1")
        await asyncio.sleep(5.0)
        self.c.start_worker("w1", wait=False)       # it joins once it serves; main() waits for it

    async def sampler(self, every: float) -> None:
        while True:
            rss = self.c.rss_mb()
            try:
                blocks = (await asyncio.to_thread(self.c.metrics)).get("pagoda_router_index_blocks", float("nan"))
            except OSError:
                blocks = float("nan")
            self.samples.append((time.monotonic() - self.t0, rss, blocks))
            await asyncio.sleep(every)

    async def run(self, quick: bool) -> None:
        good = self.a.good_clients or (2 if quick else 4)
        timeout = aiohttp.ClientTimeout(total=120)
        # Pooled connections idle for less than the router's idle timeout (4 s), so that a reused
        # one is never the one the router just closed.
        connector = aiohttp.TCPConnector(limit=64, keepalive_timeout=2)
        async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
            async with session.get(self.base + "/v1/models") as r:
                self.model = (await r.json())["data"][0]["id"]
            sampler = asyncio.ensure_future(self.sampler(0.5 if quick else 1.0))
            self.t0 = time.monotonic()
            self.end = self.t0 + self.seconds
            # The whole mix from the start; the baseline is taken once it has run a while (the
            # allocators warm up, the index fills), so that what grows later is what the bound is about.
            self.warm_at = min(60.0, 0.2 * self.seconds)
            asyncio.get_running_loop().call_later(self.warm_at, self.baseline)
            await asyncio.gather(
                *(self.good(session, k) for k in range(good)), self.neighbour(session), self.canceller(session),
                self.batcher(session), self.hostile(session), self.chaos(),
                *(self.held_connection("slowloris", 2 + 3) for _ in range(4)),
                *(self.held_connection("idle", 2 + 3) for _ in range(4)),
                *(self.held_connection("stalled", 2 + 6) for _ in range(2)))
            sampler.cancel()
            await asyncio.gather(sampler, return_exceptions=True)


def _peer_closed(s: socket.socket) -> bool:
    try:
        return s.recv(65536, socket.MSG_PEEK) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True


def _reset(s: socket.socket) -> bool:
    """The router dropped a stream this client never read: its buffered bytes, then the end."""
    try:
        while True:
            if not s.recv(1 << 20):
                return True
    except BlockingIOError:
        return False
    except OSError:
        return True


# -- report ------------------------------------------------------------------------------------

def leaked_blocks(c: Cluster, timeout: float = 30.0) -> dict[str, int]:
    """Blocks not free on each worker once everything ended (waits for stragglers to finish)."""
    deadline = time.monotonic() + timeout
    while True:
        loads = {name: c.load(name) for name in c.workers}
        leaked = {n: ld.num_blocks - ld.free_blocks + ld.running + ld.waiting for n, ld in loads.items()}
        if not any(leaked.values()) or time.monotonic() > deadline:
            return leaked
        time.sleep(0.2)


def _slope(points: list[tuple[float, float]]) -> float:
    """Least-squares slope of (t, y) points, y per second."""
    if len(points) < 2:
        return 0.0
    mt = sum(t for t, _ in points) / len(points)
    my = sum(y for _, y in points) / len(points)
    den = sum((t - mt) ** 2 for t, _ in points)
    return sum((t - mt) * (y - my) for t, y in points) / den if den else 0.0


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def plot(samples, bound_mb: float, killed_at: float | None, warm_at: float, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(8, 4.5))
    times = [t for t, _, _ in samples]
    for name in ("router", "w0", "w1", "redis"):       # NaN where the process was down: a gap
        ax.plot(times, [rss.get(name, float("nan")) for _, rss, _ in samples], label=name)
    ax.axhline(bound_mb, color="red", linestyle="--", label="router bound")
    if killed_at is not None:
        ax.axvline(killed_at, color="grey", linestyle=":", label="w1 killed")
    ax.axvline(warm_at, color="green", linestyle=":", label="baseline taken")
    ax.set_xlabel("seconds")
    ax.set_ylabel("RSS (MiB)")
    ax.set_title("soak: RSS per process")
    ax.legend(loc="center right", fontsize="small")
    blocks = ax.twinx()
    blocks.plot(times, [b for _, _, b in samples], color="black", linewidth=0.6, alpha=0.5)
    blocks.set_ylabel("router index blocks (thin black)")
    blocks.set_ylim(bottom=0)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def lscpu() -> list[str]:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [line.strip() for line in out.splitlines() if line.startswith(("Model name", "Flags"))]


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    seconds = 15.0 if a.quick else a.minutes * 60
    model = a.model or up.default_model(up.DEFAULT_CACHE)
    per_block = index_bytes_per_block()
    log_dir = tempfile.mkdtemp(prefix="pagoda-soak-")
    cluster = Cluster(model, a, log_dir)
    try:
        soak = Soak(cluster, a, seconds)
        asyncio.run(soak.run(a.quick))
        up.wait_serving(cluster.workers["w1"], cluster.procs["w1"], "w1", 240)
        leaked = leaked_blocks(cluster)
        final_rss = cluster.rss_mb()
    finally:
        cluster.stop()
    t = soak.t
    index_mb = per_block * a.index_max_blocks / MIB
    hasher_b, hasher_prompts = hasher_bytes_at_bound(prompt_tokens(model, random.Random(a.seed)))
    hasher_mb = hasher_b / MIB
    allowance_mb = 16.0          # requests in flight (bodies up to 1 MiB, parsed), allocator slack
    bound_mb = soak.warm_rss["router"] + index_mb + hasher_mb + allowance_mb
    router = [(s, rss["router"]) for s, rss, _ in soak.samples if "router" in rss]
    router_rss = [r for _, r in router]
    last = [(s, r) for s, r in router if s > 2 * router[-1][0] / 3]
    plot(soak.samples, bound_mb, t.killed_at, soak.warm_at, a.plot)
    blocks_seen = max((b for _, _, b in soak.samples if b == b), default=0)

    print(f"{now()} | {command_line()}")
    for line in lscpu():
        print(line)
    print(f"run {seconds:.0f} s (baseline taken at {soak.warm_at:.0f} s), logs {log_dir}")
    rows = [
        ["good requests lost", len(t.good_lost), f"{t.good_ok} ok; {t.good_cut_by_kill} cut mid-stream by the kill "
                                                 "(not counted)"],
        ["neighbours failed", len(t.neighbour_failed),
         f"{len(t.neighbour_ttft)} ok, TTFT p50 {pct(t.neighbour_ttft, .5) * 1e3:.0f} ms, "
         f"p99 {pct(t.neighbour_ttft, .99) * 1e3:.0f} ms, max {max(t.neighbour_ttft, default=0) * 1e3:.0f} ms; "
         f"{t.neighbour_cut_by_kill} cut mid-stream by the kill (not counted)"],
        ["hostile requests answered wrongly", len(t.hostile_wrong),
         ", ".join(f"{k} {v}" for k, v in sorted(t.hostile.items()))],
        ["held connections left open", len(t.left_open),
         ", ".join(f"{k} {len(v)} closed after {pct(v, .5):.1f} s (max {max(v):.1f})" for k, v in sorted(t.closed.items()))],
        ["blocks leaked", sum(leaked.values()), ", ".join(f"{k} {v}" for k, v in leaked.items())],
        ["router RSS past its bound (MiB)", round(max(max(router_rss, default=0) - bound_mb, 0), 1),
         f"bound {bound_mb:.1f} = {soak.warm_rss['router']:.1f} at {soak.warm_at:.0f} s + block index "
         f"{index_mb:.2f} ({a.index_max_blocks} blocks x {per_block:.0f} B) + prompt-hash cache {hasher_mb:.1f} "
         f"({hasher_prompts} prompts) + {allowance_mb:.0f} in flight; max {max(router_rss, default=0):.1f}, "
         f"end {final_rss.get('router', float('nan')):.1f}, last third {_slope(last) * 60:+.2f} MiB/min"],
        ["other work", "", f"{t.cancels} cancels, {t.batches_ok} batches ({t.batch_prompts} prompts x n=2), "
                           f"w1 killed at {t.killed_at or 0:.0f} s and restarted 5 s later, index up to "
                           f"{blocks_seen:.0f} blocks (bound {a.index_max_blocks})"],
    ]
    print(markdown_table(["figure", "value", "detail"], rows))
    procs = sorted({name for _, rss, _ in soak.samples for name in rss})
    print()
    print(markdown_table(["process", f"RSS MiB at {soak.warm_at:.0f} s", "max", "end"],
                         [[n, soak.warm_rss.get(n, float("nan")),
                           max(rss[n] for _, rss, _ in soak.samples if n in rss), final_rss.get(n, float("nan"))]
                          for n in procs]))
    for what, items in (("lost", t.good_lost), ("neighbour failed", t.neighbour_failed),
                        ("hostile wrong", t.hostile_wrong), ("left open", t.left_open)):
        for item in items[:5]:
            print(f"{what}: {item}")
    print(f"plot: {os.path.relpath(a.plot, REPO) if a.plot.startswith(REPO) else a.plot}")
    bad = t.good_lost or t.neighbour_failed or t.hostile_wrong or t.left_open or any(leaked.values()) \
        or max(router_rss, default=0) > bound_mb
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
