"""The Prometheus endpoint of workers and routers (--metrics-port): prometheus_client's
exposition served so that HEAD is answered as GET is, without a body.

prometheus_client's own server answers HEAD with a 405 that carries a body, which breaks HTTP
clients that read no body after a HEAD (aiohttp's, used by benchmark tools that probe the
endpoint first): a body after a HEAD answer is read as the next response.
"""
from __future__ import annotations

import socket
import threading
from socketserver import ThreadingMixIn
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app


class _Server(ThreadingMixIn, WSGIServer):
    daemon_threads = True


class _V6Server(_Server):
    address_family = socket.AF_INET6


class _Quiet(WSGIRequestHandler):
    def log_message(self, format, *args):       # noqa: A002 (the base class's name)
        pass


def head_as_get(app):
    """A WSGI app that answers HEAD with GET's status and headers and no body."""
    def wrapped(environ, start_response):
        if environ.get("REQUEST_METHOD") != "HEAD":
            return app(environ, start_response)
        seen: list = []
        body = b"".join(app({**environ, "REQUEST_METHOD": "GET"}, lambda s, h, *e: seen.append((s, h, *e))))
        status, headers, *exc = seen[0]
        headers = [(k, v) for k, v in headers if k.lower() != "content-length"]
        start_response(status, headers + [("Content-Length", str(len(body)))], *exc)
        return []                   # GET's headers, none of its body
    return wrapped


def start_metrics_server(port: int, host: str, registry: CollectorRegistry) -> WSGIServer:
    """Serve `registry` on host:port in a daemon thread; -> the server (server_port, shutdown)."""
    cls = _V6Server if ":" in host else _Server
    httpd = make_server(host, port, head_as_get(make_wsgi_app(registry)), cls, handler_class=_Quiet)
    threading.Thread(target=httpd.serve_forever, daemon=True, name="metrics-http").start()
    return httpd
