"""The router's cost model (router/scoring.py): exact figures on hand-built workers, no I/O."""
import random

import pytest

from pagoda.protos.block_hash import block_hashes, namespace_root
from pagoda.protos.redis_schema import Lease
from pagoda.router.index import BlockIndex
from pagoda.router.scoring import DECODE_SHARE, DEFAULT_OUTPUT_TOKENS, WorkerState
from pagoda.router.selection import Scorer

# 1 ms per prompt token, 1 ms per decoding sequence per step, 10 ms per step, 100 tokens per step:
# with D sequences decoding, a prompt token costs 1 ms + (10 ms + D ms) / 100.
RATES = dict(prefill_tps=1000.0, decode_tps=1000.0, step_s=0.01, max_batched_tokens=100)


def per_token(decoding=0):
    return 0.001 + (0.01 + decoding * 0.001) / 100


def chain(n_blocks, first=0):
    return block_hashes(list(range(first, first + n_blocks * 16)), 16, namespace_root("m"))


def worker(wid, rates=RATES, **load):
    return WorkerState(Lease(wid, "m", f"h:{wid}", 1, 16, num_blocks=100, free_blocks=100, **rates, **load))


def scorer(policy="prefix_aware", idx=None, seed=0, **kw):
    return Scorer(policy, idx or BlockIndex(), random.Random(seed), **kw)


def test_cost_is_the_documented_formula():
    w = worker("a", running=2, waiting=1, queued_prefill_tokens=200, ts=10.0)
    w.credit("r1", 50, now=10.0)
    d = 4                                               # running + waiting + one credit
    load = 250 * per_token(d) + DECODE_SHARE * DEFAULT_OUTPUT_TOKENS * d / 1000
    assert w.load_cost() == pytest.approx(load)
    (c,) = scorer().rank("m", [w], 100, chain(6, first=999), now=10.0)
    assert c.cost == pytest.approx(load + 100 * per_token(d)) and c.cached_tokens == 0


def test_a_hot_prefix_stays_until_its_holders_queue_makes_a_cold_prefill_elsewhere_faster():
    idx, h = BlockIndex(), chain(8)                     # 128 tokens cached on a; prompt of 130
    idx.add("a", h)
    s = scorer(idx=idx, balance=100.0)                 # the saving against the queue alone
    a, b = worker("a", queued_prefill_tokens=127), worker("b")
    ranked = s.rank("m", [a, b], 130, h, now=0.0)
    assert [c.worker.id for c in ranked] == ["a", "b"] and ranked[0].cached_tokens == 128
    assert ranked[0].cost == pytest.approx((127 + 2) * per_token())
    a.on_heartbeat(Lease("a", "m", "h:a", 1, 16, queued_prefill_tokens=129, **RATES))
    assert s.rank("m", [a, b], 130, h, now=0.0)[0].worker.id == "b"      # b computes it and caches a copy
    # Overlap is capped at prompt_len - 1: the engine always recomputes the last token.
    assert s.rank("m", [worker("a")], 128, h, now=0.0)[0].cached_tokens == 127


def test_a_worker_past_the_balance_bound_pays_its_excess_twice():
    idx, h = BlockIndex(), chain(100)                   # 1600 tokens cached on a
    idx.add("a", h)
    others = [worker(w, running=10) for w in "bcd"]
    a = worker("a", running=10, queued_prefill_tokens=1500)
    pt = per_token(10)
    load_a, load_b = a.load_cost(), others[0].load_cost()
    # Unbounded, a's saving (1600 tokens) outweighs its extra queue (1500): it would win.
    assert load_a + 1 * pt < load_b + 1601 * pt
    mean = (load_a + 3 * load_b) / 4
    assert load_a > 1.5 * mean
    ranked = scorer(idx=idx, balance=1.5).rank("m", [a] + others, 1601, h, now=0.0)
    assert ranked[0].worker.id != "a"
    a_cost = next(c.cost for c in ranked if c.worker.id == "a")
    assert a_cost == pytest.approx(load_a + (load_a - 1.5 * mean) + 1 * pt)
    assert scorer(idx=idx, balance=100.0).rank("m", [a] + others, 1601, h, now=0.0)[0].worker.id == "a"
    with pytest.raises(ValueError, match="balance"):
        scorer(balance=0.5)


