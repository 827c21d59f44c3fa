"""Formats with one tag per argument and raw text values: qwen3_coder, glm4.

- `qwen3_coder` (Qwen3-Coder, Qwen3.5): `<tool_call>\n<function=NAME>\n<parameter=KEY>\nVALUE\n</parameter>\n
  </function>\n</tool_call>`; the newline that opens and the one that closes a value are markup.
- `glm4` (GLM-4.5/4.6; 4.7 drops the newlines): `<tool_call>NAME\n<arg_key>KEY</arg_key>\n<arg_value>VALUE
  </arg_value>\n</tool_call>`.

Values are text, typed by the tool's schema (`ToolParser.typed_value`). A value ends at the first
closing tag that is followed by the next structural tag, so code that prints `</tool_call>` or even
`</parameter>` mid-line stays inside the value.
"""

from __future__ import annotations

from typing import Any

from agent.parsers.base import ParseResult, ToolCall, ToolParser, closed_after, skip_ws, tagged_blocks


class _BlockError(Exception):
    """A malformed call; carries the message and where to resume."""

    def __init__(self, message: str, resume: int) -> None:
        super().__init__(message)
        self.resume = resume


class _TaggedBlocks(ToolParser):
    open_tag = "<tool_call>"
    close_tag = "</tool_call>"
    markers = (open_tag,)

    def block(self, text: str, at: int) -> tuple[ToolCall, int]:
        """The call whose block body starts at `at` and the index after its close tag; raises _BlockError."""
        raise NotImplementedError

    def parse(self, text: str) -> ParseResult:
        return tagged_blocks(text, self.open_tag, self.close_tag, self._block)

    def _block(self, text: str, at: int, where: str, result: ParseResult) -> int:
        try:
            call, pos = self.block(text, at)
        except _BlockError as e:
            result.errors.append(f"{where}: {e}")
            return e.resume
        result.calls.append(call)
        return pos

    def fail(self, text: str, at: int, message: str) -> _BlockError:
        """An error that resumes after the next close tag, at the next open tag if that comes first,
        or at the end of the reply."""
        end = text.find(self.close_tag, at)
        nxt = text.find(self.open_tag, at)
        if nxt >= 0 and (end < 0 or nxt < end):
            return _BlockError(message, nxt)
        return _BlockError(message, len(text) if end < 0 else end + len(self.close_tag))

    def close(self, text: str, at: int, after: str) -> int:
        k = skip_ws(text, at)
        if not text.startswith(self.close_tag, k):
            raise self.fail(text, k, f"no {self.close_tag} after {after}"
                            + (" (the reply ends there)" if k == len(text) else f", got {text[k:k + 40]!r}"))
        return k + len(self.close_tag)


class Qwen3CoderParser(_TaggedBlocks):
    name = "qwen3_coder"

    def block(self, text: str, at: int) -> tuple[ToolCall, int]:
        k = skip_ws(text, at)
        if not text.startswith("<function=", k):
            raise self.fail(text, k, f"expected <function=NAME> after {self.open_tag}, got {text[k:k + 40]!r}")
        name_end = text.find(">", k)
        name = text[k + len("<function="):name_end].strip() if name_end >= 0 else ""
        if not name or "<" in name or "\n" in name:
            raise self.fail(text, k, f"bad function tag {text[k:k + 40]!r}; write <function=NAME>")
        args: dict[str, Any] = {}
        p = name_end + 1
        while True:
            k = skip_ws(text, p)
            if text.startswith("</function>", k):
                return ToolCall(name, args), self.close(text, k + len("</function>"), "</function>")
            if not text.startswith("<parameter=", k):
                what = "the reply ends" if k == len(text) else f"got {text[k:k + 40]!r}"
                raise self.fail(text, k, f"in {name!r}: expected <parameter=KEY> or </function>; {what}")
            key_end = text.find(">", k)
            key = text[k + len("<parameter="):key_end].strip() if key_end >= 0 else ""
            if not key or "<" in key or "\n" in key:
                raise self.fail(text, k, f"in {name!r}: bad parameter tag {text[k:k + 40]!r}; write <parameter=KEY>")
            end = closed_after(text, key_end + 1, "</parameter>", "<parameter=", "</function>")
            if end < 0:
                raise self.fail(text, k, f"in {name!r}: parameter {key!r} is not closed by </parameter> "
                                         "before the next <parameter= or </function>")
            raw = text[key_end + 1:end]
            raw = raw[1:] if raw.startswith("\n") else raw
            raw = raw[:-1] if raw.endswith("\n") else raw
            args[key] = self.typed_value(name, key, raw)
            p = end + len("</parameter>")


class Glm4Parser(_TaggedBlocks):
    name = "glm4"

    def block(self, text: str, at: int) -> tuple[ToolCall, int]:
        stops = [i for i in (text.find("<arg_key>", at), text.find(self.close_tag, at), text.find("\n", at)) if i >= 0]
        name_end = min(stops) if stops else len(text)
        name = text[at:name_end].strip()
        if not name or "<" in name:
            raise self.fail(text, at, f"expected the tool name after {self.open_tag}, got {text[at:at + 40]!r}")
        args: dict[str, Any] = {}
        p = name_end
        while True:
            k = skip_ws(text, p)
            if text.startswith(self.close_tag, k):
                return ToolCall(name, args), k + len(self.close_tag)
            if not text.startswith("<arg_key>", k):
                what = "the reply ends" if k == len(text) else f"got {text[k:k + 40]!r}"
                raise self.fail(text, k, f"in {name!r}: expected <arg_key> or {self.close_tag}; {what}")
            key_end = text.find("</arg_key>", k)
            key = text[k + len("<arg_key>"):key_end].strip() if key_end >= 0 else ""
            if not key or "<" in key:
                raise self.fail(text, k, f"in {name!r}: bad <arg_key> {text[k:k + 40]!r}; write <arg_key>KEY</arg_key>")
            v = skip_ws(text, key_end + len("</arg_key>"))
            if not text.startswith("<arg_value>", v):
                raise self.fail(text, v, f"in {name!r}: <arg_key>{key}</arg_key> is not followed by <arg_value>")
            end = closed_after(text, v + len("<arg_value>"), "</arg_value>", "<arg_key>", self.close_tag)
            if end < 0:
                raise self.fail(text, v, f"in {name!r}: the value of {key!r} is not closed by </arg_value> "
                                         f"before the next <arg_key> or {self.close_tag}")
            args[key] = self.typed_value(name, key, text[v + len("<arg_value>"):end])
            p = end + len("</arg_value>")
