"""Which worker gets a request: per-worker state as the router sees it, and the cost the policies
rank by (the policies themselves: router/policies/, one module each).

The cost is time, in seconds, from the speed each worker measures and reports in its lease
(gpu_worker/serving/step_rates.py): a step costs  s + p / Rp + d / Rd  for p prompt tokens and d
decoding sequences, carrying at most B tokens. For worker w, a request of P prompt tokens of
which C are cached on w, D sequences decoding there (running + waiting + credits - those ended
since the report) and O the expected output length (a moving average of finished requests,
capped at this request's max_tokens):

    prefill(x) = x / Rp + (x / B) * (s + D / Rd)   x prompt tokens in steps that also carry D decodes
    load       = queue(now)                        what is left of the queued prefill
               + DECODE_SHARE * O * D / Rd         our O decode steps, each slowed by D others
               + kv_penalty                        grows quadratically past KV_KNEE of the pool:
                                                   admission would stall or preempt
    excess     = max(0, load - BALANCE * mean load)
    cost       = load + excess + prefill(P - C)

The queue is a time, not a count: a report stamped t0 shows Q tokens queued, less the prefill
of requests whose first token this router has seen since (only running and waiting changes
send a load event, so a finished prefill would otherwise stay queued until the next
heartbeat); that much drains from t0 (or from the last such first token, when that much was
surely done) at the rate prefill() charges, and each of this router's requests in flight
(its uncached prompt, until its first token) drains in the order sent, from its send:

    done       = max(t0, last first token seen) + prefill(Q - prefills done since t0)
    done       = max(done, sent_i) + prefill(p_i)  for each credit i in the order sent
    queue(now) = clip(done - now, 0, prefill(Q - done since t0 + sum p_i))

The bound is the queue as counted, undrained: a report stamped ahead of the router's clock
(skew) never counts more. Without the drain, a busy prompt's holder looked busy for up to a
heartbeat after its queue had emptied, and its followers went elsewhere (shared prompts at
32 workers: 0.808 of the tokens hit with neither rule, 0.825 with the first, 0.839 with both).

prefix_aware ranks by cost, lowest first. The overlap C saves prefill(C), so a worker holding
the prefix wins until its queue costs more than recomputing the prefix elsewhere: a hot prefix
then goes to a second worker, which caches it and reports it like any other block. A worker
whose load runs ahead of BALANCE times the mean pays that excess twice, so only a large enough
saving keeps sending it work. The bound is a ratio with no floor: when every load is small the
excess is small too and yields to any real saving, while a floor in absolute time lets a saving
of any size keep a worker at many times the mean. (A floor of one full prefill step, ~270 ms in
the bench, was never reached by chat sessions, whose loads are a tenth of it: multi_turn busy
imbalance 1.24-1.28 at 16-32 workers on seeds 1 and 3; without it 1.15-1.18.) least_loaded is the
same cost with C = 0; round_robin rotates. Ties break at random.

SPREAD: a hot prefix's holders that run ahead get a copy made. The saving above weighs one request
against the holder's load, as if the worker that computes the prefix again did so for that one
request; but the copy serves every later request of that prefix. So once every deepest holder
of the prompt is past the balance bound (load > BALANCE * mean load), a worker that holds less of
it is charged the prefill of what it lacks divided by the requests a copy would take: with L of
this router's requests sharing the deepest held block running on the h deepest holders
(prefix_live, counted from the decision to the request's end), a new copy would take about
u = L / (h + 1) of as many to come, and for u > 1

    cost      -= (1 - 1 / u) * prefill(C_max - C)       C_max: the deepest holders' overlap

(prefill at that worker's rates). A holder with a burst of a single system prompt running then
loses the next request to the next-best worker once its load exceeds that worker's by 1/u of one
prefill, not by a whole one: one prefill makes a second copy, and the copies share the load. A
prefix that is not hot (a chat session's own history: the turn before has ended, L = 0), or
whose holders are near the mean (the copy's prefill would be paid for a gap that closes by
itself: shared_prompts lost a point of hit rate and 16 ms of TTFT p90 at 4 workers without this
condition), is costed as before.

Host tier (issue 23): a worker may hold blocks of the prefix in host memory, which it copies back
to the device instead of computing them. With C counted over the device tier and C' >= C over
either tier (the chain may run on through host blocks), the worker's extra C' - C tokens save
their prefill less the copy:

    cost      -= (C' - C) * (per_token - copy)      copy = min(1 / Rc, per_token)

with Rc the copy rate the worker reports (kv_copy_tps, tokens per second), DEFAULT_KV_COPY_TPS
until it has. A host hit thus ranks between a device hit and a miss: it saves as much as a device
hit less the copy, and never less than nothing.

Fetch (issue 36): a worker that lacks part of a prefix another live worker holds may fetch those
blocks from the holder instead of computing them (gpu_worker/serving/kv_transfer.py; the hint goes
with the request, router/selection.py). With C_max the deepest device holders' overlap and the
source the least loaded of them, a worker that holds C < C_max of it (C' over both tiers) pays for
the blocks it lacks the cheaper of

    recompute  = (C_max - C') * per_token
    fetch      = blocks lacking * kv_block_bytes / kv_fetch_bps + kv_fetch_overhead_s

at its own figures. Where the fetch is cheaper the worker is sent a hint to fetch (the router
predicts, and the worker reports, the fetched tokens as cached) and its cost falls by recompute -
fetch; the fetch does not take the worker's compute from others. Only where both sides take
fetches (kv_block_bytes > 0 in their leases, and equal: one layout and dtype) and the source is
one of the ranked workers (live, not in a breaker's cooldown, of the request's model, serving its
adapter); the namespace needs no check, since the chain's hashes fold it in. Under SPREAD the copy
a worker makes is priced at that cheaper figure, not at its prefill.

The cost is evaluated for all of a model's workers at once over numpy arrays of each worker's
figures. A report rewrites its worker's row where the Redis sync applies it; credits, first
tokens and ends mark the row for the next decision to recompute. A decision thus recomputes only
the few workers this router itself touched since the last one, however many reports came in: at
1,000 workers it costs little more than at 32.
"""
from __future__ import annotations