def test_the_balance_bound_is_a_ratio_of_the_mean_however_small_the_loads():
    # Chat-like: decode loads of tens of ms, far under one full prefill step (0.115 s here), and a
    # cached history worth more than the holder's extra load. A floor in absolute time would let
    # the holder keep every turn at 2.5x the mean; the ratio holds it to 1.5x.
    idx, h = BlockIndex(), chain(10)                    # 160 tokens cached on a; prompt of 161
    idx.add("a", h)
    a, others = worker("a", running=5), [worker(w, running=1) for w in "bcd"]
    load_a, load_b = a.load_cost(), others[0].load_cost()
    mean = (load_a + 3 * load_b) / 4
    assert load_a == pytest.approx(2.5 * mean) and load_a < mean + 100 * per_token(5)
    assert load_a + per_token(5) < load_b + 161 * per_token(1)        # unbounded, a would win
    ranked = scorer(idx=idx).rank("m", [a] + others, 161, h, now=0.0)
    assert ranked[0].worker.id != "a"
    a_cost = next(c.cost for c in ranked if c.worker.id == "a")
    assert a_cost == pytest.approx(load_a + (load_a - 1.5 * mean) + per_token(5))


def test_measured_rates_decide_between_workers():
    slow = worker("slow", rates=dict(RATES, prefill_tps=500.0))
    fast = worker("fast")
    assert scorer().rank("m", [slow, fast], 500, chain(31, first=7))[0].worker.id == "fast"
    # A worker that has not measured its speed yet is costed at the defaults, not at zero.
    assert worker("new", rates={}, queued_prefill_tokens=100).load_cost() > 0


def test_in_flight_credit_spreads_a_burst_and_clears_on_a_later_report():
    a, b = worker("a"), worker("b")
    s = scorer(seed=1)
    first = s.rank("m", [a, b], 100, chain(6, first=1000), now=10.0)[0].worker
    first.credit("r1", 100, now=10.0)
    assert s.rank("m", [a, b], 100, chain(6, first=5000), now=10.0)[0].worker is not first
    decode = DECODE_SHARE * DEFAULT_OUTPUT_TOKENS / 1000
    assert first.load_cost() == pytest.approx(100 * per_token(1) + decode)
    first.prefill_done("r1")
    assert first.load_cost() == pytest.approx(decode)
    first.on_heartbeat(Lease(first.id, "m", "h", 1, 16, ts=9.0, **RATES))    # stamped before the send
    assert first.credits
    first.on_heartbeat(Lease(first.id, "m", "h", 1, 16, ts=11.0, **RATES))   # after: the report counts it
    assert not first.credits and first.load_cost() == 0
    # Reports arrive by two paths; an older one never replaces a newer one.
    first.on_heartbeat(Lease(first.id, "m", "h", 1, 16, ts=10.5, running=9, **RATES))
    assert first.lease.running == 0


