"""Tool-call parsers: good, multiple, malformed and truncated calls; parsing never raises."""

from __future__ import annotations

import json
import random

import pytest

from agent.parsers import ParseResult, ToolCall, get_tool_parser


def _hermes(name: str, args: object, key: str = "arguments") -> str:
    return "<tool_call>\n" + json.dumps({"name": name, key: args}) + "\n</tool_call>"


# ---------------------------------------------------------------- hermes

def test_hermes_single_call_with_text_around() -> None:
    r = get_tool_parser("hermes").parse("Let me check.\n" + _hermes("calc", {"expr": "6*7"}) + "\nDone.")
    assert r.calls == [ToolCall("calc", {"expr": "6*7"})]
    assert r.errors == []
    assert r.content == "Let me check.\n\nDone."


def test_hermes_multiple_calls_and_string_arguments() -> None:
    text = (_hermes("calc", {"expr": "1+1"}) + _hermes("search", json.dumps({"query": "x", "k": 2}))
            + "\n" + _hermes("now", {}) + "<tool_call>{\"name\": \"noargs\"}</tool_call>")
    r = get_tool_parser("hermes").parse(text)
    assert [c.name for c in r.calls] == ["calc", "search", "now", "noargs"]
    assert r.calls[1].arguments == {"query": "x", "k": 2}
    assert r.calls[3].arguments == {}
    assert r.errors == [] and r.content == ""


def test_hermes_braces_and_tags_inside_json_strings() -> None:
    args = {"code": "def f():\n    return {'a': [1, 2]} }}{{", "note": "use <b>bold</b> and \"quotes\""}
    r = get_tool_parser("hermes").parse(_hermes("python", args))
    assert r.calls == [ToolCall("python", args)] and r.errors == []


def test_hermes_the_tags_themselves_inside_argument_strings_are_data() -> None:
    """A code tool whose source prints the tags: the JSON is decoded first, so the call survives
    whole, and a second call after it still parses."""
    args = {"code": "print('</tool_call>')\nprint(\"<tool_call>{}</tool_call>\")"}
    text = "Run it. " + _hermes("python", args) + " then " + _hermes("calc", {"expr": "1+1"}) + " done"
    r = get_tool_parser("hermes").parse(text)
    assert r.calls == [ToolCall("python", args), ToolCall("calc", {"expr": "1+1"})] and r.errors == []
    assert r.content == "Run it.  then  done"


def test_hermes_malformed_calls_become_errors_and_good_ones_survive() -> None:
    text = ("a <tool_call>{\"name\": \"calc\", \"arguments\": {\"expr\": }</tool_call>"   # bad JSON
            " b " + _hermes("", {"x": 1})                                               # empty name
            + "<tool_call>{\"arguments\": {}}</tool_call>"                              # missing name
            + _hermes("calc", [1, 2])                                                   # arguments a list
            + _hermes("calc", "{not json")                                              # arguments a bad string
            + "<tool_call>[1, 2]</tool_call>"                                           # not an object
            + _hermes("good", {"k": "v"}) + " c")
    r = get_tool_parser("hermes").parse(text)
    assert r.calls == [ToolCall("good", {"k": "v"})]
    assert len(r.errors) == 6
    assert "bad JSON" in r.errors[0] and "tool call 0" in r.errors[0]
    assert "name" in r.errors[1] and "name" in r.errors[2]
    assert "must be a JSON object, got list" in r.errors[3]
    assert "not valid JSON" in r.errors[4]
    assert "expected a JSON object" in r.errors[5]
    assert r.content == "a  b  c"


