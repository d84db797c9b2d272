"""The router's gRPC front: the same pagoda.v1 Generation service as a worker, answered by the
request pipeline (router/pipeline.py); a RouterError becomes the call's status."""
from __future__ import annotations

from protos.pagoda.v1 import pagoda_pb2 as pb
from protos.pagoda.v1 import pagoda_pb2_grpc as pb_grpc
from protos.security import identity
from router.errors import RouterError
from router.pipeline import Pipeline


class RouterService(pb_grpc.GenerationServicer):
    def __init__(self, pipeline: Pipeline):
        self.pipeline = pipeline

    async def Generate(self, request: pb.GenerateRequest, context):
        try:
            async for resp in self.pipeline.generate(request, context.time_remaining(),
                                                     identity(self.pipeline.keyring, context)):
                yield resp
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
