"""The router's gRPC server: the same Generation service as a worker, proxied to the best worker.

Per request: tokenize once with the model's own tokenizer (fetched from a worker), hash the full
blocks in the request's namespace, rank the model's live workers, credit the winner and record
the prefix speculatively, then proxy the stream as token ids. A worker that fails before its
first response is marked in the circuit breaker and the next best one is tried; after the first
response a failure ends the stream with UNAVAILABLE, since tokens cannot be taken back.
"""
from __future__ import annotations

import asyncio
import logging
import signal
import time
import uuid
from typing import TYPE_CHECKING

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from protos.block_hash import block_hashes, namespace_root
from protos.pagoda.v1 import pagoda_pb2 as pb
from protos.pagoda.v1 import pagoda_pb2_grpc as pb_grpc
from protos.tokenization import PromptTokenizer, encode_prompt, prompt_field
from router.breaker import CircuitBreaker
from router.cluster import Cluster
from router.index import BlockIndex
from router.metrics import RouterMetrics
from router.scoring import Scorer, WorkerState

if TYPE_CHECKING:                   # openai_api imports this module; the router imports it only when serving HTTP
    from router.openai_api import OpenAIFront

log = logging.getLogger(__name__)
# Codes that say the request itself is wrong: another worker would answer the same.
_CLIENT_ERRORS = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.OUT_OF_RANGE,
                  grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.NOT_FOUND,
                  grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNAUTHENTICATED}
_CHANNEL_OPTIONS = [("grpc.keepalive_time_ms", 10_000), ("grpc.keepalive_timeout_ms", 5_000),
                    ("grpc.keepalive_permit_without_calls", 1), ("grpc.enable_retries", 0),
                    ("grpc.initial_reconnect_backoff_ms", 100), ("grpc.max_reconnect_backoff_ms", 1000)]


class _Reject(Exception):
    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code, self.message = code, message


