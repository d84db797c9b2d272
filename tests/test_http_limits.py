"""The router's HTTP front against hostile clients (a real router and a stand-in worker on a real
redis-server, loopback): bodies nested too deep, too large, not UTF-8, not JSON; a fuzz of every
route the front registers with every method; request heads trickled in byte by byte (slowloris),
bodies that never finish and connections that sit idle. Every answer is a 200 or a 4xx OpenAI
error object, every such connection is closed within its timeout, and the router serves a normal
request after."""
from __future__ import annotations

import asyncio
import gzip
import json
import random
import socket
import time
import urllib.error
import urllib.request

import aiohttp
import pytest

from pagoda.clients.up import free_port
from pagoda.router.openai.front import OpenAIFront
from tests.test_router import metric, wait_for

pytestmark = pytest.mark.timeout(120)


def http_router(redis_server, start_fake_worker, start_router, **flags):
    start_fake_worker(redis_server.url, "w1", token_delay=0)
    port = free_port()
    router = start_router(redis_server.url, http_port=port, **flags)
    wait_for(lambda: metric(router, "pagoda_router_live_workers", model="m") == 1, 10, "the worker")
    return router, port


def post(port: int, path: str, data: bytes, headers: dict | None = None) -> tuple[int, bytes]:
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data,
                                 {"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def error_of(raw: bytes) -> dict:
    """The OpenAI error object in `raw` (fails the test when it is anything else)."""
    err = json.loads(raw)["error"]
    assert isinstance(err["message"], str) and err["message"] and isinstance(err["type"], str), err
    return err


def normal_request_works(port: int) -> None:
    status, raw = post(port, "/v1/completions", json.dumps({"model": "m", "prompt": "a b c", "max_tokens": 2}).encode())
    assert status == 200 and json.loads(raw)["choices"][0]["finish_reason"] == "length", raw


def routes() -> list[tuple[str, str]]:
    """(method, path) of every route the front registers (HEAD included: aiohttp adds it to GETs)."""
    app = OpenAIFront(None).app          # type: ignore[arg-type]  # the routes need no pipeline
    return sorted({(r.method, r.resource.canonical) for r in app.router.routes() if r.resource is not None})


def nested(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


def test_json_nested_100000_deep_is_400_naming_the_limit_on_every_route(redis_server, start_fake_worker,
                                                                        start_router):
    router, port = http_router(redis_server, start_fake_worker, start_router)
    posts = [path for method, path in routes() if method == "POST"]
    assert {"/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"} <= set(posts)
    for path in posts:
        for body in (nested(100_000), b'{"prompt": ' + nested(65) + b"}", b'{"model": ' + b'{"a": ' * 65 + b"1" +
                     b"}" * 66):
            status, raw = post(port, path, body)
            assert status == 400 and "--http-max-json-depth" in error_of(raw)["message"], (path, status, raw[:200])
    # At the bound is not past it: the body is read, and refused for what it says, naming the field.
    status, raw = post(port, "/v1/completions", b'{"model": "m", "prompt": ' + nested(63) + b"}")
    assert status == 400 and error_of(raw)["param"] == "prompt", raw
    normal_request_works(port)
    assert router.proc.poll() is None


def test_body_size_limit_and_non_utf8_bodies(redis_server, start_fake_worker, start_router):
    router, port = http_router(redis_server, start_fake_worker, start_router, http_max_body_bytes=4096,
                               http_max_json_depth=8)
    big = json.dumps({"model": "m", "prompt": "a " * 3000}).encode()
    status, raw = post(port, "/v1/completions", big)
    assert status == 413 and "--http-max-body-bytes" in error_of(raw)["message"] and "4096" in error_of(raw)["message"]
    status, raw = post(port, "/tokenize", b'{"model": "m", "prompt": ' + nested(9) + b"}")
    assert status == 400 and "8 levels" in error_of(raw)["message"]
    for body, headers in ((b'{"prompt": "\xff\xfe"}', {}),
                          (b'{"model": "m", "prompt": "a"}', {"Content-Type": "application/json; charset=bogus"}),
                          (b"not gzip at all", {"Content-Encoding": "gzip"})):
        status, raw = post(port, "/v1/completions", body, headers)
        assert status in (200, 400), (body, headers, status, raw[:200])
        if status == 400:
            assert error_of(raw)["message"].startswith("body:"), raw
    # A declared charset is not trusted (JSON is UTF-8), and a gzip body counts decompressed.
    status, raw = post(port, "/v1/completions", json.dumps({"model": "m", "prompt": "a", "max_tokens": 1}).encode(),
                       {"Content-Type": "application/json; charset=bogus"})
    assert status == 200, raw
    status, raw = post(port, "/v1/completions", gzip.compress(big), {"Content-Encoding": "gzip"})
    assert status == 413, raw
    # A body declared larger than the bound is refused unread, at once.
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.settimeout(5)
        t0 = time.monotonic()
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 1000000000\r\n\r\n{")
        assert s.recv(65536).startswith(b"HTTP/1.1 413") and time.monotonic() - t0 < 1.0
    normal_request_works(port)


# -- fuzz: every route, every method, hostile bodies -----------------------------------------------

FIELDS = ["model", "prompt", "messages", "tokens", "n", "max_tokens", "max_completion_tokens", "stream",
          "stream_options", "logprobs", "top_logprobs", "prompt_logprobs", "echo", "stop", "stop_token_ids",
          "logit_bias", "temperature", "top_p", "seed", "tools", "tool_choice", "response_format", "guided_json",
          "guided_choice", "guided_regex", "lora_name", "lora_path", "add_special_tokens", "return_token_strs",
          "add_generation_prompt", "use_beam_search", "best_of", "priority", "cache_salt", "ignore_eos",
          "min_tokens", "parallel_tool_calls", "role", "content", "type", "function", "name"]
METHODS = ["GET", "POST", "PUT", "DELETE", "PATCH", "OPTIONS", "HEAD"]


def wild(rng: random.Random, depth: int = 0):
    """A JSON value of any type, shaped like what the endpoints read."""
    kind = rng.randrange(10 if depth < 3 else 7)
    if kind == 0:
        return None
    if kind == 1:
        return rng.random() < 0.5
    if kind == 2:
        return rng.choice([0, 1, -1, 2, 7, 2**31, -(2**63), 10**30, rng.randrange(-5, 5000)])
    if kind == 3:
        return rng.choice([0.5, -1e308, 1e308, float("inf"), float("nan"), rng.random() * 3])
    if kind in (4, 5, 6):
        return rng.choice(["m", "", "a b c", "user", "assistant", "tool", "function", "json_object", "json_schema",
                           "\ud800", "é" * rng.randrange(50), "\x00", "<tool_call>", "a" * rng.randrange(2000)])
    if kind in (7, 8):
        return [wild(rng, depth + 1) for _ in range(rng.randrange(4))]
    return {rng.choice(FIELDS): wild(rng, depth + 1) for _ in range(rng.randrange(5))}


def hostile_body(rng: random.Random, max_body: int) -> tuple[bytes, dict]:
    kind = rng.randrange(8)
    headers = {"Content-Type": rng.choice(["application/json", "application/json; charset=latin-1",
                                           "application/json; charset=nope", "text/plain",
                                           "multipart/form-data; boundary=x"])}
    if kind == 0:
        return bytes(rng.randrange(256) for _ in range(rng.randrange(2048))), headers
    if kind == 1:                                    # not UTF-8, around something JSON-like
        return b'{"model": "m", "prompt": "' + bytes([0xff, 0xc3, 0x28, 0xa0]) * rng.randrange(1, 50) + b'"}', headers
    if kind == 2:                                    # nested past the bound, arrays and objects
        d = rng.choice([17, 100, 5000, 100_000])
        opener, closer = (b"[", b"]") if rng.random() < 0.5 else (b'{"a":', b"}")
        return b'{"prompt": ' + opener * d + b"1" * (opener != b"[") + closer * d + b"}", headers
    if kind == 3:                                    # past the size bound
        return b'{"prompt": "' + b"a" * (max_body + rng.randrange(1, 100_000)) + b'"}', headers
    if kind == 4:
        return gzip.compress(json.dumps({"model": "m", "prompt": "a"}).encode())[:rng.randrange(30)], \
            {**headers, "Content-Encoding": rng.choice(["gzip", "deflate", "br", "zstd", "x"])}
    body = {rng.choice(FIELDS): wild(rng) for _ in range(rng.randrange(8))}
    if rng.random() < 0.6:
        body["model"] = "m"
    if rng.random() < 0.5:
        body["max_tokens"] = rng.randrange(1, 8)
    return json.dumps(body).encode(), headers


def test_fuzz_every_route_and_method_with_hostile_bodies(redis_server, start_fake_worker, start_router):
    max_body = 1 << 16
    router, port = http_router(redis_server, start_fake_worker, start_router, http_max_body_bytes=max_body,
                               http_max_json_depth=16)
    registered = [(m, p.replace("{model}", "m")) for m, p in routes()]
    paths = sorted({p for _, p in registered})
    rng = random.Random(1234)
    # Mostly a route's own method (its handler reads the body), sometimes any method on any route.
    cases = [(*(rng.choice(registered) if rng.random() < 0.8 else (rng.choice(METHODS), rng.choice(paths))),
              *hostile_body(rng, max_body)) for _ in range(800)]
    cases += [(m, p, b"", {}) for m in METHODS for p in paths]      # every method on every route at least once
    failures: list[str] = []

    async def one(session: aiohttp.ClientSession, method: str, path: str, body: bytes, headers: dict) -> None:
        try:
            async with session.request(method, f"http://127.0.0.1:{port}{path}", data=body, headers=headers,
                                       skip_auto_headers=["Content-Type"]) as r:
                status, raw = r.status, await r.read()
        except aiohttp.ClientResponseError as e:
            # A HEAD the router could not parse (an unknown Content-Encoding) is answered as a request
            # of unknown method, with its error object as a body the client did not expect.
            if method == "HEAD" and 400 <= e.status < 500:
                return
            raise
        if status == 200:
            return
        if not 400 <= status < 500:
            failures.append(f"{method} {path} {body[:80]!r}: {status} {raw[:200]!r}")
        elif method != "HEAD":
            try:
                error_of(raw)
            except (ValueError, KeyError, TypeError, AssertionError):
                failures.append(f"{method} {path} {body[:80]!r}: {status} not an error object {raw[:200]!r}")

    async def main() -> None:
        deadline = time.monotonic() + 40
        sem = asyncio.Semaphore(8)
        timeout = aiohttp.ClientTimeout(total=15)
        # A connection per request: a reused one may race the server's idle close.
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True), timeout=timeout,
                                         auto_decompress=False) as session:
            async def bounded(case) -> None:
                async with sem:
                    if time.monotonic() < deadline:
                        await one(session, *case)
            await asyncio.gather(*(bounded(c) for c in cases))

    asyncio.run(main())
    assert not failures, f"{len(failures)} bad answers, first: " + "\n".join(failures[:5])
    assert router.proc.poll() is None
    normal_request_works(port)


# -- slow and idle connections ------------------------------------------------------------------

def closed_within(port: int, plan: list[tuple[bytes, float]]) -> tuple[float, bytes]:
    """Send each chunk then wait its seconds, until the router closes the connection: -> (seconds
    from connecting to the close, everything received), or (inf, received) if it never closed."""
    s = socket.create_connection(("127.0.0.1", port))
    t0, got = time.monotonic(), b""
    try:
        for chunk, wait in plan:
            try:
                if chunk:
                    s.sendall(chunk)
                end = time.monotonic() + wait
                while (left := end - time.monotonic()) > 0:
                    s.settimeout(left)
                    try:
                        data = s.recv(65536)
                    except TimeoutError:
                        break
                    if not data:
                        return time.monotonic() - t0, got
                    got += data
            except (BrokenPipeError, ConnectionResetError):
                return time.monotonic() - t0, got
        return float("inf"), got
    finally:
        s.close()


def test_slowloris_slow_bodies_and_idle_connections_are_closed(redis_server, start_fake_worker, start_router):
    router, port = http_router(redis_server, start_fake_worker, start_router, http_read_timeout=1.0,
                               http_idle_timeout=1.5)
    head = b"GET /health HTTP/1.1\r\nHost: x\r\nX-Padding: " + b"a" * 40 + b"\r\n\r\n"
    # Headers byte by byte, 0.1 s apart: 6 s to send them all; the router closes at 1 s.
    took, got = closed_within(port, [(head[i:i + 1], 0.1) for i in range(len(head))])
    assert 0.9 < took < 2.0 and got == b"", (took, got)
    # Head complete, then a body that trickles in: the same bound covers the body.
    body_head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 200\r\n\r\n"
    took, got = closed_within(port, [(body_head, 0.1)] + [(b"a", 0.1)] * 60)
    assert 0.9 < took < 2.0 and got == b"", (took, got)
    # A connection that never sends anything.
    took, got = closed_within(port, [(b"", 6.0)])
    assert 0.9 < took < 2.0, took
    # Keep-alive: served, then idle until --http-idle-timeout.
    took, got = closed_within(port, [(head, 6.0)])
    assert got.startswith(b"HTTP/1.1 200") and 1.4 < took < 2.5, (took, got[:100])
    # Two requests on one connection, each sent in time: both served, the idle clock restarting.
    took, got = closed_within(port, [(head, 0.8), (head, 6.0)])
    assert got.count(b"HTTP/1.1 200") == 2 and 2.1 < took < 3.5, (took, got[:100])
    normal_request_works(port)
