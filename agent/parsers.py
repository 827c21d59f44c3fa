"""Tool-call parsers: turn a model's decoded reply into text content plus tool calls.

Parsing happens on the model's text only to decide what to execute; the trajectory keeps the
model's token ids untouched (see agent/chat.py). A parser never raises on model output: during
RL, malformed calls are common and are part of what the policy learns from, so each problem
becomes an entry in `ParseResult.errors` that the loop can turn into an observation or a
penalty, while the well-formed calls of the same reply still run.

Formats:
- `hermes` (Qwen2.5, Hermes, many fine-tunes): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`
  blocks anywhere in the text, several per reply.
- `llama3_json` (Llama 3.1/3.2 JSON tool calling): bare JSON objects `{"name": ..., "parameters":
  {...}}`, optionally after `<|python_tag|>`, several separated by `;`, or a JSON list of them.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Callable


@dataclass
class ToolCall:
    """One call the model asked for; `arguments` is always a dict (decoded if it came as a string)."""

    name: str
    arguments: dict[str, Any]


@dataclass
class ParseResult:
    """`content` is the reply without its tool-call markup; `errors` explain every call that
    could not be used (the loop reports them to the model instead of failing the trajectory)."""

    content: str
    calls: list[ToolCall] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


class ToolParser:
    """Base of the parsers; `parse` must accept any string and never raise."""

    name = "base"

    def parse(self, text: str) -> ParseResult:
        raise NotImplementedError


def _call_from_obj(obj: Any, where: str, args_keys: tuple[str, ...]) -> ToolCall | str:
    """A ToolCall from a decoded JSON value, or an error message naming what is wrong.

    `arguments` may be an object or a JSON string holding an object (some models double-encode,
    as the OpenAI API does); a missing arguments field means a call without arguments.
    """
    if not isinstance(obj, dict):
        return f"{where}: expected a JSON object with \"name\" and arguments, got {type(obj).__name__}"
    name = obj.get("name")
    if not isinstance(name, str) or not name.strip():
        return f"{where}: missing or empty \"name\" (got {name!r})"
    key = next((k for k in args_keys if k in obj), None)
    args: Any = {} if key is None else obj[key]
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError as e:
            return f"{where}: \"{key}\" of {name!r} is a string that is not valid JSON ({e.msg} at char {e.pos})"
    if not isinstance(args, dict):
        return f"{where}: \"{key}\" of {name!r} must be a JSON object, got {type(args).__name__}"
    return ToolCall(name=name.strip(), arguments=args)


_DECODER = json.JSONDecoder()


def _json_then(text: str, at: int, close_tag: str) -> tuple[Any, int] | None:
    """(value, index after `close_tag`) when a JSON value starts at `at` (after whitespace) and
    only whitespace separates it from `close_tag`; else None. Decoding the JSON first is what lets
    a string argument hold the tags themselves (code that prints `</tool_call>`)."""
    i = len(text) - len(text[at:].lstrip())
    try:
        value, j = _DECODER.raw_decode(text, i)
    except (json.JSONDecodeError, RecursionError):
        return None
    k = len(text) - len(text[j:].lstrip())
    return (value, k + len(close_tag)) if text.startswith(close_tag, k) else None


class HermesParser(ToolParser):
    """`<tool_call>...</tool_call>` blocks; the tags delimit each call, so braces inside JSON
    strings never confuse it. An unclosed tag (typically a reply cut by the length limit) is
    an error rather than a guess, because executing half a call is worse than reporting it."""

    name = "hermes"
    open_tag = "<tool_call>"
    close_tag = "</tool_call>"

    def parse(self, text: str) -> ParseResult:
        result = ParseResult(content="")
        pieces: list[str] = []
        pos, index = 0, 0
        while True:
            start = text.find(self.open_tag, pos)
            if start < 0:
                pieces.append(text[pos:])
                break
            pieces.append(text[pos:start])
            body_start = start + len(self.open_tag)
            whole = _json_then(text, body_start, self.close_tag)
            if whole is not None:  # a JSON value and the close tag: tags inside its strings are data
                obj, pos = whole
                call = _call_from_obj(obj, f"tool call {index} (char {start})", ("arguments", "parameters"))
                index += 1
                (result.calls.append(call) if isinstance(call, ToolCall) else result.errors.append(call))
                continue
            end = text.find(self.close_tag, body_start)
            nested = text.find(self.open_tag, body_start)
            where = f"tool call {index} (char {start})"
            index += 1
            if end < 0 or 0 <= nested < end:
                stop = len(text) if end < 0 else nested
                result.errors.append(f"{where}: unclosed {self.open_tag} tag (no {self.close_tag} before "
                                     f"{'the end of the reply' if end < 0 else 'the next ' + self.open_tag})")
                pos = stop
                continue
            body = text[body_start:end].strip()
            pos = end + len(self.close_tag)
            try:
                obj = json.loads(body)
            except json.JSONDecodeError as e:
                result.errors.append(f"{where}: bad JSON ({e.msg} at char {e.pos}): {body[:80]!r}")
                continue
            call = _call_from_obj(obj, where, ("arguments", "parameters"))
            (result.calls.append(call) if isinstance(call, ToolCall) else result.errors.append(call))
        content = "".join(pieces)
        if self.close_tag in content:
            result.errors.append(f"stray {self.close_tag} without a matching {self.open_tag}")
            content = content.replace(self.close_tag, "")
        result.content = content.strip()
        return result


class Llama3JsonParser(ToolParser):
    """Bare JSON calls as Llama 3.1 emits them: `{"name": "f", "parameters": {...}}`.

    There are no tags, so intent decides strictness: a reply that starts with `<|python_tag|>`,
    `{` or `[` is meant to be calls, and JSON that does not decode there is an error; inside
    prose, only JSON objects with a "name" key count as calls and other text (including
    unbalanced braces) stays content.
    """

    name = "llama3_json"
    python_tag = "<|python_tag|>"
    _start = re.compile(r"[\[{]")

    def parse(self, text: str) -> ParseResult:
        result = ParseResult(content="")
        body = text.strip()
        strict = body.startswith((self.python_tag, "{", "["))
        body = body.replace(self.python_tag, "")
        decoder = json.JSONDecoder()
        pieces: list[str] = []
        pos, index = 0, 0
        while True:
            m = self._start.search(body, pos)
            if m is None:
                pieces.append(body[pos:])
                break
            start = m.start()
            between = body[pos:start]
            try:
                value, end = decoder.raw_decode(body, start)
            except json.JSONDecodeError as e:
                if strict and not between.strip(" \n\t;"):
                    result.errors.append(f"tool call {index} (char {start}): bad JSON ({e.msg} at char {e.pos}): "
                                         f"{body[start:start + 80]!r}")
                    pieces.append(between)
                    break  # without tags there is no telling where a broken call ends
                pieces.append(body[pos:start + 1])
                pos = start + 1
                continue
            items = value if isinstance(value, list) else [value]
            looks_like_calls = bool(items) and all(isinstance(v, dict) and "name" in v for v in items)
            if not looks_like_calls and not (strict and not between.strip(" \n\t;")):
                pieces.append(body[pos:end])  # ordinary JSON in prose
                pos = end
                continue
            pieces.append(between if between.strip(" \n\t;") else "")  # drop bare `;` separators
            for item in items:
                call = _call_from_obj(item, f"tool call {index} (char {start})", ("parameters", "arguments"))
                index += 1
                (result.calls.append(call) if isinstance(call, ToolCall) else result.errors.append(call))
            pos = end
        result.content = "".join(pieces).strip(" \n\t;")
        return result


_PARSERS: dict[str, Callable[[], ToolParser]] = {
    HermesParser.name: HermesParser,
    Llama3JsonParser.name: Llama3JsonParser,
}


def get_tool_parser(name: str) -> ToolParser:
    """The parser registered as `name` (the config's `tool_parser` value)."""
    try:
        return _PARSERS[name]()
    except KeyError:
        raise ValueError(f"unknown tool parser {name!r}; known parsers: {', '.join(sorted(_PARSERS))}") from None
