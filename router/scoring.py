"""Which worker gets a request: per-worker state as the router sees it, and the three policies.

The cost is time, in seconds, from the speed each worker measures and reports in its lease
(gpu_worker/step_rates.py): a step costs  s + p / Rp + d / Rd  for p prompt tokens and d
decoding sequences, carrying at most B tokens. For worker w, a request of P prompt tokens of
which C are cached on w, Q prefill tokens queued on w (reported, plus this router's in-flight
credits), D sequences decoding there (running + waiting + credits - those ended since the
report) and O the expected output length (learned from finished requests):

    prefill(x) = x / Rp + (x / B) * (s + D / Rd)   x prompt tokens in steps that also carry D decodes
    load       = prefill(Q)                        drain the queued prefill
               + DECODE_SHARE * O * D / Rd         our O decode steps, each slowed by D others
               + kv_penalty                        grows quadratically past KV_KNEE of the pool:
                                                   admission would stall or preempt
    excess     = max(0, load - max(BALANCE * mean load, mean load + prefill(B)))
    cost       = load + excess + prefill(P - C)

prefix_aware ranks by cost, lowest first. The overlap C saves prefill(C), so a worker holding
the prefix wins until its queue costs more than recomputing the prefix elsewhere: a hot prefix
then goes to a second worker, which caches it and reports it like any other block. A worker
whose load runs ahead of BALANCE times the mean pays that excess twice, so only a large enough
saving keeps sending it work; within one full prefill step of the mean nobody is held back (a
ratio of small loads says nothing). least_loaded is the same cost with C = 0; round_robin
rotates. Ties break at random.
"""
from __future__ import annotations

import heapq
import itertools
import math
import random
from dataclasses import dataclass, field

from protos.redis_schema import Lease
from router.index import BlockIndex

POLICIES = ("prefix_aware", "least_loaded", "round_robin")
BALANCE = 1.5                 # how far past the mean load a cache hit may keep a worker
# Each running sequence slows our O decode steps by 1/Rd; counted at a quarter, since time to first
# token is what routing is judged by (at 1 the cache hit rate fell 10% with no gain in balance).
DECODE_SHARE = 0.25
KV_KNEE = 0.8
KV_PENALTY_TOKENS = 4096      # at a full pool, as bad as this much queued prefill
# Speed assumed until a worker has measured its own (an older worker, or the first heartbeat).
DEFAULT_PREFILL_TPS, DEFAULT_DECODE_TPS, DEFAULT_STEP_S, DEFAULT_BATCH_TOKENS = 10_000.0, 2_000.0, 0.005, 2048
DEFAULT_OUTPUT_TOKENS = 128


@dataclass
class Credit:
    prefill_tokens: int
    sent_at: float           # router wall clock, compared with the worker's report stamp


@dataclass
class WorkerState:
    lease: Lease
    seq: int | None = None                  # last event batch applied in order; None = must resync
    next_resync: float = 0.0
    credits: dict[str, Credit] = field(default_factory=dict)   # request id -> in-flight credit
    credit_prefill: int = 0                 # sum of the credits' prefill tokens
    # Requests a report already counts (their credit was dropped): request id -> sent at; and
    # requests that ended, until a report stamped after their end: id -> (sent at, ended at).
    # A report stamped between the two still counts one as running, so it is taken off.
    counted: dict[str, float] = field(default_factory=dict)
    gone: dict[str, tuple[float, float]] = field(default_factory=dict)
    _memo: tuple[float, float, float, float] | None = field(default=None, repr=False)   # (O, *load())

    @property
    def id(self) -> str:
        return self.lease.worker_id

    @property
    def name(self) -> str:
        """Stable across restarts (for metric labels); the id changes with every process."""
        return self.lease.name or self.lease.worker_id

    def credit(self, request_id: str, prefill_tokens: int, now: float) -> None:
        self.uncredit(request_id)
        self.credits[request_id] = Credit(prefill_tokens, now)
        self.credit_prefill += prefill_tokens
        self._memo = None

    def prefill_done(self, request_id: str) -> None:
        """First token out: its prefill no longer waits, but it decodes until it finishes."""
        c = self.credits.get(request_id)
        if c:
            self.credit_prefill -= c.prefill_tokens
            c.prefill_tokens = 0
            self._memo = None

    def uncredit(self, request_id: str) -> None:
        """The request never ran here (it failed before its first token)."""
        c = self.credits.pop(request_id, None)
        if c:
            self.credit_prefill -= c.prefill_tokens
            self._memo = None
        self.counted.pop(request_id, None)

    def finish(self, request_id: str, now: float) -> None:
        """The request's stream ended: it no longer loads the worker, reported or not."""
        c = self.credits.pop(request_id, None)
        if c:
            self.credit_prefill -= c.prefill_tokens
            self.gone[request_id] = (c.sent_at, now)
        elif request_id in self.counted:
            self.gone[request_id] = (self.counted.pop(request_id), now)
        self._memo = None

    def on_heartbeat(self, lease: Lease) -> None:
        """A report stamped after a request was sent already counts it: drop its credit; one
        stamped after it ended no longer counts it. Reports come by two paths (lease key, load
        stream); an older one never replaces a newer."""
        if lease.ts < self.lease.ts:
            return
        self.lease = lease
        for k in [k for k, c in self.credits.items() if c.sent_at < lease.ts]:
            self.counted[k] = self.credits.pop(k).sent_at
        self.credit_prefill = sum(c.prefill_tokens for c in self.credits.values())
        self.gone = {k: t for k, t in self.gone.items() if t[1] >= lease.ts}
        self._memo = None

    def rates(self) -> tuple[float, float, float, int]:
        """(Rp, Rd, s, B) as reported, or the defaults where the worker has not measured them."""
        ls = self.lease
        return (ls.prefill_tps or DEFAULT_PREFILL_TPS, ls.decode_tps or DEFAULT_DECODE_TPS,
                ls.step_s or DEFAULT_STEP_S, ls.max_batched_tokens or DEFAULT_BATCH_TOKENS)

    def load(self, output_tokens: float) -> tuple[float, float, float]:
        """(load, seconds per prompt token of prefill, seconds of one full prefill step) with
        `output_tokens` = O."""
        memo = self._memo
        if memo is not None and memo[0] == output_tokens:
            return memo[1], memo[2], memo[3]
        rp, rd, s, b = self.rates()
        ls = self.lease
        ended = sum(1 for sent, _ in self.gone.values() if sent < ls.ts) if self.gone else 0
        decoding = max(0, ls.running + ls.waiting + len(self.credits) - ended)
        per_token = 1.0 / rp + (s + decoding / rd) / b
        load = (ls.queued_prefill_tokens + self.credit_prefill) * per_token + DECODE_SHARE * output_tokens * decoding / rd
        if ls.kv_usage > KV_KNEE:
            load += KV_PENALTY_TOKENS * per_token * ((ls.kv_usage - KV_KNEE) / (1 - KV_KNEE)) ** 2
        self._memo = (output_tokens, load, per_token, per_token * b)
        return load, per_token, per_token * b

    def load_cost(self, output_tokens: float = DEFAULT_OUTPUT_TOKENS) -> float:
        return self.load(output_tokens)[0]


