"""Python clients for pagoda (a router or a single worker): PagodaClient (blocking) and
AsyncPagodaClient (asyncio).

generate(...) yields Chunk objects as tokens stream; complete(...) returns one Completion.
Both take deadlines, TLS and per-call metadata, and retry UNAVAILABLE (no worker, worker
draining, connection refused) with backoff, but only before the first chunk: after that a
retry would duplicate text the caller has already seen.
"""
from __future__ import annotations

import asyncio
import os
import random
import time
from dataclasses import dataclass, field
from typing import AsyncIterator, Iterator, Optional, Sequence

import grpc

from protos.pagoda.v1 import pagoda_pb2 as pb
from protos.pagoda.v1 import pagoda_pb2_grpc as pb_grpc

_FINISH = {pb.FINISH_REASON_STOP: "stop", pb.FINISH_REASON_LENGTH: "length", pb.FINISH_REASON_ABORT: "abort"}
_SAMPLING = set(pb.SamplingParams.DESCRIPTOR.fields_by_name)


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
                  cache_salt: str = "", add_generation_prompt: Optional[bool] = None,
                  **sampling) -> pb.GenerateRequest:
    """A GenerateRequest from Python values. `prompt` is text or token ids; `system` turns a text
    prompt into a two-message chat. Sampling keywords are pagoda.v1.SamplingParams fields."""
    unknown = set(sampling) - _SAMPLING
    if unknown:
        raise TypeError(f"unknown sampling parameter(s): {', '.join(sorted(unknown))}")
    req = pb.GenerateRequest(model=model, request_id=request_id, priority=priority, cache_salt=cache_salt)
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
                 api_key: Optional[str] = None):
        """target: HOST:PORT. tls or any certificate -> a secure channel. metadata is sent on every
        call (per-call metadata is added to it; None means none); timeout is the default per-call deadline in seconds.
        api_key (default: $PAGODA_API_KEY) is sent as `authorization: Bearer KEY`."""
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

    def generate(self, prompt=None, *, timeout: Optional[float] = None, metadata=None, **kw) -> Iterator[Chunk]:
        """Stream chunks. Closing the iterator early cancels the call (and the request)."""
        yield from self.generate_request(build_request(prompt, **kw), timeout=timeout, metadata=metadata)

    def generate_request(self, req: pb.GenerateRequest, *, timeout=None, metadata=None) -> Iterator[Chunk]:
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

    async def generate(self, prompt=None, *, timeout: Optional[float] = None, metadata=None,
                       **kw) -> AsyncIterator[Chunk]:
        """Stream chunks. aclose() on the iterator, or cancelling the task, cancels the request."""
        async for c in self.generate_request(build_request(prompt, **kw), timeout=timeout, metadata=metadata):
            yield c

    async def generate_request(self, req: pb.GenerateRequest, *, timeout=None, metadata=None) -> AsyncIterator[Chunk]:
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
