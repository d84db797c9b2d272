"""Routing at scale: one router process's decision cost with up to 1,000 workers and a million
cached blocks in its index, no Redis and no simulated GPUs.

    python bench/routing_scale.py [--workers 32,256,1000] [--blocks 1000000] [--decisions 3000]

Per cluster size: a BlockIndex holding --blocks block hashes (unrelated blocks, then shared
prefixes, a tenth of the blocks, each cached on one to three workers and the most recently
used), and one WorkerState per worker with a lease of random load and speed. Each decision's
prompt is a shared prefix plus fresh tokens. A decision is what the router's Generate does
before it opens the upstream stream, on the router's own Cluster (its leases put in as the
Redis sync would): Preparer.candidates and the tokenizer-pinned filter (the model's live
workers), Preparer.hashes (hash the prompt's blocks), Selector.rank (walk the index, rank every
live worker), then Selector.claim (credit the winner, record its prefix speculatively; the
index stays at its bound, so every decision also evicts). Leases are renewed every 100
decisions, outside the timing, as heartbeats would. The heap is frozen as Router.start
freezes it, and the bench's own token lists are kept out of the collector's walk.

Figures: decision p50/p99 as this thread's CPU time and as wall time; the CPU p99 of the
decisions that do not follow a renewal and the CPU p50 of those that do (when a decision refreshed the figures of every worker
whose report had changed, the first after a renewal refreshed them all and paid milliseconds);
decisions/s = 1 / mean CPU time (one core); the CPU time the sync path spends applying one
renewed lease (Cluster._upsert, timed apart from the decisions, since that work is the router's
too); the index's memory per million blocks (tracemalloc, while filling it).
"""
from __future__ import annotations

import argparse
import gc
import os
import platform
import random
import statistics
import sys
import time
import tracemalloc

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from pagoda.protos.block_hash import block_hashes, namespace_root  # noqa: E402
from pagoda.protos.pagoda.v1 import pagoda_pb2 as pb  # noqa: E402
from pagoda.protos.redis_schema import Lease  # noqa: E402
from pagoda.router.breaker import CircuitBreaker  # noqa: E402
from pagoda.router.channels import WorkerChannels  # noqa: E402
from pagoda.router.cluster import Cluster  # noqa: E402
from pagoda.router.index import BlockIndex  # noqa: E402
from pagoda.router.prepare import Pin, Preparer  # noqa: E402
from pagoda.router.selection import Scorer, Selector  # noqa: E402
from pagoda.runtime.heap import freeze_heap  # noqa: E402

MODEL, BLOCK, DIGEST = "scale-model", 16, "0" * 32


def lease(i: int, rng: random.Random, ts: float) -> Lease:
    return Lease(f"worker-{i}", MODEL, f"10.0.{i // 250}.{i % 250}:50051", 1, BLOCK, num_blocks=8192,
                 running=rng.randint(0, 64), waiting=rng.randint(0, 8),
                 queued_prefill_tokens=rng.randint(0, 16384), kv_usage=rng.uniform(0.2, 0.95),
                 free_blocks=4096, ts=ts, prefill_tps=rng.uniform(8000, 20000),
                 decode_tps=rng.uniform(2000, 6000), step_s=rng.uniform(0.004, 0.008), max_batched_tokens=4096,
                 name=f"pod-{i}", tokenizer_digest=DIGEST)


def fill(index: BlockIndex, num_workers: int, num_blocks: int, rng: random.Random, root: bytes):
    """Unrelated blocks, then shared prefixes (a tenth of the blocks) that requests will hit: the
    prefixes are the most recently used, as hot ones are; each decision evicts the oldest filler."""
    prefixes = []
    shared = num_blocks // 10
    while sum(len(p[1]) for p in prefixes) < shared:
        tokens = [rng.randrange(1, 32000) for _ in range(rng.randint(32, 128) * BLOCK)]
        prefixes.append((tokens, block_hashes(tokens, BLOCK, root)))
    filler = rng.randbytes
    while len(index) < num_blocks - shared:
        chunk = [filler(16) for _ in range(min(64, num_blocks - shared - len(index)))]
        index.add(f"worker-{rng.randrange(num_workers)}", chunk)
    for _, hashes in prefixes:
        for w in rng.sample(range(num_workers), k=min(num_workers, rng.randint(1, 3))):
            index.add(f"worker-{w}", hashes)
    return prefixes