import heapq
import operator
import random
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from pagoda.protos.redis_schema import Lease

BALANCE = 1.5                 # how far past the mean load a cache hit may keep a worker
# Each running sequence slows our O decode steps by 1/Rd; counted at a quarter, since time to first
# token is what routing is judged by (at 1 the cache hit rate fell 10% with no gain in balance).
DECODE_SHARE = 0.25
KV_KNEE = 0.8
KV_PENALTY_TOKENS = 4096      # at a full pool, as bad as this much queued prefill
# Speed assumed until a worker has measured its own (an older worker, or the first heartbeat).
DEFAULT_PREFILL_TPS, DEFAULT_DECODE_TPS, DEFAULT_STEP_S, DEFAULT_BATCH_TOKENS = 10_000.0, 2_000.0, 0.005, 2048
# Host -> device KV copy, tokens per second, until a worker reports its own: an 8B Llama's KV is
# 128 KiB a token, and pinned copies over PCIe 4/5 run at 25-50 GB/s: ~200k-400k tokens/s; the
# low end, 20x the default prefill rate.
DEFAULT_KV_COPY_TPS = 200_000.0
# A fetch from a peer, until the fetcher reports its own figures (it publishes a prior of its own
# from its first heartbeat, gpu_worker/serving/step_rates.py: these cover a lease without them).
DEFAULT_KV_FETCH_BPS, DEFAULT_KV_FETCH_OVERHEAD_S = 200e6, 0.02
DEFAULT_OUTPUT_TOKENS = 128
# How long after a request's end a report may still count it. A worker's report is built from
# stats taken after the step that finished the request, and a finish changes its running count,
# which sends a load event within one load interval: a report stamped after the end is trusted.
# (At 0.2 s the router took ended requests off reports that no longer counted them, saw busy
# workers as idle and piled sessions onto them: multi_turn at 32 workers, 0.934 of the oracle's
# hit rate and busy imbalance 1.23; at 0, 0.972 and 1.16.)
GONE_GRACE_S = 0.0
# A LoRA adapter not in a device slot is copied in (and another evicted) before the first step:
# about a prefill step's time for rank-16 adapters of an 8B model; the slot then serves later
# requests of that adapter too, so this is kept small against a prefix saving.
LORA_LOAD_S = 0.02
# Up to this many workers the cheapest few are picked in Python, past it by numpy's partition.
_SMALL = 64
INF = float("inf")


@dataclass
class Credit:
    prefill_tokens: int      # still to compute (0 once the first token is out)
    sent_at: float           # router wall clock, compared with the worker's report stamp
    prompt_tokens: int = 0   # prefill it was sent with
    first_at: float = float("inf")     # when its first token came (router clock)
    ended_at: float = float("inf")
    # Direct mode: the client streams from the worker, so this router sees neither its first
    # token nor its end; the first report that counts it takes it off the ledger altogether.
    direct: bool = False


