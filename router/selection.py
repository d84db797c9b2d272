"""Stage 2: worker selection. Rank a prepared request's workers (router/scoring.py's cost,
with no I/O), leaving out those the circuit breaker keeps out, and, once one is chosen, claim
it: credit it with the request in flight (counted under the deepest prefix it shares, which
prices a hot prefix's copies: SPREAD in router/scoring.py) and record the prompt's blocks there
speculatively, so that a burst of a new shared prompt gathers there instead of scattering."""
from __future__ import annotations

import time
from typing import Sequence

from pagoda.router.breaker import CircuitBreaker
from pagoda.router.scoring import Choice, Scorer, WorkerState


class Selector:
    def __init__(self, scorer: Scorer, breaker: CircuitBreaker, max_attempts: int = 3):
        self.scorer, self.breaker, self.max_attempts = scorer, breaker, max_attempts

    def rank(self, model: str, workers: list[WorkerState], prompt_len: int, hashes: Sequence[bytes],
             max_output: int | None = None, now: float | None = None, adapter: str = "") -> list[Choice]:
        """The best max_attempts workers, best first (`now`: the wall clock, unless a simulation
        keeps its own). Workers sitting out a breaker cooldown are left out, unless all are."""
        shut = self.breaker.open_workers()
        allowed = ([w for w in workers if w.id not in shut] or workers) if shut else workers
        return self.scorer.rank(model, allowed, prompt_len, hashes, self.max_attempts, max_output or None, now,
                                adapter)

    def claim(self, choice: Choice, request_id: str, prompt_len: int, hashes: Sequence[bytes],
              sent_at: float | None = None, now: float | None = None, direct: bool = False) -> None:
        """The decision taken: credit the worker with the request in flight (stamped `sent_at`,
        wall clock) and record the prompt's blocks there speculatively. The blocks the index
        already has it holding are skipped, not looked up again. `direct`: the client streams from
        the worker itself, so the credit lasts until a report counts the request."""
        w = choice.worker
        w.credit(request_id, prompt_len - choice.cached_tokens, time.time() if sent_at is None else sent_at,
                 choice.prefix, direct)
        self.scorer.index.speculate(w.id, hashes[choice.cached_tokens // w.lease.block_size:], now)
