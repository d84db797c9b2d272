"""router/tools.py without a server: tool plans (tool_choice none / auto / required / named, bad
input naming the field), the Hermes and Llama-3 JSON formats parsed whole and streamed, and the
structured-output schema that required and named tool choices hold the output to."""
from __future__ import annotations

import json

import jsonschema
import pytest

from pagoda.router import tools as T

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                            "parameters": {"type": "object",
                                                           "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}
HERMES = ('Let me look. <tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>\n'
          '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>')
LLAMA3 = '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "get_time", "parameters": {}}'


def plan(parser="hermes", **body):
    p = T.plan({"tools": [WEATHER, TIME], **body}, parser)
    assert p is not None
    return p


def streamed(p: T.ToolPlan, text: str, step: int) -> tuple[str, list[dict]]:
    """Feed text in pieces of `step` characters; -> (content, calls) put back together from the
    deltas as an OpenAI client does."""
    s, deltas = T.ToolCallStream(p), []
    for k in range(0, len(text), step):
        deltas += s.feed(text[k:k + step])
    deltas += s.feed("", last=True)
    content, calls = "", {}
    for d in deltas:
        content += d.get("content", "")
        for c in d.get("tool_calls", []):
            one = calls.setdefault(c["index"], {"id": None, "name": "", "arguments": ""})
            if "id" in c:
                assert one["id"] is None, "a call's header comes once"
                one["id"], one["name"] = c["id"], c["function"]["name"]
            one["arguments"] += c["function"]["arguments"]
    return content, [calls[i] for i in sorted(calls)]


def names_args(calls):
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


def test_hermes_whole_and_streamed_in_any_piece_size():
    p = plan()
    content, calls = T.parse(HERMES, p)
    assert content == "Let me look. "
    assert names_args(calls) == [("get_weather", {"city": "Paris"}), ("get_time", {})]
    assert all(c["id"].startswith("call_") and c["type"] == "function" for c in calls)
    for step in (1, 2, 5, 11, len(HERMES)):
        s_content, s_calls = streamed(p, HERMES, step)
        assert s_content == content, step
        assert [(c["name"], json.loads(c["arguments"])) for c in s_calls] == names_args(calls)


def test_hermes_text_without_a_call_streams_as_content_and_holds_back_only_a_partial_tag():
    p = plan()
    s = T.ToolCallStream(p)
    assert s.feed("The answer is <tool") == [{"content": "The answer is "}]      # "<tool" may be a tag
    assert s.feed("s> here", last=True) == [{"content": "<tools> here"}]
    assert T.parse("plain text", p) == ("plain text", [])


def test_malformed_hermes_call_stays_content():
    p = plan()
    bad = 'x <tool_call>{"name": "get_weather", "arguments": {"city": </tool_call>'
    assert T.parse(bad, p) == (bad, [])
    assert streamed(p, bad, 3) == (bad, [])
    # Cut off at the end of the output (no closing tag) but whole JSON: still a call.
    assert names_args(T.parse('<tool_call>{"name": "get_time", "arguments": {}}', p)[1]) == [("get_time", {})]


def test_llama3_json_whole_and_streamed():
    p = plan("llama3_json")
    content, calls = T.parse(LLAMA3, p)
    assert content is None and names_args(calls) == [("get_weather", {"city": "Paris"}), ("get_time", {})]
    for step in (1, 4, len(LLAMA3)):
        s_content, s_calls = streamed(p, LLAMA3, step)
        assert s_content == "" and [c["name"] for c in s_calls] == ["get_weather", "get_time"]
    # Text that is not a call streams at once as content.
    assert streamed(p, "Hello there", 2) == ("Hello there", [])
    assert T.parse('{"not": "a call"}', p) == ('{"not": "a call"}', [])


def test_parallel_tool_calls_false_keeps_the_first():
    """What a plan with `single` set does (the router's OpenAI front sets it from the request's
    parallel_tool_calls: false; tests/test_openai_tools.py checks that end to end)."""
    p = plan()
    p.single = True
    required = plan(tool_choice="required")
    required.single = True
    schema = required.schema()
    assert schema is not None and schema["maxItems"] == 1
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "get_time", "parameters": {}}] * 2, schema)
    assert [c["function"]["name"] for c in T.parse(HERMES, p)[1]] == ["get_weather"]
    assert [c["name"] for c in streamed(p, HERMES, 3)[1]] == ["get_weather"]


def test_named_choice_schema_is_the_functions_parameters_and_the_output_its_arguments():
    p = plan(tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert p.choice == "named" and p.schema() == WEATHER["function"]["parameters"]
    content, calls = T.parse('{"city": "Rome"}', p)
    assert content is None and names_args(calls) == [("get_weather", {"city": "Rome"})]
    s_content, s_calls = streamed(p, '{"city": "Rome"}', 3)
    assert s_content == "" and s_calls[0]["name"] == "get_weather" and s_calls[0]["arguments"] == '{"city": "Rome"}'


def test_required_schema_admits_each_tool_with_its_parameters_and_nothing_else():
    p = plan(tool_choice="required")
    schema = p.schema()
    assert schema is not None
    good = [{"name": "get_weather", "parameters": {"city": "Oslo"}}, {"name": "get_time", "parameters": {}}]
    jsonschema.validate(good, schema)
    for bad in ([], [{"name": "get_weather", "parameters": {}}], [{"name": "nope", "parameters": {}}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    assert names_args(T.parse(json.dumps(good), p)[1]) == [("get_weather", {"city": "Oslo"}), ("get_time", {})]
    s_content, s_calls = streamed(p, json.dumps(good), 7)
    assert s_content == "" and [(c["name"], json.loads(c["arguments"])) for c in s_calls] == \
        [("get_weather", {"city": "Oslo"}), ("get_time", {})]


def test_tool_choice_none_and_no_tools():
    assert T.plan({}, "hermes") is None
    p = plan(tool_choice="none")
    assert not p.parses and p.schema() is None
    assert plan().choice == "auto"


@pytest.mark.parametrize("body, param", [
    ({"tools": []}, "tools"),
    ({"tools": [{"type": "function"}]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": ""}}]}, "tools"),
    ({"tools": [WEATHER, WEATHER]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}]}, "tools"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": "always"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_time"}}}, "tool_choice"),
])
def test_bad_tools_name_the_field(body, param):
    with pytest.raises(T.ToolError) as e:
        T.plan(body, "hermes")
    assert e.value.param == param and str(e.value).startswith(param + ":")


def test_messages_with_tool_calls_and_results_reach_the_template_as_objects():
    msgs = T.chat_messages([
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}])
    assert msgs[1] == {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]}
    assert msgs[2] == {"role": "tool", "content": "sunny", "tool_call_id": "call_1"}
    with pytest.raises(T.ToolError, match="messages: message 0: unsupported field"):
        T.chat_messages([{"role": "user", "content": "x", "audio": {}}])
