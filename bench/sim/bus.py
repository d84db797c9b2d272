"""Simulated workers publishing to a real Redis through the worker's own Publisher.

One pagoda.gpu_worker.serving.publisher.Publisher per simulated worker, with the SimWorker standing in
for the AsyncLLM it reads. The publisher's background task runs on wall-clock time, so it
is not started; instead its drain / push / heartbeat / snapshot steps are called at
simulated-time ticks. What lands in Redis is byte for byte what a real worker writes, except
that a report is stamped with simulated time (the router side stamps its credits with the same
clock): on wall time, how many ticks fit in the router's grace for reports that may still count
an ended request depended on how fast the machine ran the simulation, and so did the results.
"""
from __future__ import annotations

import asyncio
import dataclasses

import redis.asyncio as aioredis

from pagoda.gpu_worker.serving.publisher import Publisher

MODEL = "sim-model"


class SimPublisher(Publisher):
    """The worker's own publisher, its reports stamped with the simulation's clock."""
    clock = 0.0

    def _lease(self, st):
        return dataclasses.replace(super()._lease(st), ts=self.clock)


class RedisBus:
    def __init__(self, redis_url: str, num_workers: int, engines, loop: asyncio.AbstractEventLoop,
                 heartbeat_s: float, snapshot_s: float, model: str = MODEL):
        self.loop, self.heartbeat_s, self.snapshot_s = loop, heartbeat_s, snapshot_s
        self.client = aioredis.from_url(redis_url, max_connections=64)
        # Leases outlive any simulated run: simulated time may run slower than the TTL.
        self.pubs = [SimPublisher(redis_url, f"sim-{i}", model, f"10.0.0.{i}:50051", engines[i],
                               heartbeat_s=heartbeat_s, snapshot_s=snapshot_s, lease_ttl_s=3600.0,
                               kv_transfer=getattr(engines[i], "kv_transfer", None))
                     for i in range(num_workers)]
        for p in self.pubs:
            p._redis = self.client
        self._next_heartbeat = self._next_snapshot = 0.0

    def publish(self, workers, now: float, force: bool = False) -> None:
        heartbeat = force or now >= self._next_heartbeat
        snapshot = force or now >= self._next_snapshot
        if heartbeat:
            self._next_heartbeat = now + self.heartbeat_s
        if snapshot:
            self._next_snapshot = now + self.snapshot_s
        for p in self.pubs:
            p.clock = now
        self.loop.run_until_complete(self._all(heartbeat, snapshot, now))

    async def _all(self, heartbeat: bool, snapshot: bool, now: float) -> None:
        await asyncio.gather(*(p.publish_once(heartbeat, snapshot, now) for p in self.pubs))

    def close(self) -> None:
        self.loop.run_until_complete(self.client.aclose())