class RouterService(pb_grpc.GenerationServicer):
    def __init__(self, cluster: Cluster, scorer: Scorer, metrics: RouterMetrics, max_attempts: int = 3):
        self.cluster, self.scorer, self.metrics, self.max_attempts = cluster, scorer, metrics, max_attempts
        self.breaker = CircuitBreaker()
        self._stubs: dict[str, tuple[grpc.aio.Channel, pb_grpc.GenerationStub]] = {}
        self._tokenizers: dict[str, PromptTokenizer] = {}
        self._max_model_len: dict[str, int] = {}
        self._tok_locks: dict[str, asyncio.Lock] = {}
        cluster.on_worker_gone = self._forget_worker

    # -- Generation -------------------------------------------------------------------------

    async def Generate(self, request: pb.GenerateRequest, context):
        try:
            async for resp in self.generate(request, context.time_remaining()):
                yield resp
        except _Reject as r:
            await context.abort(r.code, r.message)

    async def generate(self, request: pb.GenerateRequest, timeout: float | None):
        """Route and proxy one request (the gRPC and HTTP fronts share it); a refusal or failure
        is raised as _Reject with the status to answer."""
        policy = self.scorer.policy
        arrived = time.perf_counter()
        try:
            model, workers = self.candidates(request.model)
            t0 = time.perf_counter()
            token_ids = await self._prompt_ids(model, workers, request)
            ranked, hashes = self.rank(model, workers, request, token_ids)
            self.metrics.decision_seconds.labels(policy, model).observe(time.perf_counter() - t0)
        except _Reject:
            self.metrics.decisions.labels(policy, "rejected").inc()
            raise
        upstream = pb.GenerateRequest()
        upstream.CopyFrom(request)
        upstream.ClearField("text")
        upstream.ClearField("messages")
        upstream.token_ids[:] = token_ids
        upstream.model = model
        upstream.request_id = request.request_id or uuid.uuid4().hex
        last_error = None
        for attempt, choice in enumerate(ranked[:self.max_attempts]):
            w = choice.worker
            # A worker past its cooldown gets this request as its one trial: the breaker
            # reopens it for other requests until the trial succeeds or fails.
            self.breaker.allow(w.id)
            w.credit(upstream.request_id, len(token_ids) - choice.cached_tokens, time.time())
            self.scorer.index.speculate(w.id, hashes)
            call = self._stub(w).Generate(upstream, timeout=timeout)
            try:
                first = await call.read()
            except grpc.aio.AioRpcError as e:
                w.uncredit(upstream.request_id)
                last_error = e
                if e.code() in _CLIENT_ERRORS:
                    self.metrics.attempts.labels(w.name, "rejected").inc()
                    self.metrics.decisions.labels(policy, "rejected").inc()
                    raise _Reject(e.code(), e.details()) from None
                if e.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:
                    self.breaker.failure(w.id)
                self.metrics.attempts.labels(w.name, "failed_before_first").inc()
                log.warning("worker %s failed before the first token (%s: %s); trying the next",
                            w.id, e.code().name, e.details())
                continue
            except asyncio.CancelledError:
                call.cancel()
                w.uncredit(upstream.request_id)
                raise
            if first is grpc.aio.EOF:
                last_error = None
                self.metrics.attempts.labels(w.name, "empty").inc()
                continue
            self.breaker.success(w.id)
            w.prefill_done(upstream.request_id, time.time())
            self.metrics.ttft.labels(policy, model).observe(time.perf_counter() - arrived)
            self.metrics.predicted_cached.inc(choice.cached_tokens)
            self.metrics.prompt_tokens.inc(len(token_ids))
            outcome = "ok" if attempt == 0 else "retried_ok"
            try:
                async for resp in self._relay(first, call, policy, model, choice.cached_tokens):
                    yield resp
            except grpc.aio.AioRpcError as e:
                self.breaker.failure(w.id)
                self.metrics.attempts.labels(w.name, "failed_mid_stream").inc()
                self.metrics.decisions.labels(policy, "failed_mid_stream").inc()
                raise _Reject(grpc.StatusCode.UNAVAILABLE,
                              f"worker {w.id} failed mid-stream ({e.code().name}: {e.details()}); "
                              "tokens already sent cannot be retried") from None
            finally:
                call.cancel()               # no-op when finished; aborts the worker's request otherwise
                w.finish(upstream.request_id, time.time())     # it no longer loads the worker
            self.metrics.attempts.labels(w.name, "ok").inc()
            self.metrics.decisions.labels(policy, outcome).inc()
            self.metrics.e2e.labels(policy, model).observe(time.perf_counter() - arrived)
            return
        self.metrics.decisions.labels(policy, "failed").inc()
        if last_error is not None and last_error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
            raise _Reject(grpc.StatusCode.RESOURCE_EXHAUSTED, last_error.details())
        detail = f"{last_error.code().name}: {last_error.details()}" if last_error is not None else "empty stream"
        raise _Reject(grpc.StatusCode.UNAVAILABLE,
                      f"no worker for model {model!r} could serve the request (last: {detail})")

    async def _relay(self, first, call, policy, model, predicted):
        reported = False
        resp = first
        while resp is not grpc.aio.EOF:
            if resp.finished and resp.index == 0 and not reported and resp.HasField("usage"):
                self.metrics.reported_cached.inc(resp.usage.cached_prompt_tokens)
                self.metrics.cached_error.labels(policy, model).observe(resp.usage.cached_prompt_tokens - predicted)
                self.scorer.observe_output(resp.usage.completion_tokens)
                reported = True
            yield resp
            resp = await call.read()

    async def GetModelInfo(self, request: pb.ModelInfoRequest, context):
        try:
            model, workers = self.candidates(request.model)
            return await self._model_info(model, workers)
        except _Reject as r:
            await context.abort(r.code, r.message)

    async def Tokenize(self, request: pb.TokenizeRequest, context):
        try:
            model, workers = self.candidates(request.model)
            return pb.TokenizeResponse(token_ids=await self._prompt_ids(model, workers, request))
        except _Reject as r:
            await context.abort(r.code, r.message)

    # -- helpers ----------------------------------------------------------------------------

    def candidates(self, model: str) -> tuple[str, list[WorkerState]]:
        """The model a request names (or the only one served) and its live workers."""
        models = self.cluster.models()
        if not model:
            if len(models) > 1:
                raise _Reject(grpc.StatusCode.INVALID_ARGUMENT,
                              f"model: required, this router serves {', '.join(models)}")
            if not models:
                raise _Reject(grpc.StatusCode.UNAVAILABLE, "no live worker serves any model")
            model = models[0]
        workers = self.cluster.live(model)
        if not workers:
            raise _Reject(grpc.StatusCode.UNAVAILABLE, f"model: no live worker serves {model!r}"
                          + (f" (served: {', '.join(models)})" if models else ""))
        return model, workers

    async def _prompt_ids(self, model, workers, request) -> list[int]:
        try:
            tok = None if prompt_field(request) == "token_ids" else await self._tokenizer(model, workers)
            return encode_prompt(tok, request)[1]
        except ValueError as e:       # names the field; a template error is the caller's input too
            raise _Reject(grpc.StatusCode.INVALID_ARGUMENT, str(e)) from None

    async def tokenize(self, request) -> tuple[str, list[int], int]:
        """(model, prompt token ids, its max_model_len) for a front that checks lengths itself."""
        model, workers = self.candidates(request.model)
        ids = await self._prompt_ids(model, workers, request)
        if model not in self._max_model_len:
            self._max_model_len[model] = (await self._model_info(model, workers)).max_model_len
        return model, ids, self._max_model_len[model]

    def rank(self, model, workers, request, token_ids):
        """The routing decision, with no I/O: candidates best first, and the prompt's block hashes."""
        root = namespace_root(model, request.adapter, request.cache_salt)
        hashes = block_hashes(token_ids, workers[0].lease.block_size, root)
        shut = self.breaker.open_workers()
        allowed = ([w for w in workers if w.id not in shut] or workers) if shut else workers
        return self.scorer.rank(model, allowed, len(token_ids), hashes, self.max_attempts,
                                request.sampling.max_tokens or None), hashes

    async def _model_info(self, model, workers) -> pb.ModelInfoResponse:
        last = None
        for w in sorted(workers, key=lambda w: self.breaker.is_open(w.id)):
            try:
                return await self._stub(w).GetModelInfo(pb.ModelInfoRequest(model=model), timeout=10)
            except grpc.aio.AioRpcError as e:
                last = e
        raise _Reject(grpc.StatusCode.UNAVAILABLE, f"model {model!r}: no worker answered GetModelInfo "
                      f"({last.code().name if last else ''})")

    async def _tokenizer(self, model, workers) -> PromptTokenizer:
        if model in self._tokenizers:
            return self._tokenizers[model]
        async with self._tok_locks.setdefault(model, asyncio.Lock()):
            if model not in self._tokenizers:
                info = await self._model_info(model, workers)
                if not info.tokenizer_json:
                    raise _Reject(grpc.StatusCode.FAILED_PRECONDITION,
                                  f"model {model!r}: workers serve no tokenizer; send token_ids")
                self._tokenizers[model] = PromptTokenizer(info.tokenizer_json, info.tokenizer_config_json or "{}")
        return self._tokenizers[model]

    def _stub(self, w: WorkerState) -> pb_grpc.GenerationStub:
        entry = self._stubs.get(w.lease.address)
        if entry is None:
            channel = grpc.aio.insecure_channel(w.lease.address, options=_CHANNEL_OPTIONS)
            entry = self._stubs[w.lease.address] = (channel, pb_grpc.GenerationStub(channel))
        return entry[1]

    def _forget_worker(self, worker_id: str) -> None:
        self.breaker.forget(worker_id)
        live = {w.lease.address for w in self.cluster.workers.values()}
        for address in [a for a in self._stubs if a not in live]:
            channel, _ = self._stubs.pop(address)
            asyncio.ensure_future(channel.close(grace=None))

    async def close(self) -> None:
        for channel, _ in self._stubs.values():
            await channel.close(grace=None)
        self._stubs.clear()


