"""The router against poisoned Redis data (real redis-server, real router, stand-in workers).

Each case writes one kind of hostile value the way an attacker with Redis access (or a buggy
worker) would, then checks the router keeps serving, takes a worker that joins afterwards into
rotation within 5 s, and excludes no real worker.
"""
from __future__ import annotations

import json
import time

import pytest
import redis

from pagoda.protos import redis_schema as rs
from tests.test_router import generate, metric, prompt, stub_for, wait_for

pytestmark = pytest.mark.timeout(120)


def _lease(r, worker_id: str) -> dict:
    return json.loads(r.get(rs.lease_key(worker_id)))


def _string_epoch(r):
    r.set(rs.lease_key("evil"), json.dumps({"worker_id": "evil", "model": "m", "address": "127.0.0.1:1",
                                            "epoch": "1", "block_size": 16}))


def _string_kv_usage(r):
    lease = _lease(r, "w1")
    r.set(rs.lease_key("evil"), json.dumps({**lease, "worker_id": "evil", "kv_usage": "high"}))


def _garbage_snapshot_and_gap(r):
    lease = _lease(r, "w1")
    r.set(rs.snapshot_key("w1"), b"\xff\xff\xff\x7f{garbage")
    batch = rs.EventBatch("w1", lease["epoch"], lease["seq"] + 50, [("stored", b"x" * 16)])
    r.xadd(rs.events_key("m"), batch.fields())


def _forged_epoch(r):
    # Same worker id and address, higher epoch, written repeatedly for a while: a router that
    # believed it would fence the real worker (its lower epoch) off for good.
    lease = _lease(r, "w1")
    for _ in range(12):
        r.set(rs.lease_key("w1"), json.dumps({**lease, "epoch": lease["epoch"] + 1}), px=3000)
        time.sleep(0.1)


def _huge_snapshot(r):
    lease = _lease(r, "w1")
    r.set(rs.snapshot_key("w1"), b"\0" * (50 << 20))
    batch = rs.EventBatch("w1", lease["epoch"], lease["seq"] + 50, [("stored", b"y" * 16)])
    r.xadd(rs.events_key("m"), batch.fields())


@pytest.mark.parametrize("poison", [_string_epoch, _string_kv_usage, _garbage_snapshot_and_gap, _forged_epoch,
                                    _huge_snapshot])
def test_router_survives_poisoned_redis(poison, redis_server, start_fake_worker, start_router):
    start_fake_worker(redis_server.url, "w1")
    start_fake_worker(redis_server.url, "w2")
    router = start_router(redis_server.url, policy="round_robin")
    stub = stub_for(router)
    wait_for(lambda: metric(router, "pagoda_router_live_workers", model="m") == 2, 5, "workers")
    r = redis.Redis.from_url(redis_server.url)
    poison(r)
    time.sleep(0.6)                                  # a couple of sync rounds over the poison
    t0 = time.monotonic()
    out, err = generate(stub, prompt(1, 0), model="m")
    assert err is None and time.monotonic() - t0 < 1.0, err
    assert metric(router, "pagoda_router_redis_sync_healthy") == 1
    assert metric(router, "pagoda_router_redis_sync_errors_total") == 0

    start_fake_worker(redis_server.url, "w3")
    joined = time.monotonic()
    served: set[str] = set()

    def all_served():
        out, err = generate(stub, prompt(2, len(served)), model="m")
        assert err is None, err
        served.add(out[-1].worker_id)
        return served >= {"w1", "w2", "w3"}

    wait_for(all_served, 5.0, "traffic to reach w1, w2 and the newcomer w3")
    assert time.monotonic() - joined < 5.0
    assert metric(router, "pagoda_router_live_workers", model="m") == 3
    if poison is not _forged_epoch:               # a forged epoch is refused by probing, not parsing
        assert metric(router, "pagoda_router_redis_rejected_values_total") >= 1
