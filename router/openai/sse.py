"""Server-sent events as OpenAI streams them: each object one `data: {json}` event, then
`data: [DONE]`."""
from __future__ import annotations

import contextlib
import json
from typing import AsyncGenerator

from aiohttp import web


async def send_events(request: web.Request, events: AsyncGenerator[dict, None]) -> web.StreamResponse:
    """Answer `request` with `events` as they come (the headers go first, before the first one)."""
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await resp.prepare(request)
    async with contextlib.aclosing(events):
        async for obj in events:
            await resp.write(b"data: " + json.dumps(obj).encode() + b"\n\n")
    await resp.write(b"data: [DONE]\n\n")
    await resp.write_eof()
    return resp
