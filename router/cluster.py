"""The router's view of the cluster, kept current from Redis by one background task.

Leases are polled (SCAN + MGET) for workers, their models and load; each model's event stream
is tailed with XREAD, and so is its load stream (leases sent between heartbeats when a worker's
load changes). A worker is (re)synchronised from its snapshot key plus the stream entries
after it whenever the router has no in-order history for it: a new worker or epoch, a gap in
its batch sequence, or a Redis reconnect. Routing decisions read only this memory.

When Redis is unreachable the last known state stays in use (workers are not expired on
missing leases until Redis has been back for a lease period), and the task reconnects with
backoff.

Redis is not trusted: every value is parsed against its schema (protos/redis_schema.py) and a
bad one is logged once per key and skipped; a snapshot is measured (STRLEN) before it is read
and refused beyond what its worker's lease allows; a new epoch for a worker id is taken only
after the lease's address confirms it (`verify`), so a forged lease cannot fence off a real
worker; and the loop survives any exception, counting it (sync_errors) and reporting its
freshness (healthy()).
"""
from __future__ import annotations

import asyncio
import logging
import random
import time
from typing import Any, Awaitable, Callable

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from pagoda.protos import redis_schema as rs
from pagoda.router.index import BlockIndex
from pagoda.router.scoring import WorkerState

log = logging.getLogger(__name__)
_ERRORS = (RedisError, OSError, asyncio.TimeoutError)


