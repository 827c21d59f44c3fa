"""Formats that carry each call as one JSON object: hermes, llama3_json, mistral.

- `hermes` (Qwen2.5/Qwen3, Hermes, many fine-tunes): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`
  blocks anywhere in the text, several per reply.
- `llama3_json` (Llama 3.1/3.2 JSON tool calling): bare JSON objects `{"name": ..., "parameters":
  {...}}`, optionally after `<|python_tag|>`, several separated by `;`, or a JSON list of them.
- `mistral`: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]` (tokenizers before v11) or
  `[TOOL_CALLS]name[ARGS]{...}` once per call (v13+; v11 puts `[CALL_ID]id` before `[ARGS]`).
"""

from __future__ import annotations

import json
import re
from typing import Any

from agent.parsers.base import (ParseResult, ToolParser, call_from_obj, json_at, json_then, named_call, skip_ws,
                                tagged_blocks)


class HermesParser(ToolParser):
    """`<tool_call>...</tool_call>` blocks. An unclosed tag (typically a reply cut by the length
    limit) is an error rather than a guess, because executing half a call is worse than reporting it.

    Forced call: `<tool_call>\n` (required); `<tool_call>\n{"name": "f", "arguments":` (named; the
    model writes ` {...}}\n</tool_call>`), decoded under the declared tools' schemas where the
    engine constrains (`call_constraint`)."""

    name = "hermes"
    open_tag = "<tool_call>"
    close_tag = "</tool_call>"
    markers = (open_tag,)

    def call_prefix(self, name: str | None = None) -> str | None:
        if name is None:
            return f"{self.open_tag}\n"
        return f'{self.open_tag}\n{{"name": {json.dumps(name)}, "arguments":'

    def call_constraint(self, name: str | None = None) -> tuple[dict[str, Any], str] | None:
        if name is not None:  # the arguments, then the object's and the block's closing
            return self.arguments_schema(name), "}\n" + self.close_tag
        if not self.tools:
            return None
        return ({"anyOf": [{"type": "object", "properties": {"name": {"const": n}, "arguments": self.arguments_schema(n)},
                            "required": ["name", "arguments"], "additionalProperties": False} for n in self.tools]},
                "\n" + self.close_tag)

    def parse(self, text: str) -> ParseResult:
        return tagged_blocks(text, self.open_tag, self.close_tag, self._block)

    def _block(self, text: str, body_start: int, where: str, result: ParseResult) -> int:
        whole = json_then(text, body_start, (self.close_tag,))
        if whole is not None:  # a JSON value and the close tag: tags inside its strings are data
            obj, pos, _ = whole
            result.add(call_from_obj(obj, where))
            return pos
        end = text.find(self.close_tag, body_start)
        nested = text.find(self.open_tag, body_start)
        if end < 0 or 0 <= nested < end:
            result.errors.append(f"{where}: unclosed {self.open_tag} tag (no {self.close_tag} before "
                                 f"{'the end of the reply' if end < 0 else 'the next ' + self.open_tag})")
            return len(text) if end < 0 else nested
        got = json_at(text[:end], body_start)
        result.add(f"{where}: {got}" if isinstance(got, str) else
                   f"{where}: bad JSON (text after the value): {text[body_start:end].strip()[:80]!r}")
        return end + len(self.close_tag)


