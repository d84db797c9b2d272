"""pagoda.gpu_worker.serving.publisher against a real redis-server: lease, events, snapshots, outages."""
import asyncio
import time

import redis

from pagoda.gpu_worker.serving.publisher import Publisher
from pagoda.protos import redis_schema as rs
from tests.plugins.cluster import FakeEngine


def _ids(first, n=48):
    return list(range(first, first + n))


async def _until(cond, timeout=5.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if cond():
                return True
        except redis.RedisError:
            pass
        await asyncio.sleep(0.05)
    raise AssertionError("condition not met in time")


def test_lease_events_snapshot_and_stop(redis_server):
    async def main():
        r = redis.Redis.from_url(redis_server.url)
        eng = FakeEngine("m", block_size=16, num_blocks=4)
        pub = Publisher(redis_server.url, "w1", "m", "127.0.0.1:1", eng, heartbeat_s=0.2, snapshot_s=0.5)
        await pub.start()
        await _until(lambda: r.get(rs.lease_key("w1")))
        lease = rs.Lease.decode(r.get(rs.lease_key("w1")))
        assert (lease.model, lease.address, lease.epoch, lease.block_size) == ("m", "127.0.0.1:1", pub.epoch, 16)
        assert 0 < r.pttl(rs.lease_key("w1")) <= 3000
        eng.running, eng.queued = 2, 77
        await _until(lambda: rs.Lease.decode(r.get(rs.lease_key("w1"))).queued_prefill_tokens == 77, 1.0)

        eng.admit(_ids(0), "", "")                     # 3 blocks stored
        eng.admit(_ids(1000, 32), "", "")              # 2 more: 1 evicted (capacity 4)
        await _until(lambda: r.xlen(rs.events_key("m")) >= 1)
        entries = r.xrange(rs.events_key("m"))
        batches = [rs.EventBatch.from_fields(f) for _, f in entries]
        assert [b.seq for b in batches] == list(range(1, len(batches) + 1))
        assert all(b.worker_id == "w1" and b.epoch == pub.epoch for b in batches)
        events = [e for b in batches for e in b.events]
        assert [k for k, _ in events] == ["stored"] * 5 + ["removed"]
        await _until(lambda: rs.Snapshot.decode(r.get(rs.snapshot_key("w1"))).seq == batches[-1].seq)
        snap = rs.Snapshot.decode(r.get(rs.snapshot_key("w1")))
        assert set(snap.hashes) == set(eng.cached_block_hashes()) and len(snap.hashes) == 4
        assert snap.stream_id == entries[-1][0].decode()
        await pub.stop()
        assert r.get(rs.lease_key("w1")) is None       # routers drop it at once
        pub2 = Publisher(redis_server.url, "w1", "m", "127.0.0.1:1", eng)
        assert pub2.epoch > pub.epoch
    asyncio.run(main())


def test_redis_outage_neither_raises_nor_stalls_the_loop(redis_server):
    async def main():
        eng = FakeEngine("m", block_size=16, num_blocks=1000)
        pub = Publisher(redis_server.url, "w1", "m", "127.0.0.1:1", eng, heartbeat_s=0.2, snapshot_s=30)
        await pub.start()
        r = redis.Redis.from_url(redis_server.url)
        await _until(lambda: r.get(rs.lease_key("w1")))
        redis_server.stop()
        lag, t = 0.0, time.monotonic()
        for i in range(30):                          # 1.5 s of "engine steps" while Redis is gone
            eng.admit(_ids(10_000 * (i + 1)), "", "")
            await asyncio.sleep(0.05)
            now = time.monotonic()
            lag, t = max(lag, now - t - 0.05), now
        assert lag < 0.1, f"event loop stalled {lag:.3f}s during the outage"
        assert not pub.connected and pub._task and not pub._task.done()
        redis_server.start()                         # same port, empty data
        r = redis.Redis.from_url(redis_server.url)
        await _until(lambda: r.get(rs.lease_key("w1")) and r.get(rs.snapshot_key("w1")), 5.0)
        snap = rs.Snapshot.decode(r.get(rs.snapshot_key("w1")))
        assert len(snap.hashes) == 90 and set(snap.hashes) == set(eng.cached_block_hashes())
        await pub.stop()
    asyncio.run(main())


def test_dropped_events_leave_a_sequence_gap_and_a_fresh_snapshot(redis_server):
    async def main():
        eng = FakeEngine("m", block_size=16, num_blocks=1000)
        pub = Publisher(redis_server.url, "w1", "m", "127.0.0.1:1", eng, heartbeat_s=0.2, snapshot_s=30,
                        max_pending_events=5)
        await pub.start()
        r = redis.Redis.from_url(redis_server.url)
        eng.admit(_ids(0), "", "")
        await _until(lambda: r.xlen(rs.events_key("m")) == 1)
        redis_server.stop()
        eng.admit(_ids(5000, 160), "", "")             # 10 events > bound of 5: dropped
        await asyncio.sleep(0.3)
        redis_server.start()
        r = redis.Redis.from_url(redis_server.url)
        eng.admit(_ids(9000, 16), "", "")
        await _until(lambda: r.xlen(rs.events_key("m")) >= 1 and r.get(rs.snapshot_key("w1")), 5.0)
        (_, f), = r.xrange(rs.events_key("m"))
        assert rs.EventBatch.from_fields(f).seq == 3   # seq 2 was the dropped batch
        snap = rs.Snapshot.decode(r.get(rs.snapshot_key("w1")))
        # Current to the gap at least, and holding every block, the dropped ones included.
        assert snap.seq >= 2 and len(snap.hashes) == 3 + 10 + 1
        assert set(snap.hashes) == set(eng.cached_block_hashes())
        await pub.stop()
    asyncio.run(main())


def test_load_changes_reach_a_router_between_heartbeats_rate_limited(redis_server):
    import redis.asyncio as aioredis

    from pagoda.router.cluster import Cluster
    from pagoda.router.index import BlockIndex

    async def main():
        r = redis.Redis.from_url(redis_server.url)
        eng = FakeEngine("m", block_size=16, num_blocks=100)
        pub = Publisher(redis_server.url, "w1", "m", "127.0.0.1:1", eng, name="pod-7", load_interval_s=0.05)
        pub._redis = aioredis.from_url(redis_server.url)       # driven by hand, on a made-up clock
        cluster = Cluster(redis_server.url, BlockIndex())
        cluster._redis = aioredis.from_url(redis_server.url)
        await pub.publish_once(True, True, now=0.0)
        await cluster.sync_once(True, block_ms=None)
        w = cluster.workers["w1"]
        assert (w.name, w.lease.running) == ("pod-7", 0) and w.lease.prefill_tps > 0
        eng.running = 3
        await pub.publish_once(False, False, now=0.01)          # within the rate limit: nothing
        assert r.xlen(rs.load_key("m")) == 0
        await pub.publish_once(False, False, now=0.06)
        await pub.publish_once(False, False, now=0.2)           # no change since: nothing more
        assert r.xlen(rs.load_key("m")) == 1
        await cluster.sync_once(False, block_ms=None)           # no lease poll: the stream alone
        assert w.lease.running == 3
        r.xadd(rs.load_key("m"), {"lease": b"{broken"})          # skipped with a warning
        other = rs.Lease("w1", "m", "x:1", pub.epoch - 1, 16, running=50, ts=time.time() + 5)
        r.xadd(rs.load_key("m"), {"lease": other.encode()})     # an older process's: fenced off
        await cluster.sync_once(False, block_ms=None)
        assert w.lease.running == 3 and cluster.workers["w1"] is w
        await pub._redis.aclose()
        await cluster._redis.aclose()
    asyncio.run(main())
