"""A recording HTTP relay on loopback for the tests that drive pagoda with third-party tools:
it forwards to the router, streams each answer through as it comes and keeps (method, path, request
body, status, whole response text), so a test can check every call the tool made. A helper, not a
plugin: imported by the tests that use it (after importorskip("aiohttp"))."""
from __future__ import annotations

import asyncio
import contextlib
import json
import threading

import aiohttp
from aiohttp import web


class RecordingRelay:
    """An HTTP relay on loopback that forwards to the router, streams the answer through as it comes
    and records (path, request body, status, whole response text)."""

    def __init__(self, upstream: str):
        self.upstream, self.records = upstream, []
        self.loop = asyncio.new_event_loop()
        self.port = 0
        started = threading.Event()
        threading.Thread(target=self._run, args=(started,), daemon=True).start()
        assert started.wait(10)

    def _run(self, started: threading.Event) -> None:
        asyncio.set_event_loop(self.loop)
        app = web.Application(client_max_size=64 * 2**20)
        app.router.add_route("*", "/{tail:.*}", self._forward)
        runner = web.AppRunner(app, access_log=None)
        self.loop.run_until_complete(runner.setup())
        site = web.TCPSite(runner, "127.0.0.1", 0)
        self.loop.run_until_complete(site.start())
        self.port = site._server.sockets[0].getsockname()[1]    # type: ignore[union-attr]
        self.session = self.loop.run_until_complete(self._session())
        started.set()
        self.loop.run_forever()

    @staticmethod
    async def _session():
        return aiohttp.ClientSession()

    async def _forward(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        headers = {"Content-Type": request.headers.get("Content-Type", "application/json")}
        async with self.session.request(request.method, self.upstream + request.path_qs, data=body,
                                        headers=headers) as r:
            out = web.StreamResponse(status=r.status, headers={"Content-Type": r.headers.get("Content-Type", "")})
            await out.prepare(request)
            data = b""
            async for chunk in r.content.iter_any():
                data += chunk
                await out.write(chunk)
        # Recorded once the server's whole answer has passed: guidellm may hang up as soon as it has
        # read [DONE], before the chunked body's terminator goes out (seen on a busy machine).
        self.records.append((request.method, request.path, json.loads(body) if body else None, r.status,
                             data.decode()))
        with contextlib.suppress(ConnectionResetError):
            await out.write_eof()
        return out

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self.session.close(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
