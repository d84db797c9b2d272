"""The engine loop has one writer: a slow model step (1 s, through PAGODA_TEST_STEP_DELAY_S)
must not slow anything the event loop answers. While steps run, GetLoad, health checks and the
publisher's heartbeats answer within 100 ms, and two streams each get a token every step."""
import asyncio
import time

import grpc
import pytest
import redis
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pagoda.clients import AsyncPagodaClient
from pagoda.protos import redis_schema as rs

pytestmark = pytest.mark.slow

STEP_S = 1.0
FAST_S = 0.1


def test_slow_steps_never_block_the_event_loop(start_worker, tiny_model, redis_server):
    w = start_worker(tiny_model, num_kv_blocks=32, redis_url=redis_server.url, worker_id="slow",
                     heartbeat_interval=0.05, env={"PAGODA_TEST_STEP_DELAY_S": str(STEP_S)})
    r = redis.Redis.from_url(redis_server.url)

    async def stream(c, prompt, arrivals):
        async for chunk in c.generate(prompt, max_tokens=4, ignore_eos=True, temperature=0.0):
            arrivals.append((time.monotonic(), len(chunk.token_ids)))

    async def probe(c, health, latencies, lease_ts, done):
        while not done.is_set():
            t = time.monotonic()
            await c.load()
            latencies["load"].append(time.monotonic() - t)
            t = time.monotonic()
            reply = await health.Check(health_pb2.HealthCheckRequest())
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
            latencies["health"].append(time.monotonic() - t)
            raw = r.get(rs.lease_key("slow"))
            if raw is not None:
                lease_ts.add(rs.Lease.decode(raw).ts)
            await asyncio.sleep(0.01)

    async def main():
        latencies: dict[str, list[float]] = {"load": [], "health": []}
        lease_ts: set[float] = set()
        a: list = []
        b: list = []
        done = asyncio.Event()
        async with AsyncPagodaClient(w.address, retries=0) as c, \
                grpc.aio.insecure_channel(w.address) as ch:
            health = health_pb2_grpc.HealthStub(ch)
            prober = asyncio.create_task(probe(c, health, latencies, lease_ts, done))
            t0 = time.monotonic()
            await asyncio.gather(stream(c, "first stream", a), stream(c, "the second one", b))
            elapsed = time.monotonic() - t0
            done.set()
            await prober
        return latencies, sorted(lease_ts), a, b, elapsed

    latencies, ts, a, b, elapsed = asyncio.run(main())
    # Both requests share every step: 4 steps of at least 1 s each.
    assert elapsed >= 4 * STEP_S
    for name, values in latencies.items():
        assert len(values) >= 10 and max(values) < FAST_S, (name, sorted(values)[-5:])
    gaps = [y - x for x, y in zip(ts, ts[1:])]
    # Heartbeats every 0.05 s plus Redis round trips on a loaded machine: a heartbeat that
    # waited on a step would leave a gap of about STEP_S.
    assert len(ts) >= 40 and max(gaps) < STEP_S / 4, sorted(gaps)[-5:]
    for arrivals in (a, b):
        assert sum(n for _, n in arrivals) == 4
        # A token every step: no stream waits for a step it is not in.
        times = [t for t, _ in arrivals]
        assert max(y - x for x, y in zip(times, times[1:])) < STEP_S + 0.5