class Llama3JsonParser(ToolParser):
    """Bare JSON calls as Llama 3.1 emits them: `{"name": "f", "parameters": {...}}`.

    There are no tags, so intent decides strictness: a reply that starts with `<|python_tag|>`,
    `{` or `[` is meant to be calls, and JSON that does not decode there is an error; inside
    prose, only JSON objects with a "name" key count as calls and other text (including
    unbalanced braces) stays content.

    Forced call: `{"name":` (required); `{"name": "f", "parameters":` (named), as Llama 3.1's
    template writes a call.
    """

    name = "llama3_json"
    python_tag = "<|python_tag|>"
    markers = (python_tag,)
    _start = re.compile(r"[\[{]")

    def call_prefix(self, name: str | None = None) -> str | None:
        return '{"name":' if name is None else f'{{"name": {json.dumps(name)}, "parameters":'

    def call_constraint(self, name: str | None = None) -> tuple[dict[str, Any], str] | None:
        return None if name is None else (self.arguments_schema(name), "}")  # required: the name is free text

    def parse(self, text: str) -> ParseResult:
        result = ParseResult(content="")
        body = text.strip()
        strict = body.startswith((self.python_tag, "{", "["))
        body = body.replace(self.python_tag, "")
        pieces: list[str] = []
        pos, index = 0, 0
        while True:
            m = self._start.search(body, pos)
            if m is None:
                pieces.append(body[pos:])
                break
            start = m.start()
            between = body[pos:start]
            got = json_at(body, start)
            if isinstance(got, str):
                if strict and not between.strip(" \n\t;"):
                    result.errors.append(f"tool call {index} (char {start}): {got}")
                    pieces.append(between)
                    break  # without tags there is no telling where a broken call ends
                pieces.append(body[pos:start + 1])
                pos = start + 1
                continue
            value, end = got
            items = value if isinstance(value, list) else [value]
            looks_like_calls = bool(items) and all(isinstance(v, dict) and "name" in v for v in items)
            if not looks_like_calls and not (strict and not between.strip(" \n\t;")):
                pieces.append(body[pos:end])  # ordinary JSON in prose
                pos = end
                continue
            pieces.append(between if between.strip(" \n\t;") else "")  # drop bare `;` separators
            for item in items:
                result.add(call_from_obj(item, f"tool call {index} (char {start})", ("parameters", "arguments")))
                index += 1
            pos = end
        result.content = "".join(pieces).strip(" \n\t;")
        if self.python_tag in text and not result.calls and not result.errors:
            result.errors.append(f"{self.python_tag} is not followed by a JSON call "
                                 '{"name": ..., "parameters": {...}}')
        return result


class MistralParser(ToolParser):
    """`[TOOL_CALLS]` followed by a JSON list of calls (old tokenizers) or by `name[ARGS]{...}`
    (`name[CALL_ID]id[ARGS]{...}` in v11). Text before and between the calls is content.

    Forced call: `[TOOL_CALLS]` (required only: a named call is written differently by the tokenizer
    versions, a JSON list before v11 and `name[ARGS]` after, so there is no one opening to force)."""

    name = "mistral"
    marker = "[TOOL_CALLS]"
    markers = (marker,)

    def call_prefix(self, name: str | None = None) -> str | None:
        return self.marker if name is None else None

    def parse(self, text: str) -> ParseResult:
        result = ParseResult(content="")
        pieces: list[str] = []
        pos, index = 0, 0
        while True:
            start = text.find(self.marker, pos)
            if start < 0:
                pieces.append(text[pos:])
                break
            pieces.append(text[pos:start])
            at = start + len(self.marker)
            nxt = text.find(self.marker, at)
            give_up = len(text) if nxt < 0 else nxt  # where a broken call's text ends
            where = f"tool call {index} (char {start})"
            k = skip_ws(text, at)
            if text.startswith(("[", "{"), k) and not text.startswith(("[ARGS]", "[CALL_ID]"), k):
                got = json_at(text, k)
                if isinstance(got, str):
                    result.errors.append(f"{where}: {got}")
                    index, pos = index + 1, give_up
                    continue
                value, pos = got
                if value == []:
                    result.errors.append(f"{where}: an empty list of calls after {self.marker}")
                for item in value if isinstance(value, list) else [value]:
                    result.add(call_from_obj(item, f"tool call {index} (char {start})"))
                    index += 1
                continue
            index += 1
            args_at = text.find("[ARGS]", at)
            if args_at < 0 or 0 <= nxt < args_at:
                result.errors.append(f"{where}: no [ARGS] after the tool name "
                                     f"{text[at:give_up].strip()[:40]!r}; write {self.marker}name[ARGS]{{...}}")
                pos = give_up
                continue
            name = text[at:args_at].split("[CALL_ID]")[0]
            got = json_at(text, args_at + len("[ARGS]"))
            if isinstance(got, str):
                result.errors.append(f"{where}: arguments of {name.strip()!r}: {got}")
                pos = give_up
                continue
            args, pos = got
            result.add(named_call(name, args, where))
        result.content = "".join(pieces).strip()
        return result
