"""Front doors and structured output: what the router's HTTP front costs against its gRPC front,
and what constrained decoding costs the engine.

    python bench/front_doors.py [--quick] [--requests 300] [--batch 16] [--tokens 64]

1. Overhead: one real stack (redis-server, 2 CPU workers on pagoda up's tiny model, one router with
   --http-port). The same 1-token chat request (greedy, prompt cached after the first) goes, one at a
   time, straight to a worker over gRPC, through the router over gRPC, and through the router over
   HTTP (/v1/chat/completions, non-streaming, keep-alive). The three are interleaved in shuffled
   order, so machine noise falls on all alike. Reports p50/p99 latency and the HTTP - gRPC difference.
2. Constrained decoding: the offline engine (gpu_worker.LLM, CPU, the same tiny model), a batch of
   --batch requests of exactly --tokens tokens each, with none, half or all of them constrained by a
   JSON schema whose one string field is longer than --tokens (so every row runs to max_tokens and
   the batches do equal work). Reports output tokens/s and the ratio to the unconstrained batch.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import aiohttp  # noqa: E402
import grpc  # noqa: E402

from bench.common import command_line, machine, markdown_table, now, set_threads  # noqa: E402
from bench.e2e import Stack  # noqa: E402
from bench.routing import LocalRedis  # noqa: E402
from pagoda.clients.up import DEFAULT_CACHE, default_model, free_port  # noqa: E402
from pagoda.protos.pagoda.v1 import pagoda_pb2 as pb  # noqa: E402
from pagoda.protos.pagoda.v1 import pagoda_pb2_grpc as pb_grpc  # noqa: E402

MESSAGES = [{"role": "system", "content": "You answer in one word."}, {"role": "user", "content": "Hello?"}]
LONG_STRING_SCHEMA = {"type": "object", "additionalProperties": False, "required": ["text"],
                      "properties": {"text": {"type": "string", "minLength": 2000}}}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="smoke run: 20 requests, batch 4 x 8 tokens")
    p.add_argument("--model", default=None, help="checkpoint directory (default: pagoda up's tiny model)")
    p.add_argument("--requests", type=int, default=300, help="timed requests per front door")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=180.0)
    return p


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


async def overhead(model: str, a) -> list[list]:
    with tempfile.TemporaryDirectory() as tmp, LocalRedis() as redis_url:
        http_port = free_port()
        stack = Stack(model, redis_url, "prefix_aware", 64, tmp, a.timeout, http_port=http_port)
        try:
            stack.start()
            return await _time_fronts(stack, f"http://127.0.0.1:{http_port}/v1/chat/completions", a)
        finally:
            stack.stop()


async def _time_fronts(stack: Stack, url: str, a) -> list[list]:
    req = pb.GenerateRequest(messages=[pb.ChatMessage(**m) for m in MESSAGES],
                             sampling=pb.SamplingParams(max_tokens=1, temperature=0))
    body = {"messages": MESSAGES, "max_tokens": 1, "temperature": 0}
    async with grpc.aio.insecure_channel(stack.workers[0]) as wch, grpc.aio.insecure_channel(stack.router) as rch, \
            aiohttp.ClientSession() as http:
        worker, router = pb_grpc.GenerationStub(wch), pb_grpc.GenerationStub(rch)

        async def grpc_call(stub) -> None:
            async for _ in stub.Generate(req, timeout=30):
                pass

        async def http_call() -> None:
            async with http.post(url, json=body) as r:
                assert r.status == 200, await r.text()
                await r.read()

        deadline = time.monotonic() + a.timeout
        while not (await (await http.get(url.replace("/chat/completions", "/models"))).json())["data"]:
            if time.monotonic() > deadline:         # the router syncs its view of Redis in the background
                raise TimeoutError("the router never listed a model")
            await asyncio.sleep(0.1)
        fronts = {"worker, gRPC (no router)": lambda: grpc_call(worker),
                  "router, gRPC": lambda: grpc_call(router), "router, HTTP (OpenAI)": http_call}
        for call in fronts.values():            # warm: connections, tokenizer, prefix cache
            for _ in range(5):
                await call()
        times: dict[str, list[float]] = {k: [] for k in fronts}
        rng = random.Random(a.seed)
        for _ in range(a.requests):
            order = list(fronts)
            rng.shuffle(order)
            for name in order:
                t0 = time.perf_counter()
                await fronts[name]()
                times[name].append(time.perf_counter() - t0)
    grpc_p50, grpc_p99 = pct(times["router, gRPC"], 0.5), pct(times["router, gRPC"], 0.99)
    rows = []
    for name, ts in times.items():
        p50, p99 = pct(ts, 0.5), pct(ts, 0.99)
        rows.append([name, len(ts), p50 * 1e3, p99 * 1e3, (p50 - grpc_p50) * 1e3, (p99 - grpc_p99) * 1e3])
    return rows


def constrained(model: str, a) -> list[list]:
    from pagoda.gpu_worker.core.sampling_params import SamplingParams
    from pagoda.gpu_worker.engine.llm import LLM
    from pagoda.gpu_worker.features.structured_output import GrammarCompiler, GuidedSpec
    llm = LLM(model=model, device="cpu", num_kv_blocks=a.batch * (a.tokens // 16 + 4), max_model_len=512)
    with open(os.path.join(model, "tokenizer.json"), encoding="utf-8") as f:
        compiler = GrammarCompiler(f.read(), llm.engine.vocab_size, llm.engine.eos_token_ids)
    grammar = compiler.compile(GuidedSpec("json_schema", json.dumps(LONG_STRING_SCHEMA)))
    prompts = [f"Request {i}: write" for i in range(a.batch)]

    def params(guided: bool, i: int) -> SamplingParams:
        return SamplingParams(temperature=1.0, seed=i, max_tokens=a.tokens, ignore_eos=not guided,
                              structured_output=grammar if guided else None)
    llm.generate(prompts, [params(i % 2 == 0, i) for i in range(a.batch)])          # warm
    results = {}
    for name, share in (("none", 0.0), ("half", 0.5), ("all", 1.0)):
        k = round(share * a.batch)
        t0, c0 = time.perf_counter(), time.process_time()
        outs = llm.generate(prompts, [params(i < k, i) for i in range(a.batch)])
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        assert tokens == a.batch * a.tokens, "every row must run to max_tokens"
        results[name] = (k, tokens / wall, cpu / tokens)
    base, base_cpu = results["none"][1], results["none"][2]
    # CPU time (all of this process's threads, llguidance's included) is the steadier figure on a
    # shared machine, where wall time also counts other processes' load.
    return [[name, f"{k}/{a.batch}", tps, tps / base, cpu * 1e3, cpu / base_cpu]
            for name, (k, tps, cpu) in results.items()]


def main(argv=None) -> None:
    a = build_parser().parse_args(argv)
    if a.quick:
        a.requests, a.batch, a.tokens = 20, 4, 8
    set_threads(1)
    model = a.model or default_model(DEFAULT_CACHE)
    print(f"{now()}  {machine()}\ncommand: {command_line()}\n")
    rows = asyncio.run(overhead(model, a))
    print(f"1-token chat request, one at a time, {a.requests} per front door, interleaved:\n")
    print(markdown_table(["front door", "requests", "p50 ms", "p99 ms", "p50 - router gRPC ms",
                          "p99 - router gRPC ms"], rows))
    rows = constrained(model, a)
    print(f"\nBatch of {a.batch} x {a.tokens} tokens (temperature 1), offline engine:\n")
    print(markdown_table(["constrained (JSON schema)", "rows", "output tok/s", "vs none", "CPU ms/token",
                          "CPU vs none"], rows))


if __name__ == "__main__":
    main()
