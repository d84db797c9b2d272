"""/v1/completions and /v1/chat/completions: a request body becomes GenerateRequests, is
tokenized and length-checked here, then goes through Pipeline.generate: the same routing
decision, retries and upstream gRPC stream as the gRPC front. A client that goes away cancels
the handler, which cancels the upstream call, which aborts the request on the worker.

/v1/completions as vLLM serves it: a list of prompts (strings or token-id lists) is that many
independent requests, each routed on its own as it starts, a window of them at a time (so that
one batch cannot queue workers full ahead of other requests), whose choices are numbered prompt
by prompt (prompt p's sequence j is choice p * n + j); `echo` puts the prompt before the
completion, and with `logprobs` the prompt's tokens are scored by the engine
(SamplingParams.prompt_logprobs), the first token's score null, as lm-eval's loglikelihood tasks
read them.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from typing import AsyncGenerator, AsyncIterator, Callable

from aiohttp import web

from pagoda.protos.pagoda.v1 import pagoda_pb2 as pb
from pagoda.router.errors import RouterError
from pagoda.router.openai.limits import limits_of
from pagoda.router.openai.request import (
    COMPLETION_DEFAULT_MAX_TOKENS,
    ApiError,
    bad,
    build_requests,
    chat_ids,
    json_body,
    number,
    stream_options,
    tool_plan,
)
from pagoda.router.openai.response import Choices, Prompt, response_object, stream_chunks
from pagoda.router.openai.serving import Serving
from pagoda.router.openai.sse import send_events


class Generation(Serving):
    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, "completion")

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, "chat")

    async def _serve(self, request: web.Request, kind: str) -> web.StreamResponse:
        try:
            ident = self.identity(request)
            body = await json_body(request)
            reqs = build_requests(body, kind)
            plan = tool_plan(body, self.tool_call_parser) if kind == "chat" else None
            if plan is not None and body.get("parallel_tool_calls") is False:
                plan.single = True
            if kind == "chat" and not reqs[0].messages:      # tools: rendered here
                model, pin = await self.pin(reqs[0].model)
                reqs[0].token_ids[:] = await chat_ids(body, pin, plan.tools if plan else None)
            if plan is not None and plan.schema() is not None:
                if reqs[0].sampling.HasField("structured_output"):
                    raise bad("tool_choice", f"{plan.choice} tool choice and response_format/guided_* "
                                             "both constrain the output: give one")
                reqs[0].sampling.structured_output.json_schema = json.dumps(plan.schema())
            if plan is not None and not plan.parses:
                plan = None
            stream = "stream" in body and number(body, "stream", bool)
            usage_in_stream, continuous = stream_options(body, stream)
            echo = kind == "completion" and body.get("echo") is True
            texts = [r.text if r.HasField("text") else None for r in reqs]
            max_name = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
            asked = reqs[0].model      # an adapter's name stays the response's model
            score_only = _score_only(kind, body, echo, max_name, reqs)
            prompts = [Prompt(ids) for ids in await asyncio.gather(*(self._prepare(r, kind, max_name) for r in reqs))]
            if echo:
                await self._echoes(reqs[0].model, prompts, texts)
        except ApiError as e:
            return e.response()
        rid = ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex
        for p, req in enumerate(reqs):       # each prompt is a request of its own, routed on its own
            req.request_id = rid if len(reqs) == 1 else f"{rid}-{p}"
        head = {"id": rid, "object": "chat.completion" if kind == "chat" else "text_completion",
                "created": int(time.time()), "model": asked or reqs[0].model}
        sp = reqs[0].sampling
        n = sp.n if sp.HasField("n") else 1
        choices = Choices(kind, n, prompts, echo and sp.HasField("logprobs"), score_only)
        # A list of prompts runs a window at a time, so that one batch never fills the workers'
        # queues ahead of other callers' requests: its sequences in flight stay within
        # --http-batch-seqs-per-worker for each live worker of the model.
        workers = len(self.service.cluster.live(reqs[0].model))
        window = max(1, limits_of(request).batch_seqs_per_worker * max(workers, 1) // n)
        merged = _responses(lambda p: self.service.generate(reqs[p], None, ident), len(reqs), window)
        async with contextlib.aclosing(merged):
            try:
                first = await anext(merged)      # an error before the first token gets its HTTP status
            except RouterError as r:
                return ApiError.from_reject(r).response()
            except StopAsyncIteration:
                return ApiError(503, "no worker answered").response()
            deltas = _prepend(first, merged)
            if stream:
                return await send_events(request, stream_chunks(head, choices, deltas, usage_in_stream, continuous, plan))
            try:
                async for p, resp in deltas:
                    choices.add(p, resp)
            except RouterError as r:
                return ApiError.from_reject(r).response()
        scored = kind == "completion" and "prompt_logprobs" in body
        return web.json_response(response_object(head, choices, scored, plan))

    async def _echoes(self, model: str, prompts: list[Prompt], texts: list[str | None]) -> None:
        """What echo puts before each prompt's completions: the prompt as sent, or token ids decoded."""
        try:
            _, pin = await self.service.pin(model)
        except RouterError as r:
            raise ApiError.from_reject(r) from None
        tok = pin.tokenizer
        if tok is None:
            raise bad("echo", f"model {model!r} has no tokenizer to show the prompt with")
        for prompt, text in zip(prompts, texts):
            prompt.echo = text if text is not None else tok.decode(prompt.ids)
            prompt.first_token = tok.decode(prompt.ids[:1])

    async def _prepare(self, req: pb.GenerateRequest, kind: str, max_name: str) -> list[int]:
        """Resolve the model, tokenize, check the length, and fill defaults, in place; -> the
        prompt's token ids."""
        models = self.service.cluster.models()
        if req.model and req.model not in models and req.model not in self.service.cluster.adapters():
            if not models:
                raise ApiError(503, "model: no live worker serves any model", "model")
            raise ApiError(404, f"model: the model {req.model!r} does not exist (served: {', '.join(models)})",
                           "model", "model_not_found")
        try:
            model, req.adapter = self.service.prepare.resolve_adapter(req.model, req.adapter)
            req.model = model
            model, ids, max_len = await self.service.tokenize(req)
        except RouterError as r:
            raise ApiError.from_reject(r) from None
        prompt = "messages" if kind == "chat" else "prompt"
        if len(ids) >= max_len:
            raise bad(prompt, f"the prompt has {len(ids)} tokens; this model's maximum context length "
                              f"is {max_len} tokens, so it leaves no room for a completion")
        sp = req.sampling
        if not sp.HasField("max_tokens"):
            sp.max_tokens = max_len - len(ids) if kind == "chat" else COMPLETION_DEFAULT_MAX_TOKENS
        if len(ids) + sp.max_tokens > max_len:
            raise bad(max_name, f"this model's maximum context length is {max_len} tokens; the request asks "
                            f"for {len(ids) + sp.max_tokens} ({len(ids)} in the {prompt}, {sp.max_tokens} "
                            "in the completion); reduce the length of either")
        req.model = model
        req.ClearField("text")
        req.ClearField("messages")
        req.token_ids[:] = ids               # tokenized once: the router path skips it
        return list(ids)


