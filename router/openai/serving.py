"""What the OpenAI front's endpoint groups share: the pipeline they serve through, the caller
(API keys, as on the gRPC front) and the model a request names, pinned with its tokenizer."""
from __future__ import annotations

from aiohttp import web

from pagoda.router.errors import RouterError
from pagoda.router.openai.request import ApiError
from pagoda.router.pipeline import Pipeline


class Serving:
    def __init__(self, service: Pipeline, tool_call_parser: str = "hermes"):
        self.service, self.tool_call_parser = service, tool_call_parser

    def identity(self, request: web.Request):
        """The caller, when the router runs with --api-keys-file (OpenAI clients send the same
        `Authorization: Bearer KEY` header); 401 without a valid key."""
        ring = self.service.keyring
        if ring is None:
            return None
        ident = ring.identify([("authorization", request.headers.get("Authorization", ""))])
        if ident is None:
            raise ApiError(401, "authorization: send `Authorization: Bearer KEY` with a valid key",
                           code="invalid_api_key")
        return ident

    async def pin(self, model: str):
        try:
            return await self.service.pin(model)
        except RouterError as r:
            raise ApiError.from_reject(r) from None
