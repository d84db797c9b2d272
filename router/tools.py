"""Tool calling on /v1/chat/completions, as vLLM's OpenAI server does it.

`tools` are rendered into the prompt by the model's chat template. `tool_choice`:
- "none": the tools are in the prompt, the output is plain content.
- "auto" (the default with tools): the output is parsed by the router's --tool-call-parser,
  `hermes` (`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, text before the first tag
  is content) or `llama3_json` (the whole output is `{"name": ..., "parameters": {...}}`, several
  separated by `;`, an optional leading `<|python_tag|>`); calls found -> `tool_calls`,
  finish_reason "tool_calls".
- "required": the worker's structured output holds the output to a JSON array of
  {"name", "parameters"} objects, one of the tools each, with that tool's parameter schema.
- a named function ({"type": "function", "function": {"name": ...}}): the output is held to that
  function's parameter schema and is its arguments.
Parsing needs no I/O: `ToolCallStream` turns streamed text into content and tool-call deltas.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

PARSERS = ("hermes", "llama3_json")
HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"


class ToolError(ValueError):
    """A bad `tools` / `tool_choice` / message: str(e) starts with the field's name."""

    def __init__(self, param: str, why: str):
        super().__init__(f"{param}: {why}")
        self.param = param


@dataclass
class ToolPlan:
    """What a request's tools ask of the router."""
    tools: list[dict]                 # as the chat template gets them
    choice: str                       # none | auto | required | named
    name: str | None = None           # the named function
    parser: str = "hermes"
    single: bool = False              # parallel_tool_calls false: the first call only

    @property
    def parses(self) -> bool:
        return self.choice != "none"

    def schema(self) -> dict | None:
        """The JSON schema the worker holds the output to (required / named), else None."""
        params = {t["function"]["name"]: t["function"].get("parameters") or {"type": "object"}
                  for t in self.tools}
        if self.choice == "named":
            assert self.name is not None
            return params[self.name]
        if self.choice == "required":
            one = [{"type": "object", "properties": {"name": {"type": "string", "enum": [n]}, "parameters": p},
                    "required": ["name", "parameters"], "additionalProperties": False}
                   for n, p in params.items()]
            return {"type": "array", "minItems": 1, "items": {"anyOf": one}, **({"maxItems": 1} if self.single else {})}
        return None


def plan(body: dict, parser: str) -> ToolPlan | None:
    """The request's tool plan, or None without tools; ToolError names the bad field."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    if tools is None:
        if choice not in (None, "none"):
            raise ToolError("tool_choice", "needs tools")
        return None
    if not isinstance(tools, list) or not tools:
        raise ToolError("tools", "must be a non-empty list of {\"type\": \"function\", \"function\": {...}}")
    names = []
    for i, t in enumerate(tools):
        f = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type", "function") != "function" or not isinstance(f, dict):
            raise ToolError("tools", f"tool {i} must be {{\"type\": \"function\", \"function\": {{...}}}}")
        if not isinstance(f.get("name"), str) or not f["name"]:
            raise ToolError("tools", f"tool {i}: function.name must be a non-empty string")
        if f.get("parameters") is not None and not isinstance(f["parameters"], dict):
            raise ToolError("tools", f"tool {i}: function.parameters must be a JSON schema object")
        names.append(f["name"])
    if len(set(names)) != len(names):
        raise ToolError("tools", "function names must be unique")
    tools = [{"type": "function", "function": t["function"]} for t in tools]
    if choice is None or choice in ("none", "auto", "required"):
        return ToolPlan(tools, choice or "auto", parser=parser)
    name = choice.get("function", {}).get("name") if isinstance(choice, dict) and \
        choice.get("type") == "function" and isinstance(choice.get("function"), dict) else None
    if not isinstance(name, str):
        raise ToolError("tool_choice", "must be \"none\", \"auto\", \"required\" or "
                                       "{\"type\": \"function\", \"function\": {\"name\": NAME}}")
    if name not in names:
        raise ToolError("tool_choice", f"names function {name!r}, which is not in tools")
    return ToolPlan(tools, "named", name, parser)


def chat_messages(msgs: Any) -> list[dict]:
    """OpenAI messages -> what the chat template gets: text content, an assistant turn's
    tool_calls (arguments as objects, as templates expect), a tool turn's tool_call_id."""
    if not isinstance(msgs, list) or not msgs:
        raise ToolError("messages", "must be a non-empty list of messages")
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ToolError("messages", f"message {i} needs a role")
        extra = set(m) - {"role", "content", "name", "tool_calls", "tool_call_id"}
        if extra:
            raise ToolError("messages", f"message {i}: unsupported field(s) {', '.join(sorted(extra))}")
        content = m.get("content")
        if isinstance(content, list):       # content parts: only text is served
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise ToolError("messages", f"message {i}: only text content parts are supported")
            content = "".join(p["text"] for p in content)
        calls = m.get("tool_calls")
        if content is None and calls:
            content = ""
        if not isinstance(content, str):
            raise ToolError("messages", f"message {i}: content must be a string or text parts")
        one: dict[str, Any] = {"role": m["role"], "content": content}
        if m.get("name") is not None:
            one["name"] = m["name"]
        if m.get("tool_call_id") is not None:
            one["tool_call_id"] = m["tool_call_id"]
        if calls:
            one["tool_calls"] = [_call_in(i, c) for c in calls] if isinstance(calls, list) else \
                _raise("messages", f"message {i}: tool_calls must be a list")
        out.append(one)
    return out


