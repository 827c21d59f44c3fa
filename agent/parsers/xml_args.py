"""Formats with one tag per argument and raw text values: qwen3_coder, glm4, seed_oss, minimax, deepseek_v4.

- `qwen3_coder` (Qwen3-Coder, Qwen3.5): `<tool_call>\n<function=NAME>\n<parameter=KEY>\nVALUE\n</parameter>\n
  </function>\n</tool_call>`; the newline that opens and the one that closes a value are markup.
- `glm4` (GLM-4.5/4.6; 4.7 drops the newlines): `<tool_call>NAME\n<arg_key>KEY</arg_key>\n<arg_value>VALUE
  </arg_value>\n</tool_call>`.
- `seed_oss` (ByteDance Seed-OSS): qwen3_coder's calls inside `<seed:tool_call>...</seed:tool_call>`, where one
  block may hold several `<function=NAME>...</function>`.
- `minimax` (MiniMax-M2): `<minimax:tool_call>\n<invoke name="NAME">\n<parameter name="KEY">VALUE</parameter>\n
  </invoke>\n...</minimax:tool_call>`, one or more invokes per block.
- `deepseek_v4` (DeepSeek V4's DSML; the bars are U+FF5C): `<｜DSML｜tool_calls>\n<｜DSML｜invoke name="NAME">\n
  <｜DSML｜parameter name="KEY" string="true">VALUE</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>`;
  `string="true"` marks a raw string, `string="false"` a JSON value.

Values are text, typed by the tool's schema (`ToolParser.typed_value`). A value ends at the first
closing tag that is followed by the next structural tag, so code that prints `</tool_call>` or even
`</parameter>` mid-line stays inside the value.
"""

from __future__ import annotations

import json
import re
from typing import Any

from agent.parsers.base import ParseResult, ToolCall, ToolParser, closed_after, plain_name, skip_ws, tagged_blocks


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
    """Forced call: `<tool_call>\n` (required); `<tool_call>\n<function=f>\n` (named)."""

    name = "qwen3_coder"

    def call_prefix(self, name: str | None = None) -> str | None:
        if name is None:
            return f"{self.open_tag}\n"
        return None if plain_name(name) is None else f"{self.open_tag}\n<function={name}>\n"

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
    """Forced call: `<tool_call>` (required); `<tool_call>f` (named; GLM-4.5 goes on with a newline,
    4.7 straight with `<arg_key>`, so the opening stops at the name)."""

    name = "glm4"

    def call_prefix(self, name: str | None = None) -> str | None:
        if name is None:
            return self.open_tag
        return None if plain_name(name) is None else f"{self.open_tag}{name}"

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


_ATTR = re.compile(r"""\s+([A-Za-z_][\w-]*)\s*=\s*(?:"([^"]*)"|'([^']*)'|([^\s"'>]+))""")


def _attributes(head: str) -> dict[str, str] | None:
    """The `key="value"` attributes in a tag's text between its name and `>`; None when that text
    holds anything else (quotes may be double, single or left out)."""
    attrs: dict[str, str] = {}
    i = 0
    while i < len(head):
        m = _ATTR.match(head, i)
        if m is None:
            return None if head[i:].strip() else attrs
        attrs[m.group(1)] = next(g for g in m.group(2, 3, 4) if g is not None)
        i = m.end()
    return attrs