@dataclass
class Choice:
    worker: WorkerState
    cost: float
    cached_tokens: int       # predicted prefix-cache hit on this worker


class Scorer:
    def __init__(self, policy: str, index: BlockIndex, rng: random.Random | None = None,
                 balance: float = BALANCE):
        if policy not in POLICIES:
            raise ValueError(f"policy: must be one of {', '.join(POLICIES)} (got {policy!r})")
        if not balance >= 1.0:
            raise ValueError(f"balance: must be at least 1.0 (got {balance})")
        self.policy, self.index, self.balance = policy, index, balance
        self.rng = rng or random.Random()
        self.output_tokens = float(DEFAULT_OUTPUT_TOKENS)     # O, as used in the cost
        self._output_avg = self.output_tokens
        self._rr: dict[str, itertools.count] = {}

    def observe_output(self, tokens: int) -> None:
        """A finished request's output length. O is a quick moving average (a few dozen requests
        re-learn it) rounded to a step of 2^(1/4), so that each worker's memoised load stays
        valid until O really moves."""
        self._output_avg += 0.1 * (max(tokens, 1) - self._output_avg)
        self.output_tokens = 2.0 ** (round(4 * math.log2(self._output_avg)) / 4)

    def rank(self, model: str, workers: list[WorkerState], prompt_len: int,
             hashes: list[bytes], limit: int | None = None) -> list[Choice]:
        """Candidates best first (the best `limit` of them when given)."""
        if not workers:
            return []
        return self.rank_overlap(model, workers, prompt_len, self.index.overlap(hashes), limit)

    def rank_overlap(self, model: str, workers: list[WorkerState], prompt_len: int, overlap: dict[str, int],
                     limit: int | None = None) -> list[Choice]:
        """rank() given each worker's cached leading blocks (absent = none): the oracle's entry."""
        block = workers[0].lease.block_size
        # The engine always recomputes the last prompt token, so at most prompt_len - 1 hit.
        cap = max(prompt_len - 1, 0)
        if self.policy == "round_robin":
            workers = sorted(workers, key=lambda w: w.id)
            start = next(self._rr.setdefault(model, itertools.count())) % len(workers)
            order = workers[start:] + workers[:start]
            return [Choice(w, float(i), min(overlap.get(w.id, 0) * block, cap))
                    for i, w in enumerate(order)][:limit]
        o = self.output_tokens
        loads = [w.load(o) for w in workers]
        mean = sum(x[0] for x in loads) / len(loads)
        bound = self.balance * mean
        use_cache = self.policy == "prefix_aware"
        rand = self.rng.random
        keyed = []
        for w, (ld, per_token, full_step) in zip(workers, loads):
            cached = min(overlap.get(w.id, 0) * block, cap)
            excess = ld - max(bound, mean + full_step)
            cost = ld + (excess if excess > 0 else 0.0) + (prompt_len - (cached if use_cache else 0)) * per_token
            keyed.append((cost, rand(), cached, w))
        best = heapq.nsmallest(limit, keyed) if limit else sorted(keyed)
        return [Choice(w, cost, cached) for cost, _, cached, w in best]
