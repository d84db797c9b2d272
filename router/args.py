"""Command-line flags of `python -m pagoda.router` / `pagoda router` (light: imports nothing heavy)."""
from __future__ import annotations

import argparse

from pagoda.protos import limits
from pagoda.router.policies.registry import POLICIES
from pagoda.router.tools import PARSERS
from pagoda.runtime import security
from pagoda.runtime.cli_help import DefaultsHelpFormatter

# Python's JSON parser recurses once per level and stops near the interpreter's recursion limit
# (1000, less the frames beneath it), so a deeper bound could never be reached.
MAX_JSON_DEPTH = 512


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pagoda router",
                                description="Prefix-aware gRPC router in front of pagoda GPU workers.",
                                formatter_class=DefaultsHelpFormatter)
    p.add_argument("--host", default="0.0.0.0", help="address the gRPC and HTTP servers listen on")
    p.add_argument("--port", type=int, default=50050, help="gRPC port (pagoda.v1.Generation)")
    p.add_argument("--http-port", type=int, default=8000,
                   help="OpenAI-compatible HTTP port (/v1/chat/completions, ..., /metrics); 0 = off "
                        "(as in `pagoda up`, where it defaults to any free port)")
    p.add_argument("--tool-call-parser", choices=PARSERS, default="hermes",
                   help="how /v1/chat/completions reads tool calls out of a model's output with "
                        "tool_choice auto: hermes (<tool_call>{json}</tool_call>) or llama3_json")
    p.add_argument("--metrics-port", type=int, default=None,
                   help="Prometheus port (default: --port + 10000); 0 = off")
    p.add_argument("--redis-url", required=True, help="redis://[user:password@]host:port/db, or rediss:// "
                   "for TLS (REDIS_PASSWORD is used when the URL has none)")
    p.add_argument("--policy", choices=POLICIES, default="prefix_aware",
                   help="how a worker is picked: prefix_aware (cache overlap against load), least_loaded or round_robin")
    p.add_argument("--index-max-blocks", type=_positive, default=1_000_000,
                   help="bound on block hashes held in memory (least recently used go first)")
    p.add_argument("--speculative-ttl", type=float, default=10.0,
                   help="seconds a routed prefix counts as cached before its worker reports it")
    p.add_argument("--kv-fetch-hints", choices=("on", "off"), default="on",
                   help="prefix_aware: send a worker that lacks a prefix another live worker holds a hint to "
                        "fetch those KV blocks from it, where the fetch (at the rate the worker measures) "
                        "beats computing them")
    p.add_argument("--max-attempts", type=_positive, default=3,
                   help="workers tried for one request before the first token")
    p.add_argument("--first-token-timeout", type=float, default=60.0,
                   help="seconds a worker may take to send its first response before the request "
                        "fails over to the next worker (and the breaker counts a failure)")
    p.add_argument("--max-snapshot-bytes", type=_positive, default=32 << 20,
                   help="a worker's block snapshot in Redis larger than this is refused unread")
    p.add_argument("--max-concurrent-streams", type=_positive, default=2048,
                   help="HTTP/2 streams one client connection may hold open")
    http = p.add_argument_group("HTTP front limits (what one client can hold of the router)")
    http.add_argument("--http-max-body-bytes", type=_positive, default=16 << 20,
                      help="a request body larger than this is refused (413) after reading this much")
    http.add_argument("--http-max-json-depth", type=_json_depth, default=64,
                      help="JSON nested deeper than this (arrays and objects) is refused (400); at most "
                           f"{MAX_JSON_DEPTH}")
    http.add_argument("--http-read-timeout", type=_seconds, default=30.0,
                      help="seconds a client has to send a whole request (head and body) from its first "
                           "byte, or from connecting for its first request; past it the connection closes")
    http.add_argument("--http-idle-timeout", type=_seconds, default=75.0,
                      help="seconds a kept-alive connection may sit with no request before it closes")
    http.add_argument("--http-write-timeout", type=_seconds, default=30.0,
                      help="seconds a stream may wait for its client to take more of it; past it the "
                           "stream is aborted (on the worker too) and the connection closed")
    http.add_argument("--http-send-buffer-bytes", type=_positive, default=256 << 10,
                      help="kernel send buffer of each HTTP connection (Linux grows it up to 4 MiB "
                           "otherwise): what a client that stops reading pins in the router")
    http.add_argument("--http-batch-seqs-per-worker", type=_positive, default=32,
                      help="a /v1/completions list of prompts keeps at most this many sequences (prompts "
                           "times n) in flight per live worker of its model, the rest waiting in the "
                           "router, so that one batch cannot queue a worker full ahead of other requests")
    p.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING or ERROR")
    limits.add_flags(p)
    security.add_flags(p, worker_side=False)
    return p


def _seconds(value: str) -> float:
    x = float(value)
    if not 0 < x < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds (got {value})")
    return x


def _json_depth(value: str) -> int:
    n = _positive(value)
    if n > MAX_JSON_DEPTH:
        raise argparse.ArgumentTypeError(f"must be at most {MAX_JSON_DEPTH} (got {n})")
    return n


def _positive(value: str) -> int:
    n = int(value)
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1 (got {n})")
    return n
