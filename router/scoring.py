"""Which worker gets a request: per-worker state as the router sees it, and the three policies.

prefix_aware cost, lowest wins, in prompt-token units of work:
    prefill left after the worker's cached overlap
  + prefill already queued there (reported, plus requests this router sent since that report)
  + DECODE_WEIGHT per running, waiting or just-sent request (each slows every step a little)
  + a penalty growing quadratically once KV usage passes KV_KNEE (admission would stall or preempt).
least_loaded is the same cost with the overlap ignored; round_robin rotates. Ties break at random.
"""
from __future__ import annotations

import itertools
import random
from dataclasses import dataclass, field

from protos.redis_schema import Lease
from router.index import BlockIndex

POLICIES = ("prefix_aware", "least_loaded", "round_robin")
DECODE_WEIGHT = 4
KV_KNEE = 0.8
KV_PENALTY_TOKENS = 4096


@dataclass
class Credit:
    prefill_tokens: int
    sent_at: float           # router wall clock, compared with the worker's heartbeat stamp


@dataclass
class WorkerState:
    lease: Lease
    seq: int | None = None                  # last event batch applied in order; None = must resync
    next_resync: float = 0.0
    credits: dict[str, Credit] = field(default_factory=dict)   # request id -> in-flight credit

    @property
    def id(self) -> str:
        return self.lease.worker_id

    def credit(self, request_id: str, prefill_tokens: int, now: float) -> None:
        self.credits[request_id] = Credit(prefill_tokens, now)

    def prefill_done(self, request_id: str) -> None:
        """First token out: its prefill no longer waits, but it runs until the next report."""
        c = self.credits.get(request_id)
        if c:
            c.prefill_tokens = 0

    def uncredit(self, request_id: str) -> None:
        self.credits.pop(request_id, None)

    def on_heartbeat(self, lease: Lease) -> None:
        """A report stamped after a request was sent already counts it: drop its credit."""
        self.lease = lease
        self.credits = {k: c for k, c in self.credits.items() if c.sent_at >= lease.ts}

    def load_cost(self) -> float:
        lease = self.lease
        queued = lease.queued_prefill_tokens + sum(c.prefill_tokens for c in self.credits.values())
        busy = lease.running + lease.waiting + len(self.credits)
        penalty = 0.0
        if lease.kv_usage > KV_KNEE:
            penalty = KV_PENALTY_TOKENS * ((lease.kv_usage - KV_KNEE) / (1 - KV_KNEE)) ** 2
        return queued + DECODE_WEIGHT * busy + penalty


@dataclass
class Choice:
    worker: WorkerState
    cost: float
    cached_tokens: int       # predicted prefix-cache hit on this worker


class Scorer:
    def __init__(self, policy: str, index: BlockIndex, rng: random.Random | None = None):
        if policy not in POLICIES:
            raise ValueError(f"policy: must be one of {', '.join(POLICIES)} (got {policy!r})")
        self.policy, self.index = policy, index
        self.rng = rng or random.Random()
        self._rr: dict[str, itertools.count] = {}

    def rank(self, model: str, workers: list[WorkerState], prompt_len: int,
             hashes: list[bytes]) -> list[Choice]:
        """Every candidate, best first."""
        if not workers:
            return []
        workers = sorted(workers, key=lambda w: w.id)
        overlap = self.index.overlap(hashes, [w.id for w in workers])
        block = workers[0].lease.block_size
        # The engine always recomputes the last prompt token, so at most prompt_len - 1 hit.
        cached = {w.id: min(overlap[w.id] * block, max(prompt_len - 1, 0)) for w in workers}
        if self.policy == "round_robin":
            start = next(self._rr.setdefault(model, itertools.count())) % len(workers)
            order = workers[start:] + workers[:start]
            return [Choice(w, float(i), cached[w.id]) for i, w in enumerate(order)]
        choices = []
        for w in workers:
            hit = cached[w.id] if self.policy == "prefix_aware" else 0
            choices.append(Choice(w, prompt_len - hit + w.load_cost(), cached[w.id]))
        keyed = [(c.cost, self.rng.random(), c) for c in choices]
        keyed.sort(key=lambda t: t[:2])
        return [c for _, _, c in keyed]
