"""The router's OpenAI-compatible HTTP front: /v1/models, /v1/completions, /v1/chat/completions.

An aiohttp application on the router's own event loop. A request body becomes a GenerateRequest
(OpenAI and vLLM parameter names map one to one onto pagoda.v1 SamplingParams), is tokenized and
length-checked here, then goes through Pipeline.generate: the same routing decision, retries
and upstream gRPC stream as the gRPC front. Worker deltas become an OpenAI response or
server-sent events. Errors are OpenAI error objects; a gRPC status maps to its HTTP status and
the `field:` prefix of pagoda's messages names the `param`. A client that goes away cancels the
handler, which cancels the upstream call, which aborts the request on the worker.

/v1/completions as vLLM serves it: a list of prompts (strings or token-id lists) is that many
independent requests, routed each on its own, whose choices are numbered prompt by prompt
(prompt p's sequence j is choice p * n + j); `echo` puts the prompt before the completion, and
with `logprobs` the prompt's tokens are scored by the engine (SamplingParams.prompt_logprobs),
the first token's score null, as lm-eval's loglikelihood tasks read them.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from dataclasses import dataclass
from typing import Any

import grpc
from aiohttp import web

from pagoda.protos.pagoda.v1 import pagoda_pb2 as pb
from pagoda.router import tools
from pagoda.router.errors import RouterError
from pagoda.router.pipeline import Pipeline
from pagoda.router.tools import ToolError, ToolPlan, chat_messages

_HTTP_STATUS = {grpc.StatusCode.INVALID_ARGUMENT: 400, grpc.StatusCode.OUT_OF_RANGE: 400,
                grpc.StatusCode.FAILED_PRECONDITION: 400, grpc.StatusCode.UNAUTHENTICATED: 401,
                grpc.StatusCode.PERMISSION_DENIED: 403, grpc.StatusCode.NOT_FOUND: 404,
                grpc.StatusCode.RESOURCE_EXHAUSTED: 429, grpc.StatusCode.UNAVAILABLE: 503,
                grpc.StatusCode.DEADLINE_EXCEEDED: 504}
_ERROR_TYPE = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 429: "rate_limit_error", 503: "service_unavailable_error"}
_FINISH = {pb.FINISH_REASON_STOP: "stop", pb.FINISH_REASON_LENGTH: "length", pb.FINISH_REASON_ABORT: "abort"}
# pagoda.v1 field names that an HTTP caller knows under another name.
_PARAM_ALIASES = {"text": "prompt", "token_ids": "prompt"}

_INT_PARAMS = ("n", "top_k", "seed", "min_tokens", "best_of")
_FLOAT_PARAMS = ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty",
                 "length_penalty")
_BOOL_PARAMS = ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output", "use_beam_search")
_STRUCTURED = ("response_format", "guided_json", "guided_choice", "guided_regex")
_COMMON = {"model", "max_tokens", "stop", "logit_bias", "stream", "stream_options", "user", "cache_salt",
           "priority", "stop_token_ids", "logprobs", *_STRUCTURED, *_INT_PARAMS, *_FLOAT_PARAMS, *_BOOL_PARAMS}
_ALLOWED = {"chat": _COMMON | {"messages", "max_completion_tokens", "top_logprobs", "add_generation_prompt",
                               "tools", "tool_choice", "parallel_tool_calls"},
            "completion": _COMMON | {"prompt", "echo", "prompt_logprobs"}}
_STREAM_OPTIONS = ("include_usage", "continuous_usage_stats")
COMPLETION_DEFAULT_MAX_TOKENS = 16      # OpenAI's legacy completions default
MAX_BATCH_PROMPTS = 1024                # prompts in one /v1/completions request


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    @classmethod
    def from_reject(cls, r: RouterError) -> ApiError:
        head = r.message.split(":", 1)[0]
        param = head if head.isidentifier() else None
        return cls(_HTTP_STATUS.get(r.code, 500), r.message, _PARAM_ALIASES.get(param or "", param))

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": _ERROR_TYPE.get(self.status, "server_error"),
                          "param": self.param, "code": self.code}}

    def response(self) -> web.Response:
        return web.json_response(self.body(), status=self.status)


def _bad(param: str, why: str) -> ApiError:
    return ApiError(400, f"{param}: {why}", param)


# -- request body -> GenerateRequest -----------------------------------------------------------

def _number(body: dict, name: str, kind: type) -> Any:
    v = body[name]
    ok = isinstance(v, bool) if kind is bool else (
        isinstance(v, (int, float) if kind is float else int) and not isinstance(v, bool))
    if not ok:
        raise _bad(name, f"must be {'a boolean' if kind is bool else 'an integer' if kind is int else 'a number'} "
                         f"(got {v!r})")
    return v


def _sampling(body: dict, kind: str) -> pb.SamplingParams:
    sp = pb.SamplingParams()
    for names, t in ((_INT_PARAMS, int), (_FLOAT_PARAMS, float), (_BOOL_PARAMS, bool)):
        for name in names:
            if name in body:
                try:
                    setattr(sp, name, _number(body, name, t))
                except ValueError:           # outside int32/int64
                    raise _bad(name, f"out of range (got {body[name]!r})") from None
    max_name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    if body.get(max_name) is not None:
        try:
            sp.max_tokens = _number(body, max_name, int)
        except ValueError:
            raise _bad(max_name, f"out of range (got {body[max_name]!r})") from None
    stop = body.get("stop")
    if stop is not None:
        stops = [stop] if isinstance(stop, str) else stop
        if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
            raise _bad("stop", "must be a string or a list of strings")
        sp.stop[:] = stops
    ids = body.get("stop_token_ids")
    if ids is not None:
        if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise _bad("stop_token_ids", "must be a list of token ids")
        sp.stop_token_ids[:] = ids
    bias = body.get("logit_bias")
    if bias is not None:
        try:
            sp.logit_bias.update({int(k): float(v) for k, v in bias.items()})
        except (AttributeError, TypeError, ValueError):
            raise _bad("logit_bias", "must map token ids to numbers") from None
    _logprobs(body, kind, sp)
    _structured(body, sp)
    if sp.use_beam_search:
        _beam_search(body, sp)
    return sp


def _beam_search(body: dict, sp: pb.SamplingParams) -> None:
    """use_beam_search (vLLM's): best_of beams (n without it), the n best returned. What the
    router can tell at once is refused here; the worker checks the rest by the same names."""
    if body.get("stream") is True:
        raise _bad("stream", "not allowed with use_beam_search (beams are ranked only when the search ends)")
    if sp.HasField("temperature") and sp.temperature != 0:
        raise _bad("temperature", f"must be 0 with use_beam_search (got {sp.temperature:g})")
    n = sp.n if sp.HasField("n") else 1
    if sp.HasField("best_of") and n > sp.best_of:
        raise _bad("n", f"must be <= best_of with use_beam_search (got n={n}, best_of={sp.best_of})")


def _logprobs(body: dict, kind: str, sp: pb.SamplingParams) -> None:
    if kind == "completion":
        if body.get("logprobs") is not None:
            sp.logprobs = _number(body, "logprobs", int)
        if "prompt_logprobs" in body:
            sp.prompt_logprobs = _number(body, "prompt_logprobs", int)
        elif sp.HasField("logprobs") and "echo" in body and _number(body, "echo", bool):
            sp.prompt_logprobs = sp.logprobs      # the echoed prompt's tokens are scored too
        return
    wanted = body.get("logprobs") is not None and _number(body, "logprobs", bool)
    top = body.get("top_logprobs")
    if top is not None and not wanted:
        raise _bad("top_logprobs", "needs logprobs: true")
    if wanted:
        sp.logprobs = 0 if top is None else _number(body, "top_logprobs", int)


def _structured(body: dict, sp: pb.SamplingParams) -> None:
    """response_format / guided_json / guided_choice / guided_regex -> SamplingParams.structured_output."""
    fmt = body.get("response_format")
    if fmt is not None and (not isinstance(fmt, dict) or fmt.get("type") not in ("text", "json_object",
                                                                                   "json_schema")):
        raise _bad("response_format", "must be {\"type\": \"text\" | \"json_object\" | \"json_schema\"}")
    given = [k for k in _STRUCTURED if k in body and not (k == "response_format" and fmt and fmt["type"] == "text")]
    if len(given) > 1:
        raise _bad(given[1], f"give only one of {', '.join(given)}")
    if not given:
        return
    name, value, so = given[0], body[given[0]], sp.structured_output
    if name == "response_format" and value["type"] == "json_object":
        so.json_object = True
    elif name == "response_format":
        schema = value.get("json_schema")
        schema = schema.get("schema") if isinstance(schema, dict) else None
        if not isinstance(schema, dict):
            raise _bad(name, "json_schema.schema must be a JSON schema object")
        so.json_schema = json.dumps(schema)
    elif name == "guided_json":
        if not isinstance(value, (dict, str)):
            raise _bad(name, "must be a JSON schema")
        so.json_schema = value if isinstance(value, str) else json.dumps(value)
    elif name == "guided_choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
            raise _bad(name, "must be a non-empty list of non-empty strings")
        so.choice[:] = value
    else:
        if not isinstance(value, str) or not value:
            raise _bad(name, "must be a non-empty regular expression")
        so.regex = value


def _messages(body: dict) -> list[dict]:
    try:
        return chat_messages(body.get("messages"))
    except ToolError as e:
        raise ApiError(400, str(e), e.param) from None


def renders_tools(body: dict, msgs: list[dict]) -> bool:
    """The front renders the chat itself (tools, tool calls and results need more than
    pagoda.v1 ChatMessage carries)."""
    return body.get("tools") is not None or any("tool_calls" in m or "tool_call_id" in m for m in msgs)


def build_requests(body: Any, kind: str) -> list[pb.GenerateRequest]:
    """An OpenAI request body -> one GenerateRequest per prompt, or ApiError naming the first bad
    parameter."""
    if not isinstance(body, dict):
        raise ApiError(400, "body: must be a JSON object")
    body = {k: v for k, v in body.items() if v is not None}    # null means "not given", as in vLLM
    unknown = sorted(set(body) - _ALLOWED[kind])
    if unknown:
        raise ApiError(400, f"{unknown[0]}: unsupported parameter(s): {', '.join(unknown)}", unknown[0])
    model = body.get("model", "")
    if not isinstance(model, str):
        raise _bad("model", "must be a string")
    req = pb.GenerateRequest(model=model, sampling=_sampling(body, kind))
    if "priority" in body:
        req.priority = _number(body, "priority", int)
    if "cache_salt" in body:
        if not isinstance(body["cache_salt"], str):
            raise _bad("cache_salt", "must be a string")
        req.cache_salt = body["cache_salt"]
    if kind == "chat":
        msgs = _messages(body)
        if not renders_tools(body, msgs):        # else the front renders them into token ids
            req.messages.extend(pb.ChatMessage(role=m["role"], content=m["content"]) for m in msgs)
        if "parallel_tool_calls" in body:
            _number(body, "parallel_tool_calls", bool)
        if "add_generation_prompt" in body:
            req.add_generation_prompt = _number(body, "add_generation_prompt", bool)
        return [req]
    if "echo" in body:
        _number(body, "echo", bool)
    out = []
    for prompt in _prompts(body.get("prompt")):
        one = pb.GenerateRequest()
        one.CopyFrom(req)
        if isinstance(prompt, str):
            one.text = prompt
        else:
            one.token_ids[:] = prompt
        out.append(one)
    return out


def _is_ids(x: Any) -> bool:
    return isinstance(x, list) and bool(x) and all(isinstance(t, int) and not isinstance(t, bool) for t in x)


def _prompts(prompt: Any) -> list[str | list[int]]:
    """A completion's prompt: a string, token ids, or a batch (a list of either)."""
    if isinstance(prompt, str) or _is_ids(prompt):
        return [prompt]
    if isinstance(prompt, list) and prompt and (all(isinstance(p, str) for p in prompt)
                                                or all(_is_ids(p) for p in prompt)):
        if len(prompt) > MAX_BATCH_PROMPTS:
            raise _bad("prompt", f"at most {MAX_BATCH_PROMPTS} prompts in one request (got {len(prompt)})")
        return prompt
    raise _bad("prompt", "must be a string, a list of token ids, or a non-empty list of strings or of "
                         "token-id lists (a batch)")


def _stream_options(body: dict, stream: bool) -> tuple[bool, bool]:
    """(usage in a last chunk, usage on every chunk too): stream_options as vLLM reads them."""
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise _bad("stream_options", "must be an object")
    unknown = sorted(set(options) - set(_STREAM_OPTIONS))
    if unknown:
        raise ApiError(400, f"stream_options.{unknown[0]}: unsupported option (supported: "
                            f"{', '.join(_STREAM_OPTIONS)})", "stream_options")
    flags = {}
    for k in _STREAM_OPTIONS:
        v = options.get(k)
        if v is not None and not isinstance(v, bool):
            raise ApiError(400, f"stream_options.{k}: must be a boolean (got {v!r})", "stream_options")
        flags[k] = v is True
    usage = stream and flags["include_usage"]
    return usage, usage and flags["continuous_usage_stats"]


# -- worker deltas -> OpenAI responses ----------------------------------------------------------

@dataclass
class _Prompt:
    """One prompt of a request, and what echo shows of it."""
    ids: list[int]
    echo: str | None = None                   # the text to put before each of its completions
    first_token: str = ""                     # its first token's text (that token has no score)
    logprobs: list[pb.Logprobs] | None = None  # scores of its tokens after the first, once they come


class _Choices:
    """What each of the prompts' n sequences has produced so far, and the request's usage."""

    def __init__(self, kind: str, n: int, prompts: list[_Prompt], echo_logprobs: bool = False):
        self.kind, self.n, self.prompts = kind, n, prompts
        self.echo_logprobs = echo_logprobs   # echo with logprobs: the prompt's tokens lead the logprobs
        total = n * len(prompts)
        self.text = [""] * total
        self.logprobs: list[list] = [[] for _ in range(total)]
        self.finish: list[str | None] = [None] * total
        self.stop_reason: list[str | int | None] = [None] * total
        self.num_tokens = [0] * total        # completion tokens so far, per choice
        self.started = [False] * total
        self.prompt_tokens = [len(p.ids) for p in prompts]
        self.cached_tokens = [0] * len(prompts)
        self.offsets = [0] * total           # completions' text_offset per sequence

    def add(self, p: int, resp: pb.GenerateResponse) -> tuple[int, str, Any, str | None]:
        """Record one delta of prompt p's request; -> (its choice index, its text, its logprobs in
        this endpoint's shape or None, finish)."""
        i = p * self.n + resp.index
        prompt = self.prompts[p]
        if resp.prompt_logprobs:
            prompt.logprobs = list(resp.prompt_logprobs)
        text, lead = resp.text, False
        if not self.started[i]:
            self.started[i] = True
            if prompt.echo is not None:
                text, lead = prompt.echo + text, self.echo_logprobs
        self.text[i] += text
        self.num_tokens[i] += len(resp.token_ids)
        lps = self._format_logprobs(i, resp, prompt if lead else None) if resp.logprobs or lead else None
        finish = None
        if resp.finished:
            finish = self.finish[i] = _FINISH.get(resp.finish_reason)
            kind = resp.WhichOneof("stop_reason")
            self.stop_reason[i] = getattr(resp, kind) if kind else None
            self.num_tokens[i] = resp.usage.completion_tokens
            self.prompt_tokens[p] = resp.usage.prompt_tokens
            if resp.index == 0:              # every sequence of a prompt shares its blocks
                self.cached_tokens[p] = resp.usage.cached_prompt_tokens
        return i, text, lps, finish

    def _format_logprobs(self, i: int, resp: pb.GenerateResponse, prompt: _Prompt | None):
        if self.kind == "chat":
            entries = [dict(_chat_lp(lp.sampled), top_logprobs=[_chat_lp(t) for t in lp.top])
                       for lp in resp.logprobs]
            self.logprobs[i].extend(entries)
            return {"content": entries}
        out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        if prompt is not None:               # echo: the prompt's tokens first, the first one unscored
            out["tokens"].append(prompt.first_token)
            out["token_logprobs"].append(None)
            out["top_logprobs"].append(None)
            out["text_offset"].append(self.offsets[i])
            self.offsets[i] += len(prompt.first_token)
            for lp in prompt.logprobs or ():
                top = {t.token: t.logprob for t in lp.top}
                top.setdefault(lp.sampled.token, lp.sampled.logprob)   # the prompt's own token, as vLLM
                self._completion_lp(out, i, lp.sampled, top)
        for lp in resp.logprobs:
            self._completion_lp(out, i, lp.sampled, {t.token: t.logprob for t in lp.top})
        self.logprobs[i].append(out)
        return out

    def _completion_lp(self, out: dict[str, list], i: int, token: pb.TokenLogprob, top: dict) -> None:
        out["tokens"].append(token.token)
        out["token_logprobs"].append(token.logprob)
        out["top_logprobs"].append(top)
        out["text_offset"].append(self.offsets[i])
        self.offsets[i] += len(token.token)

    def final_logprobs(self, i: int):
        if not self.logprobs[i]:
            return None
        if self.kind == "chat":
            return {"content": self.logprobs[i]}
        return {k: [x for part in self.logprobs[i] for x in part[k]] for k in self.logprobs[i][0]}

    def prompt_logprobs(self, i: int) -> list | None:
        """vLLM's prompt_logprobs of choice i's prompt: null, then {token id: its score} per token."""
        prompt = self.prompts[i // self.n]
        if prompt.logprobs is None:
            return None
        out: list[dict | None] = [None]
        for lp in prompt.logprobs:
            entry = {str(t.token_id): {"logprob": t.logprob, "rank": r, "decoded_token": t.token}
                     for r, t in enumerate(lp.top, 1)}
            entry.setdefault(str(lp.sampled.token_id), {"logprob": lp.sampled.logprob, "rank": None,
                                                        "decoded_token": lp.sampled.token})
            out.append(entry)
        return out

    def choice_usage(self, i: int) -> dict:
        """Choice i's own figures so far (continuous_usage_stats, as vLLM counts them)."""
        prompt, done = self.prompt_tokens[i // self.n], self.num_tokens[i]
        return {"prompt_tokens": prompt, "completion_tokens": done, "total_tokens": prompt + done}

    def usage(self) -> dict:
        prompt, done = sum(self.prompt_tokens), sum(self.num_tokens)
        return {"prompt_tokens": prompt, "completion_tokens": done, "total_tokens": prompt + done,
                "prompt_tokens_details": {"cached_tokens": sum(self.cached_tokens)}}


def _chat_lp(t: pb.TokenLogprob) -> dict:
    return {"token": t.token, "logprob": t.logprob, "bytes": list(t.token.encode())}


class OpenAIFront:
    """The aiohttp application and its listening site."""

    def __init__(self, service: Pipeline, tool_call_parser: str = "hermes"):
        self.service, self.tool_call_parser = service, tool_call_parser
        self.app = web.Application(client_max_size=16 * 2**20, middlewares=[_json_errors])
        add = self.app.router
        add.add_get("/v1/models", self.models)
        add.add_get("/v1/models/{model:.+}", self.model)
        add.add_post("/v1/completions", self.completions)
        add.add_post("/v1/chat/completions", self.chat_completions)
        add.add_post("/tokenize", self.tokenize)
        add.add_post("/detokenize", self.detokenize)
        add.add_get("/version", self.version)
        add.add_get("/health", self.health)
        add.add_get("/metrics", self.metrics)       # GET and HEAD (aiohttp adds HEAD to every GET)
        add.add_post("/v1/load_lora_adapter", self.load_lora_adapter)
        add.add_post("/v1/unload_lora_adapter", self.unload_lora_adapter)
        self.runner: web.AppRunner | None = None

    async def start(self, host: str, port: int) -> None:
        # handler_cancellation: a client that disconnects cancels its handler, and so its upstream call.
        self.runner = web.AppRunner(self.app, handler_cancellation=True, access_log=None)
        await self.runner.setup()
        await web.TCPSite(self.runner, host, port).start()

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({"models": self.service.cluster.models()},
                                 status=200 if self.service.cluster.models() else 503)

    def _identity(self, request: web.Request):
        """The caller, when the router runs with --api-keys-file (OpenAI clients send the same
        `Authorization: Bearer KEY` header); 401 without a valid key."""
        ring = self.service.keyring
        if ring is None:
            return None
        ident = ring.identify([("authorization", request.headers.get("Authorization", ""))])
        if ident is None:
            raise ApiError(401, "authorization: send `Authorization: Bearer KEY` with a valid key",
                           code="invalid_api_key")
        return ident

    async def models(self, request: web.Request) -> web.Response:
        try:
            self._identity(request)
            data = [await self._model_card(m) for m in self.service.cluster.models()]
        except ApiError as e:
            return e.response()
        # As vLLM lists them: each LoRA adapter a model of its own, its parent the base model.
        data += [self._adapter_card(name, base) for name, base in self.service.cluster.adapters().items()]
        return web.json_response({"object": "list", "data": data})

    async def load_lora_adapter(self, request: web.Request) -> web.Response:
        """vLLM's POST /v1/load_lora_adapter {lora_name, lora_path}: every live worker (of
        `model`, when the body names one) registers the adapter; its path must be readable on
        each of them."""
        return await self._lora_admin(request, load=True)

    async def unload_lora_adapter(self, request: web.Request) -> web.Response:
        """vLLM's POST /v1/unload_lora_adapter {lora_name}: every live worker that serves it forgets it."""
        return await self._lora_admin(request, load=False)

    async def _lora_admin(self, request: web.Request, load: bool) -> web.Response:
        try:
            ident = self._identity(request)
            if ident is not None and not ident.admin:
                raise ApiError(403, "authorization: loading and unloading LoRA adapters needs an admin key",
                               code="permission_denied")
            body = await _json_body(request)
            name, path, model = body.get("lora_name"), body.get("lora_path", ""), body.get("model")
            if not isinstance(name, str) or not name:
                raise _bad("lora_name", "must be a non-empty string")
            if load and (not isinstance(path, str) or not path):
                raise _bad("lora_path", "must be the adapter directory's path on the workers")
            if model is not None and not isinstance(model, str):
                raise _bad("model", "must be a string")
            cluster = self.service.cluster
            workers = [w for w in cluster.workers.values() if model is None or w.lease.model == model]
            if not load:
                workers = [w for w in workers if name in w.lease.lora_adapters]
            if not workers:
                raise ApiError(404 if not load else 503, f"lora_name: no live worker {'serves' if not load else 'to load'} "
                               f"{name!r}" + (f" (model {model!r})" if model else ""), "lora_name")
        except ApiError as e:
            return e.response()

        async def one(w):
            admin = self.service.channels.admin(w.lease.address)
            meta = self.service.channels.metadata
            if load:
                return await admin.LoadLoRAAdapter(pb.LoadLoRAAdapterRequest(lora_name=name, lora_path=path),
                                                   timeout=60, metadata=meta)
            return await admin.UnloadLoRAAdapter(pb.UnloadLoRAAdapterRequest(lora_name=name), timeout=60,
                                                 metadata=meta)

        results = await asyncio.gather(*(one(w) for w in workers), return_exceptions=True)
        failed = []
        for w, r in zip(workers, results):
            if isinstance(r, grpc.aio.AioRpcError):
                failed.append(f"{w.name}: {r.details()}")
            elif isinstance(r, BaseException):
                raise r
            else:
                cluster.adapters_changed(w, list(r.adapters))
        if failed:
            return _bad("lora_path" if load and "lora_path" in failed[0] else "lora_name",
                        f"{len(failed)} of {len(workers)} workers refused: " + "; ".join(failed)).response()
        verb = "added" if load else "removed"
        return web.Response(text=f"Success: LoRA adapter '{name}' {verb} successfully.")

    async def model(self, request: web.Request) -> web.Response:
        """/v1/models/{id}: the model's card, or 404 naming it."""
        name = request.match_info["model"]
        try:
            self._identity(request)
            adapters = self.service.cluster.adapters()
            if name in adapters:
                return web.json_response(self._adapter_card(name, adapters[name]))
            if name not in self.service.cluster.models():
                raise ApiError(404, f"model: the model {name!r} does not exist", "model", "model_not_found")
            return web.json_response(await self._model_card(name))
        except ApiError as e:
            return e.response()

    @staticmethod
    def _adapter_card(name: str, base: str) -> dict:
        return {"id": name, "object": "model", "created": 0, "owned_by": "pagoda", "root": name, "parent": base}

    async def _model_card(self, model: str) -> dict:
        card: dict[str, Any] = {"id": model, "object": "model", "created": 0, "owned_by": "pagoda",
                                "root": model, "parent": None}
        try:
            card["max_model_len"] = (await self.service.model_info(model)).max_model_len
        except RouterError:          # its workers went away meanwhile: the card without the figure
            pass
        return card

    async def tokenize(self, request: web.Request) -> web.Response:
        """vLLM's /tokenize: {prompt} or {messages}, -> {count, max_model_len, tokens, token_strs}."""
        try:
            self._identity(request)
            body = await _json_body(request)
            kind = "chat" if "messages" in body else "completion"
            allowed = {"model", "add_special_tokens", "return_token_strs"} | (
                {"messages", "add_generation_prompt", "tools"} if kind == "chat" else {"prompt"})
            _refuse_unknown(body, allowed)
            special = "add_special_tokens" not in body or _number(body, "add_special_tokens", bool)
            req = pb.GenerateRequest(model=_model_name(body))
            model, pin = await self._pin(req.model)
            if kind == "chat":
                plan = self._tool_plan(body)
                ids = await self._chat_ids(body, pin, plan.tools if plan else None)
            else:
                prompt = body.get("prompt")
                if not isinstance(prompt, str):
                    raise _bad("prompt", "must be a string")
                if pin.tokenizer is None:
                    raise _bad("prompt", f"model {model!r} has no tokenizer")
                ids = await asyncio.to_thread(pin.tokenizer.encode_text, prompt) if special else \
                    pin.tokenizer.backend.encode(prompt, add_special_tokens=False).ids
            strs = None
            if body.get("return_token_strs") and _number(body, "return_token_strs", bool):
                strs = [pin.tokenizer.backend.id_to_token(t) for t in ids] if pin.tokenizer else None
            return web.json_response({"count": len(ids), "max_model_len": pin.info.max_model_len,
                                      "tokens": ids, "token_strs": strs})
        except ApiError as e:
            return e.response()

    async def detokenize(self, request: web.Request) -> web.Response:
        """vLLM's /detokenize: {tokens} -> {prompt}."""
        try:
            self._identity(request)
            body = await _json_body(request)
            _refuse_unknown(body, {"model", "tokens"})
            ids = body.get("tokens")
            if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
                raise _bad("tokens", "must be a list of token ids")
            model, pin = await self._pin(_model_name(body))
            if pin.tokenizer is None:
                raise _bad("tokens", f"model {model!r} has no tokenizer")
            vocab = pin.tokenizer.vocab_size
            bad = next((t for t in ids if not 0 <= t < vocab), None)
            if bad is not None:
                raise _bad("tokens", f"token id {bad} is outside the vocabulary (0..{vocab - 1})")
            return web.json_response({"prompt": pin.tokenizer.decode(ids)})
        except ApiError as e:
            return e.response()

    async def version(self, request: web.Request) -> web.Response:
        return web.json_response({"version": _version()})

    async def metrics(self, request: web.Request) -> web.Response:
        """The router's Prometheus metrics on the API port, as vLLM serves its own there."""
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
        body = generate_latest(self.service.metrics.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    def _tool_plan(self, body: dict) -> ToolPlan | None:
        try:
            return tools.plan(body, self.tool_call_parser)
        except ToolError as e:
            raise ApiError(400, str(e), e.param) from None

    async def _chat_ids(self, body: dict, pin, tool_list: list[dict] | None) -> list[int]:
        """The chat rendered by the model's template, tools included, -> token ids."""
        msgs = _messages(body)
        agp = "add_generation_prompt" not in body or body["add_generation_prompt"] is None or \
            _number(body, "add_generation_prompt", bool)
        if pin.tokenizer is None:
            raise _bad("messages", f"model {pin.info.model!r} has no tokenizer; send a prompt of token ids")
        try:
            return await asyncio.to_thread(pin.tokenizer.encode_chat, msgs, agp, tool_list)
        except ValueError as e:
            head = str(e).split(":", 1)[0]
            raise ApiError(400, str(e), head if head.isidentifier() else "messages") from None

    async def _pin(self, model: str):
        try:
            return await self.service.pin(model)
        except RouterError as r:
            raise ApiError.from_reject(r) from None

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, "completion")

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, "chat")

    async def _serve(self, request: web.Request, kind: str) -> web.StreamResponse:
        try:
            ident = self._identity(request)
            body = await _json_body(request)
            reqs = build_requests(body, kind)
            plan = self._tool_plan(body) if kind == "chat" else None
            if plan is not None and body.get("parallel_tool_calls") is False:
                plan.single = True
            if kind == "chat" and not reqs[0].messages:      # tools: rendered here
                model, pin = await self._pin(reqs[0].model)
                reqs[0].token_ids[:] = await self._chat_ids(body, pin, plan.tools if plan else None)
            if plan is not None and plan.schema() is not None:
                if reqs[0].sampling.HasField("structured_output"):
                    raise _bad("tool_choice", f"{plan.choice} tool choice and response_format/guided_* "
                                              "both constrain the output: give one")
                reqs[0].sampling.structured_output.json_schema = json.dumps(plan.schema())
            if plan is not None and not plan.parses:
                plan = None
            stream = "stream" in body and _number(body, "stream", bool)
            usage_in_stream, continuous = _stream_options(body, stream)
            echo = kind == "completion" and body.get("echo") is True
            texts = [r.text if r.HasField("text") else None for r in reqs]
            max_name = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
            asked = reqs[0].model      # an adapter's name stays the response's model
            prompts = [_Prompt(ids) for ids in await asyncio.gather(*(self._prepare(r, kind, max_name) for r in reqs))]
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
        choices = _Choices(kind, sp.n if sp.HasField("n") else 1, prompts, echo and sp.HasField("logprobs"))
        async with contextlib.AsyncExitStack() as stack:
            upstreams = [await stack.enter_async_context(contextlib.aclosing(self.service.generate(r, None, ident)))
                         for r in reqs]
            try:
                firsts = await _first_of_each(upstreams)    # errors before the first token get their HTTP status
            except RouterError as r:
                return ApiError.from_reject(r).response()
            except StopAsyncIteration:
                return ApiError(503, "no worker answered").response()
            merged = await stack.enter_async_context(contextlib.aclosing(_merge(upstreams, firsts)))
            if stream:
                return await self._stream(request, head, choices, merged, usage_in_stream, continuous, plan)
            try:
                async for p, resp in merged:
                    choices.add(p, resp)
            except RouterError as r:
                return ApiError.from_reject(r).response()
        scored = kind == "completion" and "prompt_logprobs" in body
        return web.json_response({**head, "choices": [self._choice(kind, choices, i, scored, plan)
                                                       for i in range(len(choices.text))],
                                  "usage": choices.usage()})

    async def _echoes(self, model: str, prompts: list[_Prompt], texts: list[str | None]) -> None:
        """What echo puts before each prompt's completions: the prompt as sent, or token ids decoded."""
        try:
            _, pin = await self.service.pin(model)
        except RouterError as r:
            raise ApiError.from_reject(r) from None
        tok = pin.tokenizer
        if tok is None:
            raise _bad("echo", f"model {model!r} has no tokenizer to show the prompt with")
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
            raise _bad(prompt, f"the prompt has {len(ids)} tokens; this model's maximum context length "
                               f"is {max_len} tokens, so it leaves no room for a completion")
        sp = req.sampling
        if not sp.HasField("max_tokens"):
            sp.max_tokens = max_len - len(ids) if kind == "chat" else COMPLETION_DEFAULT_MAX_TOKENS
        if len(ids) + sp.max_tokens > max_len:
            raise _bad(max_name, f"this model's maximum context length is {max_len} tokens; the request asks "
                             f"for {len(ids) + sp.max_tokens} ({len(ids)} in the {prompt}, {sp.max_tokens} "
                             "in the completion); reduce the length of either")
        req.model = model
        req.ClearField("text")
        req.ClearField("messages")
        req.token_ids[:] = ids               # tokenized once: the router path skips it
        return list(ids)

    @staticmethod
    def _choice(kind: str, choices: _Choices, i: int, scored: bool = False, plan: ToolPlan | None = None) -> dict:
        out: dict[str, Any] = {"index": i, "logprobs": choices.final_logprobs(i),
                               "finish_reason": choices.finish[i], "stop_reason": choices.stop_reason[i]}
        if kind == "chat" and plan is not None:
            content, calls = tools.parse(choices.text[i], plan)
            out["message"] = {"role": "assistant", "content": content, "tool_calls": calls}
            if calls and out["finish_reason"] == "stop":     # cut off by max_tokens: "length" stays
                out["finish_reason"] = "tool_calls"
        elif kind == "chat":
            out["message"] = {"role": "assistant", "content": choices.text[i]}
        else:
            out["text"] = choices.text[i]
        if scored:
            out["prompt_logprobs"] = choices.prompt_logprobs(i)
        return out

    async def _stream(self, request, head, choices, merged, usage_in_stream, continuous,
                      plan: ToolPlan | None = None) -> web.StreamResponse:
        kind = choices.kind
        head = {**head, "object": "chat.completion.chunk" if kind == "chat" else "text_completion"}
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)

        async def send(obj) -> None:
            await resp.write(b"data: " + json.dumps(obj).encode() + b"\n\n")

        started: set[int] = set()
        parsers: dict[int, tools.ToolCallStream] = {}
        choice: dict[str, Any]
        try:
            async for p, delta in merged:
                i, text, lps, finish = choices.add(p, delta)
                if kind == "chat" and i not in started:
                    started.add(i)
                    chunk = {**head, "choices": [{"index": i, "delta": {"role": "assistant", "content": ""},
                                                  "logprobs": None, "finish_reason": None}]}
                    if continuous:
                        chunk["usage"] = {"prompt_tokens": choices.prompt_tokens[p], "completion_tokens": 0,
                                          "total_tokens": choices.prompt_tokens[p]}
                    await send(chunk)
                if plan is not None:          # tool calls: content and tool_calls deltas
                    parser = parsers.setdefault(i, tools.ToolCallStream(plan))
                    deltas = parser.feed(text, last=finish is not None)
                    if finish == "stop" and parser.calls:
                        finish = "tool_calls"
                    if not deltas and (lps or finish):
                        deltas = [{}]
                    for k, d in enumerate(deltas):
                        end = finish if k == len(deltas) - 1 else None
                        choice = {"index": i, "delta": d, "logprobs": lps if k == 0 else None, "finish_reason": end}
                        if end:
                            choice["stop_reason"] = choices.stop_reason[i]
                        chunk = {**head, "choices": [choice]}
                        if continuous:
                            chunk["usage"] = choices.choice_usage(i)
                        await send(chunk)
                elif text or lps or finish:
                    choice = {"index": i, "logprobs": lps, "finish_reason": finish}
                    if finish:
                        choice["stop_reason"] = choices.stop_reason[i]
                    if kind == "chat":
                        choice["delta"] = {"content": text} if text else {}
                    else:
                        choice["text"] = text
                    chunk = {**head, "choices": [choice]}
                    if continuous:
                        chunk["usage"] = choices.choice_usage(i)
                    await send(chunk)
            if usage_in_stream:
                await send({**head, "choices": [], "usage": choices.usage()})
        except RouterError as r:
            await send(ApiError.from_reject(r).body())
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp


@web.middleware
async def _json_errors(request: web.Request, handler):
    """aiohttp's own answers (no such route, a wrong method) as OpenAI error objects, not text."""
    try:
        return await handler(request)
    except web.HTTPException as e:
        if e.status < 400:
            raise
        why = {404: f"no route {request.path!r} (the OpenAI API is under /v1)",
               405: f"method {request.method} not allowed on {request.path!r}"}.get(e.status, e.reason)
        headers = {"Allow": e.headers["Allow"]} if "Allow" in e.headers else None
        err = ApiError(e.status, why)
        return web.json_response(err.body(), status=e.status, headers=headers)


async def _json_body(request: web.Request) -> dict:
    try:
        body = await request.json()
    except ValueError as e:
        raise ApiError(400, f"body: not valid JSON ({e})") from None
    if not isinstance(body, dict):
        raise ApiError(400, "body: must be a JSON object")
    return body


def _refuse_unknown(body: dict, allowed: set[str]) -> None:
    unknown = sorted(k for k in set(body) - allowed if body[k] is not None)
    if unknown:
        raise ApiError(400, f"{unknown[0]}: unsupported parameter(s): {', '.join(unknown)}", unknown[0])


def _model_name(body: dict) -> str:
    model = body.get("model") or ""
    if not isinstance(model, str):
        raise _bad("model", "must be a string")
    return model


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version("pagoda-serve")
    except PackageNotFoundError:
        return "unknown"


async def _first_of_each(upstreams: list) -> list[pb.GenerateResponse]:
    """Every upstream's first response, awaited together (each prompt's request starts now)."""
    if len(upstreams) == 1:
        return [await anext(upstreams[0])]
    tasks = [asyncio.ensure_future(anext(u)) for u in upstreams]
    try:
        return list(await asyncio.gather(*tasks))
    finally:          # one failed: the others stop before their streams are closed
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _merge(upstreams: list, firsts: list[pb.GenerateResponse]):
    """(prompt number, response) from every upstream as each comes; a RouterError of any ends it."""
    if len(upstreams) == 1:
        yield 0, firsts[0]
        async for resp in upstreams[0]:
            yield 0, resp
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(p: int, upstream) -> None:
        try:
            async for resp in upstream:
                queue.put_nowait((p, resp))
        except RouterError as e:
            queue.put_nowait((p, e))
        queue.put_nowait((p, None))

    for p, first in enumerate(firsts):
        queue.put_nowait((p, first))
    tasks = [asyncio.ensure_future(pump(p, u)) for p, u in enumerate(upstreams)]
    try:
        left = len(tasks)
        while left:
            p, item = await queue.get()
            if item is None:
                left -= 1
            elif isinstance(item, RouterError):
                raise item
            else:
                yield p, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
