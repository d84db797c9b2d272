"""Routing policies under simulation: the real router, and an oracle.

RouterPolicy is the router process's own objects (BlockIndex, Cluster reading Redis, Scorer,
the request pipeline's preparation and selection stages) with the gRPC proxy cut off: a decision is what Generate does before
it opens the upstream stream (hash, rank, credit the winner, record its prefix speculatively),
and the Cluster's sync steps run at simulated-time ticks instead of in its background task.
Credits, first tokens and ends are stamped with simulated time, the clock the simulated
workers' reports carry (bench/sim/bus.py).

OraclePolicy sees every simulated worker's exact cache and load at the moment of decision (its
queue as the exact time until the last queued prompt token is computed, and the requests there
that share the prompt's prefix, for SPREAD) and applies the
router's own cost formula to them, so the gap between the two is the price of the
router's delayed, summarised view rather than of a different formula.
"""
from __future__ import annotations

import asyncio
import random
import time

import redis.asyncio as aioredis

from pagoda.protos import redis_schema as rs
from pagoda.protos.block_hash import namespace_root
from pagoda.router.breaker import CircuitBreaker
from pagoda.router.channels import WorkerChannels
from pagoda.router.cluster import Cluster
from pagoda.router.index import BlockIndex
from pagoda.router.prepare import Preparer
from pagoda.router.scoring import KV_KNEE, KV_PENALTY_TOKENS, Choice, WorkerState, prefix_key
from pagoda.router.selection import Scorer, Selector

from .bus import MODEL


class RouterPolicy:
    def __init__(self, policy: str, redis_url: str, loop: asyncio.AbstractEventLoop, seed: int,
                 lease_poll_s: float = 0.25, index_max_blocks: int = 1_000_000,
                 speculative_ttl_s: float = 10.0, spread: bool = True, fetch: bool = True):
        self.name, self.loop, self.lease_poll_s = policy, loop, lease_poll_s
        self.index = BlockIndex(index_max_blocks, speculative_ttl_s)
        self.cluster = Cluster(redis_url, self.index, lease_poll_s=lease_poll_s)
        self.cluster._redis = aioredis.from_url(redis_url)
        self.cluster.connected = True
        self.scorer = Scorer(policy, self.index, random.Random(seed), spread=spread, fetch=fetch)
        breaker = CircuitBreaker()
        self.prepare = Preparer(self.cluster, WorkerChannels(), breaker)
        self.select = Selector(self.scorer, breaker)
        self._next_poll = 0.0

    def sync(self, now: float) -> None:
        self.loop.run_until_complete(self._sync(now))

    async def _sync(self, now: float) -> None:
        poll = now >= self._next_poll
        if poll:
            self._next_poll = now + self.lease_poll_s
        await self.cluster.sync_once(poll, block_ms=None, now=now)   # None: XREAD without BLOCK

    def choose(self, req, now: float) -> tuple[int, int, int]:
        """(worker index, wall ns, this thread's CPU ns) for one decision."""
        t0, c0 = time.perf_counter_ns(), time.thread_time_ns()
        model, workers = self.prepare.candidates(MODEL)
        # The default namespace: no adapter, no salt.
        hashes = self.prepare.hashes(model, "", "", req.prompt, workers[0].lease.block_size)
        best = self.select.rank(model, workers, len(req.prompt), hashes, None, now)[0]
        self.select.claim(best, req.rid, len(req.prompt), hashes, now, now)
        if best.fetch is not None:
            req.fetch = (int(best.fetch.source.id.rsplit("-", 1)[1]), best.fetch.num_blocks)
        wall, cpu = time.perf_counter_ns() - t0, time.thread_time_ns() - c0
        return int(best.worker.id.rsplit("-", 1)[1]), wall, cpu

    def on_first_token(self, req, now: float) -> None:
        w = self.cluster.workers.get(f"sim-{req.worker}")
        if w is not None:
            w.prefill_done(req.rid, now)

    def on_finish(self, req, now: float) -> None:
        self.scorer.observe_output(len(req.output))
        w = self.cluster.workers.get(f"sim-{req.worker}")
        if w is not None:
            w.finish(req.rid, now)

    def close(self) -> None:
        self.loop.run_until_complete(self.cluster._redis.aclose())