def test_a_request_that_ended_stops_loading_its_worker_before_the_next_report():
    w = worker("a")
    w.credit("r1", 100, now=10.0)
    w.on_heartbeat(Lease("a", "m", "h", 1, 16, ts=11.0, running=1, **RATES))     # counts r1
    one = DECODE_SHARE * DEFAULT_OUTPUT_TOKENS / 1000
    assert not w.credits and w.load_cost() == pytest.approx(one)
    w.finish("r1", now=11.5)
    assert w.load_cost() == 0
    w.on_heartbeat(Lease("a", "m", "h", 1, 16, ts=11.2, running=1, **RATES))     # older than the end
    assert w.load_cost() == 0
    # Stamped after the end, a report no longer counts r1: the one it shows running is another
    # request (taking r1 off it too saw a busy worker as idle, and sessions piled onto it).
    w.on_heartbeat(Lease("a", "m", "h", 1, 16, ts=11.6, running=1, **RATES))
    assert w.load_cost() == pytest.approx(one) and not w.gone and not w.counted
    w.on_heartbeat(Lease("a", "m", "h", 1, 16, ts=12.0, running=0, **RATES))
    assert w.load_cost() == 0
    w.credit("r2", 50, now=13.0)
    w.finish("r2", now=13.2)                       # ended before any report counted it...
    assert not w.credits and w.load_cost() == 0
    w.on_heartbeat(Lease("a", "m", "h", 1, 16, ts=13.1, running=1, **RATES))     # ...but this one does
    assert w.load_cost() == 0
    w.on_heartbeat(Lease("a", "m", "h", 1, 16, ts=14.0, running=1, **RATES))     # another request runs
    assert w.load_cost() == pytest.approx(one) and not w.gone


def test_a_report_taken_before_a_requests_first_token_does_not_bring_its_prefill_back():
    w = worker("a")
    w.credit("r1", 100, now=10.0)
    w.on_heartbeat(Lease("a", "m", "h", 1, 16, ts=10.1, waiting=1, queued_prefill_tokens=100, **RATES))
    w.prefill_done("r1", now=10.3)
    w.finish("r1", now=10.4)
    assert w.load_cost() == 0          # that report still shows r1 queued, but it has come and gone


def test_a_first_token_takes_its_prefill_off_a_report_taken_before_it():
    w = worker("a")
    w.credit("r1", 100, now=10.0)
    w.on_heartbeat(Lease("a", "m", "h", 1, 16, ts=10.1, running=1, queued_prefill_tokens=100, **RATES))
    one = DECODE_SHARE * DEFAULT_OUTPUT_TOKENS / 1000
    assert not w.credits and w.load_cost() == pytest.approx(100 * per_token(1) + one)
    # Prefill done: running and waiting do not change, so no load event comes before the next
    # heartbeat, and that report would keep showing r1's prompt as queued until then.
    w.prefill_done("r1", now=10.3)
    assert w.load_cost() == pytest.approx(one)
    # A report taken after the first token does not count r1's prefill: what it queues is another's.
    w.on_heartbeat(Lease("a", "m", "h", 1, 16, ts=10.4, running=1, queued_prefill_tokens=100, **RATES))
    assert w.load_cost() == pytest.approx(100 * per_token(1) + one)
    # Nor when the report comes after the first token but was taken before it.
    v = worker("b")
    v.credit("r1", 100, now=10.0)
    v.prefill_done("r1", now=10.3)
    v.on_heartbeat(Lease("b", "m", "h", 1, 16, ts=10.1, running=1, queued_prefill_tokens=100, **RATES))
    assert not v.credits and v.load_cost() == pytest.approx(one)


