"""`pagoda up` (pagoda.clients.up): embedded redis-server, a worker and a router as processes, the default
tiny model built into the cache directory, and Ctrl-C stopping every child."""
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import grpc
import pytest

from pagoda.protos.pagoda.v1 import pagoda_pb2 as pb
from pagoda.protos.pagoda.v1 import pagoda_pb2_grpc as pb_grpc

ROOT = Path(__file__).resolve().parents[1]
pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is dead for our purposes (its parent has not reaped it yet).
    return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"


def test_up_serves_then_ctrl_c_stops_everything(tmp_path):
    import pagoda.clients.up
    assert pagoda.clients.up.find_redis_server()
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "pagoda.clients.up", "--workers", "1", "--port", "0", "--device", "cpu",
                             "--num-kv-blocks", "64", "--cache-dir", str(tmp_path / "cache")],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    lines, address = [], None
    try:
        deadline = time.monotonic() + 240
        while address is None and time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line)
            m = re.search(r"router at (\S+)", line)
            address = m and m.group(1)
        assert address, "".join(lines)
        pids = [int(p) for p in re.findall(r"\(pid (\d+)\)", "".join(lines))]
        assert len(pids) == 3                      # redis, worker, router
        assert (tmp_path / "cache" / "tiny-llama" / "config.json").is_file()
        stub = pb_grpc.GenerationStub(grpc.insecure_channel(address))
        final = list(stub.Generate(pb.GenerateRequest(text="Hello there", sampling=pb.SamplingParams(
            max_tokens=5, temperature=0, ignore_eos=True)), timeout=60))[-1]
        assert final.finished and final.usage.completion_tokens == 5 and final.worker_id == "worker-0"
        base = re.search(r"OpenAI HTTP at (http://\S+)", "".join(lines)).group(1)
        models = json.load(urllib.request.urlopen(base + "/models", timeout=30))
        assert [m["id"] for m in models["data"]] == ["tiny-llama"], models
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
        assert "stopped" in out and proc.returncode == 0
        assert not [p for p in pids if _alive(p)]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def test_up_import_is_light():
    code = ("import sys, pagoda.clients.up; "
            "assert 'torch' not in sys.modules and not any(m.startswith('pagoda.gpu_worker') for m in sys.modules)")
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, timeout=60)


def test_router_import_is_light():
    code = ("import sys, pagoda.router.server, pagoda.router.args, pagoda.router.openai.front; "
            "assert 'torch' not in sys.modules and not any(m.startswith('pagoda.gpu_worker') for m in sys.modules)")
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, timeout=60)


