"""OpenAI request bodies -> pagoda.v1 GenerateRequests, and the errors that name the field.

OpenAI and vLLM parameter names map one to one onto pagoda.v1 SamplingParams, and null means "not
given", as in vLLM. A bad body is an ApiError: an OpenAI error object whose `param` names the
field, as the `field:` prefix of pagoda's own messages does; a refusal from the pipeline (a gRPC
status) becomes one with its HTTP status.
"""
from __future__ import annotations

import asyncio
import json
from typing import Any

import grpc
from aiohttp import web

from pagoda.protos.pagoda.v1 import pagoda_pb2 as pb
from pagoda.router import tools
from pagoda.router.errors import RouterError
from pagoda.router.openai.limits import limits_of
from pagoda.router.tools import ToolError, ToolPlan, chat_messages

_HTTP_STATUS = {grpc.StatusCode.INVALID_ARGUMENT: 400, grpc.StatusCode.OUT_OF_RANGE: 400,
                grpc.StatusCode.FAILED_PRECONDITION: 400, grpc.StatusCode.UNAUTHENTICATED: 401,
                grpc.StatusCode.PERMISSION_DENIED: 403, grpc.StatusCode.NOT_FOUND: 404,
                grpc.StatusCode.RESOURCE_EXHAUSTED: 429, grpc.StatusCode.UNAVAILABLE: 503,
                grpc.StatusCode.DEADLINE_EXCEEDED: 504}
_ERROR_TYPE = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "invalid_request_error", 429: "rate_limit_error",
               503: "service_unavailable_error"}
# pagoda.v1 field names that an HTTP caller knows under another name.
_PARAM_ALIASES = {"text": "prompt", "token_ids": "prompt"}

_INT_PARAMS = ("n", "top_k", "seed", "min_tokens", "best_of")
_FLOAT_PARAMS = ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty",
                 "length_penalty")
_BOOL_PARAMS = ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output", "use_beam_search")
_STRUCTURED = ("response_format", "guided_json", "guided_choice", "guided_regex")
# `user` (OpenAI's end-user id for abuse monitoring) is accepted and not used: tenants come
# from API keys here, and refusing it would break clients that always send it.
_COMMON = {"model", "max_tokens", "stop", "logit_bias", "stream", "stream_options", "user", "cache_salt",
           "priority", "stop_token_ids", "logprobs", *_STRUCTURED, *_INT_PARAMS, *_FLOAT_PARAMS, *_BOOL_PARAMS}
_ALLOWED = {"chat": _COMMON | {"messages", "max_completion_tokens", "top_logprobs", "add_generation_prompt",
                               "tools", "tool_choice", "parallel_tool_calls"},
            "completion": _COMMON | {"prompt", "echo", "prompt_logprobs"}}
_STREAM_OPTIONS = ("include_usage", "continuous_usage_stats")
COMPLETION_DEFAULT_MAX_TOKENS = 16      # OpenAI's legacy completions default
MAX_BATCH_PROMPTS = 1024                # prompts in one /v1/completions request


class ApiError(Exception):
    """An OpenAI error object and its HTTP status; `param` names the field at fault."""

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


def bad(param: str, why: str) -> ApiError:
    return ApiError(400, f"{param}: {why}", param)


# -- request body -> GenerateRequest -----------------------------------------------------------

def number(body: dict, name: str, kind: type) -> Any:
    v = body[name]
    ok = isinstance(v, bool) if kind is bool else (
        isinstance(v, (int, float) if kind is float else int) and not isinstance(v, bool))
    if not ok:
        raise bad(name, f"must be {'a boolean' if kind is bool else 'an integer' if kind is int else 'a number'} "
                        f"(got {v!r})")
    return v


