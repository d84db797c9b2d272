"""Stage 2: worker selection. Rank a prepared request's workers (the policy --policy names,
router/policies/, over router/scoring.py's cost, with no I/O), leaving out those the circuit
breaker keeps out, and, once one is chosen, claim it: credit it with the request in flight
(counted under the deepest prefix it shares, which prices a hot prefix's copies: SPREAD in
router/scoring.py) and record the prompt's blocks there speculatively, so that a burst of a new
shared prompt gathers there instead of scattering."""
from __future__ import annotations

import random
import time
from typing import Sequence

from pagoda.protos.pagoda.v1 import pagoda_pb2 as pb
from pagoda.router.breaker import CircuitBreaker
from pagoda.router.index import BlockIndex
from pagoda.router.policies.base import Query
from pagoda.router.policies.registry import make_policy
from pagoda.router.scoring import BALANCE, DEFAULT_OUTPUT_TOKENS, Choice, WorkerState, prefix_key


class Scorer:
    """A policy over the router's block index: a request's cached blocks per worker (device and
    host tiers) and its hot prefix, read from the index, and O, the expected output length, learnt
    from finished requests, go to the policy, which ranks with no I/O."""

    def __init__(self, policy: str, index: BlockIndex, rng: random.Random | None = None,
                 balance: float = BALANCE, spread: bool = True, fetch: bool = True):
        """`policy`: a name in POLICIES; `spread` False: SPREAD off (bench comparisons); `fetch`
        False: no fetch hints (--kv-fetch-hints off)."""
        self.ranker = make_policy(policy, rng or random.Random(), balance, spread, fetch)
        self.policy, self.index = policy, index
        self.output_tokens = float(DEFAULT_OUTPUT_TOKENS)     # O: moving average of finished outputs

    @property
    def spread(self) -> bool:
        return self.ranker.spread

    def observe_output(self, tokens: int) -> None:
        """A finished request's output length: O is a quick moving average (a few dozen
        requests re-learn it)."""
        self.output_tokens += 0.1 * (max(tokens, 1) - self.output_tokens)

    def rank(self, model: str, workers: list[WorkerState], prompt_len: int, hashes: Sequence[bytes],
             limit: int | None = None, max_output: int | None = None, now: float | None = None,
             adapter: str = "") -> list[Choice]:
        """Candidates best first (the best `limit` of them when given) at time `now` (wall clock,
        the one credits and reports are stamped with; default the current time). A request's own
        decode runs at most `max_output` tokens (its max_tokens), whatever others average.
        With a LoRA `adapter` (workers: those serving it), a worker without it in a device slot
        pays LORA_LOAD_S."""
        if not workers:
            return []
        overlap = self.index.overlap(hashes)
        tiered = self.index.overlap_tiers(hashes) if self.index.has_host_blocks() else None
        key = prefix_key(hashes, overlap, prompt_len, workers[0].lease.block_size)
        return self.rank_overlap(model, workers, prompt_len, overlap, limit, max_output, now, key, adapter, tiered)

    def rank_overlap(self, model: str, workers: list[WorkerState], prompt_len: int, overlap: dict[str, int],
                     limit: int | None = None, max_output: int | None = None,
                     now: float | None = None, prefix: bytes | None = None, adapter: str = "",
                     tiered: dict[str, int] | None = None) -> list[Choice]:
        """rank() given each worker's cached leading blocks (absent = none), the prompt's
        prefix_key() (the oracle's entry), and each worker's leading blocks over both tiers
        (None: no worker holds any in host memory)."""
        o = min(self.output_tokens, max_output) if max_output else self.output_tokens
        q = Query(model, prompt_len, overlap, o, time.time() if now is None else now, prefix, adapter, tiered)
        return self.ranker.rank(q, workers, limit)


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
        held = choice.cached_tokens if choice.fetch is None else choice.fetch.own_tokens    # fetched ones come too
        self.scorer.index.speculate(w.id, hashes[held // w.lease.block_size:], now)

    def upstream(self, choice: Choice, request: pb.GenerateRequest) -> pb.GenerateRequest:
        """What `choice`'s worker is sent: `request`, with the fetch hint of the choice when it has
        one whose source is not sitting out a breaker cooldown (a copy: the request stays as it is
        for the next attempt)."""
        fetch = choice.fetch
        if fetch is None or self.breaker.is_open(fetch.source.id):
            return request
        hinted = pb.GenerateRequest()
        hinted.CopyFrom(request)
        hinted.kv_fetch.CopyFrom(pb.KVFetchHint(source_address=fetch.source.lease.address,
                                                num_blocks=fetch.num_blocks))
        return hinted