class TokenCostPolicy(RouterPolicy):
    """v1's cost (before issue 16), on the same router view, for comparison: in prompt tokens,
    P - C + queued prefill (reported + in-flight credits) + 4 per running, waiting or in-flight
    request + the KV penalty; lowest wins, ties at random. Hashing, index and claim are the
    router's own."""
    DECODE_WEIGHT = 4

    def __init__(self, redis_url: str, loop: asyncio.AbstractEventLoop, seed: int):
        super().__init__("prefix_aware", redis_url, loop, seed)
        self.name = "v1_tokens"
        self.rng = random.Random(seed)
        self._root = namespace_root(MODEL)

    def choose(self, req, now: float) -> tuple[int, int, int]:
        t0, c0 = time.perf_counter_ns(), time.thread_time_ns()
        model, workers = self.prepare.candidates(MODEL)
        block = workers[0].lease.block_size
        hashes = self.prepare.hasher.hashes(req.prompt, block, self._root)
        overlap = self.index.overlap(hashes)
        best = None
        for w in workers:
            ls = w.lease
            cached = min(overlap.get(w.id, 0) * block, max(len(req.prompt) - 1, 0))
            cost = (len(req.prompt) - cached + ls.queued_prefill_tokens + w.credit_prefill
                    + self.DECODE_WEIGHT * (ls.running + ls.waiting + len(w.credits)))
            if ls.kv_usage > KV_KNEE:
                cost += KV_PENALTY_TOKENS * ((ls.kv_usage - KV_KNEE) / (1 - KV_KNEE)) ** 2
            key = (cost, self.rng.random())
            if best is None or key < best[0]:
                best = (key, Choice(w, cost, cached))
        assert best is not None
        self.select.claim(best[1], req.rid, len(req.prompt), hashes, now, now)
        wall, cpu = time.perf_counter_ns() - t0, time.thread_time_ns() - c0
        return int(best[1].worker.id.rsplit("-", 1)[1]), wall, cpu


class OraclePolicy:
    name = "oracle"

    def __init__(self, workers, seed: int, block_size: int):
        self.workers, self.block_size = workers, block_size
        self.scorer = Scorer("prefix_aware", BlockIndex(), random.Random(seed))

    def sync(self, now: float) -> None:
        pass

    def choose(self, req, now: float) -> tuple[int, int, int]:
        states, overlap = [], {}
        held = {f"sim-{i}": w.cached_prefix_tokens(req) // self.block_size for i, w in enumerate(self.workers)}
        key = prefix_key(req.hashes, held, len(req.prompt), self.block_size)
        for i, w in enumerate(self.workers):
            st, c = w.stats(), w.cost
            # Exact load and the exact step-time model, where the router has reports and fits; the
            # queue as the exact time until its last token is computed (the step under way
            # included), in the tokens of the formula, which the router can only estimate.
            per_token = c.prefill_token_s + (c.base_s + (st.running + st.waiting) * c.decode_seq_s) \
                / w.max_batched_tokens
            queued = round(w.queued_prefill_s(now, st.running + st.waiting) / per_token)
            lease = rs.Lease(f"sim-{i}", MODEL, "-", 0, self.block_size, st.num_blocks, st.running, st.waiting,
                             queued, st.kv_usage, st.free_blocks,
                             prefill_tps=1 / c.prefill_token_s, decode_tps=1 / c.decode_seq_s, step_s=c.base_s,
                             max_batched_tokens=w.max_batched_tokens, ts=now)
            st = WorkerState(lease)
            if key is not None:       # exact: the requests there now that share the prefix
                st.prefix_live[key] = sum(1 for r in (*w.running, *w.waiting) if key in r.hashes)
            states.append(st)
            overlap[lease.worker_id] = held[lease.worker_id]
        best = self.scorer.rank_overlap(MODEL, states, len(req.prompt), overlap, limit=1, now=now, prefix=key)[0]
        return int(best.worker.id.rsplit("-", 1)[1]), 0, 0

    def on_first_token(self, req, now: float) -> None:
        pass

    def on_finish(self, req, now: float) -> None:
        self.scorer.observe_output(len(req.output))

    def close(self) -> None:
        pass