@dataclass(eq=False)
class WorkerState:
    lease: Lease
    seq: int | None = None                  # last event batch applied in order; None = must resync
    next_resync: float = 0.0
    credits: dict[str, Credit] = field(default_factory=dict)   # request id -> in-flight credit
    credit_prefill: int = 0                 # sum of the credits' prefill tokens
    # Requests a report already counts (their credit was dropped), and requests that ended, kept
    # until a report stamped after their end: a report stamped between sending and the end still
    # counts one as running (and before its first token, its prefill as queued), so it is taken off.
    counted: dict[str, Credit] = field(default_factory=dict)
    gone: dict[str, Credit] = field(default_factory=dict)
    # The counted ones whose first token came after the report: kept apart so that figures()
    # looks at these few, not at every request the worker runs.
    prefilled: dict[str, Credit] = field(default_factory=dict)
    # This router's requests running here, by the deepest cached block they share (hot prefixes).
    prefix_live: dict[bytes, int] = field(default_factory=dict)
    _prefix_of: dict[str, bytes] = field(default_factory=dict, repr=False)
    _memo: tuple[float, float, float, float, float] | None = field(default=None, repr=False)   # figures()
    _table: Figures | None = field(default=None, repr=False)   # the scorer's arrays this worker is a row of

    def _changed(self) -> None:
        self._memo = None
        if self._table is not None:
            self._table.dirty.add(self)

    @property
    def id(self) -> str:
        return self.lease.worker_id

    @property
    def name(self) -> str:
        """Stable across restarts (for metric labels); the id changes with every process."""
        return self.lease.name or self.lease.worker_id

    def credit(self, request_id: str, prefill_tokens: int, now: float, prefix: bytes | None = None,
               direct: bool = False) -> None:
        """`prefix`: the deepest cached block the request shares (Choice.prefix), counted in
        prefix_live until the request ends here or fails (`direct`: until a report counts it)."""
        self.uncredit(request_id)
        self.credits[request_id] = Credit(prefill_tokens, now, prefill_tokens, direct=direct)
        self.credit_prefill += prefill_tokens
        if prefix is not None:
            self._prefix_of[request_id] = prefix
            self.prefix_live[prefix] = self.prefix_live.get(prefix, 0) + 1
        self._changed()

    def _release_prefix(self, request_id: str) -> None:
        key = self._prefix_of.pop(request_id, None)
        if key is not None:
            left = self.prefix_live[key] - 1
            if left:
                self.prefix_live[key] = left
            else:
                del self.prefix_live[key]

    def prefill_done(self, request_id: str, now: float = 0.0) -> None:
        """First token out: its prefill no longer waits, but it decodes until it finishes."""
        c = self.credits.get(request_id)
        if c:
            self.credit_prefill -= c.prefill_tokens
        else:
            c = self.counted.get(request_id)
            if c and self.lease.ts < now:
                self.prefilled[request_id] = c
        if c:
            c.prefill_tokens, c.first_at = 0, now
            self._changed()

    def uncredit(self, request_id: str) -> None:
        """The request never ran here (it failed before its first token)."""
        c = self.credits.pop(request_id, None)
        if c:
            self.credit_prefill -= c.prefill_tokens
            self._changed()
        self.counted.pop(request_id, None)
        self.prefilled.pop(request_id, None)
        self._release_prefix(request_id)

    def finish(self, request_id: str, now: float) -> None:
        """The request's stream ended: it no longer loads the worker, reported or not."""
        c = self.credits.pop(request_id, None)
        if c:
            self.credit_prefill -= c.prefill_tokens
        else:
            c = self.counted.pop(request_id, None)
            self.prefilled.pop(request_id, None)
        if c:
            c.ended_at = now
            self.gone[request_id] = c
        self._release_prefix(request_id)
        self._changed()

    def on_heartbeat(self, lease: Lease) -> None:
        """A report stamped after a request was sent already counts it: drop its credit; one
        stamped after it ended no longer counts it. Reports come by two paths (lease key, load
        stream); an older one never replaces a newer."""
        if lease.ts < self.lease.ts:
            return
        self.lease = lease
        self.prefilled = {k: c for k, c in self.prefilled.items() if lease.ts < c.first_at}
        for k in [k for k, c in self.credits.items() if c.sent_at < lease.ts]:
            c = self.credits.pop(k)
            if c.direct:            # the report carries it from here; no end will come to take it off
                self._release_prefix(k)
                continue
            self.counted[k] = c
            if lease.ts < c.first_at < INF:
                self.prefilled[k] = c
        self.credit_prefill = sum(c.prefill_tokens for c in self.credits.values())
        # A report stamped after the end no longer counts it (GONE_GRACE_S).
        self.gone = {k: c for k, c in self.gone.items() if c.ended_at + GONE_GRACE_S >= lease.ts}
        # Written through at once: reports come from the Redis sync, and a lease poll renews every
        # worker together, which left to the next decision made that one refresh them all.
        self._memo = None
        if self._table is not None:
            self._table.write(self)

    def rates(self) -> tuple[float, float, float, int]:
        """(Rp, Rd, s, B) as reported, or the defaults where the worker has not measured them."""
        ls = self.lease
        return (ls.prefill_tps or DEFAULT_PREFILL_TPS, ls.decode_tps or DEFAULT_DECODE_TPS,
                ls.step_s or DEFAULT_STEP_S, ls.max_batched_tokens or DEFAULT_BATCH_TOKENS)

    def figures(self) -> tuple[float, float, float, float, float]:
        """(drain_at, queued_s, kv_s, per_output, per_token): the time its queued prefill is done
        (this router's clock), that queue's seconds as counted, undrained; the KV penalty in
        seconds; the decode term per output token; seconds per prompt token of prefill. At time t,
        load = clip(drain_at - t, 0, queued_s) + kv_s + O * per_output."""
        if self._memo is not None:
            return self._memo
        rp, rd, s, b = self.rates()
        ls = self.lease
        ended = ended_prefill = 0
        since = ls.ts           # what the report queues has drained since then, as far as we know
        for c in self.gone.values():
            if c.sent_at < ls.ts:              # the report counts it
                ended += 1
                if ls.ts < c.first_at:
                    ended_prefill += c.prompt_tokens
                    since = max(since, c.first_at)
        # A report taken before a request's first token counts its prefill as queued; once the
        # first token is out that prefill is done, though no load event says so (only running
        # and waiting send one) until the next heartbeat.
        for c in self.prefilled.values():
            ended_prefill += c.prompt_tokens
            since = max(since, c.first_at)
        decoding = max(0, ls.running + ls.waiting + len(self.credits) - ended)
        per_token = 1.0 / rp + (s + decoding / rd) / b
        queued = max(0, ls.queued_prefill_tokens - ended_prefill)
        # The queue drains while the router waits for the next report: what the report queued
        # from its stamp (or from the last first token seen since, which is when that much was
        # surely done), then each request in flight from its send, in the order sent.
        drain_at = since + queued * per_token
        for c in self.credits.values():
            if c.prefill_tokens:
                drain_at = max(drain_at, c.sent_at) + c.prefill_tokens * per_token
        kv = 0.0
        if ls.kv_usage > KV_KNEE:
            kv = KV_PENALTY_TOKENS * per_token * ((ls.kv_usage - KV_KNEE) / (1 - KV_KNEE)) ** 2
        self._memo = (drain_at, (queued + self.credit_prefill) * per_token, kv, DECODE_SHARE * decoding / rd,
                      per_token)
        return self._memo

    def load_cost(self, output_tokens: float = DEFAULT_OUTPUT_TOKENS, now: float | None = None) -> float:
        """The load term at `now` (None: as counted, before any of the queue drains)."""
        drain_at, queued_s, kv, per_output, _ = self.figures()
        queue = queued_s if now is None else min(max(drain_at - now, 0.0), queued_s)
        return queue + kv + output_tokens * per_output


