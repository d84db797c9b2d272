"""The worker's gRPC server (grpc.aio): pagoda.v1 Generation and Admin over one AsyncLLM,
plus standard health checking, server reflection, Prometheus metrics and graceful drain.

Request handling is a thin translation: proto -> (token ids, SamplingParams) -> AsyncLLM.generate
-> GenerateResponse per delta. The engine validates; its ValueError becomes INVALID_ARGUMENT with
the engine's message (which names the field). A request that a stage of a step failed alone
(core/faults.py: RequestFault) also ends INVALID_ARGUMENT, even after its first token, so that
neither the router nor a client retries it elsewhere; a dead engine turns the health NOT_SERVING.
A cancelled call or passed deadline cancels the handler task, which closes the engine stream and
so aborts the request.
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import math
import signal
import time
import uuid
from typing import TYPE_CHECKING, Optional

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from pagoda.gpu_worker.core.config import EngineConfig
from pagoda.gpu_worker.core.faults import RequestFault
from pagoda.gpu_worker.core.sampling_params import SamplingParams
from pagoda.gpu_worker.features.structured_output import GrammarCompiler, spec_from_proto
from pagoda.gpu_worker.runner.distributed import RankFailure
from pagoda.gpu_worker.serving import args as worker_args
from pagoda.gpu_worker.serving.async_llm import AsyncLLM, QueueFullError
from pagoda.gpu_worker.serving.engine_client import EngineClient
from pagoda.gpu_worker.serving.kv_transfer import KVFetcher, peer_credentials, serve_fetch, transfer_block_bytes
from pagoda.gpu_worker.serving.metrics import WorkerMetrics
from pagoda.protos import redis_schema as rs
from pagoda.protos.limits import Limits, check_fits, check_request
from pagoda.protos.pagoda.v1 import pagoda_pb2 as pb
from pagoda.protos.pagoda.v1 import pagoda_pb2_grpc as pb_grpc
from pagoda.runtime import serving
from pagoda.runtime.security import (
    AuthInterceptor,
    GrantError,
    GrantVerifier,
    KeyRing,
    acting_identity,
    grant_of,
    identity,
    read_key,
    scoped_id,
    scoped_salt,
    server_credentials,
)
from pagoda.runtime.serving import StartupError, StopDeadline, at_stage, bind, check_port_free, server_options
from pagoda.runtime.tokenization import PromptTokenizer, encode_prompt

if TYPE_CHECKING:       # imported when a publisher starts: redis may be missing
    from pagoda.gpu_worker.serving.publisher import Publisher

log = logging.getLogger("pagoda.gpu_worker.serving.server")

_FINISH = {"stop": pb.FINISH_REASON_STOP, "length": pb.FINISH_REASON_LENGTH, "abort": pb.FINISH_REASON_ABORT}
_SCALARS = ("n", "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
            "frequency_penalty", "seed", "max_tokens", "min_tokens", "logprobs", "prompt_logprobs",
            "skip_special_tokens", "best_of", "length_penalty")


def sampling_from_proto(sp: pb.SamplingParams) -> SamplingParams:
    """Only fields the caller set override the engine's defaults."""
    kw = {name: getattr(sp, name) for name in _SCALARS if sp.HasField(name)}
    if sp.use_beam_search:
        # As vLLM's OpenAI server used to: beams are ranked by log-probability, not drawn.
        if kw.get("temperature", 0.0) != 0.0:
            raise ValueError(f"temperature: must be 0 with use_beam_search (got {sp.temperature:g})")
        kw["temperature"] = 0.0
    if sp.logit_bias:
        kw["logit_bias"] = dict(sp.logit_bias)
    return SamplingParams(stop=list(sp.stop), stop_token_ids=list(sp.stop_token_ids), ignore_eos=sp.ignore_eos,
                          include_stop_str_in_output=sp.include_stop_str_in_output,
                          use_beam_search=sp.use_beam_search, **kw)


class _Invalid(Exception):
    """A request field the server itself refuses (before the engine sees it)."""


class _NotFound(Exception):
    """The request names a model this worker does not serve."""


