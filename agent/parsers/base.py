"""What every tool-call parser shares: the result types, the base class and small helpers.

Parsing happens on the model's text only to decide what to execute; the trajectory keeps the
model's token ids untouched (see agent/chat.py). A parser never raises on model output: during
RL, malformed calls are common and are part of what the policy learns from, so each problem
becomes an entry in `ParseResult.errors` that the loop turns into an observation or a penalty,
while the well-formed calls of the same reply still run. The text a parser sees is decoded with
special tokens kept (the markers of most formats are special tokens).

Markup inside argument values is data: where a format carries JSON, the JSON is decoded first and
only then is the closing marker looked for, so a code argument that prints `</tool_call>` does not
end the call. Where a format carries raw text values (qwen3_coder, glm4), a value ends only at a
closing tag that is followed by the next structural tag.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping


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

    def add(self, call: "ToolCall | str") -> None:
        """Keep a call, or an error message in its place."""
        (self.calls.append(call) if isinstance(call, ToolCall) else self.errors.append(call))


class ToolParser:
    """Base of the parsers; `parse` must accept any string and never raise.

    `tools` maps each tool's name to its JSON-schema `parameters` (the `function.parameters` of
    its OpenAI schema). Formats whose argument values are raw text use it to give each value its
    declared type; the JSON formats ignore it. Subclass this and name the class by dotted path in
    `tool_parser` to add a format without touching switchyard.
    """

    name = "base"
    markers: tuple[str, ...] = ()  # strings that announce a call in this format (the fuzz test reads them)

    def __init__(self, tools: Mapping[str, Mapping[str, Any]] | None = None) -> None:
        self.tools: dict[str, Mapping[str, Any]] = dict(tools or {})

    def parse(self, text: str) -> ParseResult:
        raise NotImplementedError

    def call_prefix(self, name: str | None = None) -> str | None:
        """The text that opens a call in this format, for forcing one (`tool_choice` required: `name`
        None; a named function: its name): the gateway appends it to the prompt as template tokens,
        the model's generation continues inside the call, and `parse(prefix + generation)` reads it.
        None when the format has no well-defined opening (the gateway then answers a 400); that is the
        default, so a format of the user's own forces nothing until it says how.

        A prefix ends where a tokenizer's pre-tokenization splits anyway (after a special marker, a
        newline, a `:` or a name; never after a space or before a name), so its tokens, encoded on
        their own, are the ones the model would have produced writing the same call."""
        return None

    def call_constraint(self, name: str | None = None) -> tuple[dict[str, Any], str] | None:
        """What the generation after `call_prefix(name)` must be, for a forced call decoded under a
        constraint: (a JSON schema of the value that comes next, the text that closes the call
        after it). The engine then writes exactly one well-formed call to a declared tool, with
        arguments that match its `parameters`, and ends the turn. None (the default): the
        generation after the opening is free, as the model writes it."""
        return None

    def arguments_schema(self, tool: str) -> dict[str, Any]:
        """`tool`'s declared `parameters` as a schema of an object (an empty or missing one: any object)."""
        params = dict(self.tools.get(tool) or {})
        params.setdefault("type", "object")
        return params

    def param_type(self, tool: str, param: str) -> Any:
        """The JSON-schema `type` declared for `param` of `tool`, or None when unknown."""
        props = (self.tools.get(tool) or {}).get("properties") or {}
        spec = props.get(param) if isinstance(props, Mapping) else None
        return spec.get("type") if isinstance(spec, Mapping) else None

    def typed_value(self, tool: str, param: str, raw: str) -> Any:
        """A raw text argument as its declared type. Strings stay as written; other declared types
        are decoded as JSON (Python's True/False/None spellings are accepted too); a value that does
        not decode stays a string, so the tool's own validation reports it to the model. Without a
        declared type, only JSON objects and arrays are decoded."""
        kind = self.param_type(tool, param)
        kinds = set(kind) if isinstance(kind, list) else {kind}
        if "string" in kinds and not kinds & {"object", "array", "integer", "number", "boolean", "null"}:
            return raw
        text = raw.strip()
        if kind is None and not text.startswith(("{", "[")):
            return raw
        try:
            return json.loads(text)
        except (json.JSONDecodeError, RecursionError):
            pass
        python = {"True": True, "False": False, "None": None}
        return python[text] if text in python else raw


