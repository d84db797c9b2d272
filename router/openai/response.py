"""Worker deltas -> OpenAI responses: the choices of every prompt's n sequences as they grow, their
logprobs in each endpoint's shape, usage, and the objects sent: a whole (chat) completion, or the
chunks of a streamed one (router/openai/sse.py sends those).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, AsyncGenerator, AsyncIterator

from pagoda.protos.pagoda.v1 import pagoda_pb2 as pb
from pagoda.router import tools
from pagoda.router.errors import RouterError
from pagoda.router.openai.request import ApiError
from pagoda.router.tools import ToolPlan

_FINISH = {pb.FINISH_REASON_STOP: "stop", pb.FINISH_REASON_LENGTH: "length", pb.FINISH_REASON_ABORT: "abort"}


@dataclass
class Prompt:
    """One prompt of a request, and what echo shows of it."""
    ids: list[int]
    echo: str | None = None                   # the text to put before each of its completions
    first_token: str = ""                     # its first token's text (that token has no score)
    logprobs: list[pb.Logprobs] | None = None  # scores of its tokens after the first, once they come


class Choices:
    """What each of the prompts' n sequences has produced so far, and the request's usage."""

    def __init__(self, kind: str, n: int, prompts: list[Prompt], echo_logprobs: bool = False,
                 score_only: bool = False):
        self.kind, self.n, self.prompts = kind, n, prompts
        self.echo_logprobs = echo_logprobs   # echo with logprobs: the prompt's tokens lead the logprobs
        # max_tokens=0 (vLLM's echo without generation): the engine ran one token to score the
        # prompt; that token is dropped, so the choice is the prompt alone, cut at its "length".
        self.score_only = score_only
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
        if self.score_only:
            resp = _without_completion(resp)
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

    def _format_logprobs(self, i: int, resp: pb.GenerateResponse, prompt: Prompt | None):
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


def _without_completion(resp: pb.GenerateResponse) -> pb.GenerateResponse:
    """A delta of a max_tokens=0 request with its one generated token taken out."""
    out = pb.GenerateResponse()
    out.CopyFrom(resp)
    out.text = ""
    out.ClearField("token_ids")
    out.ClearField("logprobs")
    if out.finished:
        out.finish_reason = pb.FINISH_REASON_LENGTH
        kind = out.WhichOneof("stop_reason")
        if kind:
            out.ClearField(kind)
        out.usage.completion_tokens = 0
    return out


def _chat_lp(t: pb.TokenLogprob) -> dict:
    return {"token": t.token, "logprob": t.logprob, "bytes": list(t.token.encode())}


def response_object(head: dict, choices: Choices, scored: bool = False, plan: ToolPlan | None = None) -> dict:
    """The whole response of a request that does not stream (`scored`: with each choice's
    prompt_logprobs; `plan`: tool calls parsed out of the chat's text)."""
    return {**head, "choices": [_choice(choices.kind, choices, i, scored, plan) for i in range(len(choices.text))],
            "usage": choices.usage()}


def _choice(kind: str, choices: Choices, i: int, scored: bool = False, plan: ToolPlan | None = None) -> dict:
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


async def stream_chunks(head: dict, choices: Choices, merged: AsyncIterator[tuple[int, pb.GenerateResponse]],
                        usage_in_stream: bool, continuous: bool, plan: ToolPlan | None = None
                        ) -> AsyncGenerator[dict, None]:
    """The chunks of a streamed response as the deltas come (`merged`: (prompt number, response));
    a RouterError of any upstream ends them with an error object."""
    kind = choices.kind
    head = {**head, "object": "chat.completion.chunk" if kind == "chat" else "text_completion"}
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
                yield chunk
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
                    yield chunk
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
                yield chunk
        if usage_in_stream:
            yield {**head, "choices": [], "usage": choices.usage()}
    except RouterError as r:
        yield ApiError.from_reject(r).body()
