"""vLLM's /tokenize and /detokenize: a prompt or a chat (tools included) -> token ids, as the router
tokenizes them for routing, and token ids -> text."""
from __future__ import annotations

import asyncio

from aiohttp import web

from pagoda.protos.pagoda.v1 import pagoda_pb2 as pb
from pagoda.router.openai.request import ApiError, bad, chat_ids, json_body, model_name, number, refuse_unknown, tool_plan
from pagoda.router.openai.serving import Serving


class Tokenization(Serving):
    async def tokenize(self, request: web.Request) -> web.Response:
        """vLLM's /tokenize: {prompt} or {messages}, -> {count, max_model_len, tokens, token_strs}."""
        try:
            self.identity(request)
            body = await json_body(request)
            kind = "chat" if "messages" in body else "completion"
            allowed = {"model", "add_special_tokens", "return_token_strs"} | (
                {"messages", "add_generation_prompt", "tools"} if kind == "chat" else {"prompt"})
            refuse_unknown(body, allowed)
            special = "add_special_tokens" not in body or number(body, "add_special_tokens", bool)
            req = pb.GenerateRequest(model=model_name(body))
            model, pin = await self.pin(req.model)
            if kind == "chat":
                plan = tool_plan(body, self.tool_call_parser)
                ids = await chat_ids(body, pin, plan.tools if plan else None)
            else:
                prompt = body.get("prompt")
                if not isinstance(prompt, str):
                    raise bad("prompt", "must be a string")
                if pin.tokenizer is None:
                    raise bad("prompt", f"model {model!r} has no tokenizer")
                ids = await asyncio.to_thread(pin.tokenizer.encode_text, prompt) if special else \
                    pin.tokenizer.backend.encode(prompt, add_special_tokens=False).ids
            strs = None
            if body.get("return_token_strs") and number(body, "return_token_strs", bool):
                strs = [pin.tokenizer.backend.id_to_token(t) for t in ids] if pin.tokenizer else None
            return web.json_response({"count": len(ids), "max_model_len": pin.info.max_model_len,
                                      "tokens": ids, "token_strs": strs})
        except ApiError as e:
            return e.response()

    async def detokenize(self, request: web.Request) -> web.Response:
        """vLLM's /detokenize: {tokens} -> {prompt}."""
        try:
            self.identity(request)
            body = await json_body(request)
            refuse_unknown(body, {"model", "tokens"})
            ids = body.get("tokens")
            if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
                raise bad("tokens", "must be a list of token ids")
            model, pin = await self.pin(model_name(body))
            if pin.tokenizer is None:
                raise bad("tokens", f"model {model!r} has no tokenizer")
            vocab = pin.tokenizer.vocab_size
            outside = next((t for t in ids if not 0 <= t < vocab), None)
            if outside is not None:
                raise bad("tokens", f"token id {outside} is outside the vocabulary (0..{vocab - 1})")
            return web.json_response({"prompt": pin.tokenizer.decode(ids)})
        except ApiError as e:
            return e.response()
