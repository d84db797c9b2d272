"""End to end with the host KV tier: a real worker process (CPU, both pools CPU tensors) serves a
prefix that its device pool evicted from its host tier (cached tokens reported over gRPC, output
equal to the offline engine's without any cache), publishes which tier holds each block to a real
redis-server, and a router's Cluster rebuilds both tiers from it."""
import asyncio
import random
import time

import pytest
import redis

from pagoda.clients import PagodaClient
from pagoda.protos import redis_schema as rs
from pagoda.protos.block_hash import block_hashes, namespace_root

pytestmark = pytest.mark.slow

BLOCK = 16
HOST_BLOCKS = 64
HOST_GIB = HOST_BLOCKS * 8192 / 2**30     # the tiny llama's K and V for one block of 16, fp32


def ids(n, seed):
    rng = random.Random(seed)
    return [rng.randrange(5, 600) for _ in range(n)]


def test_prefix_comes_back_from_the_host_tier_and_routers_see_the_tier(redis_server, start_worker, tiny_model):
    from pagoda.gpu_worker.core.sampling_params import SamplingParams
    from pagoda.gpu_worker.engine.llm import LLM
    from pagoda.router.cluster import Cluster
    from pagoda.router.index import BlockIndex

    w = start_worker(tiny_model, num_kv_blocks=16, block_size=BLOCK, max_model_len=512, worker_id="tier-1",
                     kv_offloading_size=HOST_GIB, redis_url=redis_server.url, heartbeat_interval=0.2,
                     snapshot_interval=0.5)
    assert f"host KV tier: {HOST_BLOCKS} blocks" in w.log()
    prefix = ids(96, 0)                                          # six full blocks
    greedy = dict(max_tokens=8, temperature=0.0)
    with PagodaClient(w.address, retries=0) as c:
        c.complete(prefix + ids(5, 1), **greedy)
        for s in range(4):                                       # 4 x 6 blocks through a 16-block pool
            c.complete(ids(85, 10 + s), **greedy)
        again = prefix + ids(7, 2)
        got = c.complete(again, **greedy)
    assert got.usage.cached_prompt_tokens == 96
    ref = LLM(tiny_model, device="cpu", num_kv_blocks=16, block_size=BLOCK, max_model_len=512,
              enable_prefix_caching=False).generate([again], SamplingParams(**greedy))[0]
    assert got.choices[0].token_ids == ref.outputs[0].token_ids

    r = redis.Redis.from_url(redis_server.url)
    deadline = time.monotonic() + 10
    while True:         # the copy rate is in the lease from the first heartbeat after a copy
        lease = rs.Lease.decode(r.get(rs.lease_key("tier-1")))
        if lease.kv_copy_tps > 0 or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert lease.host_blocks == HOST_BLOCKS and lease.kv_copy_tps > 0
    hashes = block_hashes(prefix, BLOCK, namespace_root(lease.model))
    batches = [rs.EventBatch.from_fields(f) for _, f in r.xrange(rs.events_key(lease.model))]
    host_stored = {h for b in batches for kind, h in b.host_events if kind == "stored"}
    device_removed = {h for b in batches for kind, h in b.events if kind == "removed"}
    assert set(hashes) <= host_stored and set(hashes) <= device_removed

    async def sync():
        import redis.asyncio as aioredis
        cluster = Cluster(redis_server.url, BlockIndex())
        cluster._redis = aioredis.from_url(redis_server.url)
        try:
            for _ in range(100):
                await cluster.sync_once(True, block_ms=None)
                # Settled once the index matches the worker's current snapshots, both tiers.
                snap = rs.Snapshot.decode(r.get(rs.snapshot_key("tier-1")))
                host = rs.Snapshot.decode(r.get(rs.host_snapshot_key("tier-1")))
                idx = cluster.index
                if host.seq == snap.seq and idx.host_blocks_of("tier-1") == len(host.hashes) > 0 \
                        and idx.blocks_of("tier-1") == len(snap.hashes):
                    return idx, snap, host
                await asyncio.sleep(0.1)
            raise AssertionError("the router never caught up with the worker's tiers")
        finally:
            await cluster._redis.aclose()

    idx, snap, host = asyncio.run(sync())
    assert set(idx._host_of["tier-1"]) == set(host.hashes)
    # The prefix is back on the device (and still on the host): both walks reach all of it.
    assert idx.overlap(hashes)["tier-1"] == 6 and idx.overlap_tiers(hashes)["tier-1"] == 6
    # An evicted prompt's chain is found only through the host tier.
    other = block_hashes(ids(85, 10), BLOCK, namespace_root(lease.model))
    assert idx.overlap_tiers(other).get("tier-1", 0) > idx.overlap(other).get("tier-1", 0)