def measure(num_workers: int, num_blocks: int, decisions: int, seed: int) -> dict:
    rng = random.Random(seed)
    root = namespace_root(MODEL)
    gc.collect()
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    index = BlockIndex(max_blocks=num_blocks)
    freeze_heap()           # as Router.start does, with the index built
    prefixes = fill(index, num_workers, num_blocks, rng, root)
    prefix_bytes = sum(sys.getsizeof(t) + 28 * len(t) + sys.getsizeof(h) + 49 * len(h) for t, h in prefixes)
    index_bytes = tracemalloc.get_traced_memory()[0] - base - prefix_bytes
    tracemalloc.stop()
    cluster = Cluster("redis://unused", index)      # filled here as its Redis sync would fill it
    now = time.time()
    for i in range(num_workers):
        cluster._upsert(lease(i, rng, now))
    breaker = CircuitBreaker()
    prepare = Preparer(cluster, WorkerChannels(), breaker)
    select = Selector(Scorer("prefix_aware", index, random.Random(seed)), breaker)
    pin = Pin(DIGEST, pb.ModelInfoResponse(model=MODEL), None)
    # Every prompt is new past its shared prefix, as a user's turn is.
    prompts = [rng.choice(prefixes)[0] + [rng.randrange(1, 32000) for _ in range(rng.randint(16, 512))]
               for _ in range(decisions)]
    # The bench's own token lists (millions of ids) are no router's: kept out of the collector's walk.
    gc.collect()
    gc.freeze()
    cpu, wall, steady, renewed, renew = [], [], [], [], []
    for k in range(decisions):
        if k % 100 == 0:
            now = time.time()
            fresh = [lease(i, rng, now) for i in range(num_workers)]
            c0 = time.thread_time_ns()
            for ls in fresh:
                cluster._upsert(ls)
            renew.append((time.thread_time_ns() - c0) / 1000 / num_workers)
        ids = prompts[k]
        t0, c0 = time.perf_counter_ns(), time.thread_time_ns()
        model, live = prepare.candidates(MODEL)
        live = prepare.same_tokenizer(model, live, pin)
        hashes = prepare.hashes(model, "", "", ids, BLOCK)
        ranked = select.rank(model, live, len(ids), hashes)
        select.claim(ranked[0], f"r{k}", len(ids), hashes)
        c1, t1 = time.thread_time_ns(), time.perf_counter_ns()
        cpu.append((c1 - c0) / 1000)
        (steady if k % 100 else renewed).append((c1 - c0) / 1000)
        wall.append((t1 - t0) / 1000)
    gc.unfreeze()           # the next cluster size starts from a clean heap
    cpu.sort()
    wall.sort()
    steady.sort()
    renewed.sort()

    def pct(xs, q):
        return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))]

    return {"workers": num_workers, "blocks": len(index), "cpu_p50": pct(cpu, 0.5), "cpu_p99": pct(cpu, 0.99),
            "steady_p99": pct(steady, 0.99), "renew_us": statistics.fmean(renew),
            "renewed_p50": pct(renewed, 0.5),
            "wall_p50": pct(wall, 0.5), "wall_p99": pct(wall, 0.99), "per_s": 1e6 / statistics.fmean(cpu),
            "mib_per_m": index_bytes / 2**20 * 1e6 / num_blocks, "prompt_blocks": statistics.fmean(
                len(p) // BLOCK for p in prompts)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", default="32,256,1000")
    p.add_argument("--blocks", type=int, default=1_000_000, help="block hashes in the index")
    p.add_argument("--decisions", type=int, default=3000)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    sizes = [int(x) for x in a.workers.split(",") if x]
    if a.blocks < 1000 or a.decisions < 1 or not sizes or min(sizes) < 1:
        raise SystemExit("blocks >= 1000, decisions >= 1, workers >= 1")
    print(f"# routing scale: {' '.join(sys.argv)}")
    print(f"# {time.strftime('%Y-%m-%d %H:%M')} on {platform.node()} ({os.cpu_count()} CPUs), "
          f"python {platform.python_version()}")
    print("\n| workers | index blocks | prompt blocks | decision us CPU p50 / p99 | CPU p99 between renewals | "
          "CPU p50 after a renewal | "
          "wall p50 / p99 | decisions/s | lease apply us CPU | index MiB per million blocks |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for n in sizes:
        r = measure(n, a.blocks, a.decisions, a.seed)
        print(f"| {n} | {r['blocks']:,} | {r['prompt_blocks']:.0f} | {r['cpu_p50']:.0f} / {r['cpu_p99']:.0f} | "
              f"{r['steady_p99']:.0f} | {r['renewed_p50']:.0f} | {r['wall_p50']:.0f} / {r['wall_p99']:.0f} | {r['per_s']:,.0f} | "
              f"{r['renew_us']:.1f} | {r['mib_per_m']:.0f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
