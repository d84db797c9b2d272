"""asyncio streaming over one LLMEngine: many concurrent request streams, one engine loop.

The model forward blocks, so engine steps run in one dedicated thread. Adds and aborts cross
into it through a thread-safe queue; deltas come back to each stream's event loop with
call_soon_threadsafe. A stream whose consumer stops early (aclose, cancellation) aborts
its request, which frees its blocks at the engine's next turn.
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
from typing import AsyncIterator

from gpu_worker.config import EngineConfig
from gpu_worker.engine import LLMEngine
from gpu_worker.outputs import EngineStats, StreamDelta
from gpu_worker.sampling_params import SamplingParams

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


class AsyncLLM:
    def __init__(self, config: EngineConfig):
        self.engine = LLMEngine(config)
        self.config = config
        for name in ("tokenizer", "model_name", "vocab_size", "max_model_len", "block_size",
                     "num_blocks", "eos_token_ids"):
            setattr(self, name, getattr(self.engine, name))
        self._lock = threading.Lock()        # the engine is not thread-safe
        self._commands: queue.Queue = queue.Queue()
        self._streams: dict[str, _Stream] = {}
        self._adds_in_flight = 0             # queued to the engine thread, not yet added
        self._count_lock = threading.Lock()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="pagoda-engine", daemon=True)
        self._thread.start()

    # ---- caller side (event loop) -------------------------------------------------------

    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                       priority: int = 0, cache_salt: str = "", adapter: str = ""
                       ) -> AsyncIterator[StreamDelta]:
        if self._closed:
            raise RuntimeError("AsyncLLM is shut down")
        if request_id in self._streams:
            raise ValueError(f"request_id: {request_id!r} is already in use")
        self.engine.validate_request(request_id, prompt_token_ids, params, priority, cache_salt,
                                     adapter, check_id=False)
        if self._num_queued() >= self.config.max_waiting:
            raise QueueFullError(f"waiting queue is full ({self.config.max_waiting} requests)")
        stream = _Stream(asyncio.get_running_loop(), params.n)
        self._streams[request_id] = stream
        with self._count_lock:
            self._adds_in_flight += 1
        self._commands.put(("add", request_id, list(prompt_token_ids), params, priority,
                            cache_salt, adapter, stream))
        done = False
        try:
            while stream.left:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    done = True
                    raise item
                for d in item:
                    stream.left -= d.finished
                    yield d
            done = True
        finally:
            if self._streams.get(request_id) is stream:
                del self._streams[request_id]
            if not done:
                self._commands.put(("abort", request_id, False))

    def _num_queued(self) -> int:
        """Requests that would wait: the engine's queue plus adds still crossing over, less
        the free sequence slots those adds can take at once."""
        s = self.engine.scheduler
        free_slots = max(0, s.max_num_seqs - len(s.running))
        return s.num_waiting() + max(0, self._adds_in_flight - free_slots)

    async def abort(self, request_id: str) -> bool:
        """Abort a live request; its stream ends with finish_reason "abort"."""
        if request_id not in self._streams:
            return False
        self._commands.put(("abort", request_id, True))
        return True

    def stats(self) -> EngineStats:
        with self._lock:
            return self.engine.stats()

    def take_kv_events(self) -> list[tuple[str, bytes]]:
        with self._lock:
            return self.engine.take_kv_events()

    def cached_block_hashes(self) -> list[bytes]:
        with self._lock:
            return self.engine.cached_block_hashes()

    async def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._commands.put(("stop",))
        await asyncio.get_running_loop().run_in_executor(None, self._thread.join)

    # ---- engine thread ------------------------------------------------------------------

    def _run(self) -> None:
        pending: dict[str, _Stream] = {}      # request id -> stream, as the engine thread sees it
        while True:
            busy = self.engine.has_unfinished_requests()
            try:
                commands = [] if busy else [self._commands.get()]
                while True:
                    commands.append(self._commands.get_nowait())
            except queue.Empty:
                pass
            for cmd in commands:
                if cmd[0] == "stop":
                    self._fail_all(pending, RuntimeError("AsyncLLM is shut down"))
                    return
                self._apply(cmd, pending)
            if self.engine.has_unfinished_requests():
                try:
                    with self._lock:
                        deltas = self.engine.step()
                except Exception as e:     # a failed step fails its requests, not the worker
                    logger.exception("engine step failed")
                    self._fail_all(pending, e)
                    continue
                self._dispatch(deltas, pending)

    def _apply(self, cmd: tuple, pending: dict[str, _Stream]) -> None:
        if cmd[0] == "add":
            _, rid, ids, params, priority, salt, adapter, stream = cmd
            try:
                with self._lock:
                    self.engine.add_request(rid, ids, params, priority, salt, adapter)
                pending[rid] = stream
            except Exception as e:
                stream.put(e)
            finally:
                with self._count_lock:
                    self._adds_in_flight -= 1
        elif cmd[0] == "abort":
            _, rid, notify = cmd
            with self._lock:
                before = len(self.engine.pending)
                self.engine.abort_request(rid)
                if not notify:
                    # The consumer is gone and the id may be reused at once: drop the abort
                    # notices so that they cannot reach a newcomer of the same name.
                    del self.engine.pending[before:]
                    pending.pop(rid, None)

    def _dispatch(self, deltas: list[StreamDelta], pending: dict[str, _Stream]) -> None:
        by_request: dict[str, list[StreamDelta]] = {}
        for d in deltas:
            by_request.setdefault(d.request_id, []).append(d)
        for rid, ds in by_request.items():
            stream = pending.get(rid)
            if stream is None:
                continue
            stream.put(ds)
            # Only this thread changes the engine, so reading it here needs no lock.
            if rid not in self.engine.children:
                del pending[rid]

    def _fail_all(self, pending: dict[str, _Stream], error: BaseException) -> None:
        with self._lock:
            self.engine.abort_request(list(self.engine.children))
            self.engine.pending.clear()
        for stream in pending.values():
            stream.put(error)
        pending.clear()
