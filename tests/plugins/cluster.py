"""Router test rig: real routers and light stand-in workers as processes, on a real Redis.

A stand-in worker (`python -m tests.plugins.cluster ...`) is a real gRPC Generation server whose
engine is a bounded LRU prefix cache with no model: it reports the cached prompt tokens it really
found, publishes through the real pagoda.gpu_worker.serving.publisher.Publisher, and streams `max_tokens` dummy
tokens with a configurable delay. It starts in a fraction of a second and needs no torch, so
routing, failover and Redis outages can be tested fast; the full-model end-to-end tests use
real workers (tests/plugins/servers.py).

Fixtures: start_fake_worker(redis_url, model="m", **opts) and start_router(redis_url, **flags),
each returning a Proc (address, metrics(), kill()); everything is killed at teardown.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections import OrderedDict
from pathlib import Path
from types import SimpleNamespace

import pytest

from bench.common import scrape_metrics
from pagoda.runtime.lifetime import PARENT_PID_ENV

ROOT = Path(__file__).resolve().parents[2]
_LISTEN = re.compile(r"listening on [^\s]+:(\d+)")


# -- the stand-in worker ----------------------------------------------------------------------

TOKENIZER_CONFIG = json.dumps({"add_bos_token": False})


def word_tokenizer_json() -> str:
    """A word-level tokenizer: one id per lowercase letter word a..z plus unknown."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    vocab = {"[UNK]": 0, **{chr(97 + i) * k: 1 + i * 4 + k - 1 for i in range(26) for k in range(1, 5)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return tok.to_str()


class FakeEngine:
    """A prefix cache of `num_blocks` blocks (LRU) with the engine's publisher-facing methods
    (pagoda.gpu_worker.serving.engine_client.EngineReport): no host tier, no adapters."""

    def __init__(self, model: str, block_size: int = 16, num_blocks: int = 4096):
        self.model_name, self.block_size, self.num_blocks = model, block_size, num_blocks
        self.cache: OrderedDict[bytes, None] = OrderedDict()
        self.events: list[tuple[str, bytes]] = []
        self.lock = threading.Lock()
        self.running = self.queued = 0
        self.requests: list = []        # every GenerateRequest it was sent (router stage tests read them)

    def admit(self, token_ids: list[int], adapter: str, salt: str) -> int:
        from pagoda.protos.block_hash import block_hashes, namespace_root
        hashes = block_hashes(token_ids, self.block_size, namespace_root(self.model_name, adapter, salt))
        with self.lock:
            hit = 0
            while hit < len(hashes) and hashes[hit] in self.cache:
                hit += 1
            for h in hashes:
                if h in self.cache:
                    self.cache.move_to_end(h)
                else:
                    self.cache[h] = None
                    self.events.append(("stored", h))
            while len(self.cache) > self.num_blocks:
                old, _ = self.cache.popitem(last=False)
                self.events.append(("removed", old))
        return min(hit * self.block_size, len(token_ids) - 1)

    def take_kv_events(self):
        with self.lock:
            out, self.events = self.events, []
        return out

    def cached_block_hashes(self):
        with self.lock:
            return list(self.cache)

    def take_host_kv_events(self):
        return []

    def cached_hashes_by_tier(self):
        return self.cached_block_hashes(), []

    def lora_adapters(self):
        return []

    def lora_resident(self):
        return []

    max_loras = 0           # no LoRA: never sent an adapter load

    def lora_paths(self):
        return {}

    def stats(self):
        """The EngineStats fields a publisher reads (that module imports torch; this one must not)."""
        used = min(self.running * 4, self.num_blocks)
        return SimpleNamespace(running=self.running, waiting=0, queued_prefill_tokens=self.queued,
                               num_blocks=self.num_blocks, free_blocks=self.num_blocks - used,
                               kv_usage=used / self.num_blocks, num_steps=0, step_seconds=0.0, prompt_tokens=0,
                               generation_tokens=0, max_num_batched_tokens=0, host_blocks=0, kv_copied_blocks=0,
                               kv_copy_seconds=0.0)