def _sampling(body: dict, kind: str) -> pb.SamplingParams:
    sp = pb.SamplingParams()
    for names, t in ((_INT_PARAMS, int), (_FLOAT_PARAMS, float), (_BOOL_PARAMS, bool)):
        for name in names:
            if name in body:
                try:
                    setattr(sp, name, number(body, name, t))
                except ValueError:           # outside int32/int64
                    raise bad(name, f"out of range (got {body[name]!r})") from None
    max_name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    if body.get(max_name) is not None:
        try:
            sp.max_tokens = number(body, max_name, int)
        except ValueError:
            raise bad(max_name, f"out of range (got {body[max_name]!r})") from None
    stop = body.get("stop")
    if stop is not None:
        stops = [stop] if isinstance(stop, str) else stop
        if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
            raise bad("stop", "must be a string or a list of strings")
        sp.stop[:] = stops
    ids = body.get("stop_token_ids")
    if ids is not None:
        if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise bad("stop_token_ids", "must be a list of token ids")
        sp.stop_token_ids[:] = ids
    bias = body.get("logit_bias")
    if bias is not None:
        try:
            sp.logit_bias.update({int(k): float(v) for k, v in bias.items()})
        except (AttributeError, TypeError, ValueError):
            raise bad("logit_bias", "must map token ids to numbers") from None
    _logprobs(body, kind, sp)
    _structured(body, sp)
    if sp.use_beam_search:
        _beam_search(body, sp)
    elif sp.HasField("length_penalty") and sp.length_penalty != 1.0:
        # It ranks finished beams; without beam search it would change nothing, silently (as vLLM,
        # refused). 1.0, the neutral value some SDKs always send, changes nothing either way.
        raise bad("length_penalty", f"only applies with use_beam_search (got {sp.length_penalty:g})")
    return sp


def _beam_search(body: dict, sp: pb.SamplingParams) -> None:
    """use_beam_search (vLLM's): best_of beams (n without it), the n best returned. What the
    router can tell at once is refused here; the worker checks the rest by the same names."""
    if body.get("stream") is True:
        raise bad("stream", "not allowed with use_beam_search (beams are ranked only when the search ends)")
    if sp.HasField("temperature") and sp.temperature != 0:
        raise bad("temperature", f"must be 0 with use_beam_search (got {sp.temperature:g})")
    n = sp.n if sp.HasField("n") else 1
    if sp.HasField("best_of") and n > sp.best_of:
        raise bad("n", f"must be <= best_of with use_beam_search (got n={n}, best_of={sp.best_of})")


def _logprobs(body: dict, kind: str, sp: pb.SamplingParams) -> None:
    if kind == "completion":
        if body.get("logprobs") is not None:
            sp.logprobs = number(body, "logprobs", int)
        if "prompt_logprobs" in body:
            sp.prompt_logprobs = number(body, "prompt_logprobs", int)
        elif sp.HasField("logprobs") and "echo" in body and number(body, "echo", bool):
            sp.prompt_logprobs = sp.logprobs      # the echoed prompt's tokens are scored too
        return
    wanted = body.get("logprobs") is not None and number(body, "logprobs", bool)
    top = body.get("top_logprobs")
    if top is not None and not wanted:
        raise bad("top_logprobs", "needs logprobs: true")
    if wanted:
        sp.logprobs = 0 if top is None else number(body, "top_logprobs", int)


def _structured(body: dict, sp: pb.SamplingParams) -> None:
    """response_format / guided_json / guided_choice / guided_regex -> SamplingParams.structured_output."""
    fmt = body.get("response_format")
    if fmt is not None and (not isinstance(fmt, dict) or fmt.get("type") not in ("text", "json_object",
                                                                                   "json_schema")):
        raise bad("response_format", "must be {\"type\": \"text\" | \"json_object\" | \"json_schema\"}")
    given = [k for k in _STRUCTURED if k in body and not (k == "response_format" and fmt and fmt["type"] == "text")]
    if len(given) > 1:
        raise bad(given[1], f"give only one of {', '.join(given)}")
    if not given:
        return
    name, value, so = given[0], body[given[0]], sp.structured_output
    if name == "response_format" and value["type"] == "json_object":
        so.json_object = True
    elif name == "response_format":
        schema = value.get("json_schema")
        schema = schema.get("schema") if isinstance(schema, dict) else None
        if not isinstance(schema, dict):
            raise bad(name, "json_schema.schema must be a JSON schema object")
        so.json_schema = json.dumps(schema)
    elif name == "guided_json":
        if not isinstance(value, (dict, str)):
            raise bad(name, "must be a JSON schema")
        so.json_schema = value if isinstance(value, str) else json.dumps(value)
    elif name == "guided_choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
            raise bad(name, "must be a non-empty list of non-empty strings")
        so.choice[:] = value
    else:
        if not isinstance(value, str) or not value:
            raise bad(name, "must be a non-empty regular expression")
        so.regex = value


