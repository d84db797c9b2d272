"""What one HTTP client can hold of the router, each bound a router flag (router/args.py): a body
of at most --http-max-body-bytes, JSON at most --http-max-json-depth deep
(router/openai/request.py: json_value). Connection answers what aiohttp cannot parse as an
OpenAI error object.
"""
from __future__ import annotations

from dataclasses import dataclass
from http import HTTPStatus

from aiohttp import web


@dataclass(frozen=True)
class HttpLimits:
    max_body_bytes: int = 16 << 20
    max_json_depth: int = 64

    @classmethod
    def from_args(cls, a) -> HttpLimits:
        return cls(a.http_max_body_bytes, a.http_max_json_depth)


LIMITS = web.AppKey("http_limits", HttpLimits)


def limits_of(request: web.Request) -> HttpLimits:
    return request.app.get(LIMITS) or HttpLimits()


class Connection(web.RequestHandler):
    """aiohttp's handler of one HTTP connection."""

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