def test_queued_prefill_drains_between_reports():
    pt, pt1, pt2 = per_token(), per_token(1), per_token(2)
    w = worker("a", queued_prefill_tokens=1000, ts=10.0)         # 1.1 s of prefill at 10.0
    assert w.load_cost(now=10.0) == pytest.approx(w.load_cost()) == pytest.approx(1000 * pt)
    assert w.load_cost(now=10.5) == pytest.approx(1000 * pt - 0.5)
    assert w.load_cost(now=12.0) == 0
    # Ranked a second later, the older report's queue has mostly drained: a wins over a fresh
    # report of a fifth of its queue, which the figures as reported would give to b.
    b = worker("b", queued_prefill_tokens=200, ts=11.0)
    assert scorer().rank("m", [w, b], 50, chain(3, first=99), now=11.0)[0].worker is w
    assert scorer().rank("m", [w, b], 50, chain(3, first=99), now=10.0)[0].worker is b
    # A request in flight queues behind what is left of the report, from its send on.
    c = worker("c", queued_prefill_tokens=1000, ts=10.0)
    c.credit("r1", 500, now=10.5)
    assert c.load_cost(0, now=10.5) == pytest.approx(1500 * pt1 - 0.5)
    d = worker("d", queued_prefill_tokens=1000, ts=10.0)
    d.credit("r1", 500, now=12.0)                               # the report's queue is done by then
    assert d.load_cost(0, now=12.0) == pytest.approx(500 * pt1)
    # A first token seen after the report: what is left of the report's queue drains from then.
    e = worker("e")
    e.credit("r1", 400, now=10.0)
    e.credit("r2", 1000, now=10.0)
    e.on_heartbeat(Lease("e", "m", "h", 1, 16, ts=10.1, waiting=2, queued_prefill_tokens=1400, **RATES))
    e.prefill_done("r1", now=10.5)
    assert e.load_cost(0, now=10.5) == pytest.approx(1000 * pt2)
    e.finish("r1", now=10.6)                                    # and so when that request has ended
    assert e.load_cost(0, now=10.6) == pytest.approx(1000 * pt1 - 0.1)
    # A report stamped in the router's future (clock skew) never counts more than its queue.
    assert worker("f", queued_prefill_tokens=100, ts=20.0).load_cost(now=10.0) == pytest.approx(100 * pt)


def test_kv_pressure_penalty():
    calm, full = worker("a", kv_usage=0.5), worker("b", kv_usage=0.99)
    assert calm.load_cost() == 0
    assert full.load_cost() == pytest.approx(4096 * per_token() * (0.19 / 0.2) ** 2)


def test_least_loaded_ignores_cache_and_round_robin_rotates():
    idx, h = BlockIndex(), chain(4)
    idx.add("a", h)
    a, b = worker("a", running=1), worker("b")
    assert scorer("least_loaded", idx).rank("m", [a, b], 70, h)[0].worker.id == "b"
    assert scorer("prefix_aware", idx).rank("m", [a, b], 70, h)[0].worker.id == "a"
    rr = scorer("round_robin", idx)
    assert [rr.rank("m", [a, b], 70, h)[0].worker.id for _ in range(4)] == ["a", "b", "a", "b"]
    with pytest.raises(ValueError, match="policy"):
        Scorer("fastest", idx)


def test_ties_break_at_random_and_limit_keeps_the_best():
    s = scorer(seed=3)
    picks = {s.rank("m", [worker("a"), worker("b")], 50, chain(3))[0].worker.id for _ in range(40)}
    assert picks == {"a", "b"}
    ws = [worker(f"w{i}", queued_prefill_tokens=10 * i) for i in range(8)]
    assert [c.worker.id for c in s.rank("m", ws, 50, chain(3), limit=3, now=0.0)] == ["w0", "w1", "w2"]


def test_expected_output_follows_finished_requests_and_is_capped_by_max_tokens():
    s = scorer()
    for _ in range(60):
        s.observe_output(1000)
    assert 990 <= s.output_tokens <= 1000
    idx, h = BlockIndex(), chain(8)
    idx.add("a", h)
    s.index = idx
    a, b = worker("a", running=1), worker("b")       # a holds 128 cached tokens but one is decoding
    # With outputs of ~1000 tokens, sharing a's steps costs more than recomputing 128 tokens...
    assert s.rank("m", [a, b], 130, h)[0].worker.id == "b"
    # ...but not for a request that asks for 4 tokens.
    assert s.rank("m", [a, b], 130, h, max_output=4)[0].worker.id == "a"
    for _ in range(60):
        s.observe_output(4)
    assert s.output_tokens < 6