def _servicer(engine: FakeEngine, worker_id: str, token_delay: float, tokenizer_json: str,
              fail_first: int = 0, fail_code: str = "UNAVAILABLE", epoch: int = 0, hang: bool = False,
              misbehave: str = ""):
    import grpc

    from pagoda.protos.pagoda.v1 import pagoda_pb2 as pb
    from pagoda.protos.pagoda.v1 import pagoda_pb2_grpc as pb_grpc

    failures_left = [fail_first]

    class Servicer(pb_grpc.GenerationServicer):
        async def Generate(self, request, context):
            if hang:                              # takes calls and never answers
                await asyncio.sleep(3600)
            if failures_left[0] > 0:             # a sick worker, for the circuit breaker
                failures_left[0] -= 1
                await context.abort(grpc.StatusCode[fail_code], "stand-in told to fail")
            if not request.token_ids:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "token_ids: stand-in takes ids only")
            if request.model != engine.model_name:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"model: not served here ({request.model!r})")
            ids = list(request.token_ids)
            engine.requests.append(request)
            engine.running += 1
            engine.queued += len(ids)
            try:
                await asyncio.sleep(token_delay)
                cached = engine.admit(ids, request.adapter, request.cache_salt)
                engine.queued -= len(ids)
                n = request.sampling.max_tokens if request.sampling.HasField("max_tokens") else 4
                if misbehave == "overrun":               # ignores max_tokens
                    n *= 50
                for i in range(n):
                    last = i == n - 1
                    resp = pb.GenerateResponse(request_id=request.request_id, token_ids=[i], text="x",
                                               finished=last, worker_id=worker_id)
                    if misbehave == "index":             # a sequence the request never asked for
                        resp.index = 7
                    elif misbehave == "no_finish" and last:
                        return                           # ends the stream OK without finishing
                    elif misbehave == "abort_mid" and i == 1:
                        await context.abort(grpc.StatusCode.INTERNAL, "stand-in died mid-stream")
                    elif misbehave == "request_fault_mid" and i == 1:   # as a worker's RequestFault
                        await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                            "beam search scoring: this request's parameters or data made "
                                            "the engine raise OverflowError")
                    if last:
                        resp.finish_reason = pb.FINISH_REASON_LENGTH
                        resp.usage.CopyFrom(pb.Usage(prompt_tokens=len(ids), completion_tokens=n,
                                                     cached_prompt_tokens=cached))
                    yield resp
                    if not last:
                        await asyncio.sleep(token_delay)
            finally:
                engine.running -= 1

        async def GetModelInfo(self, request, context):
            return pb.ModelInfoResponse(model=engine.model_name, block_size=engine.block_size,
                                        max_model_len=4096, vocab_size=105, tokenizer_json=tokenizer_json,
                                        tokenizer_config_json=TOKENIZER_CONFIG, worker_id=worker_id, epoch=epoch)

    return Servicer()


