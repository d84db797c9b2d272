"""A cold worker's time to first token for a system prompt a peer already holds: fetch the prefix's
KV blocks from the peer (Admin.FetchKVBlocks, gpu_worker/serving/kv_transfer.py) against
recomputing it, per prefix length, and the break-even length.

Two real worker processes on loopback (CPU). Worker A computes each prompt first (its blocks
become cached). Worker B then serves a prompt of the same length either with a fetch hint naming
A (the prefix arrives by gRPC, only the user turn is prefilled) or without (B prefills it all);
every prompt is new to B, so B is cold for it either way. TTFT is the client's (Generate sent ->
first token), max_tokens 1, one request at a time, fetch and recompute alternating. Break-even:
the length where straight lines fitted to each curve cross (below it recompute is faster).

    python bench/kv_transfer.py           # the recorded run: the tiny Llama, prefixes 64 to 4096
    python bench/kv_transfer.py --quick   # smoke run
    python bench/kv_transfer.py --busy 4  # both workers decoding 4 other streams meanwhile

The fetch time per MiB is the target's own log of each fetch (planning, transfer and naming).
"""
from __future__ import annotations

import argparse
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

from bench.common import REPO, command_line, machine, markdown_table, now  # noqa: E402
from pagoda.protos.pagoda.v1 import pagoda_pb2 as pb  # noqa: E402
from pagoda.protos.pagoda.v1 import pagoda_pb2_grpc as pb_grpc  # noqa: E402

BLOCK = 16
# The tests' tiny Llama (2 layers, hidden 64, GQA 4/2 of 16), with room for 4k-token prompts.
TINY = dict(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=8192)
SUFFIX = 8          # the request's own tokens after the shared prefix


