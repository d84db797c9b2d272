"""The router's gRPC channels to workers: one per worker address, with the router's TLS
credentials and its own key (an admin key in the workers' --api-keys-file)."""
from __future__ import annotations

import asyncio
from typing import Iterable

import grpc

from pagoda.protos.pagoda.v1 import pagoda_pb2 as pb
from pagoda.protos.pagoda.v1 import pagoda_pb2_grpc as pb_grpc
from pagoda.protos.redis_schema import Lease
from pagoda.runtime.serving import CLIENT_KEEPALIVE

CHANNEL_OPTIONS = CLIENT_KEEPALIVE + [("grpc.enable_retries", 0), ("grpc.initial_reconnect_backoff_ms", 100),
                                      ("grpc.max_reconnect_backoff_ms", 1000),
                                      ("grpc.max_receive_message_length", 64 << 20)]
GENERATE = "/pagoda.v1.Generation/Generate"


class WorkerChannels:
    def __init__(self, credentials: grpc.ChannelCredentials | None = None, worker_key: str | None = None):
        self.credentials = credentials
        self.metadata = (("authorization", f"Bearer {worker_key}"),) if worker_key else None
        self._stubs: dict[str, tuple[grpc.aio.Channel, pb_grpc.GenerationStub, grpc.aio.UnaryStreamMultiCallable]] = {}

    def channel(self, address: str) -> grpc.aio.Channel:
        """A new channel (the caller closes it); stub() keeps one per address."""
        if self.credentials is not None:
            return grpc.aio.secure_channel(address, self.credentials, options=CHANNEL_OPTIONS)
        return grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)

    def stub(self, address: str) -> pb_grpc.GenerationStub:
        return self._entry(address)[1]

    def admin(self, address: str) -> pb_grpc.AdminStub:
        """The worker's Admin service, on the same channel (calls carry self.metadata: the router's key)."""
        return pb_grpc.AdminStub(self._entry(address)[0])

    def generate(self, address: str) -> grpc.aio.UnaryStreamMultiCallable:
        """Generate on the worker at `address`, its responses as the bytes it sent: the proxy
        relays them without decoding and encoding each again (router/proxy.py)."""
        return self._entry(address)[2]

    def _entry(self, address: str):
        entry = self._stubs.get(address)
        if entry is None:
            channel = self.channel(address)
            raw = channel.unary_stream(GENERATE, request_serializer=pb.GenerateRequest.SerializeToString,
                                       response_deserializer=None)
            entry = self._stubs[address] = (channel, pb_grpc.GenerationStub(channel), raw)
        return entry

    async def verify(self, lease: Lease) -> bool:
        """Does the lease's address answer as that worker id and epoch? (Cluster asks before a
        worker id moves to a new epoch, so a forged lease in Redis cannot fence a real worker.)"""
        channel = self.channel(lease.address)
        try:
            info = await pb_grpc.GenerationStub(channel).GetModelInfo(
                pb.ModelInfoRequest(model=lease.model), timeout=2, metadata=self.metadata)
            return info.worker_id == lease.worker_id and info.epoch == lease.epoch
        except grpc.aio.AioRpcError:
            return False
        finally:
            await channel.close(grace=None)

    def keep_only(self, addresses: Iterable[str]) -> None:
        """Close the channels to addresses no live worker has any more."""
        live = set(addresses)
        for address in [a for a in self._stubs if a not in live]:
            channel = self._stubs.pop(address)[0]
            asyncio.ensure_future(channel.close(grace=None))

    async def close(self) -> None:
        for entry in self._stubs.values():
            await entry[0].close(grace=None)
        self._stubs.clear()
