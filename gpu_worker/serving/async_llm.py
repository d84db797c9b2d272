"""asyncio streaming over one LLMEngine: many concurrent request streams, one engine loop.

One writer: the model forward blocks, so engine steps run in one dedicated thread, and that
thread alone touches the engine. Adds and aborts cross into it as typed commands through a
thread-safe queue. After every turn it pushes out what others read: deltas to each stream's
event loop (call_soon_threadsafe), an immutable EngineStats snapshot, and KV events (with a
mirror of the cached hashes they imply). The event loop reads only those, so GetLoad, health
checks and the publisher never wait on a step. A stream whose consumer stops early
(aclose, cancellation) aborts its request, which frees its blocks at the engine's next turn.
A stream yields deltas through a Coalescer (gpu_worker/serving/coalesce.py): what queued up since its
consumer last read is merged per sequence, and config.stream_interval holds tokens back.
"""
from __future__ import annotations

import asyncio
import logging
import os
import queue
import threading
from collections import Counter
from dataclasses import dataclass
from typing import Any, AsyncGenerator, Callable, Optional, Union

from pagoda.gpu_worker.core.config import EngineConfig
from pagoda.gpu_worker.core.outputs import EngineStats, StreamDelta
from pagoda.gpu_worker.core.sampling_params import SamplingParams
from pagoda.gpu_worker.engine.llm_engine import LLMEngine
from pagoda.gpu_worker.features.lora import load_peft_adapter
from pagoda.gpu_worker.serving.coalesce import Coalescer
from pagoda.gpu_worker.serving.engine_client import LoadedModel

logger = logging.getLogger(__name__)


class QueueFullError(Exception):
    """The waiting queue already holds config.max_waiting requests."""


class _Stream:
    def __init__(self, loop: asyncio.AbstractEventLoop, n: int):
        self.loop = loop
        self.queue: asyncio.Queue = asyncio.Queue()
        self.left = n            # sequences not yet finished

    def put(self, item) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:
            pass                 # the consumer's loop is closed: nobody to tell


@dataclass(frozen=True)
class AddCommand:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int
    cache_salt: str
    adapter: str
    tenant: str
    stream: _Stream


@dataclass(frozen=True)
class AbortCommand:
    request_id: str
    notify: bool             # False: the consumer is gone, send it nothing


@dataclass(frozen=True)
class StopCommand:
    pass


@dataclass(frozen=True)
class CallCommand:
    """Run fn(engine) in the engine's thread between steps; its result or error goes to `done`
    (called in the engine thread)."""
    fn: Callable[[LLMEngine], Any]
    done: Callable[[Any, Optional[BaseException]], None]


Command = Union[AddCommand, AbortCommand, StopCommand, CallCommand]