def test_figures_follow_changes_between_decisions():
    s = scorer()
    ws = [worker(f"w{i}") for i in range(5)]
    assert s.rank("m", ws, 100, chain(6, first=77), limit=1, now=5.0)[0].cost == pytest.approx(100 * per_token())
    ws[0].on_heartbeat(Lease("w0", "m", "h", 1, 16, ts=5.0, queued_prefill_tokens=10_000, **RATES))
    for w in ws[1:]:
        w.credit("r", 10_000, now=5.0)
    (best,) = s.rank("m", ws, 100, chain(6, first=77), limit=1, now=5.0)     # the credits count: w0 is least bad
    assert best.worker is ws[0] and best.cost == pytest.approx(10_100 * per_token())
    ws[1].on_heartbeat(Lease("w1", "m", "h", 1, 16, ts=6.0, **RATES))      # w1's report counts its credit...
    ws[1].finish("r", now=6.5)                                             # ...which then ends
    ws[1].on_heartbeat(Lease("w1", "m", "h", 1, 16, ts=7.0, **RATES))
    (best,) = s.rank("m", ws, 100, chain(6, first=77), limit=1, now=7.0)
    assert best.worker is ws[1] and best.cost == pytest.approx(100 * per_token())


def test_a_report_is_written_where_it_is_applied_and_a_decision_refreshes_only_its_own_changes(monkeypatch):
    s = scorer()
    ws = [worker(f"w{i}") for i in range(4)]
    s.rank("m", ws, 100, chain(6, first=77), now=5.0)
    for i, w in enumerate(ws):                      # a lease poll renews every worker
        w.on_heartbeat(Lease(w.id, "m", "h", 1, 16, ts=5.0, queued_prefill_tokens=1000 * (4 - i), **RATES))
    ws[0].credit("r", 5000, now=5.0)
    calls = []
    real = WorkerState.figures
    monkeypatch.setattr(WorkerState, "figures", lambda self: calls.append(self.id) or real(self))
    ranked = s.rank("m", ws, 100, chain(6, first=77), now=5.0)
    assert calls == ["w0"]                          # the credit, not the four reports
    assert [c.worker.id for c in ranked] == ["w3", "w2", "w1", "w0"]
    assert ranked[0].cost == pytest.approx(1100 * per_token())
    assert ws[0].load_cost(now=5.0) == pytest.approx(9000 * per_token(1) + DECODE_SHARE * DEFAULT_OUTPUT_TOKENS / 1000)


def test_claim_credits_the_choice_and_speculates_past_what_it_holds():
    from pagoda.router.breaker import CircuitBreaker
    from pagoda.router.selection import Selector
    idx, h = BlockIndex(speculative_ttl_s=5), chain(4)
    idx.add("a", h[:2])                                     # reported: a holds the first two blocks
    a = worker("a")
    select = Selector(scorer(idx=idx), CircuitBreaker())
    best = select.rank("m", [a, worker("b")], 4 * 16 + 5, h)[0]
    assert best.worker is a and best.cached_tokens == 32
    select.claim(best, "r1", 4 * 16 + 5, h, sent_at=10.0, now=100.0)
    assert a.credits["r1"].prefill_tokens == 4 * 16 + 5 - 32 and a.credits["r1"].sent_at == 10.0
    assert idx.overlap(h) == {"a": 4} and {x for x, t in idx._by_worker["a"].items() if t is not None} == set(h[2:])
    idx.expire_speculation(now=105.0)                       # the reported blocks are not speculative
    assert idx.overlap(h) == {"a": 2}


def test_preparation_hashes_each_namespace_with_its_own_root_however_many_it_has_seen():
    from types import SimpleNamespace

    from pagoda.router.breaker import CircuitBreaker
    from pagoda.router.channels import WorkerChannels
    from pagoda.router.prepare import Preparer
    prepare = Preparer(SimpleNamespace(), WorkerChannels(), CircuitBreaker())  # type: ignore[arg-type]
    ids = list(range(40))
    for salt in ["", "t2", "", "t3"] + [f"s{i}" for i in range(4100)] + ["t2"]:
        for adapter in ("", "lora"):
            hashes = prepare.hashes("m", adapter, salt, ids, 16)
            assert list(hashes) == block_hashes(ids, 16, namespace_root("m", adapter, salt))
    assert len(prepare._roots) <= 4096                      # the root cache is bounded


# ---- fetch hints: fetch a prefix a peer holds, where that beats computing it (issue 36) -----------

