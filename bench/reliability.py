"""Reliability probes: the real stack (redis-server, 2 CPU workers, 1 router) under load,
cancellation storms, slow readers, a worker killed with SIGKILL and a Redis restart.

    python bench/reliability.py [--quick] [--model DIR]

One stack runs the probes in order (the kill -9 and Redis probes last, as they break it):
  load          C clients back to back for D seconds: throughput, latency and TTFT p50/p99, errors
  cancellation  S streams cancelled after their first token: seconds until every worker is idle
                with all KV blocks free, and a normal request's latency right after
  slow readers  S streams opened and never read for T seconds: a normal request's latency p50
                meanwhile (against the load probe's), router memory growth, blocks freed after
  kill -9       one worker SIGKILLed during a burst: requests lost (only streams already on it
                may fail), seconds until requests succeed again, until the router drops it
  redis restart Redis SIGKILLed for T seconds then restarted empty: requests served meanwhile,
                seconds until the router's Redis sync is healthy and the worker is back in its view
Prints one markdown table; bench/RESULTS.md ("Reliability") records a run.
"""
from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import grpc  # noqa: E402

from bench.common import machine, markdown_table, now, scrape_metrics  # noqa: E402
from pagoda.clients import up  # noqa: E402
from pagoda.clients.client import PagodaClient  # noqa: E402
from pagoda.protos.pagoda.v1 import pagoda_pb2 as pb  # noqa: E402
from pagoda.protos.pagoda.v1 import pagoda_pb2_grpc as pb_grpc  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="smoke run: shorter and fewer of everything")
    p.add_argument("--model", default=None, help="checkpoint directory (default: pagoda up's tiny model)")
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--duration", type=float, default=None, help="load probe seconds (default 20; quick 4)")
    p.add_argument("--streams", type=int, default=None, help="cancelled / slow streams (default 48; quick 8)")
    p.add_argument("--num-kv-blocks", type=int, default=256)
    p.add_argument("--timeout", type=float, default=180.0)
    return p


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def request(i: int, max_tokens: int = 8, **kw) -> pb.GenerateRequest:
    text = f"Request {i}: tell me about the number {i % 50} and why it matters. " * 3
    return pb.GenerateRequest(text=text, sampling=pb.SamplingParams(max_tokens=max_tokens, temperature=0,
                                                                    ignore_eos=True, **kw))


