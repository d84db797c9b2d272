"""Python clients for pagoda (a router or a single worker): PagodaClient (blocking) and
AsyncPagodaClient (asyncio).

generate(...) yields Chunk objects as tokens stream; complete(...) returns one Completion.
Both take deadlines, TLS and per-call metadata, and retry UNAVAILABLE (no worker, worker
draining, connection refused) with backoff, but only before the first chunk: after that a
retry would duplicate text the caller has already seen.

direct=True (routers only): each request asks the router's Route where to go, then streams from
that worker itself with the grant the router signed, so the router relays nothing. Before the
first chunk, a worker that cannot be reached (within direct_connect_timeout) or that refuses the
grant sends the request back through the router's Generate (which fails over as ever); after it,
errors are the caller's as in proxy mode. Worker channels use the client's TLS settings and
carry the grant, not the client's API key. A target that does not route (a worker, an older
router) is streamed from as usual.
"""
from __future__ import annotations

import asyncio
import os
import random
import time
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import AsyncGenerator, AsyncIterator, Iterator, Optional, Sequence

import grpc

from pagoda.protos.pagoda.v1 import pagoda_pb2 as pb
from pagoda.protos.pagoda.v1 import pagoda_pb2_grpc as pb_grpc
from pagoda.runtime.security import GRANT_HEADER

_FINISH = {pb.FINISH_REASON_STOP: "stop", pb.FINISH_REASON_LENGTH: "length", pb.FINISH_REASON_ABORT: "abort"}
_SAMPLING = set(pb.SamplingParams.DESCRIPTOR.fields_by_name)
# Route answers that send the request through the router instead: it does not route (a worker,
# an older router), cannot sign grants, or has no worker now (Generate retries that with backoff).
_NO_ROUTE = (grpc.StatusCode.UNIMPLEMENTED, grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.UNAVAILABLE)
# A direct stream that fails with one of these before its first chunk goes through the router.
_FALL_BACK = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED,
              grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.NOT_FOUND, grpc.StatusCode.UNIMPLEMENTED)
_MAX_WORKER_CHANNELS = 64


@dataclass
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_prompt_tokens: int = 0


@dataclass
class Chunk:
    """What one step added to sequence `index`; the last chunk of a sequence has `finished`."""
    request_id: str
    index: int
    text: str
    token_ids: list[int]
    finished: bool
    finish_reason: Optional[str]            # "stop" | "length" | "abort" on the last chunk
    stop_reason: int | str | None
    usage: Optional[Usage]                  # on the last chunk
    worker_id: str
    logprobs: list = field(default_factory=list)

    @classmethod
    def from_proto(cls, r: pb.GenerateResponse) -> "Chunk":
        which = r.WhichOneof("stop_reason")
        return cls(request_id=r.request_id, index=r.index, text=r.text, token_ids=list(r.token_ids),
                   finished=r.finished, finish_reason=_FINISH.get(r.finish_reason) if r.finished else None,
                   stop_reason=getattr(r, which) if which else None,
                   usage=Usage(r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.cached_prompt_tokens)
                   if r.finished else None,
                   worker_id=r.worker_id, logprobs=list(r.logprobs))


@dataclass
class Choice:
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: Optional[str] = None
    stop_reason: int | str | None = None
    logprobs: list = field(default_factory=list)