# 8 KiB blocks at 1000 blocks a second, 20 ms a call: 100 blocks (1600 tokens) fetch in 0.12 s, where
# computing them takes 1600 * per_token() = 1.76 s; 2 blocks fetch in 0.022 s against 0.035 s.
FETCH = dict(kv_block_bytes=8192, kv_fetch_bps=8192e3, kv_fetch_overhead_s=0.02)


def fetcher(wid, **load):
    return worker(wid, rates={**RATES, **FETCH}, **load)


def test_a_worker_lacking_a_long_prefix_a_peer_holds_fetches_it_when_that_beats_computing_it():
    idx, h = BlockIndex(), chain(100)
    idx.add("a", h)
    a, b = fetcher("a", queued_prefill_tokens=1000), fetcher("b")     # a's queue outweighs the fetch
    ranked = scorer(idx=idx).rank("m", [a, b], 1700, h, now=0.0)
    best = ranked[0]
    assert best.worker is b and best.fetch is not None
    assert (best.fetch.source, best.fetch.num_blocks, best.fetch.own_tokens) == (a, 100, 0)
    assert best.cached_tokens == 1600                   # the fetched prefix is predicted as cached
    fetch_s = 100 * 8192 / 8192e3 + 0.02
    assert best.cost == pytest.approx(100 * per_token() + fetch_s)
    assert ranked[1].worker is a and ranked[1].fetch is None    # the holder itself is never hinted
    # Without hints b would compute the 1600 tokens: a, queued as it is, stays cheaper.
    off = scorer(idx=idx, fetch=False).rank("m", [fetcher("a", queued_prefill_tokens=1000), fetcher("b")],
                                            1700, h, now=0.0)
    assert off[0].worker.id == "a" and all(c.fetch is None for c in off)


def test_a_short_prefix_is_computed_not_fetched():
    idx, h = BlockIndex(), chain(2)
    idx.add("a", h)
    slow_call = dict(FETCH, kv_fetch_overhead_s=0.05)                 # 0.052 s against 0.035 s of prefill
    a = worker("a", rates={**RATES, **slow_call}, queued_prefill_tokens=100)
    b = worker("b", rates={**RATES, **slow_call})
    best = scorer(idx=idx).rank("m", [a, b], 40, h, now=0.0)[0]
    assert best.worker is b and best.fetch is None and best.cached_tokens == 0
    assert best.cost == pytest.approx(40 * per_token())


def test_a_partial_holder_fetches_only_what_it_lacks_from_the_deepest_least_loaded_holder():
    idx, h = BlockIndex(), chain(100)
    idx.add("a", h)
    idx.add("c", h)
    idx.add("b", h[:40])
    a, c = fetcher("a", queued_prefill_tokens=3000), fetcher("c", queued_prefill_tokens=2000)
    b = fetcher("b")
    best = scorer(idx=idx).rank("m", [a, b, c], 1700, h, now=0.0)[0]
    assert best.worker is b and best.fetch is not None
    assert (best.fetch.source, best.fetch.num_blocks, best.fetch.own_tokens) == (c, 100, 640)
    assert best.cost == pytest.approx(100 * per_token() + 60 * 8192 / 8192e3 + 0.02)


def test_no_hint_names_a_source_that_is_not_a_ranked_worker_or_cannot_serve_it():
    idx, h = BlockIndex(), chain(100)
    idx.add("dead", h)                                  # in the index, but no live lease: not ranked
    ranked = scorer(idx=idx).rank("m", [fetcher("b"), fetcher("c")], 1700, h, now=0.0)
    assert all(c.fetch is None and c.cached_tokens == 0 for c in ranked)
    # A holder whose lease says it takes no fetches (tensor parallel, prefix caching off, an older
    # worker), or whose blocks are another size (another KV dtype), is no source; nor is a target
    # that takes none.
    idx.add("a", h)
    for a, b in ((worker("a", queued_prefill_tokens=3000), fetcher("b")),
                 (fetcher("a", queued_prefill_tokens=3000), worker("b")),
                 (worker("a", rates={**RATES, **FETCH, "kv_block_bytes": 4096}, queued_prefill_tokens=3000),
                  fetcher("b"))):
        assert all(c.fetch is None for c in scorer(idx=idx).rank("m", [a, b], 1700, h, now=0.0))


