"""A request's way through the router, stage by stage: prepare (router/prepare.py), select
(router/selection.py), proxy (router/proxy.py). Both fronts, gRPC (router/grpc_front.py) and
OpenAI HTTP (router/openai/), call this one path, so neither can drift from the other."""
from __future__ import annotations

import time
from contextlib import aclosing
from typing import AsyncGenerator

import grpc

from pagoda.protos.limits import Limits
from pagoda.protos.pagoda.v1 import pagoda_pb2 as pb
from pagoda.router.breaker import CircuitBreaker
from pagoda.router.channels import WorkerChannels
from pagoda.router.cluster import Cluster
from pagoda.router.disagg import Disaggregation, Pools, wants_disaggregation
from pagoda.router.errors import RouterError
from pagoda.router.metrics import RouterMetrics
from pagoda.router.prepare import Pin, Prepared, Preparer
from pagoda.router.proxy import Proxy
from pagoda.router.selection import Scorer, Selector
from pagoda.runtime.security import GrantSigner, Identity, KeyRing

_decode = pb.GenerateResponse.FromString


class Pipeline:
    def __init__(self, cluster: Cluster, scorer: Scorer, metrics: RouterMetrics, channels: WorkerChannels,
                 max_attempts: int = 3, limits: Limits = Limits(), first_token_timeout: float = 60.0,
                 keyring: KeyRing | None = None, signer: GrantSigner | None = None):
        self.cluster, self.metrics, self.channels, self.keyring = cluster, metrics, channels, keyring
        self.signer = signer                # direct mode's grants, keyed as the router's key to workers
        self.breaker = CircuitBreaker()
        self.prepare = Preparer(cluster, channels, self.breaker, limits)
        self.select = Selector(scorer, self.breaker, max_attempts)
        self.disagg = Disaggregation(channels, self.select, self.breaker, metrics, first_token_timeout)
        self.proxy = Proxy(channels, self.select, self.breaker, metrics, first_token_timeout,
                           on_usage=self.disagg.observe_decode)
        cluster.on_worker_gone = self.forget_worker

    async def open(self, request: pb.GenerateRequest, timeout: float | None,
                   ident: Identity | None = None) -> AsyncGenerator[bytes, None]:
        """Prepare and rank one request for caller `ident`, then -> the proxy's stream of the
        chosen worker's responses, as the bytes it sent (not started: the caller iterates it, and
        closes it to end the upstream call). A refusal here, or a failure later, is a RouterError."""
        p, ranked, split = await self._decide(request, ident, disaggregate=True)
        self.metrics.decision_seconds.labels(self.select.scorer.policy, p.model).observe(time.perf_counter() - p.arrived)
        if split is not None:       # router/disagg.py: the prompt on a prefill worker first
            p, ranked = await self.disagg.prefill(p, split.prefill, ranked, timeout)
            if timeout is not None:     # the caller's deadline covers both legs
                timeout = max(timeout - (time.perf_counter() - p.arrived), 0.001)
        return self.proxy.stream(p, ranked, timeout)

    async def _decide(self, request: pb.GenerateRequest, ident: Identity | None,
                      disaggregate: bool = False) -> tuple[Prepared, list, Pools | None]:
        """Prepare, then rank the candidates (best first); a refusal counts as a rejected decision.
        `disaggregate`: where the model has prefill and decode pools, rank the decode pool and
        return the pools (a request with nothing to move goes to the decode pool whole)."""
        try:
            p = await self.prepare.prepare(request, ident)
            split = self.disagg.pools(p.model, p.workers) if disaggregate else None
            workers = split.decode if split is not None else p.workers
            ranked = self.select.rank(p.model, workers, p.prompt_len, p.hashes, p.upstream.sampling.max_tokens,
                                      adapter=p.upstream.adapter)
            return p, ranked, split if split is not None and wants_disaggregation(p) else None
        except RouterError:
            self.metrics.decisions.labels(self.select.scorer.policy, "rejected").inc()
            raise

    async def route(self, request: pb.GenerateRequest, ident: Identity | None = None) -> pb.RouteResponse:
        """Direct mode: prepare and rank as open() does, credit the best worker as the proxy
        would, and answer where it is with a grant for this request (runtime/security.py). The
        caller then streams from the worker; failing that, it comes back through Generate."""
        if self.signer is None and self.keyring is not None:
            raise RouterError(grpc.StatusCode.FAILED_PRECONDITION,
                              "direct mode: this router has no --worker-api-key-file to sign grants with; "
                              "use Generate")
        policy = self.select.scorer.policy
        p, ranked, _ = await self._decide(request, ident)
        choice = ranked[0]
        self.select.claim(choice, p.key, p.prompt_len, p.hashes, direct=True)
        self.metrics.decision_seconds.labels(policy, p.model).observe(time.perf_counter() - p.arrived)
        self.metrics.decisions.labels(policy, "direct").inc()
        self.metrics.predicted_cached.inc(choice.cached_tokens)
        self.metrics.prompt_tokens.inc(p.prompt_len)
        w, upstream = choice.worker, self.select.upstream(choice, p.upstream)
        if upstream is not p.upstream:
            self.metrics.kv_fetch_hints.labels(p.model).inc()
        grant, expires = self.signer.sign(w.id, ident, upstream) if self.signer is not None else (b"", 0.0)
        return pb.RouteResponse(worker_address=w.lease.address, worker_id=w.id, request=upstream, grant=grant,
                                expires_at=expires)

    async def generate(self, request: pb.GenerateRequest, timeout: float | None,
                       ident: Identity | None = None) -> AsyncGenerator[pb.GenerateResponse, None]:
        """open(), decoded: for a front that reads the responses (OpenAI HTTP)."""
        # aclosing: a caller that stops reading ends the upstream call now, not at garbage collection.
        async with aclosing(await self.open(request, timeout, ident)) as stream:
            async for raw in stream:
                yield _decode(raw)

    async def tokenize(self, request) -> tuple[str, list[int], int]:
        """(model, prompt token ids, its max_model_len)."""
        return await self.prepare.tokenize(request)

    async def model_info(self, model: str) -> pb.ModelInfoResponse:
        return await self.prepare.model_info(model)

    async def pin(self, model: str) -> tuple[str, Pin]:
        """(the model a request names, or the only one served; its pinned tokenizer and info)."""
        return await self.prepare.pin(model)

    def forget_worker(self, worker_id: str) -> None:
        self.breaker.forget(worker_id)
        self.channels.keep_only(w.lease.address for w in self.cluster.workers.values())