def fetch_figures(lease: Lease) -> tuple[float, float, float]:
    """(block bytes, seconds to fetch a block, seconds a fetch call costs besides) as the worker
    reports them; an infinite call where it takes no fetches."""
    if not lease.kv_block_bytes:
        return 0.0, 0.0, INF
    return (float(lease.kv_block_bytes), lease.kv_block_bytes / (lease.kv_fetch_bps or DEFAULT_KV_FETCH_BPS),
            lease.kv_fetch_overhead_s or DEFAULT_KV_FETCH_OVERHEAD_S)


class Figures:
    """One model's workers as arrays of figures(). A report writes its worker's row when it is
    applied (WorkerState.on_heartbeat); the router's own changes (credits, first tokens, ends) mark
    the row dirty and the next decision refreshes those few."""

    def __init__(self, workers: list[WorkerState], register: bool = True):
        """register: its workers write their reports here (one table per worker: the model's)."""
        self.workers = list(workers)
        self.position = {w.id: i for i, w in enumerate(workers)}
        self.dirty: set[WorkerState] = set()
        cols = np.array([w.figures() for w in workers], dtype=np.float64).reshape(len(workers), 5)
        (self.drain_at, self.queued_s, self.kv, self.per_output,
         self.per_token) = (cols[:, i].copy() for i in range(5))
        # Fetch figures (from the lease alone): block bytes, seconds a block, seconds a call.
        cols = np.array([fetch_figures(w.lease) for w in workers], dtype=np.float64).reshape(len(workers), 3)
        self.block_bytes, self.fetch_block_s, self.fetch_call_s = (cols[:, i].copy() for i in range(3))
        if register:
            for w in workers:
                w._table = self

    def matches(self, workers: list[WorkerState]) -> bool:
        return len(workers) == len(self.workers) and all(map(operator.is_, workers, self.workers))

    def write(self, w: WorkerState) -> None:
        i = self.position.get(w.id)
        if i is not None and self.workers[i] is w:
            (self.drain_at[i], self.queued_s[i], self.kv[i], self.per_output[i],
             self.per_token[i]) = w.figures()
            self.block_bytes[i], self.fetch_block_s[i], self.fetch_call_s[i] = fetch_figures(w.lease)
        self.dirty.discard(w)

    def refresh(self) -> None:
        for w in list(self.dirty):
            self.write(w)


