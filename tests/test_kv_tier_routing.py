"""The host KV tier as the router sees it: the index keeps which tier holds a block, scoring
prices a host hit between a device hit and a miss, and the Redis schema carries the tier where a
reader of the device schema never looks."""
import random

import pytest

from pagoda.protos import redis_schema as rs
from pagoda.protos.block_hash import block_hashes, namespace_root
from pagoda.router.index import BlockIndex
from pagoda.router.scoring import DEFAULT_KV_COPY_TPS, WorkerState
from pagoda.router.selection import Scorer

RATES = dict(prefill_tps=1000.0, decode_tps=1000.0, step_s=0.01, max_batched_tokens=100)


def per_token(decoding=0):
    return 0.001 + (0.01 + decoding * 0.001) / 100


def chain(n_blocks, first=0):
    return block_hashes(list(range(first, first + n_blocks * 16)), 16, namespace_root("m"))


def worker(wid, **lease):
    return WorkerState(rs.Lease(wid, "m", f"h:{wid}", 1, 16, num_blocks=100, free_blocks=100, **RATES, **lease))


# ---- index -------------------------------------------------------------------------------

def test_the_index_keeps_each_blocks_tier():
    idx, h = BlockIndex(), chain(6)
    idx.add("a", h[:2])
    idx.add_host("a", h[2:5])            # a's chain runs on in host memory
    idx.add("b", h[:1])
    idx.add_host("b", h[2:4])            # a hole at block 1: b's host blocks cannot be reached
    assert idx.overlap(h) == {"a": 2, "b": 1}
    assert idx.overlap_tiers(h) == {"a": 5, "b": 1}
    assert idx.host_blocks_of("a") == 3 and idx.blocks_of("a") == 2
    # A block on both tiers (reloaded, its host copy kept) counts once.
    idx.add("a", h[2:3])
    assert idx.overlap(h) == {"a": 3} | {"b": 1} and idx.overlap_tiers(h) == {"a": 5, "b": 1}
    # Events in order, per tier: the device drops block 2, the host drops block 4.
    idx.apply("a", [("removed", h[2])])
    idx.apply_host("a", [("removed", h[4]), ("stored", h[5])])
    assert idx.overlap(h)["a"] == 2 and idx.overlap_tiers(h)["a"] == 4


def test_dropping_or_resyncing_a_worker_clears_its_host_blocks_and_frees_its_bit():
    idx, h = BlockIndex(), chain(4)
    idx.add("a", h[:1])
    idx.add_host("a", h[1:4])
    idx.drop_worker("a")
    assert not idx.has_host_blocks() and idx.overlap_tiers(h) == {}
    idx.add_host("b", h[:2])             # b takes a's bit: nothing of a's may show up as b's
    assert idx.overlap_tiers(h) == {"b": 2}
    idx.replace_worker("b", h[:1], h[1:3])
    assert idx.overlap_tiers(h) == {"b": 3} and idx.host_blocks_of("b") == 2


def test_the_host_side_is_bounded_least_recent_first():
    idx, h = BlockIndex(max_blocks=3), chain(5)
    idx.add_host("a", h[:3])
    idx.add_host("b", h[3:5])            # two more: the two oldest of a's go
    assert len(idx._host) == 3 and idx.host_blocks_of("a") == 1 and idx.host_blocks_of("b") == 2
    assert idx.overlap_tiers(h) == {}    # a's first block is gone, so is its chain


def test_overlap_tiers_matches_a_plain_set_model():
    rng = random.Random(3)
    idx, dev, host = BlockIndex(), {}, {}
    chains = [chain(8, first=500 * i) for i in range(3)]
    for _ in range(300):
        w, c = f"w{rng.randrange(70)}", rng.choice(chains)
        n = rng.randrange(len(c))
        op = rng.random()
        if op < 0.05:
            idx.drop_worker(w)
            dev.pop(w, None)
            host.pop(w, None)
        elif op < 0.4:
            idx.add(w, c[:n])
            dev.setdefault(w, set()).update(c[:n])
        elif op < 0.7:
            idx.add_host(w, c[n:])
            host.setdefault(w, set()).update(c[n:])
        else:
            idx.remove_host(w, c[n:])
            host.get(w, set()).difference_update(c[n:])
        c = rng.choice(chains)
        want = {}
        for x in set(dev) | set(host):
            held = dev.get(x, set()) | host.get(x, set())
            k = next((i for i, b in enumerate(c) if b not in held), len(c))
            if k:
                want[x] = k
        assert idx.overlap_tiers(c) == want


