"""The `pagoda` command: worker, router, up, generate, make-tiny-model.

`worker`, `router` and `make-tiny-model` replace this process with `python -m ...`, so the CLI
never imports server code (or torch); `generate` is a thin use of the client library.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

_EXEC = {"worker": "pagoda.gpu_worker", "router": "pagoda.router", "make-tiny-model": "pagoda.gpu_worker.testing.tiny_model"}
USAGE = """usage: pagoda COMMAND [ARGS]

commands:
  worker            run a GPU worker (python -m pagoda.gpu_worker; see `pagoda worker --help`)
  router            run a router (python -m pagoda.router)
  up                run a local cluster: redis, a router and workers
  generate          stream a completion from a router or worker
  make-tiny-model   write a tiny random checkpoint (python -m pagoda.gpu_worker.testing.tiny_model)
"""


def generate_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pagoda generate", description="Stream a completion to the terminal.")
    p.add_argument("prompt", help="the prompt text")
    p.add_argument("--target", default="localhost:50050", help="router or worker HOST:PORT")
    p.add_argument("--model", default="", help="served model name (default: the target's only model)")
    p.add_argument("--system", default=None, help="system message: sends the prompt as a chat")
    p.add_argument("--adapter", default="", help="LoRA adapter to generate with (a router also takes its name as --model)")
    p.add_argument("--max-tokens", type=int, default=None)
    p.add_argument("--temperature", type=float, default=None)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    p.add_argument("--timeout", type=float, default=None, help="deadline in seconds")
    p.add_argument("--tls", action="store_true", help="use TLS with the system's root certificates")
    p.add_argument("--ca-cert", default=None, help="PEM file of the root certificate to trust (implies --tls)")
    p.add_argument("--cert", default=None, help="PEM client certificate, for servers that require mTLS")
    p.add_argument("--key", default=None, help="PEM private key of --cert")
    p.add_argument("--api-key", default=None, help="sent as `authorization: Bearer KEY` "
                   "(default: $PAGODA_API_KEY)")
    p.add_argument("--metadata", action="append", default=[], metavar="KEY=VALUE",
                   help="gRPC metadata to send (repeatable)")
    p.add_argument("--json", action="store_true", help="one JSON object per chunk; the last carries usage")
    p.add_argument("--direct", action="store_true",
                   help="ask the router where to go and stream from that worker itself (direct mode)")
    return p


def _chunk_json(c) -> str:
    obj = {"request_id": c.request_id, "index": c.index, "text": c.text, "token_ids": c.token_ids,
           "finished": c.finished, "worker_id": c.worker_id}
    if c.finished:
        obj.update(finish_reason=c.finish_reason, stop_reason=c.stop_reason,
                   usage={"prompt_tokens": c.usage.prompt_tokens, "completion_tokens": c.usage.completion_tokens,
                          "cached_prompt_tokens": c.usage.cached_prompt_tokens})
    return json.dumps(obj, ensure_ascii=False)


def run_generate(argv: list[str]) -> int:
    import grpc  # lazy: grpc and the client only for `generate`; `worker` and `router` exec at once

    from pagoda.clients.client import PagodaClient  # lazy: as grpc
    a = generate_parser().parse_args(argv)
    metadata = []
    for item in a.metadata:
        key, sep, value = item.partition("=")
        if not sep:
            print(f"pagoda generate: --metadata: expected KEY=VALUE (got {item!r})", file=sys.stderr)
            return 2
        metadata.append((key.lower(), value))
    root = open(a.ca_cert, "rb").read() if a.ca_cert else None
    cert = open(a.cert, "rb").read() if a.cert else None
    key = open(a.key, "rb").read() if a.key else None
    sampling = dict(max_tokens=a.max_tokens, temperature=a.temperature, top_p=a.top_p, top_k=a.top_k,
                    seed=a.seed, stop=a.stop)
    try:
        with PagodaClient(a.target, tls=a.tls, root_certificates=root, private_key=key, certificate_chain=cert,
                          metadata=metadata, api_key=a.api_key, direct=a.direct) as client:
            for c in client.generate(a.prompt, system=a.system, model=a.model, adapter=a.adapter, timeout=a.timeout,
                                     **sampling):
                if a.json:
                    print(_chunk_json(c), flush=True)
                else:
                    sys.stdout.write(c.text)
                    sys.stdout.flush()
        if not a.json:
            sys.stdout.write("\n")
    except grpc.RpcError as e:
        print(f"pagoda generate: {e.code().name}: {e.details()}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(USAGE, end="")
        return 0 if argv else 2
    cmd, rest = argv[0], argv[1:]
    if cmd in _EXEC:
        # exec, not subprocess: signals (SIGTERM drain) reach the server directly.
        os.execv(sys.executable, [sys.executable, "-m", _EXEC[cmd], *rest])
    if cmd == "up":
        from pagoda.clients.up import main as up_main  # lazy: only `pagoda up` needs it
        return up_main(rest) or 0
    if cmd == "generate":
        return run_generate(rest)
    print(f"pagoda: unknown command {cmd!r}\n\n{USAGE}", file=sys.stderr, end="")
    return 2


if __name__ == "__main__":
    sys.exit(main())
