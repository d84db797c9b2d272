"""SPREAD (router/scoring.py): a hot prefix's copy is charged its share of the prefill, so a
single system prompt's holder loses the next request to the next-best worker once it runs ahead
by that share, not by a whole prefill. Exact figures on hand-built workers, no I/O."""
import random

import pytest

from pagoda.protos.block_hash import block_hashes, namespace_root
from pagoda.protos.redis_schema import Lease
from pagoda.router.breaker import CircuitBreaker
from pagoda.router.index import BlockIndex
from pagoda.router.scoring import DECODE_SHARE, DEFAULT_OUTPUT_TOKENS, WorkerState, prefix_key
from pagoda.router.selection import Scorer, Selector

# As tests/test_scoring.py: with D sequences decoding, a prompt token costs 1 ms + (10 ms + D ms) / 100.
RATES = dict(prefill_tps=1000.0, decode_tps=1000.0, step_s=0.01, max_batched_tokens=100)
SYSTEM = list(range(20 * 16))                     # 20 blocks


def per_token(decoding=0):
    return 0.001 + (0.01 + decoding * 0.001) / 100


def prompt(user):
    return SYSTEM + [10_000 + user] * 5


def hashes(tokens):
    return block_hashes(tokens, 16, namespace_root("m"))


def worker(wid, **load):
    return WorkerState(Lease(wid, "m", f"h:{wid}", 1, 16, num_blocks=1000, free_blocks=1000, **RATES, **load))


def scorer(idx, policy="prefix_aware", **kw):
    return Scorer(policy, idx, random.Random(0), **kw)


def holding(workers_blocks):
    idx = BlockIndex()
    h = hashes(SYSTEM)
    for wid, n in workers_blocks.items():
        idx.add(wid, h[:n])
    return idx, h


def running(w, n, key, first=0):
    """n of this router's requests sharing `key` running on w (their first tokens out)."""
    for i in range(first, first + n):
        w.credit(f"{w.id}{i}", 0, now=0.0, prefix=key)


def test_prefix_key_is_the_deepest_held_block_that_can_hit():
    h = hashes(SYSTEM)
    assert prefix_key(h, {"a": 20, "b": 3}, 325, 16) == h[19]
    assert prefix_key(h, {"a": 20}, 320, 16) == h[18]          # the last prompt token is recomputed
    assert prefix_key(h, {"a": 20}, 17, 16) == h[0]
    assert prefix_key(h, {}, 325, 16) is None and prefix_key(h, {"a": 20}, 16, 16) is None


def test_a_hot_prefixs_copy_is_charged_its_share_of_the_prefill():
    idx, h = holding({"a": 20})
    a, b = worker("a"), worker("b")
    running(a, 5, h[19])                                # 5 running: a copy would take 5 / 2 of them
    p = prompt(1)
    load_a, load_b = a.load_cost(), b.load_cost()
    mean = (load_a + load_b) / 2
    excess_a = max(0.0, load_a - 1.5 * mean)
    pt_a, pt_b = per_token(5), per_token(0)
    u = 5 / 2
    ranked = scorer(idx).rank("m", [a, b], len(p), hashes(p), now=0.0)
    cost = {c.worker.id: c.cost for c in ranked}
    assert cost["a"] == pytest.approx(load_a + excess_a + 5 * pt_a)
    assert cost["b"] == pytest.approx(load_b + len(p) * pt_b - (1 - 1 / u) * 320 * pt_b)
    assert ranked[0].worker is b and all(c.prefix == h[19] for c in ranked)
    # Charged the whole prefill, b loses: a's extra load is under one prefill of the prompt.
    plain = scorer(idx, spread=False).rank("m", [a, b], len(p), hashes(p), now=0.0)
    assert plain[0].worker is a
    assert {c.worker.id: c.cost for c in plain}["b"] == pytest.approx(load_b + len(p) * pt_b)


def test_a_prefix_with_no_more_requests_than_copies_to_come_is_costed_as_before():
    idx, h = holding({"a": 20})
    p = prompt(1)
    for n in (0, 1, 2):                                 # u = n / 2 <= 1: no share to charge
        a, b = worker("a"), worker("b")
        running(a, n, h[19])
        spread = scorer(idx).rank("m", [a, b], len(p), hashes(p), now=0.0)
        plain = scorer(idx, spread=False).rank("m", [a, b], len(p), hashes(p), now=0.0)
        assert [(c.worker.id, c.cost) for c in spread] == [(c.worker.id, c.cost) for c in plain]
    # Requests running under another prefix (a chat session's own history) are not this one's.
    a, b = worker("a"), worker("b")
    running(a, 9, h[10])
    spread = scorer(idx).rank("m", [a, b], len(p), hashes(p), now=0.0)
    plain = scorer(idx, spread=False).rank("m", [a, b], len(p), hashes(p), now=0.0)
    assert [c.cost for c in spread] == [c.cost for c in plain]


def test_the_share_counts_every_deepest_holder_and_a_partial_holder_pays_for_what_it_lacks():
    idx, h = holding({"a": 20, "b": 20, "c": 8})
    a, b, c, d = worker("a"), worker("b"), worker("c"), worker("d")
    running(a, 6, h[19])
    running(b, 6, h[19], first=6)
    p = prompt(2)
    u = 12 / 3                                          # 12 running over 2 holders and the copy to come
    loads = {w.id: w.load_cost() for w in (a, b, c, d)}
    mean = sum(loads.values()) / 4
    assert loads["a"] == loads["b"] > 1.5 * mean        # both holders past the bound
    cost = {x.worker.id: x.cost for x in scorer(idx).rank("m", [a, b, c, d], len(p), hashes(p), now=0.0)}
    pc = per_token(0)
    assert cost["c"] == pytest.approx(loads["c"] + (len(p) - 128) * pc - (1 - 1 / u) * (320 - 128) * pc)
    assert cost["d"] == pytest.approx(loads["d"] + len(p) * pc - (1 - 1 / u) * 320 * pc)
    # Holders pay their excess, as ever, and no share.
    assert cost["a"] == pytest.approx(2 * loads["a"] - 1.5 * mean + 5 * per_token(6))