def start_worker(model: str, log_dir: str, name: str, max_len: int) -> tuple[subprocess.Popen, str]:
    from pagoda.clients.up import wait_serving
    log = open(os.path.join(log_dir, f"{name}.log"), "wb")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")]))}
    blocks = 4 * (max_len // BLOCK + 1)
    proc = subprocess.Popen([sys.executable, "-m", "pagoda.gpu_worker", "--model", model, "--device", "cpu",
                             "--host", "127.0.0.1", "--port", "0", "--metrics-port", "0", "--block-size", str(BLOCK),
                             "--num-kv-blocks", str(blocks), "--max-model-len", str(max_len)],
                            cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    path = log.name
    deadline = time.monotonic() + 180
    while True:
        m = re.search(r"listening on [^\s]+:(\d+)", open(path, errors="replace").read())
        if m:
            break
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"worker {name} did not start:\n" + open(path, errors="replace").read()[-3000:])
        time.sleep(0.1)
    address = f"127.0.0.1:{m.group(1)}"
    wait_serving(address, proc, "worker", max(1.0, deadline - time.monotonic()))
    return proc, address


def ttft(stub, prompt: list[int], source: str | None) -> tuple[float, int]:
    """(seconds to the first token, cached prompt tokens reported)."""
    req = pb.GenerateRequest(token_ids=prompt, sampling=pb.SamplingParams(temperature=0.0, max_tokens=1))
    if source is not None:
        req.kv_fetch.CopyFrom(pb.KVFetchHint(source_address=source, num_blocks=len(prompt) // BLOCK))
    t0, first, cached = time.perf_counter(), None, 0
    for r in stub.Generate(req, timeout=120):
        if first is None and r.token_ids:
            first = time.perf_counter() - t0
        if r.finished:
            cached = r.usage.cached_prompt_tokens
    assert first is not None
    return first, cached


def keep_busy(address: str, streams: int, stop: threading.Event, rng: random.Random) -> list[threading.Thread]:
    """`streams` threads, each decoding one long request after another on `address` until `stop`."""
    def loop(seed: int) -> None:
        r = random.Random(seed)
        stub = pb_grpc.GenerationStub(grpc.insecure_channel(address))
        while not stop.is_set():
            req = pb.GenerateRequest(token_ids=[r.randrange(5, 600) for _ in range(32)],
                                     sampling=pb.SamplingParams(temperature=0.0, max_tokens=64))
            for _ in stub.Generate(req, timeout=120):
                if stop.is_set():
                    break
    threads = [threading.Thread(target=loop, args=(rng.random(),), daemon=True) for _ in range(streams)]
    for t in threads:
        t.start()
    return threads


def fetch_ms_per_mib(log_path: str, block_bytes: int) -> float:
    """The target's logged fetches ("kv fetch from ...: N of M blocks in T ms"): ms per MiB moved."""
    ms = mib = 0.0
    for n, t in re.findall(r"kv fetch from \S+: (\d+) of \d+ blocks in ([\d.]+) ms", open(log_path).read()):
        if int(n):
            ms, mib = ms + float(t), mib + int(n) * block_bytes / 2 ** 20
    return ms / mib if mib else float("nan")


def fit(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least-squares (intercept, slope)."""
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return my - slope * mx, slope


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", default="64,128,256,512,1024,2048,4096", help="prefix lengths in tokens")
    ap.add_argument("--reps", type=int, default=5, help="prompts per length and mode")
    ap.add_argument("--model-dir", default=None, help="checkpoint to use (default: the tiny Llama, built)")
    ap.add_argument("--busy", type=int, default=0, help="other streams each worker decodes meanwhile")
    ap.add_argument("--quick", action="store_true", help="smoke run: lengths 64,256, 1 rep")
    a = ap.parse_args()
    lengths = [64, 256] if a.quick else [int(x) for x in a.lengths.split(",")]
    reps = 1 if a.quick else a.reps
    tmp = tempfile.mkdtemp(prefix="kv-transfer-bench-")
    model = a.model_dir or os.path.join(tmp, "model")
    if not os.path.exists(os.path.join(model, "config.json")):
        from pagoda.gpu_worker.testing.tiny_model import make_tiny_model
        make_tiny_model(model, family="llama", seed=0, **TINY)
    max_len = max(lengths) + SUFFIX + 8
    procs = []
    try:
        pa, src = start_worker(model, tmp, "source", max_len)
        procs.append(pa)
        pb_, dst = start_worker(model, tmp, "target", max_len)
        procs.append(pb_)
        rng = random.Random(0)
        a_stub = pb_grpc.GenerationStub(grpc.insecure_channel(src))
        b_stub = pb_grpc.GenerationStub(grpc.insecure_channel(dst))
        for _ in range(2):      # both paths warm (kernels, channels) before anything is timed
            p = [rng.randrange(5, 600) for _ in range(64 + SUFFIX)]
            ttft(a_stub, p, None)
            ttft(b_stub, p, src)
            ttft(b_stub, [rng.randrange(5, 600) for _ in range(64 + SUFFIX)], None)
        stop = threading.Event()
        busy = keep_busy(src, a.busy, stop, rng) + keep_busy(dst, a.busy, stop, rng)
        time.sleep(1.0 if a.busy else 0.0)
        rows, fetch_ms, recompute_ms = [], [], []
        for n in lengths:
            got: dict[str, list[float]] = {"fetch": [], "recompute": []}
            for i in range(reps):
                for mode in (("fetch", "recompute") if i % 2 == 0 else ("recompute", "fetch")):
                    prompt = [rng.randrange(5, 600) for _ in range(n + SUFFIX)]
                    if mode == "fetch":
                        ttft(a_stub, prompt, None)
                    t, cached = ttft(b_stub, prompt, src if mode == "fetch" else None)
                    assert cached == (n // BLOCK * BLOCK if mode == "fetch" else 0), (mode, n, cached)
                    got[mode].append(1000 * t)
            f, r = statistics.median(got["fetch"]), statistics.median(got["recompute"])
            fetch_ms.append(f)
            recompute_ms.append(r)
            rows.append([n, n // BLOCK, f, r, r / f])
        stop.set()
        for t in busy:
            t.join(30)
        print(f"{now()}; {machine()}")
        print(f"command: {command_line()}")
        kv_block = 2 * TINY["num_hidden_layers"] * TINY["num_key_value_heads"] * BLOCK * \
            (TINY["hidden_size"] // TINY["num_attention_heads"]) * 4        # float32 pool
        print(f"busy streams per worker: {a.busy}; target's fetch time: "
              f"{fetch_ms_per_mib(os.path.join(tmp, 'target.log'), kv_block):.0f} ms per MiB (all fetches, warm-up incl.)")
        print(markdown_table(["prefix tokens", "blocks", "fetch TTFT ms (median)", "recompute TTFT ms (median)",
                              "recompute / fetch"], rows))
        (a1, b1), (a2, b2) = fit(lengths, fetch_ms), fit(lengths, recompute_ms)
        print(f"fit: fetch {a1:.1f} ms + {1000 * b1:.2f} us/token; recompute {a2:.1f} ms + {1000 * b2:.2f} us/token")
        if b2 > b1:
            print(f"break-even prefix: {max(0.0, (a1 - a2) / (b2 - b1)):.0f} tokens")
        else:
            print("break-even prefix: none (fetching costs more per token than recomputing here)")
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                p.kill()


if __name__ == "__main__":
    main()
