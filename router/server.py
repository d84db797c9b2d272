"""The router's gRPC server: the same Generation service as a worker, proxied to the best worker.

Per request: tokenize once with the model's own tokenizer (fetched from a worker), hash the full
blocks in the request's namespace, rank the model's live workers, credit the winner and record
the prefix speculatively, then proxy the stream as token ids. A worker that fails before its
first response is marked in the circuit breaker and the next best one is tried; after the first
response a failure ends the stream with UNAVAILABLE, since tokens cannot be taken back.

Workers are not trusted blindly: one that sends nothing within the first-token deadline, or a
stream that breaks the protocol (router/stream_check.py), counts as failed in the breaker; the
tokenizer is pinned per model by the digest workers advertise in their leases, and a worker
advertising another is not routed to. Request limits (protos/limits.py) are checked before any
work, and with --api-keys-file each tenant gets its own cache salt and request-id scope.
"""
from __future__ import annotations

import asyncio
import logging
import signal
import sys
import time
import uuid
from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from protos import serving
from protos.block_hash import namespace_root
from protos.heap import freeze_heap
from protos.limits import Limits, check_fits, check_request
from protos.pagoda.v1 import pagoda_pb2 as pb
from protos.pagoda.v1 import pagoda_pb2_grpc as pb_grpc
from protos.security import (
    AuthInterceptor,
    Identity,
    KeyRing,
    channel_credentials,
    identity,
    read_key,
    scoped_id,
    scoped_salt,
    server_credentials,
)
from protos.serving import CLIENT_KEEPALIVE, StartupError, StopDeadline, at_stage, bind, check_port_free, server_options
from protos.tokenization import PromptTokenizer, encode_prompt, prompt_field, tokenizer_digest
from router.breaker import CircuitBreaker
from router.cluster import Cluster
from router.hashing import PromptHasher
from router.index import BlockIndex
from router.metrics import RouterMetrics
from router.scoring import Choice, Scorer, WorkerState
from router.stream_check import BadStream, StreamChecker

if TYPE_CHECKING:                   # openai_api imports this module; the router imports it only when serving HTTP
    from router.openai_api import OpenAIFront

log = logging.getLogger(__name__)
# Codes that say the request itself is wrong: another worker would answer the same.
_CLIENT_ERRORS = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.OUT_OF_RANGE,
                  grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.NOT_FOUND,
                  grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNAUTHENTICATED}
_CHANNEL_OPTIONS = CLIENT_KEEPALIVE + [("grpc.enable_retries", 0), ("grpc.initial_reconnect_backoff_ms", 100),
                                      ("grpc.max_reconnect_backoff_ms", 1000),
                                      ("grpc.max_receive_message_length", 64 << 20)]
SYNC_SERVICE = "pagoda.router.RedisSync"


class _Reject(Exception):
    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code, self.message = code, message


@dataclass
class _Pin:
    """A model's tokenizer as the router uses it, pinned by the digest workers advertise."""
    digest: str
    info: pb.ModelInfoResponse
    tokenizer: PromptTokenizer | None