def messages(body: dict) -> list[dict]:
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
        raise bad("model", "must be a string")
    req = pb.GenerateRequest(model=model, sampling=_sampling(body, kind))
    if "priority" in body:
        req.priority = number(body, "priority", int)
    if "cache_salt" in body:
        if not isinstance(body["cache_salt"], str):
            raise bad("cache_salt", "must be a string")
        req.cache_salt = body["cache_salt"]
    if kind == "chat":
        msgs = messages(body)
        if not renders_tools(body, msgs):        # else the front renders them into token ids
            req.messages.extend(pb.ChatMessage(role=m["role"], content=m["content"]) for m in msgs)
        if "parallel_tool_calls" in body:
            number(body, "parallel_tool_calls", bool)
        if "add_generation_prompt" in body:
            req.add_generation_prompt = number(body, "add_generation_prompt", bool)
        return [req]
    if "echo" in body:
        number(body, "echo", bool)
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
            raise bad("prompt", f"at most {MAX_BATCH_PROMPTS} prompts in one request (got {len(prompt)})")
        return prompt
    raise bad("prompt", "must be a string, a list of token ids, or a non-empty list of strings or of "
                        "token-id lists (a batch)")


def stream_options(body: dict, stream: bool) -> tuple[bool, bool]:
    """(usage in a last chunk, usage on every chunk too): stream_options as vLLM reads them."""
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise bad("stream_options", "must be an object")
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


def tool_plan(body: dict, parser: str) -> ToolPlan | None:
    try:
        return tools.plan(body, parser)
    except ToolError as e:
        raise ApiError(400, str(e), e.param) from None


async def chat_ids(body: dict, pin, tool_list: list[dict] | None) -> list[int]:
    """The chat rendered by the model's template, tools included, -> token ids."""
    msgs = messages(body)
    agp = "add_generation_prompt" not in body or body["add_generation_prompt"] is None or \
        number(body, "add_generation_prompt", bool)
    if pin.tokenizer is None:
        raise bad("messages", f"model {pin.info.model!r} has no tokenizer; send a prompt of token ids")
    try:
        return await asyncio.to_thread(pin.tokenizer.encode_chat, msgs, agp, tool_list)
    except ValueError as e:
        head = str(e).split(":", 1)[0]
        raise ApiError(400, str(e), head if head.isidentifier() else "messages") from None


async def json_body(request: web.Request) -> dict:
    body = json_value(await request.read(), limits_of(request).max_json_depth)
    if not isinstance(body, dict):
        raise ApiError(400, "body: must be a JSON object")
    return body


def json_value(raw: bytes, max_depth: int) -> Any:
    """`raw` parsed as JSON (UTF-8, or UTF-16/32 by its first bytes), or ApiError: not JSON, or
    arrays and objects nested deeper than `max_depth`."""
    too_deep = ApiError(400, f"body: JSON nested deeper than {max_depth} levels (the router's "
                             f"--http-max-json-depth)")
    try:
        value = json.loads(raw)
    except RecursionError:             # the parser recurses per level: far too deep
        raise too_deep from None
    except ValueError as e:            # UnicodeDecodeError included
        raise ApiError(400, f"body: not valid JSON ({e})") from None
    # Fewer brackets than the bound cannot nest past it: most bodies skip the walk.
    if raw.count(b"[") + raw.count(b"{") > max_depth and _depth_exceeds(value, max_depth):
        raise too_deep
    return value


def _depth_exceeds(value: Any, limit: int) -> bool:
    stack = [(value, 1)] if isinstance(value, (dict, list)) else []
    while stack:
        v, depth = stack.pop()
        children = v.values() if isinstance(v, dict) else v
        if depth > limit:
            return True
        stack.extend((c, depth + 1) for c in children if isinstance(c, (dict, list)))
    return False


def refuse_unknown(body: dict, allowed: set[str]) -> None:
    unknown = sorted(k for k in set(body) - allowed if body[k] is not None)
    if unknown:
        raise ApiError(400, f"{unknown[0]}: unsupported parameter(s): {', '.join(unknown)}", unknown[0])


def model_name(body: dict) -> str:
    model = body.get("model") or ""
    if not isinstance(model, str):
        raise bad("model", "must be a string")
    return model