class Stack:
    def __init__(self, model: str, blocks: int, log_dir: str, timeout: float):
        self.log_dir, self.procs = log_dir, {}
        self.redis_port = up.free_port()
        self.redis_bin = up.find_redis_server()
        self.start_redis()
        url = f"redis://127.0.0.1:{self.redis_port}/0"
        self.workers = {}
        for i in range(2):
            port = up.free_port()
            self.spawn(f"w{i}", [sys.executable, "-m", "pagoda.gpu_worker", "--model", model, "--device", "cpu",
                                 "--host", "127.0.0.1", "--port", str(port), "--metrics-port", "0",
                                 "--num-kv-blocks", str(blocks), "--redis-url", url, "--worker-id", f"w{i}",
                                 "--log-level", "WARNING"])
            self.workers[f"w{i}"] = f"127.0.0.1:{port}"
        for name, address in self.workers.items():
            up.wait_serving(address, self.procs[name], name, timeout)
        self.router, self.metrics_port = f"127.0.0.1:{up.free_port()}", up.free_port()
        self.spawn("router", [sys.executable, "-m", "pagoda.router", "--host", "127.0.0.1",
                              "--port", self.router.rsplit(":", 1)[1], "--metrics-port", str(self.metrics_port),
                              "--http-port", "0", "--redis-url", url, "--log-level", "WARNING"])
        up.wait_serving(self.router, self.procs["router"], "router", timeout)
        self.wait(lambda: self.live() == 2, 10, "the router to see both workers")

    def spawn(self, name: str, cmd: list[str]) -> None:
        with open(os.path.join(self.log_dir, f"{name}.log"), "ab") as log:
            self.procs[name] = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                                start_new_session=True, env={**os.environ, "OMP_NUM_THREADS": "1"})

    def start_redis(self) -> None:
        self.procs["redis"] = subprocess.Popen(up.redis_command(self.redis_bin, self.redis_port, self.log_dir),
                                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                               start_new_session=True)
        up.wait_redis(self.redis_port, self.procs["redis"], 10)

    def kill(self, name: str) -> None:
        os.killpg(self.procs[name].pid, signal.SIGKILL)
        self.procs[name].wait()

    def metrics(self) -> dict[str, float]:
        return scrape_metrics(self.metrics_port)

    def live(self) -> float:
        return sum(v for k, v in self.metrics().items() if k.startswith("pagoda_router_live_workers{"))

    def idle(self) -> bool:
        for name, address in self.workers.items():
            if self.procs[name].poll() is not None:
                continue
            with PagodaClient(address, retries=0) as c:
                load = c.load()
            if load.running or load.waiting or load.free_blocks != load.num_blocks:
                return False
        return True

    def router_rss_mb(self) -> float:
        with open(f"/proc/{self.procs['router'].pid}/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024

    @staticmethod
    def wait(cond, timeout: float, what: str) -> float:
        t0 = time.monotonic()
        while not cond():
            if time.monotonic() - t0 > timeout:
                raise TimeoutError(what)
            time.sleep(0.05)
        return time.monotonic() - t0

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def timed(stub, req, timeout=60.0) -> tuple[float, float, grpc.RpcError | None]:
    """(TTFT, latency, error) of one request."""
    t0 = time.perf_counter()
    ttft = None
    try:
        for _ in stub.Generate(req, timeout=timeout):
            ttft = ttft or time.perf_counter() - t0
        return ttft or float("nan"), time.perf_counter() - t0, None
    except grpc.RpcError as e:
        return float("nan"), time.perf_counter() - t0, e


def probe_load(stub, clients: int, duration: float) -> dict:
    end = time.monotonic() + duration
    results: list[tuple[float, float, grpc.RpcError | None]] = []
    lock = threading.Lock()

    def client(k: int) -> None:
        i = k
        while time.monotonic() < end:
            r = timed(stub, request(i))
            with lock:
                results.append(r)
            i += clients

    t0 = time.monotonic()
    with ThreadPoolExecutor(clients) as pool:
        list(pool.map(client, range(clients)))
    ok = [r for r in results if r[2] is None]
    return {"requests": len(results), "errors": len(results) - len(ok),
            "req/s": len(ok) / (time.monotonic() - t0),
            "latency p50/p99 ms": f"{pct([r[1] for r in ok], .5) * 1e3:.0f} / {pct([r[1] for r in ok], .99) * 1e3:.0f}",
            "ttft p50/p99 ms": f"{pct([r[0] for r in ok], .5) * 1e3:.0f} / {pct([r[0] for r in ok], .99) * 1e3:.0f}",
            "_p50": pct([r[1] for r in ok], .5)}


def probe_cancellation(stack: Stack, stub, streams: int) -> dict:
    def cancel_after_first(i: int) -> bool:
        call = stub.Generate(request(i, max_tokens=200), timeout=60)
        try:
            next(call)
            return True
        finally:
            call.cancel()

    with ThreadPoolExecutor(16) as pool:
        started = sum(pool.map(cancel_after_first, range(streams)))
    freed = stack.wait(stack.idle, 30, "workers idle after the cancellations")
    _, after, err = timed(stub, request(10_000))
    return {"streams cancelled": started, "s until all blocks free": f"{freed:.2f}",
            "next request ms": f"{after * 1e3:.0f}" + (f" ({err.code().name})" if err else "")}


def probe_slow_readers(stack: Stack, stub, streams: int, seconds: float, base_p50: float) -> dict:
    rss0 = stack.router_rss_mb()
    calls = [stub.Generate(request(20_000 + i, max_tokens=200), timeout=120) for i in range(streams)]
    lat = []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        lat.append(timed(stub, request(30_000 + len(lat)))[1])
    rss1 = stack.router_rss_mb()
    for c in calls:
        c.cancel()
    freed = stack.wait(stack.idle, 30, "workers idle after the slow readers left")
    return {"unread streams": streams, "normal p50 ms (vs load)": f"{pct(lat, .5) * 1e3:.0f} ({base_p50 * 1e3:.0f})",
            "router RSS MB before/after": f"{rss0:.0f} / {rss1:.0f}", "s until blocks free": f"{freed:.2f}"}


def probe_kill9(stack: Stack, stub) -> dict:
    first: dict[int, str] = {}

    def one(i: int):
        try:
            for r in stub.Generate(request(40_000 + i, max_tokens=60), timeout=60):
                first.setdefault(i, r.worker_id)
            return None
        except grpc.RpcError as e:
            return e

    with ThreadPoolExecutor(16) as pool:
        futs = [pool.submit(one, i) for i in range(16)]
        Stack.wait(lambda: sum(1 for w in first.values() if w == "w0") >= 2, 30, "streams on w0")
        on_w0 = sum(1 for w in first.values() if w == "w0")
        stack.kill("w0")
        killed = time.monotonic()
        errors = [f.result() for f in futs]
    failed = [i for i, e in enumerate(errors) if e is not None]
    lost_elsewhere = [i for i in failed if first.get(i) != "w0"]
    recover = None
    ok_in_row = 0
    while time.monotonic() - killed < 30 and ok_in_row < 10:
        _, _, err = timed(stub, request(50_000 + ok_in_row))
        ok_in_row = 0 if err else ok_in_row + 1
        if ok_in_row == 1 and recover is None:
            recover = time.monotonic() - killed
    dropped = Stack.wait(lambda: stack.live() == 1, 30, "the router to drop w0") + (time.monotonic() - killed)
    return {"streams on w0 when killed": on_w0, "failed (all on w0?)": f"{len(failed)} ({not lost_elsewhere})",
            "s until a request succeeds": f"{recover:.2f}", "s until the router drops w0": f"{dropped:.2f}"}


def probe_redis_restart(stack: Stack, stub, seconds: float) -> dict:
    stack.kill("redis")
    down = time.monotonic()
    results = []
    while time.monotonic() - down < seconds:
        results.append(timed(stub, request(60_000 + len(results)))[2] is None)
    stack.start_redis()
    back = time.monotonic()
    synced = Stack.wait(lambda: stack.metrics().get("pagoda_router_redis_sync_healthy") == 1
                        and stack.metrics().get("pagoda_router_redis_connected") == 1 and stack.live() == 1,
                        30, "the router to resync")
    served_after = sum(timed(stub, request(70_000 + i))[2] is None for i in range(10))
    return {"requests while Redis was down": f"{sum(results)}/{len(results)} ok",
            "s until the router is synced again": f"{synced:.2f} (after {back - down:.1f} s down)",
            "requests after": f"{served_after}/10 ok"}


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    duration = a.duration or (4.0 if a.quick else 20.0)
    streams = a.streams or (8 if a.quick else 48)
    model = a.model or up.default_model(up.DEFAULT_CACHE)
    log_dir = tempfile.mkdtemp(prefix="pagoda-reliability-")
    stack = Stack(model, a.num_kv_blocks, log_dir, a.timeout)
    try:
        stub = pb_grpc.GenerationStub(grpc.insecure_channel(stack.router))
        timed(stub, request(0))
        load = probe_load(stub, a.clients, duration)
        rows = [["load", f"{a.clients} clients x {duration:.0f} s",
                 ", ".join(f"{k} {v:.1f}" if isinstance(v, float) else f"{k} {v}"
                           for k, v in load.items() if not k.startswith("_"))]]
        for name, what, out in (
                ("cancellation", f"{streams} streams", probe_cancellation(stack, stub, streams)),
                ("slow readers", f"{streams} streams, 5 s", probe_slow_readers(stack, stub, streams, 5.0, load["_p50"])),
                ("kill -9", "1 of 2 workers, 16 in flight", probe_kill9(stack, stub)),
                ("redis restart", "SIGKILL, 3 s down", probe_redis_restart(stack, stub, 3.0))):
            rows.append([name, what, ", ".join(f"{k} {v}" for k, v in out.items())])
    finally:
        stack.stop()
    print(f"{now()} | {machine()}")
    print(markdown_table(["probe", "setup", "figures"], rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
