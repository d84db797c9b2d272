"""Stage 1 of a request's way through the router: preparation, before any worker is chosen.

From the caller's GenerateRequest and identity to a `Prepared` request: the limits checked
(protos/limits.py), the model resolved to its live workers, the model's tokenizer pinned by the
digest its workers advertise (workers advertising another are left out), the prompt tokenized
once (in a thread), its length checked against max_model_len, and the prompt's block hashes
computed in the request's namespace, the tenant folded into its cache salt as the worker will fold
it (the worker scopes salt and request id itself, for the tenant the router names in its call:
runtime/security.py).
Everything refused here is a RouterError naming the field, and no worker has been asked for
anything but its tokenizer.
"""
from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import Counter
from dataclasses import dataclass

import grpc

from pagoda.protos.block_hash import namespace_root
from pagoda.protos.limits import Limits, check_fits, check_request
from pagoda.protos.pagoda.v1 import pagoda_pb2 as pb
from pagoda.router.breaker import CircuitBreaker
from pagoda.router.channels import WorkerChannels
from pagoda.router.cluster import Cluster
from pagoda.router.errors import RouterError
from pagoda.router.hashing import PromptHasher
from pagoda.router.scoring import WorkerState
from pagoda.runtime.security import Identity, scoped_id, scoped_salt, tenant_metadata
from pagoda.runtime.tokenization import PromptTokenizer, encode_prompt, prompt_field, tokenizer_digest

log = logging.getLogger(__name__)


@dataclass
class Pin:
    """A model's tokenizer as the router uses it, pinned by the digest workers advertise."""
    digest: str
    info: pb.ModelInfoResponse
    tokenizer: PromptTokenizer | None


@dataclass
class Prepared:
    """A request ready for worker selection."""
    model: str
    workers: list[WorkerState]       # the model's live workers with the pinned tokenizer
    pin: Pin
    field: str                       # what carried the prompt: text, messages or token_ids
    upstream: pb.GenerateRequest     # what a worker is sent: token ids, the model, the caller's id and salt
    metadata: tuple                  # of the worker call: the router's key and the tenant it acts for
    key: str                         # the request in the credit ledger: its id scoped to the tenant
    hashes: tuple[bytes, ...]        # the prompt's full blocks, in the request's (tenant-scoped) namespace
    arrived: float                   # perf_counter at arrival
    ident: Identity | None = None    # the caller

    @property
    def caller_id(self) -> str:
        return self.upstream.request_id

    @property
    def prompt_len(self) -> int:
        return len(self.upstream.token_ids)

    @property
    def n(self) -> int:
        sp = self.upstream.sampling
        return sp.n if sp.HasField("n") else 1

    @property
    def max_tokens(self) -> int | None:
        sp = self.upstream.sampling
        return sp.max_tokens if sp.HasField("max_tokens") else None