def test_http_port_zero_is_off_in_up_as_in_router(tmp_path, tiny_model):
    """`--http-port 0` means off in `pagoda up` as in `pagoda router` (the chart's httpPort: 0 too);
    without the flag `pagoda up` picks a free port (the test above reads it)."""
    from pagoda.clients.up import build_parser
    from pagoda.router.args import build_parser as router_parser
    assert build_parser().parse_args([]).http_port is None
    assert "0 = off" in router_parser().format_help() and "0 = off" in build_parser().format_help()
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "pagoda.clients.up", "--workers", "1", "--port", "0", "--http-port", "0",
                             "--device", "cpu", "--num-kv-blocks", "64", "--model", tiny_model,
                             "--cache-dir", str(tmp_path / "cache")],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    lines: list[str] = []
    try:
        deadline = time.monotonic() + 240
        while not any("router at" in x for x in lines) and time.monotonic() < deadline:
            line = proc.stdout.readline()      # type: ignore[union-attr]
            if not line:
                break
            lines.append(line)
        out = "".join(lines)
        assert "OpenAI HTTP off" in out and "OpenAI HTTP at" not in out, out
        router_pid = int(re.search(r"started router \(pid (\d+)\)", out).group(1))      # type: ignore[union-attr]
        argv = Path(f"/proc/{router_pid}/cmdline").read_bytes().split(b"\0")
        assert argv[argv.index(b"--http-port") + 1] == b"0"
        router_log = Path(re.search(r"started router \(pid \d+\), log (\S+)", out).group(1))  # type: ignore[union-attr]
        assert "OpenAI-compatible HTTP" not in router_log.read_text()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGINT)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def test_up_killed_outright_leaves_nothing_behind(tmp_path, tiny_model):
    """SIGKILL gives `pagoda up` no chance to stop its children: the workers and the router end
    through die_with_parent, the embedded redis-server (which cannot watch its parent) through the
    parent-death signal that `up` asks the kernel for."""
    proc = subprocess.Popen([sys.executable, "-m", "pagoda.clients.up", "--workers", "1", "--port", "0", "--http-port", "0",
                             "--device", "cpu", "--num-kv-blocks", "64", "--model", tiny_model,
                             "--cache-dir", str(tmp_path / "cache")],
                            cwd=ROOT, env={**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    lines: list[str] = []
    pids: dict[str, int] = {}
    try:
        deadline = time.monotonic() + 240
        while not any("router at" in x for x in lines) and time.monotonic() < deadline:
            line = proc.stdout.readline()      # type: ignore[union-attr]
            if not line:
                break
            lines.append(line)
        pids = {m[0]: int(m[1]) for m in re.findall(r"started (\S+) \(pid (\d+)\)", "".join(lines))}
        assert set(pids) == {"redis", "router", "worker-0"}, "".join(lines)
        proc.kill()
        proc.wait()
        deadline = time.monotonic() + 20
        while [p for p in pids.values() if _alive(p)] and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not {n: p for n, p in pids.items() if _alive(p)}, "outlived a killed pagoda up"
    finally:
        for pid in pids.values():
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _up(tmp_path, *args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "pagoda.clients.up", "--port", "0", "--device", "cpu",
                             "--num-kv-blocks", "64", "--cache-dir", str(tmp_path / "cache"), *args],
                            cwd=ROOT, env={**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)


def test_up_passes_worker_and_router_flags_and_runs_workers_of_two_kinds(tmp_path, tiny_model):
    proc = _up(tmp_path, "--model", tiny_model, "--workers", "1", "--worker", "--served-model-name other --max-num-seqs 2",
               "--worker-args", "--max-n 3", "--router-args", "--max-n 2")
    lines: list[str] = []
    try:
        deadline = time.monotonic() + 240
        while (sum("serving at" in x for x in lines) < 2 or not any("router at" in x for x in lines)) \
                and time.monotonic() < deadline:
            line = proc.stdout.readline()      # type: ignore[union-attr]
            if not line:
                break
            lines.append(line)
        out = "".join(lines)
        base = re.search(r"OpenAI HTTP at (http://\S+)", out).group(1)      # type: ignore[union-attr]
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            models = sorted(m["id"] for m in json.load(urllib.request.urlopen(base + "/models", timeout=30))["data"])
            if len(models) == 2:
                break
            time.sleep(0.2)
        assert models == sorted(["other", os.path.basename(tiny_model)]), out    # a plain worker and one of its own kind
        address = re.search(r"router at (\S+)", out).group(1)      # type: ignore[union-attr]
        stub = pb_grpc.GenerationStub(grpc.insecure_channel(address))
        with pytest.raises(grpc.RpcError) as e:                      # the router's own --max-n
            list(stub.Generate(pb.GenerateRequest(text="hi", model="other", sampling=pb.SamplingParams(n=3)), timeout=30))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "n" in e.value.details()
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def test_up_says_in_one_line_why_a_worker_died(tmp_path, tiny_model):
    proc = _up(tmp_path, "--model", tiny_model, "--workers", "1", "--worker-args", "--no-such-flag")
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 1
    line, = [x for x in out.splitlines() if "exited with code" in x]
    assert "worker-0 exited with code 2" in line and "unrecognized arguments: --no-such-flag" in line, out


def test_up_refuses_bad_pass_through_quoting_in_one_line(tmp_path):
    proc = _up(tmp_path, "--router-args", "--tool-call-parser 'hermes")
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 2 and "--router-args: No closing quotation" in out, out


def test_a_second_cluster_takes_the_next_port_unless_one_was_given(tmp_path, tiny_model):
    """`pagoda up` twice on one host: before, the second died on 50050; now, without --port, it says
    in one line which port it took instead. An explicit --port that is taken stays a one-line error."""
    import socket

    from pagoda.clients.up import DEFAULT_ROUTER_PORT
    holder = socket.socket()
    try:
        holder.bind(("127.0.0.1", DEFAULT_ROUTER_PORT))
        holder.listen()
    except OSError:          # another cluster on this host holds it already: taken either way
        pass
    try:
        run = [sys.executable, "-m", "pagoda.clients.up", "--device", "cpu", "--cache-dir", str(tmp_path / "cache")]
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
        # The worker dies at once (a bad flag): enough to see the router's port chosen and used.
        out = subprocess.run(run + ["--model", tiny_model, "--workers", "1", "--worker-args", "--no-such-flag"],
                             cwd=ROOT, env=env, capture_output=True, text=True, timeout=120).stdout
        said = [x for x in out.splitlines() if f"port {DEFAULT_ROUTER_PORT} is in use" in x]
        assert len(said) == 1, out
        port = int(re.search(r"the router takes (\d+)", said[0]).group(1))
        assert DEFAULT_ROUTER_PORT < port and "started router" in out
        done = subprocess.run(run + ["--port", str(DEFAULT_ROUTER_PORT)], cwd=ROOT, env=env, capture_output=True,
                              text=True, timeout=60)
        assert done.returncode == 2 and done.stdout == ""
        line, = done.stderr.strip().splitlines()
        assert f"port {DEFAULT_ROUTER_PORT} (--port)" in line and "in use" in line
    finally:
        holder.close()
