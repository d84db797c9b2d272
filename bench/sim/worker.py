"""A simulated GPU worker: continuous batching over a paged KV pool with a prefix cache.

It keeps the engine's accounting, not its arithmetic: fixed-size blocks named by the
same chained hashes the real engine uses, ref counts, cached blocks that stay reusable
after their request ends and are evicted least-recently-used first (a request's blocks
are released tail first, as the engine does), and a per-step token budget with chunked
prefill. A step's duration comes from `CostModel`. It exposes what the real publisher
reads from an AsyncLLM (stats, take_kv_events, cached_block_hashes, block_size) so the
publisher's own code can publish for it.

Simplification: a request reserves blocks for its whole prompt and output on admission,
so there is no preemption; admission waits instead.

KV fetch (a router's fetch hint, issue 36): the worker advertises its block bytes and a fetch
rate from `CostModel` in its lease; the simulation holds a hinted request back for the fetch's
time (off the GPU: the worker's steps go on meanwhile), then `import_blocks` names the fetched
blocks in its prefix cache, where admission finds them as hits.
"""
from __future__ import annotations

import math
from collections import OrderedDict, deque
from dataclasses import dataclass
from types import SimpleNamespace

from pagoda.protos.block_hash import block_hashes

from .workloads import SimRequest


@dataclass
class CostModel:
    """Step time of a GPU running one batch; defaults sketch an 8B model on one H100-class GPU."""
    base_s: float = 0.006             # fixed cost per step (weights read, launch)
    prefill_token_s: float = 60e-6    # per prompt token computed (about 16k tokens/s)
    decode_seq_s: float = 0.25e-3     # per running sequence decoding one token
    # KV fetch from a peer: an 8B Llama's KV in bf16 is 128 KiB a token (a 2 MiB block of 16); over
    # a 100 Gb/s link ~10 GB/s, and 5 ms a call (setup, the engine's commands before and after).
    kv_bytes_per_token: float = 128 * 1024
    fetch_bps: float = 10e9
    fetch_call_s: float = 0.005

    def fetch_time(self, blocks: int, block_size: int) -> float:
        return self.fetch_call_s + blocks * block_size * self.kv_bytes_per_token / self.fetch_bps

    def step_time(self, prefill_tokens: int, decode_seqs: int) -> float:
        return self.base_s + self.prefill_token_s * prefill_tokens + self.decode_seq_s * decode_seqs

    def request_cost(self, prompt: float, output: float, batch: int = 32) -> float:
        """GPU seconds one request takes when nothing is cached, at a typical batch size."""
        return prompt * self.prefill_token_s + output * (self.base_s / batch + self.decode_seq_s)


@dataclass
class SimStats:
    """The fields of pagoda.gpu_worker.core.outputs.EngineStats a publisher reads (that module imports torch)."""
    running: int
    waiting: int
    queued_prefill_tokens: int
    num_blocks: int
    free_blocks: int
    kv_usage: float
    prefix_cache_queries: int
    prefix_cache_hits: int
    preemptions: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    num_steps: int = 0
    step_seconds: float = 0.0
    max_num_batched_tokens: int = 0
    host_blocks: int = 0                # no host tier
    kv_copied_blocks: int = 0
    kv_copy_seconds: float = 0.0