_PLAIN_NAME = re.compile(r"[\w.\-]+")


def plain_name(name: str) -> str | None:
    """`name` when a tag or marker format can write it as is (letters, digits, `_`, `.`, `-`); None
    otherwise (quotes, brackets or spaces would end the tag early)."""
    return name if _PLAIN_NAME.fullmatch(name) else None


def call_from_obj(obj: Any, where: str, args_keys: tuple[str, ...] = ("arguments", "parameters")) -> ToolCall | str:
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
    args = {} if key is None else obj[key]
    return named_call(name, args, where, key or "arguments")


def named_call(name: str, args: Any, where: str, key: str = "arguments") -> ToolCall | str:
    """A ToolCall from a name and arguments (a dict, or a JSON string holding one), or an error."""
    if not isinstance(name, str) or not name.strip():
        return f"{where}: missing or empty tool name (got {name!r})"
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except (json.JSONDecodeError, RecursionError) as e:
            msg = f"{e.msg}: char {e.pos}" if isinstance(e, json.JSONDecodeError) else "nested too deeply"
            return f"{where}: {key} of {name.strip()!r} is a string that is not valid JSON ({msg})"
    if not isinstance(args, dict):
        return f"{where}: {key} of {name.strip()!r} must be a JSON object, got {type(args).__name__}"
    return ToolCall(name=name.strip(), arguments=args)


_DECODER = json.JSONDecoder()


_WS = re.compile(r"\s*")


def skip_ws(text: str, at: int) -> int:
    """The index of the first non-whitespace character at or after `at`."""
    return _WS.match(text, at).end()


def json_at(text: str, at: int) -> tuple[Any, int] | str:
    """(value, end) for a JSON value starting at `at` (after whitespace), or the decode error."""
    try:
        return _DECODER.raw_decode(text, skip_ws(text, at))
    except json.JSONDecodeError as e:
        return f"bad JSON ({e.msg}: char {e.pos}): {text[at:at + 80].strip()!r}"
    except RecursionError:
        return "bad JSON (nested too deeply)"


def json_then(text: str, at: int, closers: tuple[str, ...], end_ok: bool = False) -> tuple[Any, int, str] | None:
    """(value, index after the closer, closer) when a JSON value starts at `at` and only whitespace
    separates it from one of `closers` (or from the end of the text, with `end_ok`; the closer is
    then ""). Decoding the JSON first is what lets a string argument hold the markers themselves."""
    got = json_at(text, at)
    if isinstance(got, str):
        return None
    value, j = got
    k = skip_ws(text, j)
    for closer in closers:
        if text.startswith(closer, k):
            return value, k + len(closer), closer
    return (value, len(text), "") if end_ok and k == len(text) else None


def tagged_blocks(text: str, open_tag: str, close_tag: str,
                  block: "Callable[[str, int, str, ParseResult], int]") -> ParseResult:
    """The skeleton of the formats whose calls sit between an open and a close tag. Text outside
    the blocks is the content (a stray close tag there is an error, and dropped); `block(text, at,
    where, result)` reads the call whose body starts at `at`, adds it or an error (prefixed with
    `where`) to `result`, and returns where the scan goes on."""
    result = ParseResult(content="")
    pieces: list[str] = []
    pos, index = 0, 0
    while True:
        start = text.find(open_tag, pos)
        if start < 0:
            pieces.append(text[pos:])
            break
        pieces.append(text[pos:start])
        pos = max(block(text, start + len(open_tag), f"tool call {index} (char {start})", result), start + 1)
        index += 1
    content = "".join(pieces)
    if close_tag in content:
        result.errors.append(f"stray {close_tag} without a matching {open_tag}")
        content = content.replace(close_tag, "")
    result.content = content.strip()
    return result


def closed_after(text: str, at: int, closer: str, *followers: str) -> int:
    """The index of the first `closer` at or after `at` that is followed, after whitespace, by one
    of `followers` (or by the end of the text when "" is among them); -1 when there is none. This
    is how raw-text values end: a closing tag inside a value is not followed by structure."""
    i = text.find(closer, at)
    while i >= 0:
        k = skip_ws(text, i + len(closer))
        if any(text.startswith(f, k) if f else k == len(text) for f in followers):
            return i
        i = text.find(closer, i + 1)
    return -1