class Preparer:
    def __init__(self, cluster: Cluster, channels: WorkerChannels, breaker: CircuitBreaker,
                 limits: Limits = Limits()):
        self.cluster, self.channels, self.breaker, self.limits = cluster, channels, breaker, limits
        self.hasher = PromptHasher()
        self._roots: dict[tuple[str, str, str], bytes] = {}     # namespace -> pagoda.protos.block_hash root
        self._pins: dict[str, Pin] = {}
        self._pin_locks: dict[str, asyncio.Lock] = {}
        self._known_models: set[str] = set()
        self._warned: set[tuple[str, str]] = set()
        # model -> (pinned digest, cluster version, its workers, those with that digest)
        self._same: dict[str, tuple[str, int | None, list[WorkerState], list[WorkerState]]] = {}

    async def prepare(self, request: pb.GenerateRequest, ident: Identity | None) -> Prepared:
        arrived = time.perf_counter()
        try:
            check_request(request, self.limits)
            model, adapter = self.resolve_adapter(request.model, request.adapter)
            model, workers = self.candidates(model)
            pin = await self.pinned(model, workers)
            workers = self.same_tokenizer(model, workers, pin)
            if adapter:
                workers = self.with_adapter(model, adapter, workers)
            field, token_ids = await self.prompt_ids(pin, request)
            check_fits(field, len(token_ids), request.sampling, pin.info.max_model_len)
        except ValueError as e:
            raise RouterError.invalid(e) from None
        if not workers:
            raise RouterError(grpc.StatusCode.UNAVAILABLE,
                              f"model {model!r}: no live worker serves its pinned tokenizer {pin.digest}")
        upstream = pb.GenerateRequest()
        upstream.CopyFrom(request)
        upstream.ClearField("text")
        upstream.ClearField("messages")
        upstream.ClearField("kv_fetch")      # the router alone names a source (router/selection.py)
        upstream.token_ids[:] = token_ids
        upstream.model = model
        upstream.adapter = adapter
        if not upstream.request_id:
            upstream.request_id = uuid.uuid4().hex
        hashes = self.hashes(model, upstream.adapter, scoped_salt(ident, request.cache_salt), token_ids,
                             workers[0].lease.block_size)
        metadata = (self.channels.metadata or ()) + tenant_metadata(ident)
        return Prepared(model, workers, pin, field, upstream, metadata, scoped_id(ident, upstream.request_id),
                        hashes, arrived, ident)

    async def tokenize(self, request) -> tuple[str, list[int], int]:
        """(model, prompt token ids, its max_model_len): for Tokenize, and for a front that
        checks lengths itself."""
        try:
            check_request(request, self.limits)
            model, workers = self.candidates(self.resolve_adapter(request.model, getattr(request, "adapter", ""))[0])
            pin = await self.pinned(model, workers)
            return model, (await self.prompt_ids(pin, request))[1], pin.info.max_model_len
        except ValueError as e:
            raise RouterError.invalid(e) from None

    async def model_info(self, model: str) -> pb.ModelInfoResponse:
        return (await self.pin(model))[1].info

    async def pin(self, model: str) -> tuple[str, Pin]:
        """(the base model, its pin) for a model name, an adapter's name included: an adapter
        tokenizes as its base does."""
        model, workers = self.candidates(self.resolve_adapter(model, "")[0])
        return model, await self.pinned(model, workers)

    def hashes(self, model: str, adapter: str, cache_salt: str, token_ids: list[int],
               block_size: int) -> tuple[bytes, ...]:
        """The prompt's block hashes in namespace (model, adapter, salt)."""
        names = (model, adapter, cache_salt)
        root = self._roots.get(names)
        if root is None:            # a BLAKE2b and its keyword parsing, once per namespace
            if len(self._roots) >= 4096:
                self._roots.clear()
            root = self._roots[names] = namespace_root(*names)
        return self.hasher.hashes(token_ids, block_size, root)

    def resolve_adapter(self, model: str, adapter: str) -> tuple[str, str]:
        """(model, adapter) a request is for: a model that names a LoRA adapter (as OpenAI
        clients name one) is that adapter on its base model."""
        base = self.cluster.adapters().get(model) if model not in self.cluster.models() else None
        if base is None:
            return model, adapter
        if adapter and adapter != model:
            raise RouterError(grpc.StatusCode.INVALID_ARGUMENT,
                              f"adapter: {adapter!r} differs from the adapter the model names ({model!r})")
        return base, model

    def with_adapter(self, model: str, adapter: str, workers: list[WorkerState]) -> list[WorkerState]:
        """Of `workers`, those whose lease lists `adapter`; all of them when none does (a worker
        then answers for itself, naming the field)."""
        ids = {w.id for w in self.cluster.adapter_workers(model, adapter)}
        return [w for w in workers if w.id in ids] or workers

    def candidates(self, model: str) -> tuple[str, list[WorkerState]]:
        """The model a request names (or the only one served) and its live workers."""
        models = self.cluster.models()
        self._known_models.update(models)
        if not model:
            if len(models) > 1:
                raise RouterError(grpc.StatusCode.INVALID_ARGUMENT,
                                  f"model: required, this router serves {', '.join(models)}")
            if not models:
                raise RouterError(grpc.StatusCode.UNAVAILABLE, "no live worker serves any model")
            model = models[0]
        workers = self.cluster.live(model)
        if not workers:
            # A model served before is only down for now (retry); one never seen is unknown.
            code = grpc.StatusCode.UNAVAILABLE if model in self._known_models else grpc.StatusCode.NOT_FOUND
            raise RouterError(code, f"model: no live worker serves {model!r}"
                              + (f" (served: {', '.join(models)})" if models else ""))
        return model, workers

    async def prompt_ids(self, pin: Pin, request) -> tuple[str, list[int]]:
        """(the field that carried the prompt, its ids); tokenising runs in a thread so that a
        long prompt does not stall every other stream on the event loop."""
        field = prompt_field(request)
        if field != "token_ids" and pin.tokenizer is None:
            raise RouterError(grpc.StatusCode.FAILED_PRECONDITION,
                              f"{field}: model {pin.info.model!r} has no tokenizer; send token_ids")
        if request.HasField("text") and not request.text:
            raise ValueError("text: the prompt is empty")
        # A template error is the caller's input too: ValueError names the field.
        return await asyncio.to_thread(encode_prompt, pin.tokenizer, request)

    async def pinned(self, model: str, workers: list[WorkerState]) -> Pin:
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
                        info = await self.channels.stub(w.lease.address).GetModelInfo(
                            pb.ModelInfoRequest(model=model), timeout=10, metadata=self.channels.metadata)
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
                    pin = self._pins[model] = Pin(digest, info, tok)
                    return pin
            raise RouterError(grpc.StatusCode.UNAVAILABLE,
                              f"model {model!r}: no worker answered GetModelInfo ({last})")

    def same_tokenizer(self, model: str, workers: list[WorkerState], pin: Pin) -> list[WorkerState]:
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