class _InvokeBlocks(_TaggedBlocks):
    """Blocks of one or more calls `call_tag ... call_close`, each holding `param_tag ... param_close`
    arguments. The name follows `=` in the tag (`<function=NAME>`) or, with `by_attribute`, sits in a
    `name="..."` attribute. A complete call is kept when a later one of its block is broken or the
    block is cut off (each of those is an error of its own), and the scan goes on at the block's next
    call, as in a section of deepseek or kimi_k2 calls.

    Forced call: `open_tag` and a newline (required); then the call tag, `<function=f>` or
    `<invoke name="f">`, and a newline (named)."""

    call_tag = call_close = param_tag = param_close = ""
    call_form = param_form = ""  # how a well-formed tag looks, for the error messages
    by_attribute = False
    trim_newlines = True  # a newline right after a parameter's tag and one right before its close are markup

    def call_prefix(self, name: str | None = None) -> str | None:
        if name is None:
            return f"{self.open_tag}\n"
        if plain_name(name) is None:
            return None
        tag = f'{self.call_tag} name="{name}">' if self.by_attribute else f"{self.call_tag}{name}>"
        return f"{self.open_tag}\n{tag}\n"

    def _block(self, text: str, at: int, where: str, result: ParseResult) -> int:
        index, p = 0, at
        while True:
            k = skip_ws(text, p)
            if text.startswith(self.close_tag, k):
                if index == 0:
                    result.errors.append(f"{where}: no call between {self.open_tag} and {self.close_tag}")
                return k + len(self.close_tag)
            if not text.startswith(self.call_tag, k):
                if k == len(text):
                    result.errors.append(f"{where}: unclosed {self.open_tag} (no {self.close_tag} before the end "
                                         "of the reply)")
                    return k
                result.errors.append(f"{where}: expected {self.call_form} or {self.close_tag}, got {text[k:k + 40]!r}")
                return self.fail(text, k, "").resume
            try:
                call, p = self.call(text, k)
                result.calls.append(call)
            except _BlockError as e:  # here `resume` is where the problem was found
                result.errors.append(f"{where}, call {index} (char {k}): {e}")
                p = self._next_call(text, max(e.resume, k + 1))
                if p < 0:
                    return self.fail(text, max(e.resume, k + 1), "").resume
            index += 1

    def _next_call(self, text: str, at: int) -> int:
        """The next call tag at or after `at` when it comes before the block's close tag and before the
        next block; -1 otherwise."""
        nxt = text.find(self.call_tag, at)
        if nxt < 0:
            return -1
        ends = (text.find(self.close_tag, at), text.find(self.open_tag, at))
        return nxt if all(e < 0 or nxt < e for e in ends) else -1

    def tag(self, text: str, k: int, prefix: str) -> tuple[str, dict[str, str], int] | None:
        """(name, attributes, index after `>`) of the tag that starts with `prefix` at `k`; None when malformed."""
        end = text.find(">", k)
        if end < 0:
            return None
        head = text[k + len(prefix):end]
        attrs: dict[str, str] | None = {}
        if self.by_attribute:
            attrs = _attributes(head) if head[:1].isspace() else None
            name = (attrs or {}).get("name", "").strip()
        else:
            name = head.strip()
        if attrs is None or not name or "<" in name or "\n" in name:
            return None
        return name, attrs, end + 1

    def value(self, tool: str, key: str, raw: str, attrs: dict[str, str]) -> Any:
        return self.typed_value(tool, key, raw)

    def call(self, text: str, k: int) -> tuple[ToolCall, int]:
        """The call whose tag starts at `k` and the index after its close; raises _BlockError."""
        got = self.tag(text, k, self.call_tag)
        if got is None:
            raise _BlockError(f"bad call tag {text[k:k + 40]!r}; write {self.call_form}", k)
        name, _, p = got
        args: dict[str, Any] = {}
        while True:
            k = skip_ws(text, p)
            if text.startswith(self.call_close, k):
                return ToolCall(name, args), k + len(self.call_close)
            if not text.startswith(self.param_tag, k):
                what = "the reply ends" if k == len(text) else f"got {text[k:k + 40]!r}"
                raise _BlockError(f"in {name!r}: expected {self.param_form} or {self.call_close}; {what}", k)
            got = self.tag(text, k, self.param_tag)
            if got is None:
                raise _BlockError(f"in {name!r}: bad parameter tag {text[k:k + 40]!r}; write {self.param_form}", k)
            key, attrs, v = got
            end = closed_after(text, v, self.param_close, self.param_tag, self.call_close, "")
            if end < 0:
                raise _BlockError(f"in {name!r}: parameter {key!r} is not closed by {self.param_close} before "
                                  f"the next {self.param_tag} or {self.call_close}", k)
            raw = text[v:end]
            if self.trim_newlines:
                raw = raw[1:] if raw.startswith("\n") else raw
                raw = raw[:-1] if raw.endswith("\n") else raw
            args[key] = self.value(name, key, raw, attrs)
            p = end + len(self.param_close)


class SeedOssParser(_InvokeBlocks):
    """Forced call: `<seed:tool_call>\n` (required); `<seed:tool_call>\n<function=f>\n` (named)."""

    name = "seed_oss"
    open_tag, close_tag = "<seed:tool_call>", "</seed:tool_call>"
    markers = (open_tag,)
    call_tag, call_close, call_form = "<function=", "</function>", "<function=NAME>"
    param_tag, param_close, param_form = "<parameter=", "</parameter>", "<parameter=KEY>"


class MiniMaxParser(_InvokeBlocks):
    """Forced call: `<minimax:tool_call>\n` (required); `<minimax:tool_call>\n<invoke name="f">\n` (named)."""

    name = "minimax"
    open_tag, close_tag = "<minimax:tool_call>", "</minimax:tool_call>"
    markers = (open_tag,)
    call_tag, call_close, call_form = "<invoke", "</invoke>", '<invoke name="NAME">'
    param_tag, param_close, param_form = "<parameter", "</parameter>", '<parameter name="KEY">'
    by_attribute = True


class DeepSeekV4Parser(_InvokeBlocks):
    """DSML values are as written (no newline is markup); `string="false"` values are decoded as
    JSON, and one that does not decode is typed by the schema like a value without the attribute.

    Forced call: `<｜DSML｜tool_calls>\n` (required); then `<｜DSML｜invoke name="f">\n` (named)."""

    name = "deepseek_v4"
    open_tag, close_tag = "<｜DSML｜tool_calls>", "</｜DSML｜tool_calls>"
    markers = (open_tag,)
    call_tag, call_close, call_form = "<｜DSML｜invoke", "</｜DSML｜invoke>", '<｜DSML｜invoke name="NAME">'
    param_tag, param_close = "<｜DSML｜parameter", "</｜DSML｜parameter>"
    param_form = '<｜DSML｜parameter name="KEY" string="true|false">'
    by_attribute = True
    trim_newlines = False

    def value(self, tool: str, key: str, raw: str, attrs: dict[str, str]) -> Any:
        kind = attrs.get("string", "").strip().lower()
        if kind == "true":
            return raw
        if kind == "false":
            try:
                return json.loads(raw)
            except (json.JSONDecodeError, RecursionError):
                pass
        return self.typed_value(tool, key, raw)