# ---- scoring ------------------------------------------------------------------------------

def test_a_host_hit_ranks_between_a_device_hit_and_a_miss():
    idx, h = BlockIndex(), chain(8)
    idx.add("device", h[:6])
    idx.add("host", h[:1])
    idx.add_host("host", h[1:6])
    ws = [worker("device"), worker("host", kv_copy_tps=10_000.0), worker("miss")]
    ranked = Scorer("prefix_aware", idx, random.Random(0)).rank("m", ws, 130, h)
    assert [c.worker.id for c in ranked] == ["device", "host", "miss"]
    cost = {c.worker.id: c.cost for c in ranked}
    cached = {c.worker.id: c.cached_tokens for c in ranked}
    assert cached == {"device": 96, "host": 96, "miss": 0}
    # The host worker pays the copy of its 80 host tokens at the rate it reports.
    assert cost["host"] - cost["device"] == pytest.approx(80 / 10_000.0)
    assert cost["miss"] - cost["device"] == pytest.approx(96 * per_token())


def test_the_copy_is_priced_at_the_default_until_reported_and_never_above_a_prefill():
    idx, h = BlockIndex(), chain(4)
    idx.add_host("slow", h[:4])
    idx.add_host("unknown", h[:4])
    ws = [worker("slow", kv_copy_tps=1.0), worker("unknown"), worker("miss")]
    cost = {c.worker.id: c.cost for c in Scorer("prefix_aware", idx, random.Random(0)).rank("m", ws, 80, h)}
    assert cost["miss"] - cost["unknown"] == pytest.approx(64 * (per_token() - 1 / DEFAULT_KV_COPY_TPS))
    assert cost["slow"] == pytest.approx(cost["miss"])     # a copy slower than prefill saves nothing


def test_least_loaded_ignores_the_host_tier_too():
    idx, h = BlockIndex(), chain(4)
    idx.add_host("a", h[:4])
    ws = [worker("a"), worker("b")]
    costs = {c.worker.id: c.cost for c in Scorer("least_loaded", idx, random.Random(0)).rank("m", ws, 80, h)}
    assert costs["a"] == pytest.approx(costs["b"])


# ---- schema ---------------------------------------------------------------------------------

def test_host_events_ride_in_their_own_field_and_old_batches_still_parse():
    a, b = b"a" * 16, b"b" * 16
    batch = rs.EventBatch("w", 7, 3, [("stored", a)], [("stored", b), ("removed", a)])
    f = batch.fields()
    assert rs.unpack_events(f["ev"]) == [("stored", a)]       # what a device-only reader reads
    back = rs.EventBatch.from_fields({k.encode(): v if isinstance(v, bytes) else v.encode() for k, v in f.items()})
    assert back == batch
    plain = rs.EventBatch("w", 7, 4, [("removed", a)])
    assert "hv" not in plain.fields() and rs.EventBatch.from_fields(plain.fields()).host_events == []
    with pytest.raises(ValueError, match="event batch"):
        rs.EventBatch.from_fields({**f, "hv": b"?" + a})


def test_lease_carries_the_tier_bounded_and_old_leases_default():
    lease = rs.Lease("w", "m", "h:1", 1, 16, host_blocks=4096, kv_copy_tps=3e5)
    assert rs.Lease.decode(lease.encode()) == lease
    old = rs.Lease.decode(b'{"worker_id": "w", "model": "m", "address": "h:1", "epoch": 1, "block_size": 16}')
    assert (old.host_blocks, old.kv_copy_tps) == (0, 0.0)
    for bad in ({"kv_copy_tps": -1.0}, {"kv_copy_tps": 1e13}, {"host_blocks": True}):
        with pytest.raises(ValueError, match="lease"):
            rs.Lease.decode(rs.Lease("w", "m", "h:1", 1, 16, **bad).encode())