class AsyncLLM:
    """The engine the worker serves (serving/engine_client.py's EngineClient)."""

    def __init__(self, config: EngineConfig):
        self.engine = e = LLMEngine(config)
        self.config = config
        # Fixed for the engine's life: read here, never from the engine thread's state later.
        self.tokenizer, self.model_name, self.vocab_size = e.tokenizer, e.model_name, e.vocab_size
        self.max_model_len, self.block_size, self.num_blocks = e.max_model_len, e.block_size, e.num_blocks
        self.eos_token_ids = e.eos_token_ids
        runner = e.runner
        self.loaded = LoadedModel(str(runner.device), str(runner.dtype).replace("torch.", ""), runner.weight_bytes,
                                  runner.quant.method if runner.quant is not None else "none")
        self._commands: queue.SimpleQueue[Command] = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}
        self._live: Counter[str] = Counter()     # tenant -> its live streams (_below_fair_share)
        # Adds sent (written by the event loop) and adds applied (written by the engine thread):
        # each counter has one writer, so their difference needs no lock.
        self._adds_sent = 0
        self._adds_applied = 0
        # What the engine thread publishes after each turn. The lock guards only the event
        # buffer and the mirror, for microseconds, and is never held across a step.
        self._stats: EngineStats = self.engine.stats()
        self._out_lock = threading.Lock()
        self._events: list[tuple[str, bytes]] = []
        self._cached: dict[bytes, None] = {}     # insertion-ordered set of cached hashes
        self._host_events: list[tuple[str, bytes]] = []     # the same for the host KV tier
        self._host_cached: dict[bytes, None] = {}
        self._closed = False      # no new requests: shut down, or the engine died
        self._stopped = False     # shutdown() ran
        self._lora_adapters: tuple[str, ...] = tuple(self.engine.lora_adapters())
        self._lora_paths: dict[str, str] = self._read_lora_paths()
        self.max_loras = runner.lora.max_loras if runner.lora is not None else 0
        self._lora_resident: tuple[str, ...] = ()
        self.fatal: BaseException | None = None   # set when the engine can never step again
        if runner.tp is not None:
            runner.tp.on_failure(self._die)
        self._thread = threading.Thread(target=self._run, name="pagoda-engine", daemon=True)
        self._thread.start()

    # ---- caller side (event loop) -------------------------------------------------------

    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                       priority: int = 0, cache_salt: str = "", adapter: str = "", tenant: str = ""
                       ) -> AsyncGenerator[StreamDelta, None]:
        if self._closed:
            raise RuntimeError("AsyncLLM is shut down" if self.fatal is None else f"the engine failed: {self.fatal!r}")
        if request_id in self._streams:
            raise ValueError(f"request_id: {request_id!r} is already in use")
        self.engine.validate_request(request_id, prompt_token_ids, params, priority, cache_salt,
                                     adapter, check_id=False, tenant=tenant)
        if self._num_queued() >= self.config.max_waiting and not self._below_fair_share(tenant):
            raise QueueFullError(f"waiting queue is full ({self.config.max_waiting} requests)")
        stream = _Stream(asyncio.get_running_loop(), params.n)
        self._streams[request_id] = stream
        self._live[tenant] += 1
        self._adds_sent += 1
        self._commands.put(AddCommand(request_id, list(prompt_token_ids), params, priority,
                                      cache_salt, adapter, tenant, stream))
        done = False
        coalescer = Coalescer(self.config.stream_interval)
        q = stream.queue
        try:
            while stream.left:
                # Everything that queued up while the last delta was out (being sent) goes in
                # together: one merged delta per sequence (gpu_worker/serving/coalesce.py).
                items = [await q.get()]
                while not q.empty() and not isinstance(items[-1], BaseException):
                    items.append(q.get_nowait())
                error = items.pop() if isinstance(items[-1], BaseException) else None
                for d in coalescer.push([d for item in items for d in item]):
                    stream.left -= d.finished
                    yield d
                if error is not None:
                    done = True
                    raise error
            done = True
        finally:
            if self._streams.get(request_id) is stream:
                del self._streams[request_id]
            self._live[tenant] -= 1
            if not self._live[tenant]:
                del self._live[tenant]
            if not done:
                self._commands.put(AbortCommand(request_id, notify=False))

    def _below_fair_share(self, tenant: str) -> bool:
        """With tenant fairness, a full queue still takes a request of a tenant that holds less
        than its share of what the worker holds (max_waiting + max_num_seqs, over the tenants with
        live requests, this one counted), so another tenant's burst that filled the queue cannot
        lock it out; the scheduler then admits it ahead of the burst. Each tenant overshoots the
        bound by at most its share, so the queue stays within about twice max_waiting."""
        if self.config.scheduling_fairness != "tenant":
            return False
        tenants = len(self._live) + (tenant not in self._live)
        held = self.config.max_waiting + self.config.max_num_seqs
        return tenants > 1 and self._live[tenant] < held / tenants

    def _num_queued(self) -> int:
        """Requests that would wait: the engine's queue plus adds still crossing over, less
        the free sequence slots those adds can take at once."""
        s = self._stats
        free_slots = max(0, self.config.max_num_seqs - s.running)
        in_flight = self._adds_sent - self._adds_applied
        return s.waiting + max(0, in_flight - free_slots)

    async def abort(self, request_id: str) -> bool:
        """Abort a live request; its stream ends with finish_reason "abort"."""
        if request_id not in self._streams:
            return False
        self._commands.put(AbortCommand(request_id, notify=True))
        return True

    async def call(self, fn: Callable[[LLMEngine], Any]) -> Any:
        """fn(engine), run in the engine's thread between two steps (it alone touches the engine)."""
        if self._closed:
            raise RuntimeError("AsyncLLM is shut down")
        loop = asyncio.get_running_loop()
        fut: asyncio.Future = loop.create_future()

        def done(result, error) -> None:
            def settle() -> None:
                if fut.done():
                    return
                if error is not None:
                    fut.set_exception(error)
                else:
                    fut.set_result(result)
            loop.call_soon_threadsafe(settle)

        self._commands.put(CallCommand(fn, done))
        return await fut

    def lora_adapters(self) -> list[str]:
        """Adapters requests may name (a copy taken in one step, without waiting on the engine)."""
        return list(self._lora_adapters)

    def lora_resident(self) -> list[str]:
        """Those of them in a device slot after the engine's last turn."""
        return list(self._lora_resident)

    def lora_paths(self) -> dict[str, str]:
        """Adapter -> the path it was read from ("" when given as an object), as of the last command."""
        return dict(self._lora_paths)

    def _read_lora_paths(self) -> dict[str, str]:
        lora = self.engine.runner.lora
        return {name: a.path for name, a in lora.adapters.items()} if lora is not None else {}

    async def load_lora_adapter(self, name: str, path: str) -> list[str]:
        """Read a PEFT adapter (in a worker thread: the engine keeps stepping meanwhile), then
        register it in the engine's thread; -> the adapters loaded after."""
        runner = self.engine.runner
        if runner.lora is None:
            raise ValueError("lora_name: this worker runs without --enable-lora")
        if not isinstance(name, str) or not name or name == self.engine.model_name:
            raise ValueError(f"lora_name: must be a non-empty name other than the base model's (got {name!r})")
        if not path:
            raise ValueError("lora_path: must name the adapter's directory")
        loaded = self._lora_paths.get(name) if name in self._lora_adapters else None
        if loaded is not None:
            # vLLM's clients retry a load whose answer they missed: the same name and path again is a
            # no-op, not an error; the same name for other weights still is (unload it first).
            if loaded and os.path.realpath(loaded) == os.path.realpath(path):
                return list(self._lora_adapters)
            raise ValueError(f"lora_name: adapter {name!r} is already loaded from {loaded or 'an object'!s}; "
                             f"unload it before loading {path}")
        adapter = await asyncio.to_thread(load_peft_adapter, name, path, runner.hf_config, runner.lora.max_rank)

        def register(engine: LLMEngine) -> list[str]:
            engine.load_lora_adapter(name, adapter=adapter)
            return engine.lora_adapters()
        return await self.call(register)

    async def unload_lora_adapter(self, name: str) -> list[str]:
        def forget(engine: LLMEngine) -> list[str]:
            engine.unload_lora_adapter(name)
            return engine.lora_adapters()
        return await self.call(forget)

    def stats(self) -> EngineStats:
        """The snapshot published after the engine's last turn."""
        return self._stats

    def take_kv_events(self) -> list[tuple[str, bytes]]:
        with self._out_lock:
            events, self._events = self._events, []
        return events

    def cached_block_hashes(self) -> list[bytes]:
        """Cached hashes as of the last published events (those taken or still to take)."""
        with self._out_lock:
            return list(self._cached)

    def take_host_kv_events(self) -> list[tuple[str, bytes]]:
        with self._out_lock:
            events, self._host_events = self._host_events, []
        return events

    def cached_hashes_by_tier(self) -> tuple[list[bytes], list[bytes]]:
        """(device, host) cached hashes as of the same published events."""
        with self._out_lock:
            return list(self._cached), list(self._host_cached)

    def _die(self, error: BaseException) -> None:
        """A tensor-parallel rank died (any thread): refuse new requests and end every stream with
        the error now, even while the engine thread is stuck in a collective."""
        self.fatal = error
        self._closed = True
        for stream in list(self._streams.values()):
            stream.put(error)

    async def shutdown(self) -> None:
        if self._stopped:
            return
        self._stopped = self._closed = True
        self._commands.put(StopCommand())
        await asyncio.get_running_loop().run_in_executor(None, self._thread.join)
        self.engine.runner.close()     # the other tensor-parallel ranks, if any

    # ---- engine thread ------------------------------------------------------------------

    def _run(self) -> None:
        pending: dict[str, _Stream] = {}      # request id -> stream, as the engine thread sees it
        while True:
            busy = self.engine.has_unfinished_requests()
            commands = [] if busy else [self._commands.get()]
            while True:
                try:
                    commands.append(self._commands.get_nowait())
                except queue.Empty:
                    break
            for cmd in commands:
                if isinstance(cmd, StopCommand):
                    self._fail_all(pending, RuntimeError("AsyncLLM is shut down"))
                    return
                self._apply(cmd, pending)
            deltas: list[StreamDelta] = []
            if self.engine.has_unfinished_requests():
                try:
                    deltas = self.engine.step()
                except Exception as e:
                    # Errors a request caused end that request inside the step (core/faults.py);
                    # one that gets out is the engine's own: all fail, and it serves no more.
                    logger.exception("engine step failed: the engine is dead")
                    self.fatal, self._closed = e, True
                    self._fail_all(pending, e)
            faults = self.engine.take_faults()
            # Published before any stream hears of the step, so that whoever sees a delta
            # (or an error) then sees figures at least as new.
            self._publish()
            failing = [(pending.get(f.request_id), f) for f in faults]
            self._dispatch(deltas, pending)
            for stream, fault in failing:       # after the deltas it had before the fault
                if stream is not None:
                    pending.pop(fault.request_id, None)
                    stream.put(fault)

    def _publish(self) -> None:
        events = self.engine.take_kv_events()
        host_events = self.engine.take_host_kv_events()
        stats = self.engine.stats()
        lora = self.engine.runner.lora
        if lora is not None:
            self._lora_resident = tuple(lora.resident())
        if events or host_events:
            with self._out_lock:
                for buffer, mirror, new in ((self._events, self._cached, events),
                                            (self._host_events, self._host_cached, host_events)):
                    buffer.extend(new)
                    for kind, h in new:
                        if kind == "stored":
                            mirror[h] = None
                        else:
                            mirror.pop(h, None)
        self._stats = stats

    def _apply(self, cmd: Command, pending: dict[str, _Stream]) -> None:
        if isinstance(cmd, AddCommand):
            try:
                self.engine.add_request(cmd.request_id, cmd.prompt_token_ids, cmd.params,
                                        cmd.priority, cmd.cache_salt, cmd.adapter, cmd.tenant)
                pending[cmd.request_id] = cmd.stream
            except Exception as e:
                cmd.stream.put(e)
            finally:
                self._adds_applied += 1
        elif isinstance(cmd, CallCommand):
            try:
                result = cmd.fn(self.engine)
            except Exception as e:
                cmd.done(None, e)
            else:
                cmd.done(result, None)
            self._lora_adapters = tuple(self.engine.lora_adapters())
            self._lora_paths = self._read_lora_paths()
        elif isinstance(cmd, AbortCommand):
            before = len(self.engine.pending)
            self.engine.abort_request(cmd.request_id)
            if not cmd.notify:
                # The consumer is gone and the id may be reused at once: drop the abort
                # notices so that they cannot reach a newcomer of the same name.
                del self.engine.pending[before:]
                pending.pop(cmd.request_id, None)

    def _dispatch(self, deltas: list[StreamDelta], pending: dict[str, _Stream]) -> None:
        by_request: dict[str, list[StreamDelta]] = {}
        for d in deltas:
            by_request.setdefault(d.request_id, []).append(d)
        for rid, ds in by_request.items():
            stream = pending.get(rid)
            if stream is None:
                continue
            stream.put(ds)
            if rid not in self.engine.children:
                del pending[rid]

    def _fail_all(self, pending: dict[str, _Stream], error: BaseException) -> None:
        self.engine.abort_request(list(self.engine.children))
        self.engine.pending.clear()
        self._publish()
        for stream in pending.values():
            stream.put(error)
        pending.clear()
