"""Stage 3: the proxy. Open the stream on the best ranked worker and relay it, failing over
before the first token; keep the credit ledger of each attempt.

A worker that fails before its first response (an error status other than the caller's own
mistake, no response within --first-token-timeout, a first response that breaks the protocol)
is marked in the circuit breaker and the next ranked worker is tried; RESOURCE_EXHAUSTED (a
full queue) moves on without counting against the worker. After the first response a failure
ends the stream with UNAVAILABLE, since tokens cannot be taken back. Worker streams are checked
(router/stream_check.py) as they are relayed.

The ledger, per attempt: claimed (credited, prefix speculated) when sent; uncredited when it
fails before its first token; its prefill done at the first token; finished when the stream
ends however it ends (so a worker is never left loaded with a request it no longer runs).
"""
from __future__ import annotations

import asyncio
import logging
import time
from contextlib import aclosing
from typing import AsyncGenerator

import grpc

from protos.pagoda.v1 import pagoda_pb2 as pb
from router.breaker import CircuitBreaker
from router.channels import WorkerChannels
from router.errors import CLIENT_ERRORS, RouterError, caller_field
from router.metrics import RouterMetrics
from router.prepare import Prepared
from router.scoring import Choice, WorkerState
from router.selection import Selector
from router.stream_check import BadStream, StreamChecker

log = logging.getLogger(__name__)


class _TryNext(Exception):
    """This attempt failed before its first token; the message says how."""


class Proxy:
    def __init__(self, channels: WorkerChannels, selector: Selector, breaker: CircuitBreaker,
                 metrics: RouterMetrics, first_token_timeout: float = 60.0):
        self.channels, self.selector, self.breaker, self.metrics = channels, selector, breaker, metrics
        self.first_token_timeout = first_token_timeout

    @property
    def policy(self) -> str:
        return self.selector.scorer.policy

    async def stream(self, p: Prepared, ranked: list[Choice], timeout: float | None
                     ) -> AsyncGenerator[pb.GenerateResponse, None]:
        """The responses of the first ranked worker that answers, with the caller's request id."""
        checker = StreamChecker(p.n, p.pin.info.vocab_size)
        last_error = "no worker tried"
        for attempt, choice in enumerate(ranked):
            try:
                call, first = await self._open(p, choice, timeout, checker)
            except _TryNext as e:
                last_error = str(e)
                continue
            async with aclosing(self._relay(p, choice, call, first, checker, attempt)) as relay:
                async for resp in relay:
                    yield resp
            return
        self.metrics.decisions.labels(self.policy, "failed").inc()
        if last_error.startswith("RESOURCE_EXHAUSTED"):
            raise RouterError(grpc.StatusCode.RESOURCE_EXHAUSTED, last_error.split(": ", 1)[1])
        raise RouterError(grpc.StatusCode.UNAVAILABLE,
                          f"no worker for model {p.model!r} could serve the request (last: {last_error})")

    async def _open(self, p: Prepared, choice: Choice, timeout: float | None, checker: StreamChecker):
        """(call, first response) from `choice`'s worker, or _TryNext / RouterError."""
        w, rid = choice.worker, p.upstream.request_id
        # A worker past its cooldown gets this request as its one trial: the breaker
        # reopens it for other requests until the trial succeeds or fails.
        self.breaker.allow(w.id)
        self.selector.claim(choice, rid, p.prompt_len, p.hashes)
        call = self.channels.stub(w.lease.address).Generate(p.upstream, timeout=timeout,
                                                            metadata=self.channels.metadata)
        checker.reset()
        wait = self.first_token_timeout
        try:
            # A worker that takes calls and never answers costs at most this much.
            first = await asyncio.wait_for(call.read(), wait)
            if first is grpc.aio.EOF:
                raise BadStream("the stream ended before any response")
            checker.check(first)
        except grpc.aio.AioRpcError as e:
            w.uncredit(rid)
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
            w.uncredit(rid)
            timed_out = isinstance(e, asyncio.TimeoutError)
            why = f"no response within the first-token deadline ({wait:g}s)" if timed_out else f"invalid stream: {e}"
            self._failed_before_first(w, "timeout_before_first" if timed_out else "bad_stream", why)
            raise _TryNext(why) from None
        except asyncio.CancelledError:
            call.cancel()
            w.uncredit(rid)
            raise
        self.breaker.success(w.id)
        w.prefill_done(rid, time.time())
        self.metrics.ttft.labels(self.policy, p.model).observe(time.perf_counter() - p.arrived)
        self.metrics.predicted_cached.inc(choice.cached_tokens)
        self.metrics.prompt_tokens.inc(p.prompt_len)
        return call, first

    def _failed_before_first(self, w: WorkerState, result: str, why: str) -> None:
        self.breaker.failure(w.id)
        self.metrics.attempts.labels(w.name, result).inc()
        log.warning("worker %s failed before the first token (%s); trying the next", w.id, why)

    async def _relay(self, p: Prepared, choice: Choice, call, first: pb.GenerateResponse, checker: StreamChecker,
                     attempt: int) -> AsyncGenerator[pb.GenerateResponse, None]:
        w, policy = choice.worker, self.policy
        reported = False
        resp = first
        try:
            while resp is not grpc.aio.EOF:
                if resp.finished and resp.index == 0 and not reported and resp.HasField("usage"):
                    self._observe_usage(p, choice, resp.usage)
                    reported = True
                resp.request_id = p.caller_id        # the caller's id, not the tenant-scoped one
                yield resp
                resp = await call.read()
                if resp is not grpc.aio.EOF:
                    checker.check(resp)
            checker.check_complete()
        except (grpc.aio.AioRpcError, BadStream) as e:
            self.breaker.failure(w.id)
            self.metrics.attempts.labels(w.name, "failed_mid_stream").inc()
            self.metrics.decisions.labels(policy, "failed_mid_stream").inc()
            detail = f"{e.code().name}: {e.details()}" if isinstance(e, grpc.aio.AioRpcError) \
                else f"invalid stream: {e}"
            raise RouterError(grpc.StatusCode.UNAVAILABLE,
                              f"worker {w.id} failed mid-stream ({detail}); tokens already sent cannot be retried") \
                from None
        finally:
            call.cancel()               # no-op when finished; aborts the worker's request otherwise
            w.finish(p.upstream.request_id, time.time())     # it no longer loads the worker
        self.metrics.attempts.labels(w.name, "ok").inc()
        self.metrics.decisions.labels(policy, "ok" if attempt == 0 else "retried_ok").inc()
        self.metrics.e2e.labels(policy, p.model).observe(time.perf_counter() - p.arrived)

    def _observe_usage(self, p: Prepared, choice: Choice, usage: pb.Usage) -> None:
        self.metrics.reported_cached.inc(usage.cached_prompt_tokens)
        self.metrics.cached_error.labels(self.policy, p.model).observe(usage.cached_prompt_tokens
                                                                       - choice.cached_tokens)
        self.selector.scorer.observe_output(usage.completion_tokens)