class FigureTables:
    """Each model's Figures, kept between decisions (a cost policy holds one)."""

    def __init__(self) -> None:
        self._by_model: dict[str, Figures] = {}

    def get(self, model: str, workers: list[WorkerState], adapter: str = "") -> Figures:
        """A LoRA adapter's workers are a subset of the model's: their figures are read afresh
        (memoised per worker), leaving the model's table to the model's workers."""
        if adapter:
            return Figures(workers, register=False)
        f = self._by_model.get(model)
        if f is None or not f.matches(workers):
            f = self._by_model[model] = Figures(workers)
        elif f.dirty:
            f.refresh()
        return f


@dataclass(frozen=True)
class Fetch:
    """A fetch hint: the chosen worker pulls the prompt's leading blocks from `source` first."""
    source: WorkerState
    num_blocks: int          # the prompt's leading blocks the worker holds once fetched (KVFetchHint.num_blocks)
    own_tokens: int          # what it held of the prompt itself (the prediction before the fetch)


@dataclass
class Choice:
    worker: WorkerState
    cost: float
    cached_tokens: int       # predicted prefix-cache hit on this worker (fetched blocks included)
    prefix: bytes | None = None   # the deepest block any worker holds of the prompt (prefix_live's key)
    fetch: Fetch | None = None    # where it fetches the prefix it lacks from, when that beats computing it