class SimWorker:
    def __init__(self, num_blocks: int, block_size: int, root: bytes, cost: CostModel,
                 max_num_seqs: int = 256, max_batched_tokens: int = 4096):
        self.num_blocks, self.block_size, self.root, self.cost = num_blocks, block_size, root, cost
        self.max_num_seqs, self.max_batched_tokens = max_num_seqs, max_batched_tokens
        self.free = num_blocks                 # blocks holding nothing reusable
        self.lru: OrderedDict[bytes, None] = OrderedDict()   # cached, ref count 0, oldest first
        self.ref: dict[bytes, int] = {}        # cached and in use
        self.waiting: deque[SimRequest] = deque()
        self.running: list[SimRequest] = []
        self.plan: list[tuple[SimRequest, int]] = []   # this step's prefill chunks
        self.busy = False
        self.step_end = 0.0                    # when the step under way ends (simulated time)
        self._events: list[tuple[str, bytes]] = []
        self.queries = self.hits = self.prompt_tokens = self.generation_tokens = self.evictions = 0
        self.num_steps, self.step_seconds = 0, 0.0
        # What the publisher reads of a real worker's KVFetcher: block bytes and the fetch rate.
        self.kv_transfer = SimpleNamespace(block_bytes=int(block_size * cost.kv_bytes_per_token),
                                           rate=SimpleNamespace(bps=cost.fetch_bps, overhead_s=cost.fetch_call_s))

    # ---- what routers may know -------------------------------------------------------
    def cached_prefix_tokens(self, req: SimRequest) -> int:
        """Prompt tokens of `req` this worker would find cached right now (the oracle's view)."""
        return self._hit_blocks(req) * self.block_size

    def queued_prefill_s(self, now: float, decoding: int) -> float:
        """Exact seconds until every prompt token queued now is computed (the oracle's view): the
        step under way first, then the rest in full steps of the cost model."""
        queued = sum(len(r.prompt) - r.computed for r in self.running) + sum(len(r.prompt) for r in self.waiting)
        if not queued:
            return 0.0
        c = self.cost
        per_token = c.prefill_token_s + (c.base_s + decoding * c.decode_seq_s) / self.max_batched_tokens
        if not self.busy:
            return queued * per_token
        planned = sum(n for _, n in self.plan)
        return max(self.step_end - now, 0.0) + (queued - planned) * per_token

    def stats(self) -> SimStats:
        free = self.free + len(self.lru)
        queued = sum(len(r.prompt) - r.computed for r in self.running) + sum(len(r.prompt) for r in self.waiting)
        return SimStats(len(self.running), len(self.waiting), queued, self.num_blocks, free,
                        1.0 - free / self.num_blocks, self.queries, self.hits, 0,
                        self.prompt_tokens, self.generation_tokens, self.num_steps, self.step_seconds,
                        self.max_batched_tokens)

    def take_kv_events(self) -> list[tuple[str, bytes]]:
        events, self._events = self._events, []
        return events

    def cached_block_hashes(self) -> list[bytes]:
        return list(self.ref) + list(self.lru)

    # The rest of what a publisher reads (serving/engine_client.py's EngineReport): no host
    # tier, no adapters.
    def take_host_kv_events(self) -> list[tuple[str, bytes]]:
        return []

    def cached_hashes_by_tier(self) -> tuple[list[bytes], list[bytes]]:
        return self.cached_block_hashes(), []

    def lora_adapters(self) -> list[str]:
        return []

    def lora_resident(self) -> list[str]:
        return []

    max_loras = 0           # no LoRA: never sent an adapter load

    def lora_paths(self) -> dict[str, str]:
        return {}

    # ---- engine loop ------------------------------------------------------------------
    def add(self, req: SimRequest) -> None:
        self.waiting.append(req)

    def plan_step(self) -> float:
        """Choose this step's work (admitting what fits) and return its duration."""
        budget = self.max_batched_tokens
        decode = sum(1 for r in self.running if r.computed >= len(r.prompt))
        budget -= decode
        self.plan = []
        for r in self.running:
            if budget <= 0:
                break
            if r.computed < len(r.prompt):
                n = min(len(r.prompt) - r.computed, budget)
                self.plan.append((r, n))
                budget -= n
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            r = self.waiting[0]
            if not self._admit(r):
                break   # first come, first served: no overtaking a request that does not fit
            self.waiting.popleft()
            self.running.append(r)
            n = min(len(r.prompt) - r.computed, budget)
            self.plan.append((r, n))
            budget -= n
        prefill = sum(n for _, n in self.plan)
        self.prompt_tokens += prefill
        if not (prefill or decode):
            return 0.0
        dt = self.cost.step_time(prefill, decode)
        self.num_steps += 1
        self.step_seconds += dt
        return dt

    def end_step(self, now: float) -> tuple[list[SimRequest], list[SimRequest]]:
        """Apply the planned step; returns (requests that got their first token, requests finished)."""
        prefilled = {id(r) for r, _ in self.plan}
        first, done = [], []
        for r in self.running:
            if id(r) in prefilled:
                continue
            if r.computed >= len(r.prompt):
                r.generated += 1
                self.generation_tokens += 1
        for r, n in self.plan:
            r.computed += n
            if r.computed == len(r.prompt):
                r.generated, r.t_first = 1, now
                self.generation_tokens += 1
                first.append(r)
                self._store(r, r.hashes, r.hit // self.block_size)
        for r in self.running:
            if r.computed >= len(r.prompt) and r.generated >= len(r.output):
                r.t_finish = now
                done.append(r)
        for r in done:
            self._finish(r)
        self.plan = []
        return first, done

    def holds(self, hashes: list[bytes]) -> int:
        """Leading blocks of `hashes` cached here (in use or not)."""
        k = 0
        for h in hashes:
            if h not in self.ref and h not in self.lru:
                break
            k += 1
        return k

    def import_blocks(self, hashes: list[bytes]) -> int:
        """Fetched blocks, in chain order, named in the prefix cache (most recently used); a free
        block each, or the least recently used cached one. -> blocks imported."""
        n = 0
        for h in hashes:
            if h in self.ref or h in self.lru:
                continue
            if self.free:
                self.free -= 1
            elif self.lru:
                old, _ = self.lru.popitem(last=False)
                self._events.append(("removed", old))
                self.evictions += 1
            else:
                break
            self.lru[h] = None
            self._events.append(("stored", h))
            n += 1
        return n

    # ---- block accounting -------------------------------------------------------------
    def _hit_blocks(self, req: SimRequest) -> int:
        limit = (len(req.prompt) - 1) // self.block_size   # the last prompt token is always recomputed
        k = 0
        for h in req.hashes[:limit]:
            if h not in self.ref and h not in self.lru:
                break
            k += 1
        return k

    def _admit(self, r: SimRequest) -> bool:
        k = self._hit_blocks(r)
        need = math.ceil((len(r.prompt) + len(r.output)) / self.block_size) - k
        parked = sum(1 for h in r.hashes[:k] if h in self.lru)
        if self.free + len(self.lru) - parked < need:
            return False
        for h in r.hashes[:k]:
            if h in self.lru:
                del self.lru[h]
                self.ref[h] = 1
            else:
                self.ref[h] += 1
        taken = min(need, self.free)
        self.free -= taken
        for _ in range(need - taken):
            h, _ = self.lru.popitem(last=False)
            self._events.append(("removed", h))
            self.evictions += 1
        r.owned, r.anon = list(r.hashes[:k]), need
        r.hit = r.computed = k * self.block_size
        self.queries += len(r.prompt)
        self.hits += r.hit
        return True

    def _store(self, r: SimRequest, hashes: list[bytes], start: int) -> None:
        """Blocks start.. of `hashes` are now computed: they become cached unless another
        request already cached the same content (then ours stays anonymous)."""
        for h in hashes[start:]:
            if h in self.ref or h in self.lru:
                continue
            self.ref[h] = 1
            r.anon -= 1
            r.owned.append(h)
            self._events.append(("stored", h))

    def _finish(self, r: SimRequest) -> None:
        # The last sampled token is never fed back, so its KV is never computed.
        full = block_hashes(r.prompt + r.output[:-1], self.block_size, self.root, start=r.hashes)
        self._store(r, full, len(r.hashes))
        self.running.remove(r)
        for h in reversed(r.owned):   # tail first: the tail is evicted before the shared head
            self.ref[h] -= 1
            if self.ref[h] == 0:
                del self.ref[h]
                self.lru[h] = None
        self.free += r.anon
        r.owned, r.anon = [], 0