@dataclass
class Completion:
    request_id: str
    choices: list[Choice]
    usage: Usage
    worker_id: str

    @property
    def text(self) -> str:
        return self.choices[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.choices[0].token_ids

    @property
    def finish_reason(self) -> Optional[str]:
        return self.choices[0].finish_reason


def build_request(prompt: str | Sequence[int] | None = None, *, messages: Optional[Sequence[dict]] = None,
                  system: Optional[str] = None, model: str = "", request_id: str = "", priority: int = 0,
                  cache_salt: str = "", add_generation_prompt: Optional[bool] = None, adapter: str = "",
                  **sampling) -> pb.GenerateRequest:
    """A GenerateRequest from Python values. `prompt` is text or token ids; `system` turns a text
    prompt into a two-message chat; `adapter` names a LoRA adapter (a router also takes its name
    as `model`). Sampling keywords are pagoda.v1.SamplingParams fields."""
    unknown = set(sampling) - _SAMPLING
    if unknown:
        raise TypeError(f"unknown sampling parameter(s): {', '.join(sorted(unknown))}")
    req = pb.GenerateRequest(model=model, request_id=request_id, priority=priority, cache_salt=cache_salt,
                             adapter=adapter)
    if isinstance(prompt, str) and (system is not None or messages is not None):
        messages = list(messages or []) + [{"role": "user", "content": prompt}]
        prompt = None
    if system is not None:
        messages = [{"role": "system", "content": system}] + list(messages or [])
    if isinstance(prompt, str):
        req.text = prompt
    elif prompt is not None:
        req.token_ids.extend(int(t) for t in prompt)
    for m in messages or ():
        req.messages.append(pb.ChatMessage(role=m["role"], content=m["content"]))
    if add_generation_prompt is not None:
        req.add_generation_prompt = add_generation_prompt
    if isinstance(sampling.get("stop"), str):
        sampling["stop"] = [sampling["stop"]]
    req.sampling.CopyFrom(pb.SamplingParams(**{k: v for k, v in sampling.items() if v is not None}))
    return req


def _credentials(root_certificates, private_key, certificate_chain):
    return grpc.ssl_channel_credentials(root_certificates=root_certificates, private_key=private_key,
                                        certificate_chain=certificate_chain)


class _Assembler:
    """Folds chunks into a Completion."""

    def __init__(self):
        self.choices: dict[int, Choice] = {}
        self.usage = Usage()
        self.request_id = self.worker_id = ""

    def add(self, c: Chunk) -> None:
        ch = self.choices.setdefault(c.index, Choice(c.index))
        ch.text += c.text
        ch.token_ids += c.token_ids
        ch.logprobs += c.logprobs
        self.request_id, self.worker_id = c.request_id, c.worker_id
        if c.finished:
            assert c.usage is not None   # a finished chunk always carries usage
            ch.finish_reason, ch.stop_reason = c.finish_reason, c.stop_reason
            # Prompt figures are per request; completion tokens add up over the n sequences.
            self.usage.prompt_tokens = c.usage.prompt_tokens
            self.usage.cached_prompt_tokens = max(self.usage.cached_prompt_tokens, c.usage.cached_prompt_tokens)
            self.usage.completion_tokens += c.usage.completion_tokens

    def result(self) -> Completion:
        return Completion(self.request_id, [self.choices[i] for i in sorted(self.choices)], self.usage,
                          self.worker_id)


class _Base:
    def __init__(self, target: str, *, tls: bool = False, root_certificates: Optional[bytes] = None,
                 private_key: Optional[bytes] = None, certificate_chain: Optional[bytes] = None,
                 metadata: Optional[Sequence[tuple[str, str]]] = (), timeout: Optional[float] = None,
                 retries: int = 3, backoff: float = 0.2, options: Sequence[tuple] = (),
                 api_key: Optional[str] = None, direct: bool = False, direct_connect_timeout: float = 2.0):
        """target: HOST:PORT. tls or any certificate -> a secure channel. metadata is sent on every
        call (per-call metadata is added to it; None means none); timeout is the default per-call deadline in seconds.
        api_key (default: $PAGODA_API_KEY) is sent as `authorization: Bearer KEY`. direct: stream
        from the worker the router picks (module docstring)."""
        self.direct, self.direct_connect_timeout = direct, direct_connect_timeout
        self._routes = direct            # False once the target answered that it does not route
        self._workers: dict = {}         # worker address -> (channel, stub), in direct mode
        api_key = api_key if api_key is not None else os.environ.get("PAGODA_API_KEY")
        auth = (("authorization", f"Bearer {api_key}"),) if api_key else ()
        self.target, self.metadata, self.timeout = target, auth + tuple(metadata or ()), timeout
        self.retries, self.backoff = retries, backoff
        self._secure = tls or any(x is not None for x in (root_certificates, private_key, certificate_chain))
        self._creds = _credentials(root_certificates, private_key, certificate_chain) if self._secure else None
        self._options = list(options)

    def _call_args(self, timeout, metadata):
        return dict(timeout=self.timeout if timeout is None else timeout,
                    metadata=self.metadata + tuple(metadata or ()))

    def _delay(self, attempt: int) -> float:
        return self.backoff * (2 ** attempt) * (0.5 + random.random())

    def _new_channel(self, address: str):
        raise NotImplementedError

    def _worker_channel(self, address: str) -> tuple:
        """(channel, stub, new?) for a worker address; the oldest is closed past the bound."""
        entry = self._workers.get(address)
        if entry is not None:
            return entry + (False,)
        if len(self._workers) >= _MAX_WORKER_CHANNELS:
            self._close_channel(self._workers.pop(next(iter(self._workers)))[0])
        channel = self._new_channel(address)
        entry = self._workers[address] = (channel, pb_grpc.GenerationStub(channel))
        return entry + (True,)

    def _close_channel(self, channel) -> None:
        raise NotImplementedError

    def _no_route(self, e: grpc.RpcError) -> bool:
        """Route failed: True to go through the router's Generate instead, False to raise."""
        if e.code() == grpc.StatusCode.UNIMPLEMENTED:
            self._routes = False         # not a router that routes: do not ask again
        return e.code() in _NO_ROUTE

    @staticmethod
    def _grant_metadata(route: pb.RouteResponse) -> tuple:
        return ((GRANT_HEADER, route.grant),) if route.grant else ()

    @staticmethod
    def _through_router(req: pb.GenerateRequest, route: pb.RouteResponse) -> pb.GenerateRequest:
        """The caller's request, under the id the router gave it (its credit is replaced, not doubled)."""
        again = pb.GenerateRequest()
        again.CopyFrom(req)
        again.request_id = route.request.request_id
        return again


class PagodaClient(_Base):
    """Blocking client. Use as a context manager or call close()."""

    def __init__(self, target: str, **kw):
        super().__init__(target, **kw)
        self.channel = (grpc.secure_channel(target, self._creds, options=self._options) if self._secure
                        else grpc.insecure_channel(target, options=self._options))
        self.generation = pb_grpc.GenerationStub(self.channel)
        self.admin = pb_grpc.AdminStub(self.channel)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def close(self) -> None:
        self.channel.close()
        for channel, _ in self._workers.values():
            channel.close()
        self._workers.clear()

    def generate(self, prompt=None, *, timeout: Optional[float] = None, metadata=None, **kw) -> Iterator[Chunk]:
        """Stream chunks. Closing the iterator early cancels the call (and the request)."""
        yield from self.generate_request(build_request(prompt, **kw), timeout=timeout, metadata=metadata)

    def generate_request(self, req: pb.GenerateRequest, *, timeout=None, metadata=None) -> Iterator[Chunk]:
        if self._routes:
            route = self._route(req, timeout, metadata)
            if route is not None:
                started = False
                try:
                    for chunk in self._direct(route, timeout):
                        started = True
                        yield chunk
                    return
                except grpc.RpcError as e:
                    if started or e.code() not in _FALL_BACK:
                        raise
                except grpc.FutureTimeoutError:
                    pass                # the worker cannot be reached from here
                req = self._through_router(req, route)
        attempt = 0
        while True:
            call = self.generation.Generate(req, **self._call_args(timeout, metadata))
            started = False
            try:
                for resp in call:
                    started = True
                    yield Chunk.from_proto(resp)
                return
            except grpc.RpcError as e:
                if started or e.code() != grpc.StatusCode.UNAVAILABLE or attempt >= self.retries:
                    raise
            finally:
                call.cancel()   # no-op when the stream ended; stops the request when abandoned
            time.sleep(self._delay(attempt))
            attempt += 1

    def _route(self, req, timeout, metadata) -> Optional[pb.RouteResponse]:
        try:
            return self.generation.Route(req, **self._call_args(timeout, metadata))
        except grpc.RpcError as e:
            if self._no_route(e):
                return None
            raise

    def _direct(self, route: pb.RouteResponse, timeout) -> Iterator[Chunk]:
        channel, stub, new = self._worker_channel(route.worker_address)
        if new:
            try:
                grpc.channel_ready_future(channel).result(timeout=self.direct_connect_timeout)
            except grpc.FutureTimeoutError:
                self._close_channel(self._workers.pop(route.worker_address)[0])
                raise
        call = stub.Generate(route.request, timeout=self.timeout if timeout is None else timeout,
                             metadata=self._grant_metadata(route))
        try:
            for resp in call:
                yield Chunk.from_proto(resp)
        finally:
            call.cancel()

    def _new_channel(self, address: str):
        return (grpc.secure_channel(address, self._creds, options=self._options) if self._secure
                else grpc.insecure_channel(address, options=self._options))

    def _close_channel(self, channel) -> None:
        channel.close()

    def complete(self, prompt=None, *, timeout=None, metadata=None, **kw) -> Completion:
        acc = _Assembler()
        for c in self.generate(prompt, timeout=timeout, metadata=metadata, **kw):
            acc.add(c)
        return acc.result()

    def model_info(self, model: str = "", *, timeout=None, metadata=None) -> pb.ModelInfoResponse:
        return self.generation.GetModelInfo(pb.ModelInfoRequest(model=model), **self._call_args(timeout, metadata))

    def tokenize(self, text: Optional[str] = None, *, messages=None, model: str = "", timeout=None,
                 metadata=None) -> list[int]:
        req = pb.TokenizeRequest(model=model, messages=[pb.ChatMessage(**m) for m in messages or ()])
        if text is not None:
            req.text = text
        return list(self.generation.Tokenize(req, **self._call_args(timeout, metadata)).token_ids)

    def load(self, *, timeout=None, metadata=None) -> pb.LoadReport:
        return self.admin.GetLoad(pb.LoadRequest(), **self._call_args(timeout, metadata))

    def abort(self, request_id: str, *, timeout=None, metadata=None) -> bool:
        return self.admin.Abort(pb.AbortRequest(request_id=request_id), **self._call_args(timeout, metadata)).found

    def drain(self, *, timeout=None, metadata=None) -> int:
        return self.admin.Drain(pb.DrainRequest(), **self._call_args(timeout, metadata)).running

    def load_lora_adapter(self, lora_name: str, lora_path: str, *, timeout=None, metadata=None) -> list[str]:
        """A worker's Admin: register a PEFT adapter; -> the adapters it serves after."""
        req = pb.LoadLoRAAdapterRequest(lora_name=lora_name, lora_path=lora_path)
        return list(self.admin.LoadLoRAAdapter(req, **self._call_args(timeout, metadata)).adapters)

    def unload_lora_adapter(self, lora_name: str, *, timeout=None, metadata=None) -> list[str]:
        req = pb.UnloadLoRAAdapterRequest(lora_name=lora_name)
        return list(self.admin.UnloadLoRAAdapter(req, **self._call_args(timeout, metadata)).adapters)


class AsyncPagodaClient(_Base):
    """asyncio client. Use as an async context manager or await close()."""

    def __init__(self, target: str, **kw):
        super().__init__(target, **kw)
        self.channel = (grpc.aio.secure_channel(target, self._creds, options=self._options) if self._secure
                        else grpc.aio.insecure_channel(target, options=self._options))
        self.generation = pb_grpc.GenerationStub(self.channel)
        self.admin = pb_grpc.AdminStub(self.channel)

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        await self.close()

    async def close(self) -> None:
        await self.channel.close()
        for channel, _ in self._workers.values():
            await channel.close()
        self._workers.clear()

    async def generate(self, prompt=None, *, timeout: Optional[float] = None, metadata=None,
                       **kw) -> AsyncIterator[Chunk]:
        """Stream chunks. aclose() on the iterator, or cancelling the task, cancels the request."""
        async for c in self.generate_request(build_request(prompt, **kw), timeout=timeout, metadata=metadata):
            yield c

    async def generate_request(self, req: pb.GenerateRequest, *, timeout=None, metadata=None) -> AsyncIterator[Chunk]:
        if self._routes:
            route = await self._route(req, timeout, metadata)
            if route is not None:
                started = False
                try:
                    # aclosing: a caller that stops reading cancels the worker's call now.
                    async with aclosing(self._direct(route, timeout)) as chunks:
                        async for chunk in chunks:
                            started = True
                            yield chunk
                    return
                except grpc.aio.AioRpcError as e:
                    if started or e.code() not in _FALL_BACK:
                        raise
                except asyncio.TimeoutError:
                    pass                # the worker cannot be reached from here
                req = self._through_router(req, route)
        attempt = 0
        while True:
            call = self.generation.Generate(req, **self._call_args(timeout, metadata))
            started = False
            try:
                async for resp in call:
                    started = True
                    yield Chunk.from_proto(resp)
                return
            except grpc.aio.AioRpcError as e:
                if started or e.code() != grpc.StatusCode.UNAVAILABLE or attempt >= self.retries:
                    raise
            finally:
                call.cancel()
            await asyncio.sleep(self._delay(attempt))
            attempt += 1

    async def _route(self, req, timeout, metadata) -> Optional[pb.RouteResponse]:
        try:
            return await self.generation.Route(req, **self._call_args(timeout, metadata))
        except grpc.aio.AioRpcError as e:
            if self._no_route(e):
                return None
            raise

    async def _direct(self, route: pb.RouteResponse, timeout) -> AsyncGenerator[Chunk, None]:
        channel, stub, _ = self._worker_channel(route.worker_address)
        if channel.get_state(try_to_connect=True) != grpc.ChannelConnectivity.READY:
            try:
                await asyncio.wait_for(channel.channel_ready(), self.direct_connect_timeout)
            except asyncio.TimeoutError:
                self._close_channel(self._workers.pop(route.worker_address)[0])
                raise
        call = stub.Generate(route.request, timeout=self.timeout if timeout is None else timeout,
                             metadata=self._grant_metadata(route))
        try:
            async for resp in call:
                yield Chunk.from_proto(resp)
        finally:
            call.cancel()

    def _new_channel(self, address: str):
        return (grpc.aio.secure_channel(address, self._creds, options=self._options) if self._secure
                else grpc.aio.insecure_channel(address, options=self._options))

    def _close_channel(self, channel) -> None:
        asyncio.ensure_future(channel.close())

    async def complete(self, prompt=None, *, timeout=None, metadata=None, **kw) -> Completion:
        acc = _Assembler()
        async for c in self.generate(prompt, timeout=timeout, metadata=metadata, **kw):
            acc.add(c)
        return acc.result()

    async def model_info(self, model: str = "", *, timeout=None, metadata=None) -> pb.ModelInfoResponse:
        return await self.generation.GetModelInfo(pb.ModelInfoRequest(model=model),
                                                  **self._call_args(timeout, metadata))

    async def tokenize(self, text: Optional[str] = None, *, messages=None, model: str = "", timeout=None,
                       metadata=None) -> list[int]:
        req = pb.TokenizeRequest(model=model, messages=[pb.ChatMessage(**m) for m in messages or ()])
        if text is not None:
            req.text = text
        return list((await self.generation.Tokenize(req, **self._call_args(timeout, metadata))).token_ids)

    async def load(self, *, timeout=None, metadata=None) -> pb.LoadReport:
        return await self.admin.GetLoad(pb.LoadRequest(), **self._call_args(timeout, metadata))

    async def abort(self, request_id: str, *, timeout=None, metadata=None) -> bool:
        return (await self.admin.Abort(pb.AbortRequest(request_id=request_id),
                                       **self._call_args(timeout, metadata))).found

    async def drain(self, *, timeout=None, metadata=None) -> int:
        return (await self.admin.Drain(pb.DrainRequest(), **self._call_args(timeout, metadata))).running

    async def load_lora_adapter(self, lora_name: str, lora_path: str, *, timeout=None, metadata=None) -> list[str]:
        req = pb.LoadLoRAAdapterRequest(lora_name=lora_name, lora_path=lora_path)
        return list((await self.admin.LoadLoRAAdapter(req, **self._call_args(timeout, metadata))).adapters)

    async def unload_lora_adapter(self, lora_name: str, *, timeout=None, metadata=None) -> list[str]:
        req = pb.UnloadLoRAAdapterRequest(lora_name=lora_name)
        return list((await self.admin.UnloadLoRAAdapter(req, **self._call_args(timeout, metadata))).adapters)