def prefix_key(hashes: Sequence[bytes], overlap: dict[str, int], prompt_len: int, block: int) -> bytes | None:
    """The hash of the deepest prompt block any worker holds that can hit (the last prompt token
    is always recomputed): the key a hot prefix's requests are counted by."""
    k = min(max(overlap.values(), default=0), max(prompt_len - 1, 0) // block, len(hashes))
    return hashes[k - 1] if k else None


def load_and_cost(f: Figures, prompt_len: int, output_tokens: float, now: float, balance: float
                  ) -> tuple[np.ndarray, np.ndarray, float]:
    """(load, cost, bound) per worker at `now`: the load term, load + excess + prefill(P) before
    any cache saving, and the balance bound (`balance` times the mean load)."""
    # In place where it can be: at 32 workers each numpy call costs more than its arithmetic.
    load = f.drain_at - now
    np.maximum(load, 0.0, out=load)
    np.minimum(load, f.queued_s, out=load)
    load += f.kv
    load += output_tokens * f.per_output
    mean = float(load.sum()) / len(load)        # load.mean(), without its Python-level wrapper
    bound = balance * mean
    excess = load - bound
    np.maximum(excess, 0.0, out=excess)
    excess += load
    excess += prompt_len * f.per_token
    return load, excess, bound


def device_hits(f: Figures, overlap: dict[str, int], block: int, cap: int) -> dict[int, int]:
    """Row -> the prompt tokens that worker holds in its device cache (at most `cap`), for the
    workers that hold any."""
    cached: dict[int, int] = {}
    for wid, blocks in overlap.items():
        i = f.position.get(wid)
        if i is not None:
            cached[i] = min(blocks * block, cap)
    return cached


def host_hits(f: Figures, cached: dict[int, int], tiered: dict[str, int], block: int, cap: int) -> dict[int, int]:
    """What each worker holds of the prefix past its device hit in host memory (the host tier in
    the module docstring): `cached` grows by it in place; -> row -> those extra tokens."""
    extras: dict[int, int] = {}
    for wid, blocks in tiered.items():
        i = f.position.get(wid)
        if i is None:
            continue
        device = cached.get(i, 0)
        extra = min(blocks * block, cap) - device
        if extra <= 0:
            continue
        cached[i] = device + extra
        extras[i] = extra
    return extras


@dataclass
class FetchPlan:
    """price_fetch's answer: the source, the prompt's blocks it holds, and per worker whether
    fetching wins and what it held itself (Fetch objects are made for the chosen few alone)."""
    source: WorkerState
    num_blocks: int
    wins: np.ndarray
    have: np.ndarray

    def fetch(self, i: int) -> Fetch | None:
        return Fetch(self.source, self.num_blocks, int(self.have[i])) if self.wins[i] else None


def price_fetch(f: Figures, cost: np.ndarray, device: dict[int, int], cached: dict[int, int], load: np.ndarray,
                block: int) -> tuple[np.ndarray | None, FetchPlan | None]:
    """Fetch against recompute (module docstring): each worker's cost falls by what fetching the
    prefix it lacks saves over computing it (in place). `device`: row -> device overlap (sources);
    `cached`: row -> overlap over both tiers (what each worker lacks). -> (seconds each worker pays
    for the deepest prefix it lacks, the cheaper way; the plan), or (None, None) when no fetch can be."""
    deepest = max(device.values())
    holders = [i for i, c in device.items() if c == deepest and f.fetch_call_s[i] < INF]
    if not holders or deepest < block:
        return None, None
    src = min(holders, key=load.__getitem__)          # the least loaded of the deepest holders
    have = np.zeros(len(cost))
    for i, c in cached.items():
        have[i] = c
    np.minimum(have, deepest, out=have)
    recompute = deepest - have
    recompute *= f.per_token
    # Blocks lacking at the worker's seconds a block, plus its seconds a call (infinite where it takes
    # no fetches; the holders lack none and computing nothing is cheaper anyway).
    fetch = (deepest // block - have // block) * f.fetch_block_s
    fetch += f.fetch_call_s
    fetch[f.block_bytes != f.block_bytes[src]] = INF   # another layout or dtype: the fetch would fail
    price = np.minimum(recompute, fetch)
    cost -= recompute
    cost += price
    return price, FetchPlan(f.workers[src], deepest // block, fetch < recompute, have)


def add_lora_load(cost: np.ndarray, workers: list[WorkerState], adapter: str) -> None:
    """A worker without the LoRA `adapter` in a device slot pays LORA_LOAD_S (in place)."""
    for i, w in enumerate(workers):
        if adapter not in w.lease.lora_resident:
            cost[i] += LORA_LOAD_S


def cheapest(workers: list[WorkerState], cost: np.ndarray, cached: dict[int, int], prefix: bytes | None,
             limit: int | None, rng: random.Random, plan: FetchPlan | None = None) -> list[Choice]:
    """The `limit` cheapest workers (all, when None) best first; ties break at random. `plan`: the
    workers sent with a fetch hint (their predicted hit: the fetched prefix)."""
    n = len(workers)
    k = n if limit is None else min(limit, n)
    rand = rng.random
    if n <= _SMALL:
        costs = cost.tolist()
        kth = heapq.nsmallest(k, costs)[-1]
        tied = [(c, rand(), i) for i, c in enumerate(costs) if c <= kth]
    else:           # the k cheapest, and everything tied with the k-th, go to the random tie-break
        kth = np.partition(cost, k - 1)[k - 1]
        pick = np.flatnonzero(cost <= kth)
        tied = [(c, rand(), i) for c, i in zip(cost[pick].tolist(), pick.tolist())]
    if plan is not None:
        return [Choice(workers[i], c, cached.get(i, 0), prefix) if (x := plan.fetch(i)) is None else
                Choice(workers[i], c, max(x.num_blocks * workers[i].lease.block_size, x.own_tokens), prefix, x)
                for c, _, i in sorted(tied)[:k]]
    return [Choice(workers[i], c, cached.get(i, 0), prefix) for c, _, i in sorted(tied)[:k]]