def test_the_hint_goes_with_the_request_to_its_worker_alone_and_claim_speculates_the_fetched_blocks():
    from pagoda.protos.pagoda.v1 import pagoda_pb2 as pb
    from pagoda.router.breaker import CircuitBreaker
    from pagoda.router.selection import Selector
    idx, h = BlockIndex(speculative_ttl_s=5), chain(100)
    idx.add("a", h)
    idx.add("b", h[:10])
    a, b = fetcher("a", queued_prefill_tokens=3000), fetcher("b")
    breaker = CircuitBreaker()
    select = Selector(scorer(idx=idx), breaker)
    best = select.rank("m", [a, b], 1700, h, now=0.0)[0]
    assert best.worker is b and best.fetch is not None and best.fetch.own_tokens == 160
    request = pb.GenerateRequest(token_ids=list(range(1700)))
    sent = select.upstream(best, request)
    assert sent.kv_fetch == pb.KVFetchHint(source_address="h:a", num_blocks=100)
    assert not request.HasField("kv_fetch")             # the next attempt starts from the request as it was
    assert select.upstream(select.rank("m", [a, b], 1700, h, now=0.0)[1], request) is request
    select.claim(best, "r1", 1700, h, sent_at=10.0, now=100.0)
    assert b.credits["r1"].prefill_tokens == 100
    assert {x for x, t in idx._by_worker["b"].items() if t is not None} == set(h[10:])
    for _ in range(breaker.threshold):                  # the source sits out a cooldown: no hint
        breaker.failure("a")
    assert select.upstream(best, request) is request


def test_spread_prices_a_hot_prefixs_copy_at_its_fetch_where_that_is_cheaper():
    from pagoda.router.scoring import prefix_key
    idx, h = BlockIndex(), chain(100)
    idx.add("a", h)
    a, b = fetcher("a", running=4, queued_prefill_tokens=100), fetcher("b")
    for r in range(4):                                  # four requests of the prefix running on a
        a.credit(f"r{r}", 0, now=-1.0, prefix=h[-1])
    key = prefix_key(h, {"a": 100}, 1700, 16)
    s = scorer(idx=idx)
    by_id = {c.worker.id: c for c in s.rank("m", [a, b], 1700, h, now=0.0)}
    # u = 4 / 2 = 2: b pays half of the cheaper way to the prefix (its fetch), not of its prefill.
    fetch_s = 100 * 8192 / 8192e3 + 0.02
    load_b = 0.0
    assert key == h[-1] and by_id["b"].fetch is not None
    assert by_id["b"].cost == pytest.approx(load_b + 100 * per_token() + fetch_s - 0.5 * fetch_s)


def test_a_lora_request_goes_to_the_idle_worker_with_its_adapter_and_fetches_the_prefix_there():
    """Adapter affinity: the holder of the adapter's prefix is busy; another worker with the adapter
    in a slot takes the request and fetches the prefix (hashed in the adapter's namespace) from it."""
    h = block_hashes(list(range(100 * 16)), 16, namespace_root("m", "x"))
    idx = BlockIndex()
    idx.add("a", h)
    lora = dict(lora_adapters=["x"], lora_resident=["x"], max_loras=1)
    a = fetcher("a", queued_prefill_tokens=1000, **lora)
    b, c = fetcher("b", **lora), fetcher("c", lora_adapters=["x"], max_loras=1)    # c: x not in a slot
    ranked = scorer(idx=idx).rank("m", [a, b, c], 1700, h, now=0.0, adapter="x")
    assert [r.worker.id for r in ranked] == ["b", "c", "a"]
    assert ranked[0].fetch is not None and ranked[0].fetch.source is a