def _raise(param: str, why: str):
    raise ToolError(param, why)


def _call_in(i: int, c: Any) -> dict:
    f = c.get("function") if isinstance(c, dict) else None
    if not isinstance(f, dict) or not isinstance(f.get("name"), str):
        raise ToolError("messages", f"message {i}: each tool call needs function.name")
    args = f.get("arguments", {})
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except ValueError:
            pass                      # the template gets the string as it came
    return {"id": c.get("id"), "type": "function", "function": {"name": f["name"], "arguments": args}}


def new_call(name: str, arguments: str) -> dict:
    return {"id": "call_" + uuid.uuid4().hex[:24], "type": "function",
            "function": {"name": name, "arguments": arguments}}


def _call_of(obj: Any) -> dict | None:
    """{"name", "arguments" | "parameters"} -> an OpenAI tool call, or None."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    return new_call(obj["name"], args if isinstance(args, str) else json.dumps(args, ensure_ascii=False))


def parse(text: str, p: ToolPlan) -> tuple[str | None, list[dict]]:
    """A whole output -> (content, tool calls). Text that does not parse stays content."""
    content, calls = _parse(text, p)
    return content, calls[:1] if p.single else calls


def _parse(text: str, p: ToolPlan) -> tuple[str | None, list[dict]]:
    if p.choice == "named":
        assert p.name is not None
        return None, [new_call(p.name, text)]
    if p.choice == "required":
        try:
            items = json.loads(text)
        except ValueError:
            return text, []
        calls = [c for c in map(_call_of, items if isinstance(items, list) else []) if c]
        return (None, calls) if calls else (text, [])
    if p.parser == "hermes":
        return _parse_hermes(text)
    return _parse_llama3(text)


_HERMES = re.compile(re.escape(HERMES_OPEN) + r"(.*?)(?:" + re.escape(HERMES_CLOSE) + r"|$)", re.S)


def _parse_hermes(text: str) -> tuple[str | None, list[dict]]:
    start = text.find(HERMES_OPEN)
    if start < 0:
        return text, []
    calls = []
    for m in _HERMES.finditer(text, start):
        try:
            call = _call_of(json.loads(m.group(1)))
        except ValueError:
            call = None
        if call is None:
            return text, []           # a malformed call: the text as the model wrote it
        calls.append(call)
    return (text[:start] or None), calls


def _parse_llama3(text: str) -> tuple[str | None, list[dict]]:
    body = text.strip()
    if body.startswith(PYTHON_TAG):
        body = body[len(PYTHON_TAG):].lstrip()
    if not body.startswith("{"):
        return text, []
    dec, calls, pos = json.JSONDecoder(), [], 0
    while pos < len(body):
        try:
            obj, end = dec.raw_decode(body, pos)
        except ValueError:
            return text, []
        call = _call_of(obj)
        if call is None or not ("parameters" in obj or "arguments" in obj):
            return text, []
        calls.append(call)
        pos = end
        while pos < len(body) and body[pos] in " \t\r\n;":
            pos += 1
    return None, calls


@dataclass
class ToolCallStream:
    """One choice's streamed text -> deltas: {"content": ...} or {"tool_calls": [...]}, as vLLM
    streams them (a call's first delta has its index, id, type and name, then its arguments)."""
    plan: ToolPlan
    text: str = ""                    # everything so far
    sent: int = 0                     # of text, handed out as content
    calls: list[dict] = field(default_factory=list)
    hold: bool = False                # llama3_json: the output began with a JSON object
    in_calls: bool = False            # hermes: past the first <tool_call>

    def feed(self, piece: str, last: bool = False) -> list[dict]:
        self.text += piece
        p = self.plan
        if p.choice == "named":
            out = []
            if not self.calls:
                assert p.name is not None
                self.calls.append(new_call(p.name, ""))
                out.append(_head(0, self.calls[0]))
            if piece:
                out.append({"tool_calls": [{"index": 0, "function": {"arguments": piece}}]})
            return out
        if p.choice == "required" or (p.parser == "llama3_json" and self._llama3_held()):
            return self._at_end(last)
        return self._hermes(last)

    def _llama3_held(self) -> bool:
        lead = self.text.lstrip()
        if not self.hold and lead:
            self.hold = lead.startswith("{") or lead.startswith(PYTHON_TAG) or PYTHON_TAG.startswith(lead)
        return self.hold or not lead

    def _at_end(self, last: bool) -> list[dict]:
        """A JSON output is parsed once whole."""
        if not last:
            return []
        content, calls = parse(self.text, self.plan)
        if not calls:
            return [{"content": content}] if content else []
        self.calls = calls
        return [d for i, c in enumerate(calls) for d in (_head(i, c), _args(i, c))]

    def _hermes(self, last: bool) -> list[dict]:
        """Content until the first <tool_call>; then each call once its closing tag (or the end
        of the output) arrives."""
        out: list[dict] = []
        if not self.in_calls:
            start = self.text.find(HERMES_OPEN, self.sent)
            if start < 0:
                # Hand out all but what could still become the opening tag.
                upto = len(self.text) - (0 if last else _partial_suffix(self.text, HERMES_OPEN))
                if upto > self.sent:
                    out.append({"content": self.text[self.sent:upto]})
                    self.sent = upto
                return out
            if start > self.sent:
                out.append({"content": self.text[self.sent:start]})
            self.sent, self.in_calls = start, True
        while (i := self.text.find(HERMES_OPEN, self.sent)) >= 0:
            j = self.text.find(HERMES_CLOSE, i)
            if j < 0 and not last:
                break
            end = len(self.text) if j < 0 else j + len(HERMES_CLOSE)
            try:
                call = _call_of(json.loads(self.text[i + len(HERMES_OPEN):j if j >= 0 else None]))
            except ValueError:
                call = None
            if call is None:           # a malformed call: the text as the model wrote it
                out.append({"content": self.text[self.sent:end]})
            elif self.plan.single and self.calls:
                pass                   # parallel_tool_calls false: the first call only
            else:
                out += [_head(len(self.calls), call), _args(len(self.calls), call)]
                self.calls.append(call)
            self.sent = end
        if last and self.text[self.sent:].strip():
            out.append({"content": self.text[self.sent:]})
            self.sent = len(self.text)
        return out


def _head(i: int, c: dict) -> dict:
    return {"tool_calls": [{"index": i, "id": c["id"], "type": "function",
                            "function": {"name": c["function"]["name"], "arguments": ""}}]}


def _args(i: int, c: dict) -> dict:
    return {"tool_calls": [{"index": i, "function": {"arguments": c["function"]["arguments"]}}]}


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of text that is a proper beginning of tag."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0
