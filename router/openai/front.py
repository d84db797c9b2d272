"""The router's OpenAI-compatible HTTP front: the aiohttp application on the router's own event
loop, its routes onto the endpoint groups (router/openai/: generation, models, tokenization), the
endpoints about the process itself (/health, /version, /metrics), the bounds on what one client
holds (router/openai/limits.py), and aiohttp's own errors as OpenAI error objects."""
from __future__ import annotations

import asyncio
import logging
from importlib import metadata

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from pagoda.router.openai.generation import Generation
from pagoda.router.openai.limits import LIMITS, Connection, HttpLimits
from pagoda.router.openai.models import Models
from pagoda.router.openai.request import ApiError
from pagoda.router.openai.tokenization import Tokenization
from pagoda.router.pipeline import Pipeline

log = logging.getLogger(__name__)


class OpenAIFront:
    """The aiohttp application and its listening site."""

    def __init__(self, service: Pipeline, tool_call_parser: str = "hermes", limits: HttpLimits = HttpLimits()):
        self.service, self.tool_call_parser, self.limits = service, tool_call_parser, limits
        generation = Generation(service, tool_call_parser)
        models = Models(service, tool_call_parser)
        tokenization = Tokenization(service, tool_call_parser)
        self.app = web.Application(client_max_size=limits.max_body_bytes, middlewares=[_bounded])
        self.app[LIMITS] = limits
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
        self.listener: asyncio.Server | None = None

    async def start(self, host: str, port: int) -> None:
        # handler_cancellation: a client that disconnects cancels its handler, and so its upstream call.
        self.runner = web.AppRunner(self.app, handler_cancellation=True)
        await self.runner.setup()
        server, loop, limits = self.runner.server, asyncio.get_running_loop(), self.limits
        assert server is not None

        def connection() -> Connection:     # aiohttp's own handler, with a deadline on each request
            # access_log None: no access log (aiohttp takes None, as AppRunner(access_log=None) does).
            return Connection(server, loop=loop, access_log=None,
                              keepalive_timeout=limits.idle_timeout, read_timeout=limits.read_timeout,
                              send_buffer_bytes=limits.send_buffer_bytes)
        self.listener = await loop.create_server(connection, host, port, reuse_address=True)

    async def stop(self) -> None:
        if self.listener is not None:
            self.listener.close()
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
async def _bounded(request: web.Request, handler):
    """The body read whole first, within the connection's read deadline and the size bound; then
    the handler, with aiohttp's own answers (no such route, a wrong method, a body too large) and
    anything unforeseen as OpenAI error objects, not text."""
    conn = request.protocol
    try:
        declared, bound = request.content_length or 0, request.app[LIMITS].max_body_bytes
        if declared > bound:            # refused unread
            raise web.HTTPRequestEntityTooLarge(bound, declared)
        try:
            await request.read()
        except (HttpProcessingError, web.RequestPayloadError) as e:    # malformed chunks or compression
            return ApiError(400, f"body: could not be read ({str(e).strip()})").response()
        if isinstance(conn, Connection):
            conn.request_read()
        return await handler(request)
    except web.HTTPException as e:
        if e.status < 400:
            raise
        why = {404: f"no route {request.path!r} (the OpenAI API is under /v1)",
               405: f"method {request.method} not allowed on {request.path!r}",
               413: f"body: larger than {request.app[LIMITS].max_body_bytes} bytes (the router's "
                    "--http-max-body-bytes)"}.get(e.status, e.reason)
        headers = {"Allow": e.headers["Allow"]} if "Allow" in e.headers else None
        body = ApiError(e.status, why).body()
        if e.status in (404, 405):
            # What OpenAI answers for a path or method it has no route for (it says "Invalid URL"):
            # the caller's request is wrong, not the server (before: 405 read as server_error).
            body["error"]["type"] = "invalid_request_error"
        return web.json_response(body, status=e.status, headers=headers)
    except ConnectionError:             # the client is gone: nobody to answer
        raise
    except Exception:
        log.exception("%s %s failed", request.method, request.path)
        return ApiError(500, "internal error (logged by the router)").response()
    finally:
        if isinstance(conn, Connection):
            conn.request_done()


def _version() -> str:
    try:
        return metadata.version("pagoda-serve")
    except metadata.PackageNotFoundError:
        return "unknown"
