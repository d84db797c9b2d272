"""What one HTTP client can hold of the router, each bound a router flag (router/args.py):

- a body of at most --http-max-body-bytes, JSON at most --http-max-json-depth deep
  (router/openai/request.py: json_value);
- a request that arrives whole (head and body) within --http-read-timeout of its first byte, or of
  connecting for a connection's first request: a client that trickles its headers in byte by
  byte (slowloris) loses the connection (Connection);
- a kept-alive connection with no request for --http-idle-timeout is closed (aiohttp's own
  keep-alive timer, which the front sets);
- a connection's kernel send buffer is --http-send-buffer-bytes, not the up to 4 MiB Linux grows
  it to, so that a client that stops reading pins little memory and its stream soon stalls; a
  stream whose client takes none of it for --http-write-timeout is aborted, upstream call
  included (router/openai/sse.py);
- a /v1/completions list of prompts keeps --http-batch-seqs-per-worker sequences in flight per
  live worker of its model (router/openai/generation.py).
"""
from __future__ import annotations

import asyncio
import socket
from dataclasses import dataclass
from http import HTTPStatus

from aiohttp import web


@dataclass(frozen=True)
class HttpLimits:
    max_body_bytes: int = 16 << 20
    max_json_depth: int = 64
    read_timeout: float = 30.0
    idle_timeout: float = 75.0
    write_timeout: float = 30.0
    send_buffer_bytes: int = 256 << 10
    batch_seqs_per_worker: int = 32

    @classmethod
    def from_args(cls, a) -> HttpLimits:
        return cls(a.http_max_body_bytes, a.http_max_json_depth, a.http_read_timeout, a.http_idle_timeout,
                   a.http_write_timeout, a.http_send_buffer_bytes, a.http_batch_seqs_per_worker)


LIMITS = web.AppKey("http_limits", HttpLimits)


def limits_of(request: web.Request) -> HttpLimits:
    return request.app.get(LIMITS) or HttpLimits()


class Connection(web.RequestHandler):
    """An HTTP connection whose every request must arrive whole within `read_timeout`: the clock
    starts at its first byte (at connecting, for the connection's first request) and stops when
    the front's middleware has read the body (`request_read`); past it the connection closes. A
    request being handled starts no clock (its body, a pipelined next request). What aiohttp
    cannot parse it answers with an OpenAI error object (handle_error)."""

    def __init__(self, manager, *, read_timeout: float, send_buffer_bytes: int, **kwargs):
        super().__init__(manager, **kwargs)
        self._read_timeout, self._send_buffer_bytes = read_timeout, send_buffer_bytes
        self._deadline: asyncio.TimerHandle | None = None
        self._handling = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, self._send_buffer_bytes)
        super().connection_made(transport)
        self._arm()

    def data_received(self, data: bytes) -> None:
        if self._deadline is None and not self._handling:
            self._arm()
        super().data_received(data)

    def connection_lost(self, exc: BaseException | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def request_read(self) -> None:
        self._disarm()
        self._handling = True

    def request_done(self) -> None:
        self._handling = False

    def _arm(self) -> None:
        self._deadline = asyncio.get_running_loop().call_later(self._read_timeout, self._too_slow)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def handle_error(self, request, status: int = 500, exc: BaseException | None = None,
                     message: str | None = None) -> web.StreamResponse:
        """aiohttp's answer to a request it could not parse (bad head, unknown encoding), as an
        OpenAI error object instead of text."""
        super().handle_error(request, status, exc, message)     # logs, and checks nothing was sent yet
        why = (message or HTTPStatus(status).phrase).strip().replace("\n", " ")
        body = {"error": {"message": f"request: {why}", "type": "invalid_request_error" if status < 500 else
                          "server_error", "param": None, "code": None}}
        resp = web.json_response(body, status=status)
        resp.force_close()
        return resp

    def _too_slow(self) -> None:
        self._deadline = None
        if not self._handling:
            self.force_close()