async def _responses(open_one: Callable[[int], AsyncGenerator[pb.GenerateResponse, None]], count: int,
                     window: int) -> AsyncGenerator[tuple[int, pb.GenerateResponse], None]:
    """(prompt number, response) of `count` prompts' requests (open_one(p): prompt p's upstream,
    not started) as each comes, at most `window` of them running at once: the next in prompt
    order opens as one ends, routed on its own then. A RouterError of any ends it."""
    if count == 1:
        async with contextlib.aclosing(open_one(0)) as upstream:
            async for resp in upstream:
                yield 0, resp
        return
    # Bounded: a client that reads slowly holds its upstreams back instead of queueing their output.
    queue: asyncio.Queue = asyncio.Queue(maxsize=2 * window)

    async def pump(p: int) -> None:
        try:
            async with contextlib.aclosing(open_one(p)) as upstream:
                async for resp in upstream:
                    await queue.put((p, resp))
        except RouterError as e:
            await queue.put((p, e))
        await queue.put((p, None))

    tasks = [asyncio.ensure_future(pump(p)) for p in range(min(window, count))]
    try:
        running = len(tasks)
        while running:
            p, item = await queue.get()
            if item is None:
                running -= 1
                if len(tasks) < count:
                    tasks.append(asyncio.ensure_future(pump(len(tasks))))
                    running += 1
            elif isinstance(item, RouterError):
                raise item
            else:
                yield p, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _score_only(kind: str, body: dict, echo: bool, max_name: str, reqs: list[pb.GenerateRequest]) -> bool:
    """max_tokens=0 scores the prompt without a completion (vLLM's echo without generation, as
    lm-eval's loglikelihood asks): the engine needs one step past the prompt, so one token is
    asked for and dropped from the answer (Choices.score_only). Without echo or prompt_logprobs
    it would answer nothing at all: refused."""
    sp = reqs[0].sampling
    if not sp.HasField("max_tokens") or sp.max_tokens != 0:
        return False
    if kind != "completion" or not (echo or "prompt_logprobs" in body):
        raise bad(max_name, "must be at least 1 (0 only scores the prompt: /v1/completions with echo "
                            "or prompt_logprobs)")
    if sp.use_beam_search:
        raise bad(max_name, "must be at least 1 with use_beam_search")
    for r in reqs:
        r.sampling.max_tokens = 1
    return True


async def _prepend(first, rest: AsyncIterator) -> AsyncGenerator:
    yield first
    async for item in rest:
        yield item