class Cluster:
    def __init__(self, redis_url: str, index: BlockIndex, lease_poll_s: float = 0.25,
                 resync_retry_s: float = 1.0, reconnect_grace_s: float = 4.0,
                 max_snapshot_bytes: int = 32 << 20):
        self.redis_url, self.index = redis_url, index
        self.lease_poll_s, self.resync_retry_s, self.reconnect_grace_s = lease_poll_s, resync_retry_s, reconnect_grace_s
        self.workers: dict[str, WorkerState] = {}
        # Each model's workers, rebuilt only when a worker joins, leaves, or changes its model or
        # tokenizer (`version` counts those changes): every request asks, and at 1,000 workers a
        # scan of them all was a tenth of a decision.
        self._by_model: dict[str, list[WorkerState]] | None = None
        self._adapters: dict[str, str] = {}
        self._adapter_paths: dict[str, str] = {}
        self._by_adapter: dict[tuple[str, str], list[WorkerState]] = {}
        self.version = 0
        self.cursors: dict[str, str] = {}        # model -> last stream id read
        self.load_cursors: dict[str, str] = {}   # model -> last load stream id read
        self.connected = False
        self.on_worker_gone = lambda worker_id: None
        self._epochs: dict[str, int] = {}       # highest epoch seen per worker id (fencing)
        self._keep_until = 0.0                  # no expiry on missing leases before this
        self._redis: Any = None   # aioredis.Redis once started; its stubs type replies too loosely to help
        self._task: asyncio.Task | None = None
        self._synced = asyncio.Event()
        self.max_snapshot_bytes = max_snapshot_bytes
        # async (lease) -> bool: does the lease's address answer as that worker and epoch?
        # None accepts every new epoch at once (the routing simulator has no servers).
        self.verify: Callable[[rs.Lease], Awaitable[bool]] | None = None
        self._probes: dict[str, tuple[int, asyncio.Task | None, float]] = {}
        self.sync_errors = 0                    # unexpected exceptions the loop survived
        self.rejected = 0                       # Redis values refused by their schema
        self.last_round = 0.0                   # monotonic time of the last complete round
        self._warned: set[str] = set()

    def live(self, model: str) -> list[WorkerState]:
        """The model's workers (a shared list: not to be changed by the caller)."""
        return self._grouped().get(model, [])

    def models(self) -> list[str]:
        return list(self._grouped())

    def adapters(self) -> dict[str, str]:
        """LoRA adapter -> the base model whose workers serve it (the first by name, should two
        models' workers both have one of that name)."""
        self._grouped()
        return self._adapters

    def adapter_path(self, adapter: str) -> str:
        """Where a worker read `adapter` from, as its lease says ("" when none says)."""
        self._grouped()
        return self._adapter_paths.get(adapter, "")

    def adapter_workers(self, model: str, adapter: str) -> list[WorkerState]:
        """The model's live workers that serve `adapter`."""
        key = (model, adapter)
        found = self._by_adapter.get(key)
        if found is None:
            found = self._by_adapter[key] = [w for w in self.live(model) if adapter in w.lease.lora_adapters]
        return found

    def _grouped(self) -> dict[str, list[WorkerState]]:
        if self._by_model is None:
            groups: dict[str, list[WorkerState]] = {}
            adapters: dict[str, str] = {}
            self._adapter_paths = {}
            for w in self.workers.values():
                groups.setdefault(w.lease.model, []).append(w)
            self._by_model = dict(sorted(groups.items()))
            for model, ws in self._by_model.items():
                for w in ws:
                    paths = w.lease.lora_paths
                    for i, name in enumerate(w.lease.lora_adapters):
                        adapters.setdefault(name, model)
                        if i < len(paths) and paths[i]:
                            self._adapter_paths.setdefault(name, paths[i])
            self._adapters = dict(sorted(adapters.items()))
            self._by_adapter = {}
        return self._by_model

    def _membership_changed(self) -> None:
        self._by_model = None
        self.version += 1

    def adapters_changed(self, w: WorkerState, names: list[str], loaded: tuple[str, str] | None = None) -> None:
        """A worker's adapters as it just answered a load (`loaded`: its name and path) or an
        unload, ahead of its next lease."""
        paths = dict(zip(w.lease.lora_adapters, w.lease.lora_paths))
        if loaded is not None:
            paths[loaded[0]] = loaded[1]
        w.lease.lora_adapters = list(names)
        w.lease.lora_paths = [paths.get(n, "") for n in names]
        self._membership_changed()

    def _report(self, w: WorkerState, lease: rs.Lease) -> None:
        before = w.lease
        w.on_heartbeat(lease)
        if (w.lease.model, w.lease.tokenizer_digest, w.lease.lora_adapters, w.lease.lora_paths, w.lease.kv_role) != \
                (before.model, before.tokenizer_digest, before.lora_adapters, before.lora_paths, before.kv_role):
            self._membership_changed()

    def healthy(self, stale_after_s: float = 5.0) -> bool:
        """The view is current: a full round (leases and streams) finished within stale_after_s."""
        return time.monotonic() - self.last_round < stale_after_s

    def _reject(self, key: str, why) -> None:
        """A bad value in Redis: counted always, logged once per key (bounded memory)."""
        self.rejected += 1
        if key not in self._warned:
            if len(self._warned) > 10_000:
                self._warned.clear()
            self._warned.add(key)
            log.warning("router: ignoring %s from redis: %s", key, why)

    async def start(self) -> None:
        self._redis = aioredis.from_url(
            self.redis_url, password=rs.redis_password(self.redis_url), socket_timeout=2.0,
            socket_connect_timeout=1.0, retry=None, health_check_interval=0)
        self._task = asyncio.create_task(self._run(), name="cluster-sync")

    async def wait_synced(self, timeout: float) -> bool:
        try:
            await asyncio.wait_for(self._synced.wait(), timeout)
            return True
        except asyncio.TimeoutError:
            return False

    async def stop(self) -> None:
        probes = [t for _, t, _ in self._probes.values() if t is not None]
        for task in [self._task, *probes]:
            if task:
                task.cancel()
        await asyncio.gather(*[t for t in [self._task, *probes] if t], return_exceptions=True)
        if self._redis is not None:
            await self._redis.aclose()

    async def _run(self) -> None:
        backoff, next_poll = 0.05, 0.0
        while True:
            try:
                if not self.connected:
                    await self._redis.ping()
                    log.info("router: connected to redis at %s", self.redis_url)
                    self.connected, backoff = True, 0.05
                    self._keep_until = time.monotonic() + self.reconnect_grace_s if self.workers else 0.0
                    for w in self.workers.values():
                        w.seq, w.next_resync = None, 0.0
                now = time.monotonic()
                poll = now >= next_poll
                if poll:
                    next_poll = now + self.lease_poll_s
                await self.sync_once(poll, block_ms=int(self.lease_poll_s * 1000))
                if poll:
                    self.last_round = time.monotonic()
                    self._synced.set()
            except asyncio.CancelledError:
                raise
            except _ERRORS as e:
                if self.connected or backoff == 0.05:
                    log.warning("router: redis unavailable (%s); routing on last known state", e)
                self.connected = False
                await asyncio.sleep(backoff * (0.5 + random.random() / 2))
                backoff = min(backoff * 2, 2.0)
            except Exception:           # a bug or data nothing parsed: never the end of syncing
                self.sync_errors += 1
                log.exception("router: redis sync round failed (%d so far); continuing", self.sync_errors)
                await asyncio.sleep(self.lease_poll_s)

    async def sync_once(self, poll_leases: bool, block_ms: int | None, now: float | None = None) -> None:
        """One round: leases and due resyncs (when poll_leases), then new stream entries.
        block_ms=None reads without blocking; `now` is the clock for speculation expiry."""
        if poll_leases:
            await self._poll_leases()
            await self._resync_due()
            self.index.expire_speculation(now)
        await self._read_streams(block_ms)

    async def _poll_leases(self) -> None:
        keys = [k async for k in self._redis.scan_iter(match=rs.LEASE_PATTERN, count=1000)]
        values = await self._redis.mget(keys) if keys else []
        seen = set()
        for key, raw in zip(keys, values):
            if raw is None:
                continue
            key = rs._text(key)
            try:
                lease = rs.Lease.decode(raw)
                if key != rs.lease_key(lease.worker_id):
                    raise ValueError(f"lease: worker_id {lease.worker_id!r} does not match its key")
            except ValueError as e:
                self._reject(key, e)
                continue
            if lease.epoch < self._epochs.get(lease.worker_id, 0):
                continue                     # a fenced-off older process
            seen.add(lease.worker_id)
            self._upsert(lease)
        if time.monotonic() >= self._keep_until:
            for wid in [w for w in self.workers if w not in seen]:
                log.info("router: worker %s left (lease expired)", wid)
                self._drop(wid)
        for model in {w.lease.model for w in self.workers.values()} - set(self.cursors):
            for cursors, key in ((self.cursors, rs.events_key(model)), (self.load_cursors, rs.load_key(model))):
                last = await self._redis.xrevrange(key, count=1)
                cursors[model] = rs._text(last[0][0]) if last else "0-0"

    def _upsert(self, lease: rs.Lease) -> None:
        w = self.workers.get(lease.worker_id)
        if w is not None and w.lease.epoch == lease.epoch:
            self._report(w, lease)
            return
        if not self._confirmed(lease):
            return                              # not yet (or never): the current view stays
        if w is not None:
            log.info("router: worker %s restarted (epoch %d -> %d)", lease.worker_id, w.lease.epoch, lease.epoch)
            self._drop(lease.worker_id)
        else:
            log.info("router: worker %s joined (%s, model %s)", lease.worker_id, lease.address, lease.model)
        self._epochs[lease.worker_id] = lease.epoch
        self.workers[lease.worker_id] = WorkerState(lease)
        self._membership_changed()

    def _confirmed(self, lease: rs.Lease) -> bool:
        """Whether a new (worker id, epoch) may be taken: at once without `verify`, else once
        a probe of the lease's address confirmed it. Probes run as tasks (never blocking the
        loop), one per worker id at a time, retried every resync_retry_s while they fail."""
        if self.verify is None:
            return True
        epoch, task, retry_at = self._probes.get(lease.worker_id, (-1, None, 0.0))
        if epoch == lease.epoch and task is not None and task.done():
            ok = not task.cancelled() and task.exception() is None and task.result()
            if ok:
                del self._probes[lease.worker_id]
                return True
            self._reject(f"{rs.lease_key(lease.worker_id)}@{lease.epoch}",
                         f"its address {lease.address} does not answer as worker {lease.worker_id} "
                         f"epoch {lease.epoch}; retrying")
            task, retry_at = None, time.monotonic() + self.resync_retry_s
        if epoch != lease.epoch or (task is None and time.monotonic() >= retry_at):
            task = asyncio.ensure_future(self.verify(lease))
        self._probes[lease.worker_id] = (lease.epoch, task, retry_at)
        return False

    def _drop(self, worker_id: str) -> None:
        self.workers.pop(worker_id, None)
        self._membership_changed()
        self.index.drop_worker(worker_id)
        self.on_worker_gone(worker_id)

    async def _resync_due(self) -> None:
        now = time.monotonic()
        for w in list(self.workers.values()):
            if w.seq is None and now >= w.next_resync and w.lease.model in self.cursors:
                w.next_resync = now + self.resync_retry_s
                await self._resync(w)

    async def _resync(self, w: WorkerState) -> None:
        key = rs.snapshot_key(w.id)
        size = await self._redis.strlen(key)
        if not size:
            return                              # keep what we have; retry later
        bound = min(rs.Snapshot.max_bytes(w.lease.num_blocks), self.max_snapshot_bytes)
        if size > bound:                        # refused unread: a huge GET would stall the router
            self._reject(key, f"snapshot of {size} bytes, more than {bound} for {w.lease.num_blocks} blocks")
            return
        raw = await self._redis.get(key)
        try:
            snap = rs.Snapshot.decode(raw or b"")
            if snap.worker_id != w.id:
                raise ValueError(f"snapshot: worker_id {snap.worker_id!r} does not match its key")
        except ValueError as e:
            self._reject(key, e)
            return
        if snap.epoch != w.lease.epoch or self.workers.get(w.id) is not w:
            return
        host = await self._host_snapshot(w, snap) if w.lease.host_blocks else []
        if self.workers.get(w.id) is not w:
            return
        self.index.replace_worker(w.id, snap.hashes, host)
        w.seq = snap.seq
        key, cursor = rs.events_key(w.lease.model), self.cursors[w.lease.model]
        start = "-" if snap.stream_id == "0-0" else "(" + snap.stream_id
        if rs.stream_id_tuple(snap.stream_id) >= rs.stream_id_tuple(cursor):
            return                              # the tail will bring everything after it
        while True:
            entries = await self._redis.xrange(key, min=start, max=cursor, count=1000)
            for sid, fields in entries:
                self._apply(fields, only=w.id)
            if len(entries) < 1000:
                break
            start = "(" + rs._text(entries[-1][0])
        log.info("router: synced worker %s: %d blocks", w.id, self.index.blocks_of(w.id))

    async def _host_snapshot(self, w: WorkerState, snap: rs.Snapshot) -> list[bytes]:
        """The worker's host-tier blocks as of `snap` (written with it); none when that snapshot
        is missing, bad, or of another sequence number (its events still arrive on the stream)."""
        key = rs.host_snapshot_key(w.id)
        size = await self._redis.strlen(key)
        bound = min(rs.Snapshot.max_bytes(w.lease.host_blocks), self.max_snapshot_bytes)
        if not size or size > bound:
            if size:
                self._reject(key, f"snapshot of {size} bytes, more than {bound} for {w.lease.host_blocks} blocks")
            return []
        try:
            host = rs.Snapshot.decode(await self._redis.get(key) or b"")
        except ValueError as e:
            self._reject(key, e)
            return []
        if (host.worker_id, host.epoch, host.seq) != (snap.worker_id, snap.epoch, snap.seq):
            return []
        return host.hashes

    async def _read_streams(self, block_ms: int | None) -> None:
        if not self.cursors:
            if block_ms:
                await asyncio.sleep(block_ms / 1000)   # nothing to wait on yet: pace the loop
            return
        keys = {rs.events_key(m): (m, self.cursors) for m in self.cursors}
        keys.update({rs.load_key(m): (m, self.load_cursors) for m in self.load_cursors})
        reply = await self._redis.xread({k: cursors[m] for k, (m, cursors) in keys.items()},
                                        count=1000, block=block_ms)
        for stream, entries in _stream_items(reply):
            model, cursors = keys[rs._text(stream)]
            apply = self._apply if cursors is self.cursors else self._apply_load
            for sid, fields in entries:
                apply(fields)
                cursors[model] = rs._text(sid)

    def _apply_load(self, fields: dict) -> None:
        try:
            lease = rs.Lease.decode(fields.get(b"lease", fields.get("lease", b"")))
        except ValueError as e:
            log.warning("router: ignoring load %s", e)
            return
        w = self.workers.get(lease.worker_id)
        if w is not None and w.lease.epoch == lease.epoch:
            self._report(w, lease)

    def _apply(self, fields: dict, only: str | None = None) -> None:
        try:
            batch = rs.EventBatch.from_fields(fields)
        except ValueError as e:
            self._reject("an event batch", e)
            return
        w = self.workers.get(batch.worker_id)
        if w is None or batch.epoch != w.lease.epoch or (only and batch.worker_id != only):
            return                              # unknown yet: its resync will replay this entry
        if w.seq is not None and batch.seq <= w.seq:
            return                              # already in the snapshot
        self.index.apply(w.id, batch.events)
        if batch.host_events:
            self.index.apply_host(w.id, batch.host_events)
        if w.seq is not None and batch.seq == w.seq + 1:
            w.seq = batch.seq
        elif w.seq is not None:
            log.info("router: worker %s event gap (%d -> %d); resyncing", w.id, w.seq, batch.seq)
            w.seq, w.next_resync = None, 0.0


def _stream_items(reply):
    # RESP2 answers a list of [stream, entries]; RESP3 a dict of stream -> entries.
    if not reply:
        return []
    return list(reply.items()) if isinstance(reply, dict) else reply