class WorkerService(pb_grpc.GenerationServicer, pb_grpc.AdminServicer):
    def __init__(self, engine: EngineClient, worker_id: str, metrics=None,
                 health_servicer: Optional[health.aio.HealthServicer] = None, on_drain=None,
                 limits: Limits = Limits(), keyring: Optional[KeyRing] = None,
                 kv_fetcher: Optional[KVFetcher] = None):
        self.engine, self.worker_id, self.limits = engine, worker_id, limits
        self.kv_fetcher = kv_fetcher or KVFetcher(engine.model_name)
        # The engine's tokenizer, the process's only one: prompts, served texts, digest, grammars.
        self.tokenizer: PromptTokenizer = engine.tokenizer
        self.keyring = keyring
        # Direct mode (runtime/security.py): grants signed by a router with one of our admin keys.
        self.grants = GrantVerifier(keyring, worker_id) if keyring is not None else None
        self.epoch = rs.new_epoch()                # of this process; also in the Redis lease
        self.on_drain = on_drain                   # async callable run once when draining starts
        self.metrics, self.health = metrics, health_servicer
        self.model_name = engine.model_name
        self.draining = False
        self.active: set[asyncio.Task] = set()     # handler tasks of open Generate streams
        self.grammars = GrammarCompiler(self.tokenizer.tokenizer_json, engine.vocab_size, engine.eos_token_ids)

    # ---- Generation ---------------------------------------------------------------------

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext):
        if self.draining:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "worker is draining; send the request elsewhere")
        ident = acting_identity(self.keyring, context)
        grant = grant_of(context) if self.grants is not None else None
        if grant is not None and self.grants is not None:   # direct mode: the router's grant says who
            try:
                ident = self.grants.verify(grant, request)
            except GrantError as e:
                await context.abort(e.code, str(e))
        if request.HasField("kv_fetch") and grant is None and self.keyring is not None and not getattr(
                identity(self.keyring, context), "admin", False):
            # The fetch sends this worker's peer key to the source the hint names: only the router
            # (an admin key, or the grant it signed over the request) may name one.
            await context.abort(grpc.StatusCode.PERMISSION_DENIED,
                                "kv_fetch: only a router (an admin key, or its grant) may set a fetch hint")
        try:
            field, ids = await self._prompt_ids(request)
            params = sampling_from_proto(request.sampling)
            check_fits(field, len(ids), request.sampling, self.engine.max_model_len)
            spec = spec_from_proto(request.sampling.structured_output)
            if spec is not None:            # compiled in a thread (cached per spec), off the loops
                params.structured_output = await asyncio.to_thread(self.grammars.compile, spec)
        except _NotFound as e:
            await context.abort(grpc.StatusCode.NOT_FOUND, str(e))
        except (_Invalid, ValueError) as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        rid = request.request_id or uuid.uuid4().hex
        task = asyncio.current_task()
        assert task is not None   # gRPC handlers run as tasks
        self.active.add(task)
        try:
            if request.HasField("kv_fetch"):    # the prefix a peer holds, before this prefill
                await self.kv_fetcher.fetch(self.engine, ids, request.kv_fetch,
                                            scoped_salt(ident, request.cache_salt), request.adapter)
            async for resp in self._stream(rid, field, ids, params, request, context, ident):
                resp.request_id = rid          # the caller's id, not the tenant-scoped one
                yield resp
        finally:
            self.active.discard(task)

    async def _stream(self, rid, field, ids, params, request, context, ident):
        t0 = time.monotonic()
        last: dict[int, float] = {}                # per sequence: when its last token went out
        stream = self.engine.generate(scoped_id(ident, rid), ids, params, priority=request.priority,
                                      cache_salt=scoped_salt(ident, request.cache_salt), adapter=request.adapter,
                                      tenant=ident.tenant if ident is not None else "")
        started = False
        try:
            async for delta in stream:
                started = True
                self._observe(delta, t0, last)
                yield self._response(delta)
        except RequestFault as e:      # this request's own doing: another worker would fail it too
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except ValueError as e:
            if started:
                raise
            # The engine names its own argument; the caller knows the request field it filled.
            msg = str(e)
            if msg.startswith("prompt_token_ids:"):
                msg = field + msg[len("prompt_token_ids"):]
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, msg)
        except RankFailure as e:       # the worker is going down; the caller should retry elsewhere
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
        except QueueFullError as e:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e) or "waiting queue is full")
        except RuntimeError as e:
            if started:
                raise
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"engine unavailable: {e}")
        finally:
            # Closing the engine stream is what aborts the request when the call was cancelled.
            await stream.aclose()

    async def _prompt_ids(self, request) -> tuple[str, list[int]]:
        """(the field of a GenerateRequest or TokenizeRequest that carried the prompt, its ids).
        Limits first; tokenising runs in a thread so a long prompt cannot stall the event loop
        (other streams, heartbeats)."""
        self._check_model(request.model)
        check_request(request, self.limits)
        if request.HasField("text") and not request.text:
            raise _Invalid("text: the prompt is empty")
        return await asyncio.to_thread(encode_prompt, self.tokenizer, request)

    def _check_model(self, model: str) -> None:
        if model and model != self.model_name:
            raise _NotFound(f"model: unknown model {model!r}; this worker serves {self.model_name!r}")

    def _observe(self, delta, t0: float, last: dict[int, float]) -> None:
        if self.metrics is None:
            return
        now = time.monotonic()
        if delta.token_ids:
            prev = last.get(delta.index)
            if prev is None:
                self.metrics.ttft.observe(now - t0)
            else:
                # A delta can carry several tokens (e.g. a held-back stop string released).
                for _ in delta.token_ids:
                    self.metrics.itl.observe((now - prev) / len(delta.token_ids))
            last[delta.index] = now
        if delta.finished:
            self.metrics.e2e.observe(now - t0)
            self.metrics.request_finished(delta.finish_reason)

    def _response(self, d) -> pb.GenerateResponse:
        resp = pb.GenerateResponse(request_id=d.request_id, index=d.index, token_ids=d.token_ids, text=d.text,
                                   finished=d.finished, worker_id=self.worker_id)
        for lp in d.logprobs or ():
            resp.logprobs.append(pb.Logprobs(sampled=self._lp(lp.sampled), top=[self._lp(t) for t in lp.top]))
        for lp in d.prompt_logprobs or ():
            resp.prompt_logprobs.append(pb.Logprobs(sampled=self._lp(lp.sampled), top=[self._lp(t) for t in lp.top]))
        if d.cumulative_logprob is not None:
            resp.cumulative_logprob = d.cumulative_logprob
        if d.finished:
            resp.finish_reason = _FINISH.get(d.finish_reason, pb.FINISH_REASON_UNSPECIFIED)
            if isinstance(d.stop_reason, str):
                resp.stop_str = d.stop_reason
            elif isinstance(d.stop_reason, int):
                resp.stop_token_id = d.stop_reason
            resp.usage.CopyFrom(pb.Usage(prompt_tokens=d.num_prompt_tokens, completion_tokens=d.num_output_tokens,
                                         cached_prompt_tokens=d.num_cached_tokens))
        return resp

    def _lp(self, lp) -> pb.TokenLogprob:
        value = lp.logprob if math.isfinite(lp.logprob) else -1e30
        return pb.TokenLogprob(token_id=lp.token_id, logprob=value,
                               token=self.tokenizer.decode([lp.token_id], skip_special_tokens=False))

    async def GetModelInfo(self, request, context):
        try:
            self._check_model(request.model)
        except _NotFound as err:
            await context.abort(grpc.StatusCode.NOT_FOUND, str(err))
        e = self.engine
        return pb.ModelInfoResponse(model=self.model_name, max_model_len=e.max_model_len, block_size=e.block_size,
                                    vocab_size=e.vocab_size, eos_token_ids=list(e.eos_token_ids),
                                    tokenizer_json=self.tokenizer.tokenizer_json,
                                    tokenizer_config_json=self.tokenizer.tokenizer_config_json,
                                    worker_id=self.worker_id, epoch=self.epoch)

    async def Tokenize(self, request, context):
        try:
            return pb.TokenizeResponse(token_ids=(await self._prompt_ids(request))[1])
        except _NotFound as e:
            await context.abort(grpc.StatusCode.NOT_FOUND, str(e))
        except (_Invalid, ValueError) as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))

    # ---- Admin --------------------------------------------------------------------------

    async def GetLoad(self, request, context):
        s = self.engine.stats()
        return pb.LoadReport(worker_id=self.worker_id, model=self.model_name, running=s.running, waiting=s.waiting,
                             queued_prefill_tokens=s.queued_prefill_tokens, kv_usage=s.kv_usage,
                             free_blocks=s.free_blocks, num_blocks=s.num_blocks, draining=self.draining,
                             lora_adapters=self.engine.lora_adapters())

    async def Abort(self, request, context):
        if not request.request_id:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "request_id: must not be empty")
        return pb.AbortResponse(found=bool(await self.engine.abort(request.request_id)))

    async def LoadLoRAAdapter(self, request, context):
        try:
            names = await self.engine.load_lora_adapter(request.lora_name, request.lora_path)
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        log.info("LoRA adapter %r loaded from %s", request.lora_name, request.lora_path)
        return pb.LoRAAdaptersResponse(adapters=names)

    async def UnloadLoRAAdapter(self, request, context):
        try:
            names = await self.engine.unload_lora_adapter(request.lora_name)
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        log.info("LoRA adapter %r unloaded", request.lora_name)
        return pb.LoRAAdaptersResponse(adapters=names)

    async def FetchKVBlocks(self, request, context):
        fetcher = self.kv_fetcher
        async for resp in serve_fetch(self.engine, self.model_name, request, context, fetcher.max_blocks, fetcher.served):
            yield resp

    async def Drain(self, request, context):
        await self.start_drain()
        return pb.DrainResponse(running=len(self.active))

    async def start_drain(self) -> None:
        if self.draining:
            return
        self.draining = True
        log.info("draining: admissions stopped, %d streams open", len(self.active))
        if self.health is not None:
            await self.health.enter_graceful_shutdown()
        if self.on_drain is not None:
            await self.on_drain()

    async def wait_idle(self, timeout: float) -> bool:
        """True when every open stream ended within `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while self.active and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        return not self.active


class Worker:
    """Everything one `python -m pagoda.gpu_worker` process runs, start to graceful stop."""

    def __init__(self, args, engine: Optional[EngineClient] = None):
        self.args, self.engine = args, engine
        self.server: Optional[grpc.aio.Server] = None
        self.service: Optional[WorkerService] = None
        self.metrics: Optional[WorkerMetrics] = None
        self.publisher: Optional[Publisher] = None
        self.port: Optional[int] = None
        self.keyring: Optional[KeyRing] = None
        self.stopped = asyncio.Event()
        self._watch: Optional[asyncio.Task] = None

    async def start(self) -> None:
        a = self.args
        # Every port and credential first: a mistake is reported before the slow model load.
        creds, self.keyring = _security(a)
        try:
            self.peer_key = read_key(a.kv_peer_api_key_file) if a.kv_peer_api_key_file else None
        except (OSError, ValueError) as e:
            raise StartupError(f"--kv-peer-api-key-file: {e}") from None
        interceptors = [AuthInterceptor(self.keyring, grants=True)] if self.keyring else []
        self.server = grpc.aio.server(options=server_options(a.max_concurrent_streams), interceptors=interceptors)
        self.port = bind(self.server, a.host, a.port, "--port", creds)
        metrics_port = serving.metrics_port(a.metrics_port, a.port)
        check_port_free(a.host, metrics_port, "--metrics-port")
        # After binding, so that --port 0 yields an id (and address) with the real port.
        self.worker_id = a.worker_id or worker_args.default_worker_id(self.port)
        if self.engine is None:
            self.engine = AsyncLLM(EngineConfig(**worker_args.engine_config_kwargs(a)))
        engine = self.engine
        if metrics_port:
            self.metrics = WorkerMetrics(engine.stats, engine.model_name, a.metrics_prefix, a.kv_role)
            self.metrics.serve(a.host, metrics_port)
        health_servicer = health.aio.HealthServicer()
        fetcher = KVFetcher(engine.model_name, self.peer_key, a.kv_fetch_max_blocks, a.kv_fetch_timeout,
                            peer_credentials(a.tls_cert, a.tls_key, a.tls_client_ca))
        fetcher.block_bytes = await engine.call(transfer_block_bytes)
        if self.metrics is not None:
            self.metrics.add_kv_transfer(fetcher.fetched, fetcher.served)
        self.service = WorkerService(engine, self.worker_id, self.metrics, health_servicer,
                                     on_drain=self._stop_publisher, limits=Limits.from_args(a),
                                     keyring=self.keyring, kv_fetcher=fetcher)
        pb_grpc.add_GenerationServicer_to_server(self.service, self.server)
        pb_grpc.add_AdminServicer_to_server(self.service, self.server)
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, self.server)
        names = [pb.DESCRIPTOR.services_by_name[s].full_name for s in ("Generation", "Admin")]
        reflection.enable_server_reflection(names + [health.SERVICE_NAME, reflection.SERVICE_NAME], self.server)
        await self.server.start()
        for name in [""] + names:
            await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
        self._watch = asyncio.create_task(self._watch_engine())
        self._log_startup(engine)
        if a.redis_url:
            await self._start_publisher(a)

    def _log_startup(self, engine: EngineClient) -> None:
        m = engine.loaded
        capacity = engine.num_blocks * engine.block_size
        log.info("pagoda worker %s serving model=%s device=%s dtype=%s weights=%.3fGiB quantization=%s "
                 "blocks=%d token_capacity=%d max_concurrency@max_model_len(%d)=%.2f listening on %s:%d",
                 self.worker_id, engine.model_name, m.device, m.dtype, m.weight_bytes / 2**30, m.quantization,
                 engine.num_blocks, capacity, engine.max_model_len, capacity / engine.max_model_len,
                 self.args.host, self.port)

    async def _start_publisher(self, a) -> None:
        # Started just before the publisher.
        assert self.engine is not None and self.service is not None and self.port is not None
        try:
            from pagoda.gpu_worker.serving.publisher import Publisher  # lazy: redis may be missing; serve without it
        except ImportError as e:    # the publisher is optional: serving must not depend on Redis
            log.warning("redis publisher unavailable (%s); serving without it", e)
            return
        address = a.advertise_address or worker_args.advertise_address(_with_port(a, self.port))
        self.publisher = Publisher(a.redis_url, self.worker_id, self.engine.model_name, address, self.engine,
                                   heartbeat_s=a.heartbeat_interval, snapshot_s=a.snapshot_interval,
                                   name=worker_args.worker_name(a, self.port), epoch=self.service.epoch,
                                   tokenizer_digest=self.service.tokenizer.digest, kv_transfer=self.service.kv_fetcher,
                                   kv_role=a.kv_role)
        await self.publisher.start()

    async def _watch_engine(self) -> None:
        """A dead engine (its own fault, not a request's) serves nothing more: NOT_SERVING and
        the lease withdrawn at once; serve() then stops the process."""
        assert self.engine is not None and self.service is not None
        while self.engine.fatal is None:
            await asyncio.sleep(0.1)
        log.error("engine failed: reporting NOT_SERVING (%r)", self.engine.fatal)
        await self.service.start_drain()

    async def _stop_publisher(self) -> None:
        # Withdrawing the lease at drain start lets routers stop choosing this worker at once.
        if self.publisher is not None:
            publisher, self.publisher = self.publisher, None
            await publisher.stop()

    async def shutdown(self, grace: float, deadline: Optional[StopDeadline] = None) -> None:
        """Stop admissions, let open streams finish for up to `grace` seconds, then stop."""
        assert self.service is not None and self.server is not None, "start() first"
        assert self.engine is not None
        at_stage(deadline, "draining")
        if self._watch is not None:
            self._watch.cancel()
        await self.service.start_drain()
        finished = await self.service.wait_idle(grace)
        log.info("shutdown: %s", "all streams finished" if finished else "grace period over, cancelling streams")
        at_stage(deadline, "gRPC server stop")
        await self.server.stop(0.5)
        at_stage(deadline, "publisher stop")
        await self._stop_publisher()
        await self.service.kv_fetcher.close()
        at_stage(deadline, "engine shutdown")
        await self.engine.shutdown()
        if self.metrics is not None:
            self.metrics.stop()
        at_stage(deadline, "asyncio teardown")
        self.stopped.set()

    async def fail(self) -> None:
        """The engine died: NOT_SERVING, lease withdrawn, open streams end (they hold the error), stop."""
        assert self.service is not None and self.server is not None, "start() first"
        if self._watch is not None:
            self._watch.cancel()
        await self.service.start_drain()
        await self.service.wait_idle(2.0)
        await self.server.stop(0.5)
        if self.metrics is not None:
            self.metrics.stop()
        self.stopped.set()


def _security(a) -> tuple[Optional[grpc.ServerCredentials], Optional[KeyRing]]:
    try:
        creds = server_credentials(a.tls_cert, a.tls_key, a.tls_client_ca)
        return creds, (KeyRing(a.api_keys_file) if a.api_keys_file else None)
    except (OSError, ValueError) as e:
        raise StartupError(f"TLS/keys: {e}") from None


def _with_port(args, port: int):
    return argparse.Namespace(**{**vars(args), "port": port})


async def serve(args) -> int:
    """Run until SIGTERM/SIGINT, then drain gracefully (exit code 0), or until the engine dies
    (a tensor-parallel rank gone: exit code 1)."""
    worker = Worker(args)
    await worker.start()
    loop = asyncio.get_running_loop()
    stopping = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stopping.set)
    if worker.keyring is not None:
        loop.add_signal_handler(signal.SIGHUP, worker.keyring.reload)
    assert worker.engine is not None        # start() made it
    while not stopping.is_set():
        fatal = worker.engine.fatal
        if fatal is not None:
            log.error("engine failed, stopping: %s", fatal)
            await worker.fail()
            return 1
        try:
            await asyncio.wait_for(stopping.wait(), 0.2)
        except asyncio.TimeoutError:
            pass
    log.info("signal received: draining for up to %.1fs", args.drain_grace_seconds)
    # Past the drain, every stage is bounded: 10 s more is stuck (the chart gives the pod 15).
    await worker.shutdown(args.drain_grace_seconds, StopDeadline("worker", args.drain_grace_seconds + 10).start())
    return 0
