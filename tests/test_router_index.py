"""Pure-Python unit tests of the router's block index and circuit breaker (scoring: test_scoring.py)."""
import gc
import random

import pytest

from pagoda.protos.block_hash import block_hashes, namespace_root
from pagoda.router.breaker import CircuitBreaker
from pagoda.router.index import BlockIndex


def chain(n_blocks, model="m", adapter="", salt="", first=0, bs=16):
    return block_hashes(list(range(first, first + n_blocks * bs)), bs, namespace_root(model, adapter, salt))


def test_overlap_is_the_leading_run_per_worker():
    idx, h = BlockIndex(), chain(4)
    idx.add("a", h[:3])
    idx.add("b", h[:1] + h[2:4])      # a hole at block 1: only block 0 is usable
    assert idx.overlap(h, ["a", "b", "c"]) == {"a": 3, "b": 1}
    assert idx.overlap(h, ["b"]) == {"b": 1} and idx.overlap(h) == {"a": 3, "b": 1}
    assert idx.overlap([], ["a"]) == {}


def test_overlap_matches_a_plain_set_model_with_many_workers_and_reused_bits():
    rng = random.Random(5)
    idx, truth = BlockIndex(), {}
    chains = [chain(12, first=1000 * i) for i in range(6)]
    for step in range(400):
        w = f"w{rng.randrange(90)}"               # more workers than a machine word has bits
        if rng.random() < 0.05:
            idx.drop_worker(w)
            truth.pop(w, None)
            continue
        c = rng.choice(chains)
        n = rng.randrange(len(c))
        if rng.random() < 0.7:
            idx.add(w, c[:n])
            truth.setdefault(w, set()).update(c[:n])
        else:
            idx.remove(w, c[n:])
            truth.setdefault(w, set()).difference_update(c[n:])
        probe = rng.choice(chains)
        want = {}
        for wid, held in truth.items():
            k = 0
            while k < len(probe) and probe[k] in held:
                k += 1
            if k:
                want[wid] = k
        assert idx.overlap(probe) == want, step
        assert all(idx.blocks_of(wid) == len(held) for wid, held in truth.items())
    assert len(idx._bit) <= 90 and max(idx._bit.values()) < 90     # bits of dropped workers reused


def test_events_apply_in_order_and_drop_worker():
    idx, h = BlockIndex(), chain(3)
    idx.apply("a", [("stored", h[0]), ("stored", h[1]), ("removed", h[1]), ("stored", h[2])])
    assert idx.overlap(h, ["a"]) == {"a": 1} and len(idx) == 2
    idx.add("b", h)
    idx.drop_worker("a")
    assert idx.overlap(h, ["a", "b"]) == {"b": 3}
    assert len(idx) == 3 and idx.blocks_of("a") == 0
    idx.replace_worker("b", h[:1])
    assert len(idx) == 1 and idx.blocks_of("b") == 1


def test_bounded_memory_evicts_least_recently_touched():
    idx, h = BlockIndex(max_blocks=4), chain(6)
    idx.add("a", h[:4])
    idx.overlap(h[:1], ["a"])          # touch block 0: block 1 is now the oldest
    idx.add("a", h[4:5])
    assert len(idx) == 4 and idx.blocks_of("a") == 4
    assert idx.overlap(h[1:2], ["a"]) == {}
    assert idx.overlap(h[:1], ["a"]) == {"a": 1}
    with pytest.raises(ValueError, match="index_max_blocks"):
        BlockIndex(max_blocks=0)


def test_a_lookup_touches_a_chain_tail_first_so_eviction_shortens_it_from_the_end():
    idx, h = BlockIndex(max_blocks=4), chain(4)
    idx.add("a", h)
    assert idx.overlap(h) == {"a": 4}
    idx.add("b", chain(1, first=10_000))      # one past the bound: the least recently touched goes
    assert idx.overlap(h) == {"a": 3}         # the chain's last block, not its first (that left none)


def test_eviction_updates_every_owner_alone_or_shared():
    idx, h = BlockIndex(max_blocks=3, speculative_ttl_s=5), chain(6)
    idx.speculate("a", h[:1], now=0.0)        # a lone, speculative owner
    idx.add("b", h[1:2])
    idx.add("a", h[1:2])                      # two owners
    idx.add("c", h[2:3])
    idx.add("c", h[3:5])                      # evicts block 0 (a alone), then block 1 (a and b)
    assert len(idx) == 3 and idx.blocks_of("a") == 0 and idx.blocks_of("b") == 0
    assert idx.blocks_of("c") == 3 and idx.speculative_blocks("a") == 0
    idx.drop_worker("a")
    idx.speculate("d", h[5:], now=0.0)        # takes a's bit again: nothing of a's may show
    assert idx.overlap(h[:1]) == {} and idx.overlap(h[5:]) == {"d": 1}


def test_the_index_stays_out_of_the_cyclic_collectors_walk():
    idx, h = BlockIndex(), chain(8)
    idx.add("a", h[:4])
    idx.speculate("a", h, now=0.0)
    # Per-worker hashes and speculation: a dict of bytes, which CPython does not track (a set it does).
    assert idx.speculative_blocks("a") == 4 and not gc.is_tracked(idx._by_worker["a"])
    from pagoda.runtime.heap import freeze_heap
    freeze_heap()                             # the router does this once built: the ordered dict too
    try:
        assert gc.get_freeze_count() > 0 and not any(o is idx._owners for o in gc.get_objects())
    finally:
        gc.unfreeze()


