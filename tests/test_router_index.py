"""Pure-Python unit tests of the router's block index, scoring policies and circuit breaker."""
import random

import pytest

from protos.block_hash import block_hashes, namespace_root
from protos.redis_schema import Lease
from router.breaker import CircuitBreaker
from router.index import BlockIndex
from router.scoring import DECODE_WEIGHT, Scorer, WorkerState


def chain(n_blocks, model="m", adapter="", salt="", first=0, bs=16):
    return block_hashes(list(range(first, first + n_blocks * bs)), bs, namespace_root(model, adapter, salt))


def worker(wid, **load):
    return WorkerState(Lease(wid, "m", f"h:{wid}", 1, 16, num_blocks=100, free_blocks=100, **load))


def test_overlap_is_the_leading_run_per_worker():
    idx, h = BlockIndex(), chain(4)
    idx.add("a", h[:3])
    idx.add("b", h[:1] + h[2:4])      # a hole at block 1: only block 0 is usable
    assert idx.overlap(h, ["a", "b", "c"]) == {"a": 3, "b": 1, "c": 0}
    assert idx.overlap([], ["a"]) == {"a": 0}


def test_events_apply_in_order_and_drop_worker():
    idx, h = BlockIndex(), chain(3)
    idx.apply("a", [("stored", h[0]), ("stored", h[1]), ("removed", h[1]), ("stored", h[2])])
    assert idx.overlap(h, ["a"]) == {"a": 1} and len(idx) == 2
    idx.add("b", h)
    idx.drop_worker("a")
    assert idx.overlap(h, ["a", "b"]) == {"a": 0, "b": 3}
    assert len(idx) == 3 and idx.blocks_of("a") == 0
    idx.replace_worker("b", h[:1])
    assert len(idx) == 1 and idx.blocks_of("b") == 1


def test_bounded_memory_evicts_least_recently_touched():
    idx, h = BlockIndex(max_blocks=4), chain(6)
    idx.add("a", h[:4])
    idx.overlap(h[:1], ["a"])          # touch block 0: block 1 is now the oldest
    idx.add("a", h[4:5])
    assert len(idx) == 4 and idx.blocks_of("a") == 4
    assert idx.overlap(h[1:2], ["a"]) == {"a": 0}
    assert idx.overlap(h[:1], ["a"]) == {"a": 1}
    with pytest.raises(ValueError, match="index_max_blocks"):
        BlockIndex(max_blocks=0)


def test_speculation_expires_unless_confirmed():
    idx, h = BlockIndex(speculative_ttl_s=5), chain(2)
    idx.speculate("a", h, now=100.0)
    assert idx.overlap(h, ["a"]) == {"a": 2}
    idx.add("a", h[:1])                 # the worker's own report confirms block 0
    idx.expire_speculation(now=104.9)
    assert idx.overlap(h, ["a"]) == {"a": 2}
    idx.expire_speculation(now=105.0)
    assert idx.overlap(h, ["a"]) == {"a": 1} and len(idx) == 1


def test_namespaces_never_match_each_other():
    idx = BlockIndex()
    idx.add("a", chain(4))
    for other in (chain(4, salt="t2"), chain(4, adapter="lora"), chain(4, model="other")):
        assert idx.overlap(other, ["a"]) == {"a": 0}


def test_prefix_aware_prefers_overlap_until_load_outweighs_it():
    idx, h = BlockIndex(), chain(8)             # 128-token prompt
    idx.add("a", h)
    a, b = worker("a"), worker("b")
    s = Scorer("prefix_aware", idx, random.Random(0))
    ranked = s.rank("m", [a, b], 130, h)
    assert [c.worker.id for c in ranked] == ["a", "b"]
    assert ranked[0].cached_tokens == 128 and ranked[1].cached_tokens == 0
    assert ranked[0].cost == 2 and ranked[1].cost == 130
    a.lease.queued_prefill_tokens = 200         # a is busy enough that recomputing on b is cheaper
    assert s.rank("m", [a, b], 130, h)[0].worker.id == "b"
    # Overlap is capped at prompt_len - 1: the engine always recomputes the last token.
    assert s.rank("m", [worker("a")], 128, h)[0].cached_tokens == 127


def test_in_flight_credit_spreads_a_burst_and_clears_on_a_later_heartbeat():
    idx = BlockIndex()
    a, b = worker("a"), worker("b")
    s = Scorer("prefix_aware", idx, random.Random(1))
    first = s.rank("m", [a, b], 100, chain(6, first=1000))[0].worker
    first.credit("r1", 100, now=10.0)
    other = s.rank("m", [a, b], 100, chain(6, first=5000))[0].worker
    assert other is not first
    assert first.load_cost() == 100 + DECODE_WEIGHT
    first.prefill_done("r1")
    assert first.load_cost() == DECODE_WEIGHT
    first.on_heartbeat(Lease(first.id, "m", "h", 1, 16, ts=9.0))     # stamped before the send: keep
    assert first.credits
    first.on_heartbeat(Lease(first.id, "m", "h", 1, 16, ts=11.0))    # after: the report counts it
    assert not first.credits and first.load_cost() == 0


def test_kv_pressure_penalty():
    calm, full = worker("a", kv_usage=0.5), worker("b", kv_usage=0.99)
    assert calm.load_cost() == 0
    assert full.load_cost() > 3000


def test_least_loaded_ignores_cache_and_round_robin_rotates():
    idx, h = BlockIndex(), chain(4)
    idx.add("a", h)
    a, b = worker("a", running=1), worker("b")
    assert Scorer("least_loaded", idx).rank("m", [a, b], 70, h)[0].worker.id == "b"
    rr = Scorer("round_robin", idx)
    firsts = [rr.rank("m", [a, b], 70, h)[0].worker.id for _ in range(4)]
    assert firsts == ["a", "b", "a", "b"]
    with pytest.raises(ValueError, match="policy"):
        Scorer("fastest", idx)


def test_ties_break_at_random():
    idx = BlockIndex()
    s = Scorer("prefix_aware", idx, random.Random(3))
    picks = {s.rank("m", [worker("a"), worker("b")], 50, chain(3))[0].worker.id for _ in range(40)}
    assert picks == {"a", "b"}


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