class Router:
    """One router: Redis sync task, gRPC server, optional metrics endpoint."""

    def __init__(self, redis_url: str, host: str = "0.0.0.0", port: int = 50050, metrics_port: int = 0,
                 policy: str = "prefix_aware", index_max_blocks: int = 1_000_000,
                 speculative_ttl_s: float = 10.0, max_attempts: int = 3, http_port: int = 0):
        self.index = BlockIndex(index_max_blocks, speculative_ttl_s)
        self.cluster = Cluster(redis_url, self.index)
        self.metrics = RouterMetrics(self.cluster, self.index)
        self.service = RouterService(self.cluster, Scorer(policy, self.index), self.metrics, max_attempts)
        self.host, self.port, self.metrics_port, self.http_port = host, port, metrics_port, http_port
        self.http: OpenAIFront | None = None
        self.server = grpc.aio.server()
        self.health = health.aio.HealthServicer()

    async def start(self) -> int:
        pb_grpc.add_GenerationServicer_to_server(self.service, self.server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        name = pb.DESCRIPTOR.services_by_name["Generation"].full_name
        reflection.enable_server_reflection([name, health.SERVICE_NAME, reflection.SERVICE_NAME], self.server)
        self.port = self.server.add_insecure_port(f"{self.host}:{self.port}")
        if not self.port:
            raise OSError(f"port: cannot bind {self.host}")
        await self.cluster.start()
        await self.cluster.wait_synced(2.0)
        await self.server.start()
        for service in ("", name):
            await self.health.set(service, health_pb2.HealthCheckResponse.SERVING)
        if self.http_port:
            from router.openai_api import OpenAIFront
            self.http = OpenAIFront(self.service)
            await self.http.start(self.host, self.http_port)
        if self.metrics_port:
            from prometheus_client import start_http_server
            start_http_server(self.metrics_port, registry=self.metrics.registry)
        return self.port

    async def stop(self, grace: float = 2.0) -> None:
        await self.health.enter_graceful_shutdown()
        if self.http is not None:
            await self.http.stop()
        await self.server.stop(grace)
        await self.service.close()
        await self.cluster.stop()


async def _serve(a) -> None:
    router = Router(a.redis_url, a.host, a.port, a.metrics_port, a.policy, a.index_max_blocks,
                    a.speculative_ttl, a.max_attempts, a.http_port)
    port = await router.start()
    log.info("router listening on %s:%d (policy %s, metrics port %s)", a.host, port, a.policy,
             a.metrics_port or "off")
    print(f"router listening on {a.host}:{port}", flush=True)
    if a.http_port:
        print(f"router OpenAI-compatible HTTP at http://{a.host}:{a.http_port}/v1", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await router.stop()


def main(argv: list[str] | None = None) -> None:
    from router.args import build_parser
    a = build_parser().parse_args(argv)
    logging.basicConfig(level=a.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    asyncio.run(_serve(a))
