"""Prefill/decode disaggregation (issue 36). While a model has live workers of both the prefill
and the decode role (their --kv-role, in their leases), a request's prompt is computed on a
prefill worker, and its tokens on a decode worker that first pulls the prompt's KV blocks from
the prefill worker (GenerateRequest.kv_fetch, gpu_worker/serving/kv_transfer.py). Long prefills
then never share a step with the decode streams, which is what keeps their inter-token latency
flat.

The prefill leg is the prompt alone, as a request for one greedy token that nobody sees: when it
finishes, the prefill worker's prefix cache keeps the prompt's full blocks, named by the hashes
the decode worker computes too (same model, adapter and tenant-scoped salt: the leg carries the
caller's salt and tenant). Its worker is ranked by the router's policy among the prefill workers,
and credited and claimed as any. The decode leg is the caller's request, unchanged but for the
fetch hint, relayed by the proxy over the decode workers the policy ranks (with its usual
failover among them). So the client sees one stream, and every token in it is sampled by the
decode worker with the caller's own sampling parameters and seed over the same KV: the tokens
are those a colocated worker gives (greedy: equal).

No failure costs the request its stream: a prefill leg that fails (no prefill worker answers in
time, one dies) is counted and the decode leg goes anyway, without a hint; a fetch that fails
or comes up short makes the decode worker recompute what it lacks (counted when its usage shows
it). Not disaggregated, and served whole by a decode worker: prompts without a full block to
move, and requests for prompt logprobs (computed over the whole prompt, so never from a cache).
Direct mode (Route: the client streams from the worker itself) is not disaggregated: it ranks
every live worker, as before.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import time

import grpc

from pagoda.protos.pagoda.v1 import pagoda_pb2 as pb
from pagoda.router.breaker import CircuitBreaker
from pagoda.router.channels import WorkerChannels
from pagoda.router.errors import CLIENT_ERRORS
from pagoda.router.metrics import RouterMetrics
from pagoda.router.prepare import Prepared
from pagoda.router.scoring import Choice, WorkerState
from pagoda.router.selection import Selector

log = logging.getLogger(__name__)


@dataclasses.dataclass
class Pools:
    prefill: list[WorkerState]
    decode: list[WorkerState]


def pools(workers: list[WorkerState]) -> Pools | None:
    """The prefill and decode pools of a model's live workers; None unless both have one."""
    prefill = [w for w in workers if w.lease.kv_role == "prefill"]
    decode = [w for w in workers if w.lease.kv_role == "decode"]
    return Pools(prefill, decode) if prefill and decode else None


def fetchable_blocks(p: Prepared) -> int:
    """The prompt's blocks a decode worker can take from a peer (the last prompt token is
    always computed, so a block that ends with it is not among them)."""
    block = p.workers[0].lease.block_size
    return min(len(p.hashes), max(p.prompt_len - 1, 0) // block)


def wants_disaggregation(p: Prepared) -> bool:
    return fetchable_blocks(p) > 0 and not p.upstream.sampling.prompt_logprobs


class Disaggregation:
    def __init__(self, channels: WorkerChannels, selector: Selector, breaker: CircuitBreaker,
                 metrics: RouterMetrics, timeout: float = 60.0):
        self.channels, self.selector, self.breaker, self.metrics = channels, selector, breaker, metrics
        self.timeout = timeout          # for the whole prefill leg: the proxy's first-token deadline
        self._pools: dict[str, tuple[list[WorkerState], Pools | None]] = {}

    def pools(self, model: str, workers: list[WorkerState]) -> Pools | None:
        """pools(workers), found again only when the list is another: the cluster rebuilds a
        model's list when its membership changes, so a request costs no scan of every worker."""
        cached = self._pools.get(model)
        if cached is None or cached[0] is not workers:
            cached = self._pools[model] = (workers, pools(workers))
        return cached[1]

    async def prefill(self, p: Prepared, prefill: list[WorkerState], decode: list[Choice],
                      timeout: float | None) -> tuple[Prepared, list[Choice]]:
        """Run the prefill leg; -> the decode leg's request (with its fetch hint when a prefill
        worker holds the prompt now) and its ranked decode workers (each predicted to hold the
        fetched blocks, so it is credited with only the rest of the prefill; this hint replaces any
        fetch the policy priced for it)."""
        blocks = fetchable_blocks(p)
        source = await self._prefill_leg(p, prefill, min(self.timeout, timeout or self.timeout))
        if source is None:
            self.metrics.pd_fallbacks.labels("prefill_failed").inc()
            return p, decode
        self.metrics.pd_requests.inc()
        upstream = pb.GenerateRequest()
        upstream.CopyFrom(p.upstream)
        upstream.kv_fetch.CopyFrom(pb.KVFetchHint(source_address=source.lease.address, num_blocks=blocks))
        tokens = blocks * source.lease.block_size
        return (dataclasses.replace(p, upstream=upstream),
                [dataclasses.replace(c, cached_tokens=max(c.cached_tokens, tokens), fetch=None) for c in decode])

    def observe_decode(self, p: Prepared, usage: pb.Usage) -> None:
        """The decode leg's usage: fewer cached prompt tokens than the hint promised means the
        fetch failed or came up short, and the decode worker recomputed the rest."""
        if p.upstream.HasField("kv_fetch") and \
                usage.cached_prompt_tokens < fetchable_blocks(p) * p.workers[0].lease.block_size:
            self.metrics.pd_fallbacks.labels("recomputed").inc()

    async def _prefill_leg(self, p: Prepared, workers: list[WorkerState], timeout: float) -> WorkerState | None:
        """The prefill worker that computed the prompt (the best ranked that does within
        `timeout`), or None."""
        req = pb.GenerateRequest()
        req.CopyFrom(p.upstream)
        req.ClearField("kv_fetch")
        req.sampling.Clear()
        req.sampling.max_tokens, req.sampling.temperature = 1, 0.0
        deadline = time.monotonic() + timeout
        ranked = self.selector.rank(p.model, workers, p.prompt_len, p.hashes, max_output=1, adapter=p.upstream.adapter)
        for choice in ranked:
            w, left = choice.worker, deadline - time.monotonic()
            if left <= 0:
                break
            self.breaker.allow(w.id)
            self.selector.claim(choice, p.key, p.prompt_len, p.hashes)
            call = self.channels.generate(w.lease.address)(req, timeout=left, metadata=p.metadata)
            try:
                async for _ in call:
                    pass
            except grpc.aio.AioRpcError as e:
                w.uncredit(p.key)
                if e.code() not in CLIENT_ERRORS:       # the decode leg answers the caller's mistakes
                    self.breaker.failure(w.id)
                self.metrics.attempts.labels(w.name, "prefill_failed").inc()
                log.warning("prefill worker %s failed (%s: %s); trying the next", w.id, e.code().name, e.details())
                continue
            except asyncio.CancelledError:
                call.cancel()
                w.uncredit(p.key)
                raise
            self.breaker.success(w.id)
            w.finish(p.key, time.time())
            self.metrics.attempts.labels(w.name, "prefill_ok").inc()
            return w
        return None
