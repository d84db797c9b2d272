"""Publishes a worker's lease, load and cached-block events to Redis for routers to read.

Everything here runs as one task on the worker's asyncio loop, never on the engine thread: the
engine only hands over its buffered events (take_kv_events) and figures (stats), both cheap and
thread-safe, so a slow or absent Redis cannot slow a step. Redis failures are logged and retried
with backoff; requests never see them. Events that cannot be pushed are kept (bounded); if the
bound is hit they are dropped, the batch sequence skips a number so routers notice the gap, and
a fresh snapshot is published as soon as Redis answers again.

With a host KV tier, its block events ride in the same batches (their own field) and its
snapshot is written with the device one, in one transaction, under the same sequence number.

Between heartbeats, a change in running or waiting requests (an admission or a finish) sends
the lease on the model's load stream, at most once per `load_interval_s`, so routers do not
balance on figures a heartbeat old.
"""
from __future__ import annotations

import asyncio
import logging
import random
import time
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from pagoda.gpu_worker.serving.engine_client import EngineReport
from pagoda.gpu_worker.serving.step_rates import StepRates
from pagoda.protos import redis_schema as rs

log = logging.getLogger(__name__)


class Publisher:
    def __init__(self, redis_url: str, worker_id: str, model: str, address: str, engine: EngineReport,
                 heartbeat_s: float = 0.5, snapshot_s: float = 5.0, lease_ttl_s: float = 3.0,
                 poll_s: float = 0.02, max_pending_events: int = 200_000,
                 stream_maxlen: int = rs.STREAM_MAXLEN, name: str = "", load_interval_s: float = 0.05,
                 epoch: int | None = None, tokenizer_digest: str = "", kv_transfer: Any = None,
                 kv_role: str = "both"):
        """`kv_transfer`: the worker's KVFetcher (its block_bytes and measured rate go in the
        lease); None: the worker takes no fetches."""
        if heartbeat_s <= 0 or snapshot_s <= 0 or lease_ttl_s <= heartbeat_s:
            raise ValueError("heartbeat_s, snapshot_s must be > 0 and lease_ttl_s > heartbeat_s")
        self.redis_url, self.worker_id, self.model, self.address = redis_url, worker_id, model, address
        self.name = name or worker_id
        self.rates = StepRates()
        self.load_interval_s = load_interval_s
        self._published_load: tuple[int, int] | None = None     # (running, waiting) last sent
        self._next_load = 0.0
        self.engine = engine
        self.heartbeat_s, self.snapshot_s, self.lease_ttl_s = heartbeat_s, snapshot_s, lease_ttl_s
        self.poll_s, self.max_pending, self.stream_maxlen = poll_s, max_pending_events, stream_maxlen
        self.epoch = rs.new_epoch() if epoch is None else epoch   # the server answers with it too
        self.tokenizer_digest, self.kv_role = tokenizer_digest, kv_role
        self.kv_transfer = kv_transfer
        self.seq = 0                       # last batch sequence number assigned
        self.stream_id = "0-0"             # last entry this process added
        self.pending: list[tuple[str, bytes]] = []
        self.pending_host: list[tuple[str, bytes]] = []    # the host tier's events
        self.need_snapshot = True          # a router must be able to sync before any event
        self.snapshot_seq = -1             # seq the last published snapshot is current to
        self.connected = False
        self._redis: Any = None   # aioredis.Redis once started; its stubs type replies too loosely to help
        self._task: asyncio.Task | None = None
        self._stopping = asyncio.Event()
        self._next_heartbeat = self._next_snapshot = 0.0

    async def start(self) -> None:
        self._redis = aioredis.from_url(
            self.redis_url, password=rs.redis_password(self.redis_url), socket_timeout=1.0,
            socket_connect_timeout=1.0, retry=None, health_check_interval=0)
        self._task = asyncio.create_task(self._run(), name=f"publisher-{self.worker_id}")

    async def stop(self) -> None:
        # Let the loop finish the command it is on rather than cancelling it mid-write: a
        # cancelled SET can leave its connection broken, or reach Redis after the DELETE below.
        self._stopping.set()
        if self._task:
            try:
                await asyncio.wait_for(self._task, 2.0)      # cancels it past the 2 s
            except asyncio.TimeoutError:
                pass
            except Exception as e:         # the loop died earlier; stopping still withdraws the lease
                log.warning("publisher: loop had failed: %r", e)
            self._task = None
        if self._redis is not None:
            try:
                # Routers drop this worker at once instead of waiting for the TTL.
                await asyncio.wait_for(self._redis.delete(rs.lease_key(self.worker_id)), 2.0)
            except (RedisError, OSError, asyncio.TimeoutError):
                pass
            await self._redis.aclose()
            self._redis = None

    async def _pause(self, seconds: float) -> None:
        """Sleep, but wake at once when stop() is called."""
        try:
            await asyncio.wait_for(self._stopping.wait(), seconds)
        except asyncio.TimeoutError:
            pass

    async def _run(self) -> None:
        backoff = 0.05
        while not self._stopping.is_set():
            try:
                await self._publish()
                if not self.connected:
                    log.info("publisher: connected to redis at %s", self.redis_url)
                self.connected, backoff = True, 0.05
                await self._pause(self.poll_s)
            except (RedisError, OSError, asyncio.TimeoutError) as e:
                if self.connected or backoff == 0.05:
                    log.warning("publisher: redis unavailable (%s); retrying with backoff", e)
                self.connected, self.need_snapshot = False, True
                await self._pause(backoff * (0.5 + random.random() / 2))
                backoff = min(backoff * 2, 1.0)

    def _drain(self) -> None:
        self.pending.extend(self.engine.take_kv_events())
        self.pending_host.extend(self.engine.take_host_kv_events())
        if len(self.pending) + len(self.pending_host) > self.max_pending:
            log.warning("publisher: dropping %d unpublished block events", len(self.pending) + len(self.pending_host))
            self.pending.clear()
            self.pending_host.clear()
            self.seq += 1                  # the hole tells routers to resynchronise
            self.need_snapshot = True

    async def _publish(self) -> None:
        now = time.monotonic()
        snapshot, heartbeat = now >= self._next_snapshot, now >= self._next_heartbeat
        await self.publish_once(heartbeat, snapshot)
        if snapshot:
            self._next_snapshot = now + self.snapshot_s
        if heartbeat:
            self._next_heartbeat = now + self.heartbeat_s

    async def publish_once(self, heartbeat: bool, snapshot: bool, now: float | None = None) -> None:
        """One round: pending events, then the snapshot (when due or owed), then the lease, on
        the heartbeat or, when the load changed, on the load stream. The snapshot goes before
        the lease so that a router that sees the lease can sync at once. `now` is the clock
        for the load rate limit (monotonic by default)."""
        self._drain()
        if self.pending or self.pending_host:
            await self._push_events()
        if snapshot or self.need_snapshot:
            await self._snapshot()
        now = time.monotonic() if now is None else now
        if heartbeat:
            await self._heartbeat()
            self._next_load = now + self.load_interval_s
        elif now >= self._next_load and self._published_load is not None:
            st = self.engine.stats()
            if (st.running, st.waiting) != self._published_load:
                lease = self._lease(st)
                await self._redis.xadd(rs.load_key(self.model), {"lease": lease.encode()},
                                       maxlen=rs.LOAD_STREAM_MAXLEN, approximate=True)
                self._next_load = now + self.load_interval_s

    async def _push_events(self) -> None:
        batch = rs.EventBatch(self.worker_id, self.epoch, self.seq + 1, self.pending, self.pending_host)
        sid = await self._redis.xadd(rs.events_key(self.model), batch.fields(),
                                     maxlen=self.stream_maxlen, approximate=True)
        self.seq, self.stream_id, self.pending, self.pending_host = batch.seq, rs._text(sid), [], []

    async def _heartbeat(self) -> None:
        lease = self._lease(self.engine.stats())
        await self._redis.set(rs.lease_key(self.worker_id), lease.encode(), px=int(self.lease_ttl_s * 1000))

    def _lease(self, st) -> rs.Lease:
        self._published_load = (st.running, st.waiting)
        self.rates.observe(st.num_steps, st.step_seconds, st.prompt_tokens, st.generation_tokens)
        return rs.Lease(worker_id=self.worker_id, model=self.model, address=self.address,
                        epoch=self.epoch, block_size=self.engine.block_size, num_blocks=st.num_blocks,
                        running=st.running, waiting=st.waiting,
                        queued_prefill_tokens=st.queued_prefill_tokens, kv_usage=st.kv_usage,
                        free_blocks=st.free_blocks, seq=self.seq, ts=time.time(),
                        prefill_tps=self.rates.prefill_tps, decode_tps=self.rates.decode_tps,
                        step_s=self.rates.step_s, max_batched_tokens=st.max_num_batched_tokens,
                        name=self.name, tokenizer_digest=self.tokenizer_digest, **self._adapters(),
                        host_blocks=st.host_blocks, kv_copy_tps=self._copy_tps(st), kv_role=self.kv_role,
                        **self._transfer())

    def _transfer(self) -> dict:
        """What a router needs to price a fetch to this worker: its block's bytes (0: it takes
        none) and the rate and per-call overhead it measured of its fetches (a prior until then)."""
        t = self.kv_transfer
        if t is None or not t.block_bytes:
            return {}
        return dict(kv_block_bytes=t.block_bytes, kv_fetch_bps=min(t.rate.bps, 1e12),
                    kv_fetch_overhead_s=min(t.rate.overhead_s, 60.0))

    def _copy_tps(self, st) -> float:
        """Tokens per second of KV copies between the tiers, as measured so far (0: none yet)."""
        seconds = st.kv_copy_seconds
        return min(st.kv_copied_blocks * self.engine.block_size / seconds, 1e12) if seconds > 0 else 0.0

    def _adapters(self) -> dict:
        """The engine's LoRA adapters, bounded as the schema bounds them."""
        loaded = self.engine.lora_adapters()[:rs.MAX_LORA_ADAPTERS]
        resident, paths = set(self.engine.lora_resident()), self.engine.lora_paths()
        # A path too long for the schema goes as "": the adapter is still listed, under its name.
        shown = [p if len(p := paths.get(n, "")) <= rs.MAX_ADAPTER_NAME else "" for n in loaded]
        return dict(lora_adapters=loaded, lora_resident=[n for n in loaded if n in resident], lora_paths=shown,
                    max_loras=self.engine.max_loras)

    async def _snapshot(self) -> None:
        key, ttl = rs.snapshot_key(self.worker_id), int(max(self.lease_ttl_s, 3 * self.snapshot_s) * 1000)
        if self.pending or self.pending_host:   # snapshot only once every drained event is in the stream
            return
        # No host tier: the device snapshot alone, as before.
        by_tier = self.engine.cached_hashes_by_tier if self.engine.stats().host_blocks else None
        host_key = rs.host_snapshot_key(self.worker_id)
        if not self.need_snapshot and self.snapshot_seq == self.seq and await self._redis.pexpire(key, ttl):
            if by_tier is not None:
                await self._redis.pexpire(host_key, ttl)
            return
        # Taken after the push: events the engine logs meanwhile come in later batches, and
        # replaying them on this snapshot converges because set add/remove are idempotent.
        if by_tier is None:
            device, host = list(self.engine.cached_block_hashes()), None
        else:
            device, host = by_tier()
        snap = rs.Snapshot(self.worker_id, self.epoch, self.seq, self.stream_id, device)
        if host is None:
            await self._redis.set(key, snap.encode(), px=ttl)
        else:
            host_snap = rs.Snapshot(self.worker_id, self.epoch, self.seq, self.stream_id, host)
            async with self._redis.pipeline(transaction=True) as pipe:
                pipe.set(key, snap.encode(), px=ttl)
                pipe.set(host_key, host_snap.encode(), px=ttl)
                await pipe.execute()
        self.snapshot_seq, self.need_snapshot = snap.seq, False