def test_no_copy_while_a_deepest_holder_has_room():
    idx, h = holding({"a": 20, "b": 20})
    p = prompt(2)
    a, b, c = worker("a"), worker("b"), worker("c")
    running(a, 8, h[19])
    running(b, 2, h[19], first=8)                       # u = 10 / 3, but b is under the bound
    loads = [w.load_cost() for w in (a, b, c)]
    assert loads[1] <= 1.5 * sum(loads) / 3 < loads[0]
    spread = scorer(idx).rank("m", [a, b, c], len(p), hashes(p), now=0.0)
    plain = scorer(idx, spread=False).rank("m", [a, b, c], len(p), hashes(p), now=0.0)
    assert [(x.worker.id, x.cost) for x in spread] == [(x.worker.id, x.cost) for x in plain]
    assert spread[0].worker is b
    # One holder alone, near the mean: b's 2 running are hot enough (u = 2 / 2 = 1 ... 3 / 2), but
    # its load is under the bound of a fleet as busy as it is.
    idx1, _ = holding({"b": 20})
    b2, others = worker("b"), [worker(w) for w in "xy"]
    running(b2, 3, h[19])
    for w in others:
        running(w, 3, b"other prefix")
    spread = scorer(idx1).rank("m", [b2] + others, len(p), hashes(p), now=0.0)
    plain = scorer(idx1, spread=False).rank("m", [b2] + others, len(p), hashes(p), now=0.0)
    assert [x.cost for x in spread] == [x.cost for x in plain]


def test_only_prefix_aware_spreads():
    idx, h = holding({"a": 20})
    p = prompt(1)
    for policy in ("least_loaded", "round_robin"):
        a, b = worker("a"), worker("b")
        running(a, 8, h[19])
        s = scorer(idx, policy)
        assert not s.spread
        plain = scorer(idx, policy, spread=False)
        assert ([x.cost for x in s.rank("m", [a, b], len(p), hashes(p), now=0.0)]
                == [x.cost for x in plain.rank("m", [a, b], len(p), hashes(p), now=0.0)])


def test_claim_counts_a_request_under_its_prefix_until_it_ends_or_fails():
    idx, h = holding({"a": 20})
    a, b = worker("a"), worker("b")
    select = Selector(scorer(idx, spread=False), CircuitBreaker())
    p = prompt(1)
    best = select.rank("m", [a, b], len(p), hashes(p))[0]
    assert best.worker is a and best.prefix == h[19]
    for rid in ("r1", "r2", "r3"):
        select.claim(best, rid, len(p), hashes(p), sent_at=1.0, now=1.0)
    select.claim(best, "r3", len(p), hashes(p), sent_at=1.0, now=1.0)      # a retry of the same id
    assert a.prefix_live == {h[19]: 3}
    a.prefill_done("r1", now=2.0)
    a.on_heartbeat(Lease("a", "m", "h:a", 1, 16, running=3, ts=3.0, **RATES))   # a report counts them now
    assert a.prefix_live == {h[19]: 3}
    a.finish("r1", now=4.0)
    a.uncredit("r2")
    assert a.prefix_live == {h[19]: 1}
    a.finish("r3", now=5.0)
    a.finish("r3", now=5.0)
    assert a.prefix_live == {} and a._prefix_of == {}
    # A request whose prompt nobody holds has no prefix to count.
    cold = select.rank("m", [a, b], 40, hashes(list(range(50_000, 50_040))))[0]
    assert cold.prefix is None
    select.claim(cold, "r4", 40, hashes(list(range(50_000, 50_040))))
    assert cold.worker.prefix_live == {}


def burst(spread, n=16):
    """n requests of one system prompt arriving at once (no report in between), each claimed
    as the router would: -> the worker of each."""
    idx, h = holding({"a": 20})
    a, b = worker("a"), worker("b")
    select = Selector(scorer(idx, spread=spread), CircuitBreaker())
    out = []
    for i in range(n):
        p = prompt(i)
        best = select.rank("m", [a, b], len(p), hashes(p), now=0.0)[0]
        select.claim(best, f"r{i}", len(p), hashes(p), sent_at=0.0, now=0.0)
        best.worker.prefill_done(f"r{i}", now=0.0)      # its prefill done; it decodes on
        out.append(best.worker.id)
    return out


def test_a_burst_of_one_system_prompt_gets_a_second_copy_before_its_holder_runs_ahead():
    # Decoding requests load a at DECODE_SHARE * O / Rd each (32 ms here); the prompt's prefill
    # is 0.36 s, so charged in full a copy waits for a to run 8 requests ahead of b.
    plain, spread = burst(False), burst(True)
    assert DECODE_SHARE * DEFAULT_OUTPUT_TOKENS / 1000 == pytest.approx(0.032)
    assert plain == ["a"] * 9 + ["b"] * 7
    # Priced at its share, the copy comes after 5 (u = 5 / 2), and then the two share the burst.
    assert spread[:6] == ["a"] * 5 + ["b"] and spread.count("a") == spread.count("b") == 8
