"""Server-sent events as OpenAI streams them: each object one `data: {json}` event, then
`data: [DONE]`. A client that takes none of the stream for --http-write-timeout (it stopped
reading, and the socket's buffers are full) loses it: the events' source is closed, which ends
the upstream call and so the request on the worker, and the connection is dropped."""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from typing import AsyncGenerator

from aiohttp import web

from pagoda.router.openai.limits import limits_of

log = logging.getLogger(__name__)


async def send_events(request: web.Request, events: AsyncGenerator[dict, None]) -> web.StreamResponse:
    """Answer `request` with `events` as they come (the headers go first, before the first one)."""
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    timeout = limits_of(request).write_timeout
    try:
        async with contextlib.aclosing(events):
            async with asyncio.timeout(timeout):
                await resp.prepare(request)
            async for obj in events:
                async with asyncio.timeout(timeout):
                    await resp.write(b"data: " + json.dumps(obj).encode() + b"\n\n")
        async with asyncio.timeout(timeout):
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
    except TimeoutError:
        log.warning("%s: the client took none of its stream for %gs (--http-write-timeout); aborted",
                    request.path, timeout)
        if request.transport is not None:
            request.transport.abort()
    return resp