class RouterService(pb_grpc.GenerationServicer):
    def __init__(self, cluster: Cluster, scorer: Scorer, metrics: RouterMetrics, max_attempts: int = 3,
                 limits: Limits = Limits(), first_token_timeout: float = 60.0,
                 worker_credentials: grpc.ChannelCredentials | None = None, worker_key: str | None = None,
                 keyring: KeyRing | None = None):
        self.cluster, self.scorer, self.metrics, self.max_attempts = cluster, scorer, metrics, max_attempts
        self.limits, self.first_token_timeout, self.keyring = limits, first_token_timeout, keyring
        self.worker_credentials = worker_credentials
        self.worker_metadata = (("authorization", f"Bearer {worker_key}"),) if worker_key else None
        self.breaker = CircuitBreaker()
        self.hasher = PromptHasher()
        self._roots: dict[tuple[str, str, str], bytes] = {}     # namespace -> protos.block_hash root
        self._stubs: dict[str, tuple[grpc.aio.Channel, pb_grpc.GenerationStub]] = {}
        self._pins: dict[str, _Pin] = {}
        self._pin_locks: dict[str, asyncio.Lock] = {}
        self._known_models: set[str] = set()
        self._warned: set[tuple[str, str]] = set()
        # model -> (pinned digest, cluster version, its workers, those with that digest)
        self._same: dict[str, tuple[str, int | None, list[WorkerState], list[WorkerState]]] = {}
        cluster.on_worker_gone = self._forget_worker

    # -- Generation -------------------------------------------------------------------------

    async def Generate(self, request: pb.GenerateRequest, context):
        try:
            async for resp in self.generate(request, context.time_remaining(), identity(self.keyring, context)):
                yield resp
        except _Reject as r:
            await context.abort(r.code, r.message)

    async def generate(self, request: pb.GenerateRequest, timeout: float | None, ident: Identity | None = None):
        """Route and proxy one request (the gRPC and HTTP fronts share it) for caller `ident`; a
        refusal or failure is raised as _Reject with the status to answer."""
        policy = self.scorer.policy
        arrived = time.perf_counter()
        upstream = pb.GenerateRequest()
        try:
            check_request(request, self.limits)
            model, workers = self.candidates(request.model)
            pin = await self._pinned(model, workers)
            workers = self._same_tokenizer(model, workers, pin)
            t0 = time.perf_counter()
            field, token_ids = await self._prompt_ids(pin, request)
            check_fits(field, len(token_ids), request.sampling, pin.info.max_model_len)
            upstream.CopyFrom(request)
            upstream.ClearField("text")
            upstream.ClearField("messages")
            upstream.token_ids[:] = token_ids
            upstream.model = model
            upstream.cache_salt = scoped_salt(ident, request.cache_salt)
            ranked, hashes = self.rank(model, workers, upstream, token_ids)
            self.metrics.decision_seconds.labels(policy, model).observe(time.perf_counter() - t0)
        except ValueError as e:
            self.metrics.decisions.labels(policy, "rejected").inc()
            raise _Reject(grpc.StatusCode.INVALID_ARGUMENT, str(e)) from None
        except _Reject:
            self.metrics.decisions.labels(policy, "rejected").inc()
            raise
        request_id = request.request_id or uuid.uuid4().hex
        upstream.request_id = scoped_id(ident, request_id)
        checker = StreamChecker(request.sampling.n if request.sampling.HasField("n") else 1, pin.info.vocab_size)
        last_error = "no worker tried"
        for attempt, choice in enumerate(ranked[:self.max_attempts]):
            w = choice.worker
            # A worker past its cooldown gets this request as its one trial: the breaker
            # reopens it for other requests until the trial succeeds or fails.
            self.breaker.allow(w.id)
            self.claim(choice, upstream.request_id, len(token_ids), hashes)
            call = self._stub(w).Generate(upstream, timeout=timeout, metadata=self.worker_metadata)
            checker.reset()
            wait = self.first_token_timeout
            try:
                # A worker that takes calls and never answers costs at most this much.
                first = await asyncio.wait_for(call.read(), wait)
                if first is grpc.aio.EOF:
                    raise BadStream("the stream ended before any response")
                checker.check(first)
            except grpc.aio.AioRpcError as e:
                w.uncredit(upstream.request_id)
                if e.code() in _CLIENT_ERRORS:
                    self.metrics.attempts.labels(w.name, "rejected").inc()
                    self.metrics.decisions.labels(policy, "rejected").inc()
                    raise _Reject(e.code(), _caller_field(e.details() or "", field)) from None
                last_error = f"{e.code().name}: {e.details()}"
                if e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                    self.metrics.attempts.labels(w.name, "failed_before_first").inc()
                    continue
                self._failed_before_first(w, "failed_before_first", last_error)
                continue
            except (asyncio.TimeoutError, BadStream) as e:
                call.cancel()
                w.uncredit(upstream.request_id)
                timed_out = isinstance(e, asyncio.TimeoutError)
                last_error = f"no response within the first-token deadline ({wait:g}s)" if timed_out \
                    else f"invalid stream: {e}"
                self._failed_before_first(w, "timeout_before_first" if timed_out else "bad_stream", last_error)
                continue
            except asyncio.CancelledError:
                call.cancel()
                w.uncredit(upstream.request_id)
                raise
            self.breaker.success(w.id)
            w.prefill_done(upstream.request_id, time.time())
            self.metrics.ttft.labels(policy, model).observe(time.perf_counter() - arrived)
            self.metrics.predicted_cached.inc(choice.cached_tokens)
            self.metrics.prompt_tokens.inc(len(token_ids))
            outcome = "ok" if attempt == 0 else "retried_ok"
            try:
                async for resp in self._relay(first, call, policy, model, choice.cached_tokens, checker):
                    resp.request_id = request_id        # the caller's id, not the tenant-scoped one
                    yield resp
            except (grpc.aio.AioRpcError, BadStream) as e:
                self.breaker.failure(w.id)
                self.metrics.attempts.labels(w.name, "failed_mid_stream").inc()
                self.metrics.decisions.labels(policy, "failed_mid_stream").inc()
                detail = f"{e.code().name}: {e.details()}" if isinstance(e, grpc.aio.AioRpcError) \
                    else f"invalid stream: {e}"
                raise _Reject(grpc.StatusCode.UNAVAILABLE,
                              f"worker {w.id} failed mid-stream ({detail}); tokens already sent cannot be retried") \
                    from None
            finally:
                call.cancel()               # no-op when finished; aborts the worker's request otherwise
                w.finish(upstream.request_id, time.time())     # it no longer loads the worker
            self.metrics.attempts.labels(w.name, "ok").inc()
            self.metrics.decisions.labels(policy, outcome).inc()
            self.metrics.e2e.labels(policy, model).observe(time.perf_counter() - arrived)
            return
        self.metrics.decisions.labels(policy, "failed").inc()
        if last_error.startswith("RESOURCE_EXHAUSTED"):
            raise _Reject(grpc.StatusCode.RESOURCE_EXHAUSTED, last_error.split(": ", 1)[1])
        raise _Reject(grpc.StatusCode.UNAVAILABLE,
                      f"no worker for model {model!r} could serve the request (last: {last_error})")

    def _failed_before_first(self, w: WorkerState, result: str, why: str) -> None:
        self.breaker.failure(w.id)
        self.metrics.attempts.labels(w.name, result).inc()
        log.warning("worker %s failed before the first token (%s); trying the next", w.id, why)

    async def _relay(self, first, call, policy, model, predicted, checker: StreamChecker):
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
            if resp is not grpc.aio.EOF:
                checker.check(resp)
        checker.check_complete()

    async def GetModelInfo(self, request: pb.ModelInfoRequest, context):
        try:
            model, workers = self.candidates(request.model)
            return (await self._pinned(model, workers)).info
        except _Reject as r:
            await context.abort(r.code, r.message)

    async def Tokenize(self, request: pb.TokenizeRequest, context):
        try:
            check_request(request, self.limits)
            model, workers = self.candidates(request.model)
            pin = await self._pinned(model, workers)
            return pb.TokenizeResponse(token_ids=(await self._prompt_ids(pin, request))[1])
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except _Reject as r:
            await context.abort(r.code, r.message)

    async def tokenize(self, request) -> tuple[str, list[int], int]:
        """(model, prompt token ids, its max_model_len) for a front that checks lengths itself."""
        try:
            check_request(request, self.limits)
            model, workers = self.candidates(request.model)
            pin = await self._pinned(model, workers)
            return model, (await self._prompt_ids(pin, request))[1], pin.info.max_model_len
        except ValueError as e:
            raise _Reject(grpc.StatusCode.INVALID_ARGUMENT, str(e)) from None

    # -- helpers ----------------------------------------------------------------------------

    def candidates(self, model: str) -> tuple[str, list[WorkerState]]:
        """The model a request names (or the only one served) and its live workers."""
        models = self.cluster.models()
        self._known_models.update(models)
        if not model:
            if len(models) > 1:
                raise _Reject(grpc.StatusCode.INVALID_ARGUMENT,
                              f"model: required, this router serves {', '.join(models)}")
            if not models:
                raise _Reject(grpc.StatusCode.UNAVAILABLE, "no live worker serves any model")
            model = models[0]
        workers = self.cluster.live(model)
        if not workers:
            # A model served before is only down for now (retry); one never seen is unknown.
            code = grpc.StatusCode.UNAVAILABLE if model in self._known_models else grpc.StatusCode.NOT_FOUND
            raise _Reject(code, f"model: no live worker serves {model!r}"
                          + (f" (served: {', '.join(models)})" if models else ""))
        return model, workers

    async def _prompt_ids(self, pin: _Pin, request) -> tuple[str, list[int]]:
        """(the field that carried the prompt, its ids); tokenising runs in a thread so that a
        long prompt does not stall every other stream on the event loop."""
        field = prompt_field(request)
        if field != "token_ids" and pin.tokenizer is None:
            raise _Reject(grpc.StatusCode.FAILED_PRECONDITION,
                          f"{field}: model {pin.info.model!r} has no tokenizer; send token_ids")
        if request.HasField("text") and not request.text:
            raise ValueError("text: the prompt is empty")
        # A template error is the caller's input too: ValueError names the field.
        return await asyncio.to_thread(encode_prompt, pin.tokenizer, request)

    def rank(self, model, workers, request, token_ids, now: float | None = None):
        """The routing decision, with no I/O: candidates best first, and the prompt's block hashes
        (`now`: the wall clock, unless a simulation keeps its own)."""
        names = (model, request.adapter, request.cache_salt)
        root = self._roots.get(names)
        if root is None:            # a BLAKE2b and its keyword parsing, once per namespace
            if len(self._roots) >= 4096:
                self._roots.clear()
            root = self._roots[names] = namespace_root(*names)
        hashes = self.hasher.hashes(token_ids, workers[0].lease.block_size, root)
        shut = self.breaker.open_workers()
        allowed = ([w for w in workers if w.id not in shut] or workers) if shut else workers
        return self.scorer.rank(model, allowed, len(token_ids), hashes, self.max_attempts,
                                request.sampling.max_tokens or None, now), hashes

    def claim(self, choice: Choice, request_id: str, prompt_len: int, hashes: Sequence[bytes],
              sent_at: float | None = None, now: float | None = None) -> None:
        """The decision taken: credit the worker with the request in flight (stamped `sent_at`,
        wall clock) and record the prompt's blocks there speculatively. The blocks the index
        already has it holding are skipped, not looked up again."""
        w = choice.worker
        w.credit(request_id, prompt_len - choice.cached_tokens, time.time() if sent_at is None else sent_at)
        self.scorer.index.speculate(w.id, hashes[choice.cached_tokens // w.lease.block_size:], now)

    async def _pinned(self, model: str, workers: list[WorkerState]) -> _Pin:
        """The model's info and tokenizer, pinned to one tokenizer digest: the one most live
        workers advertise, fetched from one of them and checked against it. Re-pinned only
        when no live worker advertises the pinned digest any more (a new model version)."""
        pin = self._pins.get(model)
        if pin is not None and any(w.lease.tokenizer_digest == pin.digest for w in workers):
            return pin
        async with self._pin_locks.setdefault(model, asyncio.Lock()):
            pin = self._pins.get(model)
            if pin is not None and any(w.lease.tokenizer_digest == pin.digest for w in workers):
                return pin
            last = "no worker"
            for digest, _ in Counter(w.lease.tokenizer_digest for w in workers).most_common():
                for w in sorted((w for w in workers if w.lease.tokenizer_digest == digest),
                                key=lambda w: self.breaker.is_open(w.id)):
                    try:
                        info = await self._stub(w).GetModelInfo(pb.ModelInfoRequest(model=model), timeout=10,
                                                                metadata=self.worker_metadata)
                    except grpc.aio.AioRpcError as e:
                        last = f"{w.id}: {e.code().name}"
                        continue
                    actual = tokenizer_digest(info.tokenizer_json, info.tokenizer_config_json)
                    if actual != digest:
                        log.warning("worker %s advertises tokenizer %s but serves %s; not using it",
                                    w.id, digest, actual)
                        last = f"{w.id}: tokenizer digest mismatch"
                        continue
                    tok = await asyncio.to_thread(PromptTokenizer, info.tokenizer_json,
                                                  info.tokenizer_config_json) if info.tokenizer_json else None
                    if pin is not None:
                        log.warning("model %r: tokenizer re-pinned %s -> %s", model, pin.digest, digest)
                    pin = self._pins[model] = _Pin(digest, info, tok)
                    return pin
            raise _Reject(grpc.StatusCode.UNAVAILABLE, f"model {model!r}: no worker answered GetModelInfo ({last})")

    def _same_tokenizer(self, model: str, workers: list[WorkerState], pin: _Pin) -> list[WorkerState]:
        """Workers whose advertised tokenizer is not the pinned one would see other token ids
        than the router hashed (and than the client meant): not routed to, logged once. Kept
        until the cluster's membership or a worker's tokenizer changes (a scan per request was
        most of a decision's cost at 1,000 workers that the index and ranking do not have)."""
        version = getattr(self.cluster, "version", None)
        cached = self._same.get(model)
        if cached is not None and version is not None and cached[2] is workers \
                and cached[:2] == (pin.digest, version):
            return cached[3]
        same = [w for w in workers if w.lease.tokenizer_digest == pin.digest]
        self._same[model] = (pin.digest, version, workers, same)
        for w in workers:
            if w.lease.tokenizer_digest != pin.digest and (w.id, w.lease.tokenizer_digest) not in self._warned:
                self._warned.add((w.id, w.lease.tokenizer_digest))
                log.warning("worker %s advertises tokenizer %r for model %r, not the pinned %s: not routing to it",
                            w.id, w.lease.tokenizer_digest, model, pin.digest)
        return same

    def _channel(self, address: str) -> grpc.aio.Channel:
        if self.worker_credentials is not None:
            return grpc.aio.secure_channel(address, self.worker_credentials, options=_CHANNEL_OPTIONS)
        return grpc.aio.insecure_channel(address, options=_CHANNEL_OPTIONS)

    def _stub(self, w: WorkerState) -> pb_grpc.GenerationStub:
        entry = self._stubs.get(w.lease.address)
        if entry is None:
            channel = self._channel(w.lease.address)
            entry = self._stubs[w.lease.address] = (channel, pb_grpc.GenerationStub(channel))
        return entry[1]

    async def verify(self, lease) -> bool:
        """Does the lease's address answer as that worker id and epoch? (Cluster asks before a
        worker id moves to a new epoch, so a forged lease in Redis cannot fence a real worker.)"""
        channel = self._channel(lease.address)
        try:
            info = await pb_grpc.GenerationStub(channel).GetModelInfo(
                pb.ModelInfoRequest(model=lease.model), timeout=2, metadata=self.worker_metadata)
            return info.worker_id == lease.worker_id and info.epoch == lease.epoch
        except grpc.aio.AioRpcError:
            return False
        finally:
            await channel.close(grace=None)

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


def _caller_field(message: str, field: str) -> str:
    """A worker names token_ids (all it was sent); the caller sent `field`."""
    return field + message[len("token_ids"):] if message.startswith("token_ids:") and field != "token_ids" \
        else message


class Router:
    """One router: Redis sync task, gRPC server, optional metrics endpoint."""

    def __init__(self, a):
        self.args = a
        self.index = BlockIndex(a.index_max_blocks, a.speculative_ttl)
        self.cluster = Cluster(a.redis_url, self.index, max_snapshot_bytes=a.max_snapshot_bytes)
        self.metrics = RouterMetrics(self.cluster, self.index)
        try:
            creds = server_credentials(a.tls_cert, a.tls_key, a.tls_client_ca)
            worker_creds = channel_credentials(a.worker_tls_ca, a.worker_tls_cert, a.worker_tls_key)
            self.keyring = KeyRing(a.api_keys_file) if a.api_keys_file else None
            worker_key = read_key(a.worker_api_key_file) if a.worker_api_key_file else None
        except (OSError, ValueError) as e:
            raise StartupError(f"TLS/keys: {e}") from None
        self.service = RouterService(self.cluster, Scorer(a.policy, self.index), self.metrics, a.max_attempts,
                                     Limits.from_args(a), a.first_token_timeout, worker_creds, worker_key,
                                     self.keyring)
        self.cluster.verify = self.service.verify
        self.host = a.host
        interceptors = [AuthInterceptor(self.keyring)] if self.keyring else []
        self.server = grpc.aio.server(options=server_options(a.max_concurrent_streams), interceptors=interceptors)
        self.health = health.aio.HealthServicer()
        # Ports first, before anything connects anywhere: a taken one is one line naming it.
        self.port = bind(self.server, a.host, a.port, "--port", creds)
        self.metrics_port = serving.metrics_port(a.metrics_port, a.port)
        check_port_free(a.host, self.metrics_port, "--metrics-port")
        self.http_port = a.http_port
        self.http: OpenAIFront | None = None
        check_port_free(a.host, self.http_port, "--http-port")

    async def start(self) -> int:
        pb_grpc.add_GenerationServicer_to_server(self.service, self.server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        name = pb.DESCRIPTOR.services_by_name["Generation"].full_name
        reflection.enable_server_reflection([name, health.SERVICE_NAME, reflection.SERVICE_NAME], self.server)
        if self.metrics_port:
            from prometheus_client import start_http_server
            start_http_server(self.metrics_port, addr=self.host, registry=self.metrics.registry)
        await self.cluster.start()
        await self.cluster.wait_synced(2.0)
        await self.server.start()
        for service in ("", name):
            await self.health.set(service, health_pb2.HealthCheckResponse.SERVING)
        if self.http_port:
            from router.openai_api import OpenAIFront
            self.http = OpenAIFront(self.service)
            await self.http.start(self.host, self.http_port)
        self._sync_health = asyncio.create_task(self._report_sync())
        freeze_heap()
        return self.port

    async def _report_sync(self) -> None:
        """Health service SYNC_SERVICE follows the Redis sync's freshness (readiness for
        probes that want a current view; the router itself keeps serving on its last view)."""
        last = None
        while True:
            status = health_pb2.HealthCheckResponse.SERVING if self.cluster.healthy() \
                else health_pb2.HealthCheckResponse.NOT_SERVING
            if status != last:
                await self.health.set(SYNC_SERVICE, status)
                last = status
            await asyncio.sleep(0.5)

    async def stop(self, grace: float = 2.0, deadline: StopDeadline | None = None) -> None:
        self._sync_health.cancel()
        await self.health.enter_graceful_shutdown()
        if self.http is not None:
            at_stage(deadline, "HTTP front stop")
            await self.http.stop()
        at_stage(deadline, "gRPC server stop")
        await self.server.stop(grace)
        at_stage(deadline, "closing worker channels")
        await self.service.close()
        at_stage(deadline, "redis sync stop")
        await self.cluster.stop()
        at_stage(deadline, "asyncio teardown")


async def _serve(a) -> None:
    router = Router(a)
    port = await router.start()
    log.info("router listening on %s:%d (policy %s, metrics port %s)", a.host, port, a.policy,
             router.metrics_port or "off")
    print(f"router listening on {a.host}:{port}", flush=True)
    if a.http_port:
        print(f"router OpenAI-compatible HTTP at http://{a.host}:{a.http_port}/v1", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    if router.keyring is not None:
        loop.add_signal_handler(signal.SIGHUP, router.keyring.reload)
    await stop.wait()
    # grace 2 s for open streams; the rest is bounded calls: 10 s is stuck, not slow.
    await router.stop(2.0, StopDeadline("router", 10.0).start())


def main(argv: list[str] | None = None) -> int:
    from router.args import build_parser
    a = build_parser().parse_args(argv)
    logging.basicConfig(level=a.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        asyncio.run(_serve(a))
    except StartupError as e:       # a taken port, a missing certificate: one line saying what to change
        print(f"pagoda router: {e}", file=sys.stderr, flush=True)
        return 2
    return 0
