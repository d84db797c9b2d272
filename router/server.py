"""One router process: arguments, the Redis sync, the servers (gRPC, optional OpenAI HTTP,
Prometheus), signals and an orderly shutdown.

The request path lives in its stages: preparation (router/prepare.py: limits, tenancy, tokenizer
pinning, tokenization, block hashes), worker selection (router/selection.py over
router/scoring.py), the proxy with failover and the credit ledger (router/proxy.py), composed in
router/pipeline.py; the fronts are router/grpc_front.py and router/openai/ (OpenAI HTTP).
"""
from __future__ import annotations

import asyncio
import logging
import signal
import sys
from typing import TYPE_CHECKING

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from pagoda.protos.limits import Limits
from pagoda.protos.pagoda.v1 import pagoda_pb2 as pb
from pagoda.router.args import build_parser
from pagoda.router.channels import WorkerChannels
from pagoda.router.cluster import Cluster
from pagoda.router.grpc_front import RouterService, add_to_server
from pagoda.router.index import BlockIndex
from pagoda.router.metrics import RouterMetrics
from pagoda.router.pipeline import Pipeline
from pagoda.router.selection import Scorer
from pagoda.runtime import serving
from pagoda.runtime.heap import freeze_heap
from pagoda.runtime.lifetime import die_with_parent
from pagoda.runtime.metrics_http import start_metrics_server
from pagoda.runtime.security import AuthInterceptor, GrantSigner, KeyRing, channel_credentials, read_key, server_credentials
from pagoda.runtime.serving import StartupError, StopDeadline, at_stage, bind, check_port_free, server_options

if TYPE_CHECKING:                   # imported only when serving HTTP (aiohttp)
    from pagoda.router.openai.front import OpenAIFront

log = logging.getLogger(__name__)
SYNC_SERVICE = "pagoda.router.RedisSync"


class Router:
    """One router: Redis sync task, gRPC server, optional metrics endpoint."""

    def __init__(self, a):
        self.args = a
        self.index = BlockIndex(a.index_max_blocks, a.speculative_ttl)
        self.cluster = Cluster(a.redis_url, self.index, max_snapshot_bytes=a.max_snapshot_bytes)
        self.metrics = RouterMetrics(self.cluster, self.index)
        try:
            creds = server_credentials(a.tls_cert, a.tls_key, a.tls_client_ca)
            worker_creds = channel_credentials(a.worker_tls_ca, a.worker_tls_cert, a.worker_tls_key)
            self.keyring = KeyRing(a.api_keys_file) if a.api_keys_file else None
            worker_key = read_key(a.worker_api_key_file) if a.worker_api_key_file else None
        except (OSError, ValueError) as e:
            raise StartupError(f"TLS/keys: {e}") from None
        self.channels = WorkerChannels(worker_creds, worker_key)
        scorer = Scorer(a.policy, self.index, fetch=a.kv_fetch_hints == "on")
        self.pipeline = Pipeline(self.cluster, scorer, self.metrics, self.channels,
                                 a.max_attempts, Limits.from_args(a), a.first_token_timeout, self.keyring,
                                 GrantSigner(worker_key) if worker_key else None)
        self.service = RouterService(self.pipeline)
        self.cluster.verify = self.channels.verify
        self.host = a.host
        interceptors = [AuthInterceptor(self.keyring)] if self.keyring else []
        self.server = grpc.aio.server(options=server_options(a.max_concurrent_streams), interceptors=interceptors)
        self.health = health.aio.HealthServicer()
        # Ports first, before anything connects anywhere: a taken one is one line naming it.
        self.port = bind(self.server, a.host, a.port, "--port", creds)
        self.metrics_port = serving.metrics_port(a.metrics_port, a.port)
        check_port_free(a.host, self.metrics_port, "--metrics-port")
        self.http_port = a.http_port
        self.http: OpenAIFront | None = None
        check_port_free(a.host, self.http_port, "--http-port")

    async def start(self) -> int:
        add_to_server(self.service, self.server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        name = pb.DESCRIPTOR.services_by_name["Generation"].full_name
        reflection.enable_server_reflection([name, health.SERVICE_NAME, reflection.SERVICE_NAME], self.server)
        if self.metrics_port:
            start_metrics_server(self.metrics_port, self.host, self.metrics.registry)
        await self.cluster.start()
        await self.cluster.wait_synced(2.0)
        await self.server.start()
        for service in ("", name):
            await self.health.set(service, health_pb2.HealthCheckResponse.SERVING)
        if self.http_port:
            from pagoda.router.openai.front import OpenAIFront  # lazy: aiohttp only with --http-port
            from pagoda.router.openai.limits import HttpLimits  # lazy: as the front it configures
            self.http = OpenAIFront(self.pipeline, self.args.tool_call_parser, HttpLimits.from_args(self.args))
            await self.http.start(self.host, self.http_port)
        self._sync_health = asyncio.create_task(self._report_sync())
        freeze_heap()
        return self.port

    async def _report_sync(self) -> None:
        """Health service SYNC_SERVICE follows the Redis sync's freshness (readiness for
        probes that want a current view; the router itself keeps serving on its last view)."""
        last = None
        while True:
            status = health_pb2.HealthCheckResponse.SERVING if self.cluster.healthy() \
                else health_pb2.HealthCheckResponse.NOT_SERVING
            if status != last:
                await self.health.set(SYNC_SERVICE, status)
                last = status
            await asyncio.sleep(0.5)

    async def stop(self, grace: float = 2.0, deadline: StopDeadline | None = None) -> None:
        self._sync_health.cancel()
        await self.health.enter_graceful_shutdown()
        if self.http is not None:
            at_stage(deadline, "HTTP front stop")
            await self.http.stop()
        at_stage(deadline, "gRPC server stop")
        await self.server.stop(grace)
        at_stage(deadline, "closing worker channels")
        await self.channels.close()
        at_stage(deadline, "redis sync stop")
        await self.cluster.stop()
        at_stage(deadline, "asyncio teardown")


async def _serve(a) -> None:
    router = Router(a)
    port = await router.start()
    log.info("router listening on %s:%d (policy %s, metrics port %s)", a.host, port, a.policy,
             router.metrics_port or "off")
    print(f"router listening on {a.host}:{port}", flush=True)
    if a.http_port:
        print(f"router OpenAI-compatible HTTP at http://{a.host}:{a.http_port}/v1", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    if router.keyring is not None:
        loop.add_signal_handler(signal.SIGHUP, router.keyring.reload)
    await stop.wait()
    # grace 2 s for open streams; the rest is bounded calls: 10 s is stuck, not slow.
    await router.stop(2.0, StopDeadline("router", 10.0).start())


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    die_with_parent()
    logging.basicConfig(level=a.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        asyncio.run(_serve(a))
    except StartupError as e:       # a taken port, a missing certificate: one line saying what to change
        print(f"pagoda router: {e}", file=sys.stderr, flush=True)
        return 2
    return 0