async def _serve_fake(a) -> None:
    import grpc
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc

    from pagoda.gpu_worker.serving.publisher import Publisher
    from pagoda.protos.pagoda.v1 import pagoda_pb2_grpc as pb_grpc
    from pagoda.runtime.tokenization import tokenizer_digest
    engine = FakeEngine(a.model, a.block_size, a.num_blocks)
    server = grpc.aio.server()
    tok_json = word_tokenizer_json()
    pub = Publisher(a.redis_url, a.worker_id, a.model, "", engine, heartbeat_s=a.heartbeat, snapshot_s=a.snapshot,
                    tokenizer_digest=a.tokenizer_digest or tokenizer_digest(tok_json, TOKENIZER_CONFIG))
    pb_grpc.add_GenerationServicer_to_server(_servicer(engine, a.worker_id, a.token_delay, tok_json,
                                                       a.fail_first, a.fail_code, pub.epoch, a.hang, a.misbehave),
                                             server)
    hs = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(hs, server)
    port = server.add_insecure_port(f"127.0.0.1:{a.port}")
    await server.start()
    await hs.set("", health_pb2.HealthCheckResponse.SERVING)
    pub.address = f"127.0.0.1:{port}"
    await pub.start()
    print(f"fake worker {a.worker_id} listening on 127.0.0.1:{port}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await pub.stop()
    await server.stop(1)


def main(argv=None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--redis-url", required=True)
    p.add_argument("--model", default="m")
    p.add_argument("--worker-id", required=True)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-blocks", type=int, default=4096)
    p.add_argument("--token-delay", type=float, default=0.005)
    p.add_argument("--heartbeat", type=float, default=0.5)
    p.add_argument("--snapshot", type=float, default=5.0)
    p.add_argument("--fail-first", type=int, default=0, help="answer the first N calls with --fail-code")
    p.add_argument("--fail-code", default="UNAVAILABLE", help="gRPC status name of those answers")
    p.add_argument("--hang", action="store_true", help="take Generate calls and never answer them")
    p.add_argument("--misbehave", choices=["", "index", "no_finish", "abort_mid", "request_fault_mid", "overrun"], default="",
                   help="break the stream protocol: a bad sequence index, no finished response, or an "
                        "error status after the first response (abort_mid: INTERNAL; request_fault_mid: "
                        "INVALID_ARGUMENT, the request named as the cause)")
    p.add_argument("--tokenizer-digest", default="", help="advertise this digest instead of the real one")
    asyncio.run(_serve_fake(p.parse_args(argv)))


# -- process handles and fixtures -------------------------------------------------------------

class Proc:
    def __init__(self, proc: subprocess.Popen, log_path: Path, metrics_port: int = 0):
        self.proc, self.log_path, self.metrics_port = proc, log_path, metrics_port
        self.address = None

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_listening(self, timeout: float) -> "Proc":
        deadline = time.monotonic() + timeout
        while self.address is None:
            m = _LISTEN.search(self.log())
            if m:
                self.address = f"127.0.0.1:{m.group(1)}"
            elif self.proc.poll() is not None or time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(f"process did not start (rc {self.proc.poll()}):\n{self.log()[-3000:]}")
            else:
                time.sleep(0.05)
        return self

    def metrics(self) -> dict[str, float]:
        """Prometheus text -> {'name{labels}': value}."""
        return scrape_metrics(self.metrics_port)

    def kill(self, sig=signal.SIGKILL) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, sig)
        if sig == signal.SIGKILL:
            self.proc.wait()

    def terminate(self, timeout: float = 10.0) -> None:
        self.kill(signal.SIGTERM)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()


def _spawn(args: list[str], log_dir: Path, name: str, procs: list, metrics_port: int = 0) -> Proc:
    env = {**os.environ, "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    env[PARENT_PID_ENV] = str(os.getpid())          # no server outlives a killed test run
    log_path = log_dir / f"{name}-{time.monotonic_ns()}.log"
    with open(log_path, "wb") as log:
        p = subprocess.Popen([sys.executable, *args], cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                             stdin=subprocess.DEVNULL, start_new_session=True)
    proc = Proc(p, log_path, metrics_port)
    procs.append(proc)
    return proc.wait_listening(30.0)


@pytest.fixture
def cluster_procs(tmp_path):
    procs: list[Proc] = []
    yield procs
    for p in procs:
        p.kill()


@pytest.fixture
def start_fake_worker(cluster_procs, tmp_path):
    def start(redis_url: str, worker_id: str, model: str = "m", **opts) -> Proc:
        args = ["-m", "tests.plugins.cluster", "--redis-url", redis_url, "--worker-id", worker_id, "--model", model]
        for k, v in opts.items():
            args += ["--" + k.replace("_", "-")] + ([] if v is True else [str(v)])
        return _spawn(args, tmp_path, worker_id, cluster_procs)
    return start


@pytest.fixture
def start_router(cluster_procs, tmp_path):
    def start(redis_url: str, **flags) -> Proc:
        from pagoda.clients.up import free_port
        http_port = flags.pop("http_port", 0)
        for attempt in range(3):
            # A free port is free when chosen, not always when the router binds it (another
            # process may take it between): a refusal naming the metrics port picks another.
            metrics_port = free_port()
            # HTTP off unless a test asks (http_port=free_port()): the default 8000 would collide.
            args = ["-m", "pagoda.router", "--host", "127.0.0.1", "--port", "0", "--redis-url", redis_url,
                    "--metrics-port", str(metrics_port), "--http-port", str(http_port)]
            for k, v in flags.items():
                args += ["--" + k.replace("_", "-"), str(v)]
            try:
                return _spawn(args, tmp_path, "router", cluster_procs, metrics_port)
            except RuntimeError as e:
                if attempt == 2 or f"port {metrics_port} (--metrics-port)" not in str(e):
                    raise
        raise AssertionError("unreachable")
    return start


if __name__ == "__main__":
    main()
