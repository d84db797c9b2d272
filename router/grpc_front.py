"""The router's gRPC front: the same pagoda.v1 Generation service as a worker, answered by the
request pipeline (router/pipeline.py); a RouterError becomes the call's status.

Generate writes each worker response as the bytes the worker sent (its handler is registered with
no response serializer: add_to_server), from a coroutine handler rather than an async generator,
so that a relayed response costs one read and one write and little else.
"""
from __future__ import annotations

import grpc

from pagoda.protos.pagoda.v1 import pagoda_pb2 as pb
from pagoda.router.errors import RouterError
from pagoda.router.pipeline import Pipeline
from pagoda.runtime.security import identity

SERVICE = "pagoda.v1.Generation"


class RouterService:
    def __init__(self, pipeline: Pipeline):
        self.pipeline = pipeline

    async def Generate(self, request: pb.GenerateRequest, context) -> None:
        try:
            stream = await self.pipeline.open(request, context.time_remaining(),
                                              identity(self.pipeline.keyring, context))
        except RouterError as e:
            await context.abort(e.code, e.message)
        write = context.write
        try:
            async for raw in stream:
                await write(raw)
        except RouterError as e:
            await context.abort(e.code, e.message)
        finally:
            await stream.aclose()        # a cancelled call ends the upstream call at once

    async def Route(self, request: pb.GenerateRequest, context):
        try:
            return await self.pipeline.route(request, identity(self.pipeline.keyring, context))
        except RouterError as e:
            await context.abort(e.code, e.message)

    async def GetModelInfo(self, request: pb.ModelInfoRequest, context):
        try:
            return await self.pipeline.model_info(request.model)
        except RouterError as e:
            await context.abort(e.code, e.message)

    async def Tokenize(self, request: pb.TokenizeRequest, context):
        try:
            return pb.TokenizeResponse(token_ids=(await self.pipeline.tokenize(request))[1])
        except RouterError as e:
            await context.abort(e.code, e.message)


def add_to_server(service: RouterService, server: grpc.aio.Server) -> None:
    """pagoda.v1.Generation as the generated add_GenerationServicer_to_server registers it, but for
    Generate's responses, which are bytes already."""
    handlers = {
        "Generate": grpc.unary_stream_rpc_method_handler(
            service.Generate, request_deserializer=pb.GenerateRequest.FromString, response_serializer=None),
        "Route": grpc.unary_unary_rpc_method_handler(
            service.Route, request_deserializer=pb.GenerateRequest.FromString,
            response_serializer=pb.RouteResponse.SerializeToString),
        "GetModelInfo": grpc.unary_unary_rpc_method_handler(
            service.GetModelInfo, request_deserializer=pb.ModelInfoRequest.FromString,
            response_serializer=pb.ModelInfoResponse.SerializeToString),
        "Tokenize": grpc.unary_unary_rpc_method_handler(
            service.Tokenize, request_deserializer=pb.TokenizeRequest.FromString,
            response_serializer=pb.TokenizeResponse.SerializeToString),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
    server.add_registered_method_handlers(SERVICE, handlers)