def test_hermes_unclosed_tag_is_an_error_not_a_call() -> None:
    r = get_tool_parser("hermes").parse("Thinking. " + _hermes("a", {}) + "<tool_call>\n{\"name\": \"calc\", \"argu")
    assert [c.name for c in r.calls] == ["a"]
    assert len(r.errors) == 1 and "unclosed <tool_call>" in r.errors[0] and "end of the reply" in r.errors[0]
    assert r.content == "Thinking."
    # an opening tag followed by another call: the first is unclosed, the second still parses
    r = get_tool_parser("hermes").parse("<tool_call>{\"name\": \"x\"" + _hermes("b", {"y": 1}))
    assert r.calls == [ToolCall("b", {"y": 1})] and "before the next <tool_call>" in r.errors[0]


def test_hermes_stray_closing_tag_and_plain_text() -> None:
    r = get_tool_parser("hermes").parse("just text </tool_call>")
    assert r.calls == [] and r.content == "just text" and "stray </tool_call>" in r.errors[0]
    assert get_tool_parser("hermes").parse("The answer is 42.") == ParseResult("The answer is 42.", [], [])


# ---------------------------------------------------------------- llama3_json

def test_llama3_single_multiple_and_python_tag() -> None:
    p = get_tool_parser("llama3_json")
    r = p.parse('{"name": "calc", "parameters": {"expr": "6*7"}}')
    assert r.calls == [ToolCall("calc", {"expr": "6*7"})] and r.errors == [] and r.content == ""
    r = p.parse('<|python_tag|>{"name": "a", "parameters": {}}; {"name": "b", "parameters": {"s": "};{"}}')
    assert [c.name for c in r.calls] == ["a", "b"] and r.calls[1].arguments == {"s": "};{"} and r.content == ""
    r = p.parse('[{"name": "a", "arguments": "{\\"x\\": 1}"}, {"name": "b", "parameters": {}}]')
    assert r.calls == [ToolCall("a", {"x": 1}), ToolCall("b", {})] and r.errors == []


def test_llama3_text_around_calls_and_ordinary_json_in_prose() -> None:
    p = get_tool_parser("llama3_json")
    r = p.parse('I will search. {"name": "search", "parameters": {"query": "{x}"}} Then answer.')
    assert r.calls == [ToolCall("search", {"query": "{x}"})]
    assert r.content == "I will search.  Then answer."
    r = p.parse('The config is {"a": 1} and a set {1, 2}.')
    assert r.calls == [] and r.errors == [] and r.content == 'The config is {"a": 1} and a set {1, 2}.'


def test_llama3_malformed_calls() -> None:
    p = get_tool_parser("llama3_json")
    r = p.parse('{"name": "calc", "parameters": {"expr": "6*7"')   # cut off
    assert r.calls == [] and len(r.errors) == 1 and "bad JSON" in r.errors[0]
    r = p.parse('{"parameters": {}}')
    assert r.calls == [] and "missing or empty \"name\"" in r.errors[0]
    r = p.parse('{"name": "calc", "parameters": [1]}; {"name": "ok", "parameters": {}}')
    assert r.calls == [ToolCall("ok", {})] and "must be a JSON object, got list" in r.errors[0]
    r = p.parse('[{"name": "ok"}, 3]')
    assert r.calls == [ToolCall("ok", {})] and "got int" in r.errors[0]


# ---------------------------------------------------------------- registry and robustness

def test_unknown_parser_lists_known_ones() -> None:
    with pytest.raises(ValueError, match="known parsers: deepseek, .*hermes, .*llama3_json"):
        get_tool_parser("nope")


@pytest.mark.parametrize("name", ["hermes", "llama3_json"])
def test_parsers_never_raise_on_garbage(name: str) -> None:
    parser = get_tool_parser(name)
    alphabet = ['{', '}', '[', ']', '"', ':', ',', ';', 'name', 'arguments', 'parameters', '<tool_call>',
                '</tool_call>', '<|python_tag|>', '\\', '1', 'x', ' ', '\n', 'null', 'é']
    rng = random.Random(0)
    for _ in range(2000):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 40)))
        r = parser.parse(text)
        assert isinstance(r, ParseResult)
        assert all(isinstance(c.name, str) and isinstance(c.arguments, dict) for c in r.calls)