def test_expiry_takes_only_its_own_speculation_still_unconfirmed():
    idx, h = BlockIndex(max_blocks=3, speculative_ttl_s=5), chain(4)
    idx.speculate("a", h[:2], now=0.0)
    idx.speculate("a", h[2:3], now=1.0)
    idx.add("a", h[3:4])                      # reported; evicts block 0, the oldest...
    idx.speculate("a", h[:1], now=2.0)        # ...speculated again, later (this evicts block 1)
    assert idx.speculative_blocks("a") == 2 and len(idx) == 3
    idx.expire_speculation(now=5.0)           # the first speculation is due: block 0 is the later one's
    assert idx.overlap(h[:1]) == {"a": 1} and idx.speculative_blocks("a") == 2
    idx.expire_speculation(now=6.0)
    assert idx.overlap(h[2:3]) == {} and idx.overlap(h[3:]) == {"a": 1}     # block 3 was reported
    idx.expire_speculation(now=7.0)
    assert len(idx) == 1 and idx.speculative_blocks("a") == 0 and not idx._speculated


def test_speculation_expires_unless_confirmed():
    idx, h = BlockIndex(speculative_ttl_s=5), chain(2)
    idx.speculate("a", h, now=100.0)
    assert idx.overlap(h, ["a"]) == {"a": 2}
    idx.add("a", h[:1])                 # the worker's own report confirms block 0
    idx.expire_speculation(now=104.9)
    assert idx.overlap(h, ["a"]) == {"a": 2}
    idx.expire_speculation(now=105.0)
    assert idx.overlap(h, ["a"]) == {"a": 1} and len(idx) == 1


def test_a_snapshot_keeps_pending_speculation():
    # A snapshot taken before a request's blocks were cached arrives after the router sent it:
    # the speculation stands (the next request with that prefix still finds this worker) until
    # a report confirms it or its deadline passes; what was reported and is not in it goes.
    idx, h, old = BlockIndex(speculative_ttl_s=5), chain(3), chain(2, salt="old")
    idx.add("a", old)
    idx.speculate("a", h, now=100.0)
    idx.replace_worker("a", [])                 # the snapshot holds none of them
    assert idx.overlap(h, ["a"]) == {"a": 3} and idx.overlap(old, ["a"]) == {}
    assert idx.speculative_blocks("a") == 3
    idx.replace_worker("a", h[:1])              # a later one has block 0: confirmed
    assert idx.overlap(h, ["a"]) == {"a": 3} and idx.speculative_blocks("a") == 2
    idx.expire_speculation(now=105.0)
    assert idx.overlap(h, ["a"]) == {"a": 1} and len(idx) == 1


def test_namespaces_never_match_each_other():
    idx = BlockIndex()
    idx.add("a", chain(4))
    for other in (chain(4, salt="t2"), chain(4, adapter="lora"), chain(4, model="other")):
        assert idx.overlap(other, ["a"]) == {}


def test_circuit_breaker_opens_half_opens_and_backs_off():
    br = CircuitBreaker(threshold=2, cooldown_s=1.0)
    br.failure("w", now=0.0)
    assert br.allow("w", now=0.1)
    br.failure("w", now=0.2)
    assert br.is_open("w", now=0.5) and not br.allow("w", now=0.5)
    assert br.allow("w", now=1.3)                # half-open: one trial
    assert not br.allow("w", now=1.4)
    br.failure("w", now=1.5)                     # trial failed: cooldown doubles
    assert not br.allow("w", now=3.0) and br.allow("w", now=3.6)
    br.success("w")
    assert br.allow("w", now=3.7) and not br.is_open("w", now=3.7)


def test_cluster_groups_by_model_follow_joins_leaves_and_changes():
    from types import SimpleNamespace

    from pagoda.protos.redis_schema import Lease
    from pagoda.router.breaker import CircuitBreaker
    from pagoda.router.channels import WorkerChannels
    from pagoda.router.cluster import Cluster
    from pagoda.router.prepare import Pin, Preparer

    cluster = Cluster("redis://unused", BlockIndex())       # nothing here talks to Redis

    def report(wid, model="m", digest="d1", epoch=1, ts=1.0):
        cluster._upsert(Lease(wid, model, f"h:{wid}", epoch, 16, ts=ts, tokenizer_digest=digest))

    report("a")
    report("b")
    report("c", model="other")
    assert [w.id for w in cluster.live("m")] == ["a", "b"] and cluster.models() == ["m", "other"]
    assert cluster.live("m") is cluster.live("m")           # one list, kept until something changes
    prepare = Preparer(cluster, WorkerChannels(), CircuitBreaker())
    pin = Pin("d1", SimpleNamespace(), None)  # type: ignore[arg-type]
    assert [w.id for w in prepare.same_tokenizer("m", cluster.live("m"), pin)] == ["a", "b"]
    report("b", digest="d2", ts=2.0)                         # b now advertises another tokenizer
    assert [w.id for w in prepare.same_tokenizer("m", cluster.live("m"), pin)] == ["a"]
    report("a", model="other", ts=2.0)                       # a moves to another model
    assert [w.id for w in cluster.live("m")] == ["b"] and {w.id for w in cluster.live("other")} == {"a", "c"}
    report("d")
    cluster._drop("b")
    assert [w.id for w in cluster.live("m")] == ["d"]
    report("d", epoch=2, ts=3.0)                             # a restart is a new WorkerState
    assert cluster.live("m")[0] is cluster.workers["d"] and cluster.live("m")[0].lease.epoch == 2
    cluster._drop("d")
    assert cluster.live("m") == [] and cluster.models() == ["other"]
