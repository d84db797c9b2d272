"""Stage 3: the proxy. Open the stream on the best ranked worker and relay it, failing over
before the first token; keep the credit ledger of each attempt.

A worker that fails before its first response (an error status other than the caller's own
mistake, no response within --first-token-timeout, a first response that breaks the protocol)
is marked in the circuit breaker and the next ranked worker is tried; RESOURCE_EXHAUSTED (a
full queue) moves on without counting against the worker. After the first response a failure
ends the stream with UNAVAILABLE, since tokens cannot be taken back, unless the worker named the
request itself as the cause (a client error such as INVALID_ARGUMENT: a stage of the worker's
step failed that request alone, gpu_worker/core/faults.py): that status goes to the caller as it
is, is never tried on another worker, and does not count against the worker. Worker streams are checked
(router/stream_check.py) as they are relayed.

The ledger, per attempt: claimed (credited, prefix speculated) when sent; uncredited when it
fails before its first token; its prefill done at the first token; finished when the stream
ends however it ends (so a worker is never left loaded with a request it no longer runs). Its
entries are keyed by the request id scoped to the tenant, since tenants may use the same ids.
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import AsyncGenerator, Callable

import grpc

from pagoda.protos.pagoda.v1 import pagoda_pb2 as pb
from pagoda.router.breaker import CircuitBreaker
from pagoda.router.channels import WorkerChannels
from pagoda.router.errors import CLIENT_ERRORS, RouterError, caller_field
from pagoda.router.metrics import RouterMetrics
from pagoda.router.prepare import Prepared
from pagoda.router.scoring import Choice, WorkerState
from pagoda.router.selection import Selector
from pagoda.router.stream_check import BadStream, StreamChecker

log = logging.getLogger(__name__)


class _TryNext(Exception):
    """This attempt failed before its first token; the message says how."""


class Proxy:
    def __init__(self, channels: WorkerChannels, selector: Selector, breaker: CircuitBreaker,
                 metrics: RouterMetrics, first_token_timeout: float = 60.0,
                 on_usage: Callable[[Prepared, pb.Usage], None] | None = None):
        self.channels, self.selector, self.breaker, self.metrics = channels, selector, breaker, metrics
        self.first_token_timeout = first_token_timeout
        self.on_usage = on_usage        # each finished request's usage (router/disagg.py counts fallbacks)

    @property
    def policy(self) -> str:
        return self.selector.scorer.policy

    async def stream(self, p: Prepared, ranked: list[Choice], timeout: float | None
                     ) -> AsyncGenerator[bytes, None]:
        """The responses of the first ranked worker that answers, as the bytes it sent (the
        caller's request id is already in them: the worker echoes the id it was sent)."""
        checker = StreamChecker(p.n, p.pin.info.vocab_size, p.max_tokens)
        last_error = "no worker tried"
        for attempt, choice in enumerate(ranked):
            try:
                call, raw, resp = await self._open(p, choice, timeout, checker)
            except _TryNext as e:
                last_error = str(e)
                continue
            w = choice.worker
            # The relay loop: per response one decode for the checks, no re-encoding.
            try:
                while True:
                    if resp.finished and resp.index == 0:
                        self._observe_usage(p, choice, resp.usage)
                    yield raw
                    raw = await call.read()
                    if raw is grpc.aio.EOF:
                        break
                    resp = checker.check_raw(raw)
                checker.check_complete()
            except (grpc.aio.AioRpcError, BadStream) as e:
                raise self._failed_mid_stream(w, e) from None
            finally:
                call.cancel()           # no-op when finished; aborts the worker's request otherwise
                w.finish(p.key, time.time())       # it no longer loads the worker
            self.metrics.attempts.labels(w.name, "ok").inc()
            self.metrics.decisions.labels(self.policy, "ok" if attempt == 0 else "retried_ok").inc()
            self.metrics.e2e.labels(self.policy, p.model).observe(time.perf_counter() - p.arrived)
            return
        self.metrics.decisions.labels(self.policy, "failed").inc()
        if last_error.startswith("RESOURCE_EXHAUSTED"):
            raise RouterError(grpc.StatusCode.RESOURCE_EXHAUSTED, last_error.split(": ", 1)[1])
        raise RouterError(grpc.StatusCode.UNAVAILABLE,
                          f"no worker for model {p.model!r} could serve the request (last: {last_error})")

    async def _open(self, p: Prepared, choice: Choice, timeout: float | None, checker: StreamChecker):
        """(call, first response's bytes, its decoded copy) from `choice`'s worker, or _TryNext /
        RouterError."""
        w, key = choice.worker, p.key
        # A worker past its cooldown gets this request as its one trial: the breaker
        # reopens it for other requests until the trial succeeds or fails.
        self.breaker.allow(w.id)
        self.selector.claim(choice, key, p.prompt_len, p.hashes)
        upstream = self.selector.upstream(choice, p.upstream)
        if upstream is not p.upstream:
            self.metrics.kv_fetch_hints.labels(p.model).inc()
        call = self.channels.generate(w.lease.address)(upstream, timeout=timeout, metadata=p.metadata)
        checker.reset()
        wait = self.first_token_timeout
        try:
            # A worker that takes calls and never answers costs at most this much.
            raw = await asyncio.wait_for(call.read(), wait)
            if raw is grpc.aio.EOF:
                raise BadStream("the stream ended before any response")
            first = checker.check_raw(raw)
        except grpc.aio.AioRpcError as e:
            w.uncredit(key)
            if e.code() in CLIENT_ERRORS:
                self.metrics.attempts.labels(w.name, "rejected").inc()
                self.metrics.decisions.labels(self.policy, "rejected").inc()
                raise RouterError(e.code(), caller_field(e.details() or "", p.field)) from None
            why = f"{e.code().name}: {e.details()}"
            if e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                self.metrics.attempts.labels(w.name, "failed_before_first").inc()
            else:
                self._failed_before_first(w, "failed_before_first", why)
            raise _TryNext(why) from None
        except (asyncio.TimeoutError, BadStream) as e:
            call.cancel()
            w.uncredit(key)
            timed_out = isinstance(e, asyncio.TimeoutError)
            why = f"no response within the first-token deadline ({wait:g}s)" if timed_out else f"invalid stream: {e}"
            self._failed_before_first(w, "timeout_before_first" if timed_out else "bad_stream", why, trip=not timed_out)
            raise _TryNext(why) from None
        except asyncio.CancelledError:
            call.cancel()
            w.uncredit(key)
            raise
        self.breaker.success(w.id)
        w.prefill_done(key, time.time())
        self.metrics.ttft.labels(self.policy, p.model).observe(time.perf_counter() - p.arrived)
        self.metrics.predicted_cached.inc(choice.cached_tokens)
        self.metrics.prompt_tokens.inc(p.prompt_len)
        return call, raw, first

    def _failed_before_first(self, w: WorkerState, result: str, why: str, trip: bool = False) -> None:
        (self.breaker.trip if trip else self.breaker.failure)(w.id)
        self.metrics.attempts.labels(w.name, result).inc()
        log.warning("worker %s failed before the first token (%s); trying the next", w.id, why)

    def _failed_mid_stream(self, w: WorkerState, e: Exception) -> RouterError:
        if isinstance(e, grpc.aio.AioRpcError) and e.code() in CLIENT_ERRORS:
            # The worker named the request as the cause: the caller's error, not the worker's.
            self.metrics.attempts.labels(w.name, "rejected").inc()
            self.metrics.decisions.labels(self.policy, "rejected").inc()
            return RouterError(e.code(), e.details() or "")
        if isinstance(e, BadStream):
            self.breaker.trip(w.id)
        else:
            self.breaker.failure(w.id)
        self.metrics.attempts.labels(w.name, "failed_mid_stream").inc()
        self.metrics.decisions.labels(self.policy, "failed_mid_stream").inc()
        detail = f"{e.code().name}: {e.details()}" if isinstance(e, grpc.aio.AioRpcError) else f"invalid stream: {e}"
        return RouterError(grpc.StatusCode.UNAVAILABLE,
                           f"worker {w.id} failed mid-stream ({detail}); tokens already sent cannot be retried")

    def _observe_usage(self, p: Prepared, choice: Choice, usage: pb.Usage) -> None:
        self.metrics.reported_cached.inc(usage.cached_prompt_tokens)
        self.metrics.cached_error.labels(self.policy, p.model).observe(usage.cached_prompt_tokens
                                                                       - choice.cached_tokens)
        self.selector.scorer.observe_output(usage.completion_tokens)
        if self.on_usage is not None:
            self.on_usage(p, usage)
