"""The router's OpenAI-compatible HTTP front: the aiohttp application on the router's own event
loop, its routes onto the endpoint groups (router/openai/: generation, models, tokenization), the
endpoints about the process itself (/health, /version, /metrics), and aiohttp's own errors as
OpenAI error objects."""
from __future__ import annotations

from importlib import metadata

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from pagoda.router.openai.generation import Generation
from pagoda.router.openai.models import Models
from pagoda.router.openai.request import ApiError
from pagoda.router.openai.tokenization import Tokenization
from pagoda.router.pipeline import Pipeline


class OpenAIFront:
    """The aiohttp application and its listening site."""

    def __init__(self, service: Pipeline, tool_call_parser: str = "hermes"):
        self.service, self.tool_call_parser = service, tool_call_parser
        generation = Generation(service, tool_call_parser)
        models = Models(service, tool_call_parser)
        tokenization = Tokenization(service, tool_call_parser)
        self.app = web.Application(client_max_size=16 * 2**20, middlewares=[_json_errors])
        add = self.app.router
        add.add_get("/v1/models", models.models)
        add.add_get("/v1/models/{model:.+}", models.model)
        add.add_post("/v1/completions", generation.completions)
        add.add_post("/v1/chat/completions", generation.chat_completions)
        add.add_post("/tokenize", tokenization.tokenize)
        add.add_post("/detokenize", tokenization.detokenize)
        add.add_get("/version", self.version)
        add.add_get("/health", self.health)
        add.add_get("/metrics", self.metrics)       # GET and HEAD (aiohttp adds HEAD to every GET)
        add.add_post("/v1/load_lora_adapter", models.load_lora_adapter)
        add.add_post("/v1/unload_lora_adapter", models.unload_lora_adapter)
        self.runner: web.AppRunner | None = None

    async def start(self, host: str, port: int) -> None:
        # handler_cancellation: a client that disconnects cancels its handler, and so its upstream call.
        self.runner = web.AppRunner(self.app, handler_cancellation=True, access_log=None)
        await self.runner.setup()
        await web.TCPSite(self.runner, host, port).start()

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({"models": self.service.cluster.models()},
                                 status=200 if self.service.cluster.models() else 503)

    async def version(self, request: web.Request) -> web.Response:
        return web.json_response({"version": _version()})

    async def metrics(self, request: web.Request) -> web.Response:
        """The router's Prometheus metrics on the API port, as vLLM serves its own there."""
        body = generate_latest(self.service.metrics.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


@web.middleware
async def _json_errors(request: web.Request, handler):
    """aiohttp's own answers (no such route, a wrong method) as OpenAI error objects, not text."""
    try:
        return await handler(request)
    except web.HTTPException as e:
        if e.status < 400:
            raise
        why = {404: f"no route {request.path!r} (the OpenAI API is under /v1)",
               405: f"method {request.method} not allowed on {request.path!r}"}.get(e.status, e.reason)
        headers = {"Allow": e.headers["Allow"]} if "Allow" in e.headers else None
        body = ApiError(e.status, why).body()
        if e.status in (404, 405):
            # What OpenAI answers for a path or method it has no route for (it says "Invalid URL"):
            # the caller's request is wrong, not the server (before: 405 read as server_error).
            body["error"]["type"] = "invalid_request_error"
        return web.json_response(body, status=e.status, headers=headers)


def _version() -> str:
    try:
        return metadata.version("pagoda-serve")
    except metadata.PackageNotFoundError:
        return "unknown"
