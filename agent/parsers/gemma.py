"""Gemma's call syntax: `gemma` (Gemma 4) and `functiongemma`.

Gemma 4: `<|tool_call>call:NAME{key:<|"|>text<|"|>,n:3,ok:true,xs:[1,2],o:{k:<|"|>v<|"|>}}<tool_call|>`.
FunctionGemma writes the same syntax between `<start_function_call>` and `<end_function_call>`, with
`<escape>` as the quote. Keys are bare; strings sit between two quote tokens (which never occur
inside them, so any markup in a string is data); numbers, true, false and null are bare; a bare word
that is none of those is kept as a string.
"""

from __future__ import annotations

import json
from typing import Any

from agent.parsers.base import ParseResult, ToolCall, ToolParser, plain_name, tagged_blocks

_MAX_DEPTH = 64


class _Syntax(Exception):
    pass


class _Reader:
    """Recursive descent over one call's argument object."""

    def __init__(self, text: str, at: int, quote: str) -> None:
        self.text, self.i, self.quote = text, at, quote

    def ws(self) -> None:
        while self.i < len(self.text) and self.text[self.i].isspace():
            self.i += 1

    def expect(self, ch: str) -> None:
        self.ws()
        if not self.text.startswith(ch, self.i):
            got = self.text[self.i:self.i + 20] if self.i < len(self.text) else "the end of the reply"
            raise _Syntax(f"expected {ch!r} at char {self.i}, got {got!r}")
        self.i += len(ch)

    def value(self, depth: int) -> Any:
        if depth > _MAX_DEPTH:
            raise _Syntax(f"arguments nested deeper than {_MAX_DEPTH}")
        self.ws()
        t = self.text
        if t.startswith(self.quote, self.i):
            end = t.find(self.quote, self.i + len(self.quote))
            if end < 0:
                raise _Syntax(f"string at char {self.i} is not closed by {self.quote}")
            s, self.i = t[self.i + len(self.quote):end], end + len(self.quote)
            return s
        if t.startswith("{", self.i):
            return self.obj(depth + 1)
        if t.startswith("[", self.i):
            return self.arr(depth + 1)
        start = self.i
        while self.i < len(t) and t[self.i] not in ",}]" and not t.startswith(self.quote, self.i) \
                and not t.startswith("<", self.i):
            self.i += 1
        word = t[start:self.i].strip()
        if not word:
            raise _Syntax(f"missing value at char {start}")
        try:
            return json.loads(word)
        except (json.JSONDecodeError, RecursionError):
            return word

    def obj(self, depth: int) -> dict[str, Any]:
        self.expect("{")
        out: dict[str, Any] = {}
        self.ws()
        if self.text.startswith("}", self.i):
            self.i += 1
            return out
        while True:
            self.ws()
            if self.text.startswith(self.quote, self.i):
                key = self.value(depth)
            else:
                colon = self.text.find(":", self.i)
                if colon < 0:
                    raise _Syntax(f"key at char {self.i} has no ':'")
                key = self.text[self.i:colon].strip()
                if not key or any(c in key for c in "{}[],<"):
                    raise _Syntax(f"bad key {self.text[self.i:colon][:30]!r} at char {self.i}")
                self.i = colon
            self.expect(":")
            out[str(key)] = self.value(depth)
            self.ws()
            if self.text.startswith(",", self.i):
                self.i += 1
                continue
            self.expect("}")
            return out

    def arr(self, depth: int) -> list[Any]:
        self.expect("[")
        out: list[Any] = []
        self.ws()
        if self.text.startswith("]", self.i):
            self.i += 1
            return out
        while True:
            out.append(self.value(depth))
            self.ws()
            if self.text.startswith(",", self.i):
                self.i += 1
                continue
            self.expect("]")
            return out


class GemmaParser(ToolParser):
    """Forced call: `<|tool_call>call` (required; the model writes `:NAME{...}`, since a
    pre-tokenizer may join the `:` to the name); `<|tool_call>call:f` (named; the model writes
    `{...}<tool_call|>`). FunctionGemma's are the same after `<start_function_call>`."""

    name = "gemma"
    open_tag, close_tag, quote = "<|tool_call>", "<tool_call|>", '<|"|>'
    markers = (open_tag,)

    def call_prefix(self, name: str | None = None) -> str | None:
        if name is None:
            return f"{self.open_tag}call"
        return None if plain_name(name) is None else f"{self.open_tag}call:{name}"

    def parse(self, text: str) -> ParseResult:
        return tagged_blocks(text, self.open_tag, self.close_tag, self._block)

    def _block(self, text: str, at: int, where: str, result: ParseResult) -> int:
        try:
            call, pos = self._call(text, at)
        except _Syntax as e:
            result.errors.append(f"{where}: {e}")
            end = text.find(self.close_tag, at)
            return len(text) if end < 0 else end + len(self.close_tag)
        result.calls.append(call)
        return pos

    def _call(self, text: str, at: int) -> tuple[ToolCall, int]:
        reader = _Reader(text, at, self.quote)
        reader.ws()
        if text.startswith("call:", reader.i):
            reader.i += len("call:")
        brace = text.find("{", reader.i)
        name = text[reader.i:brace].strip() if brace >= 0 else ""
        if not name or any(c.isspace() or c in "<>{}" for c in name):
            raise _Syntax(f"expected call:NAME{{...}}, got {text[at:at + 40]!r}")
        reader.i = brace
        args = reader.obj(1)
        reader.expect(self.close_tag)
        return ToolCall(name, args), reader.i


class FunctionGemmaParser(GemmaParser):
    name = "functiongemma"
    open_tag, close_tag, quote = "<start_function_call>", "<end_function_call>", "<escape>"
    markers = (open_tag,)
