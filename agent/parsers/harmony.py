"""gpt-oss's harmony format (`gpt-oss`).

A reply is a run of messages, each `[<|start|>assistant]<|channel|>CHANNEL[ to=RECIPIENT][ <|constrain|>json]
<|message|>BODY` ended by `<|end|>`, `<|call|>` or `<|return|>` (the stop token may be cut off by the
engine, so the end of the text ends the last message too). A message with a recipient
(`to=functions.NAME`, also written in the header before `<|channel|>`) is a call whose body is the
JSON arguments; `analysis` is reasoning and not content; the `final` channel is the answer. Without
a final message, the text of the other messages without a recipient is the content.
"""

from __future__ import annotations

import re

from agent.parsers.base import ParseResult, ToolParser, json_then, named_call, plain_name

_ENDS = ("<|end|>", "<|call|>", "<|return|>")
_MARKUP = ("<|start|>", "<|channel|>", "<|message|>", "<|constrain|>") + _ENDS
_RECIPIENT = re.compile(r"\bto=([^\s<]*)")
_CHANNEL = re.compile(r"<\|channel\|>\s*([^\s<]*)")


def _first(text: str, at: int, marks: tuple[str, ...]) -> tuple[int, str]:
    """(index, mark) of the earliest of `marks` at or after `at`; (len(text), "") when none."""
    best = (len(text), "")
    for m in marks:
        i = text.find(m, at, best[0])
        if i >= 0:
            best = (i, m)
    return best


class HarmonyParser(ToolParser):
    """Forced call: `<|channel|>commentary to=functions` (required; the model writes `.NAME
    <|constrain|>json<|message|>{...}<|call|>`: o200k's pre-tokenizer starts a word with the `.`
    before it, so the opening stops before the dot); `<|channel|>commentary to=functions.f
    <|constrain|>json<|message|>` (named). Both skip the analysis channel, as a forced call does."""

    name = "gpt-oss"
    markers = ("<|call|>",)

    def call_prefix(self, name: str | None = None) -> str | None:
        if name is None:
            return "<|channel|>commentary to=functions"
        if plain_name(name) is None:
            return None
        return f"<|channel|>commentary to=functions.{name} <|constrain|>json<|message|>"

    def parse(self, text: str) -> ParseResult:
        result = ParseResult(content="")
        if not any(m in text for m in _MARKUP):
            result.content = text.strip()
            return result
        finals: list[str] = []
        others: list[str] = []
        pos, index = 0, 0
        while pos < len(text):
            header_end = text.find("<|message|>", pos)
            if header_end < 0:
                rest = text[pos:]
                if any(m in rest for m in _MARKUP):
                    result.errors.append(f"harmony markup without a message after char {pos}: {rest.strip()[:60]!r}"
                                         + ("; a call header was cut off" if "to=" in rest else ""))
                else:
                    others.append(rest)
                break
            header = text[pos:header_end]
            body_at = header_end + len("<|message|>")
            stray = next((m for m in _ENDS if m in header), None)
            if stray:
                result.errors.append(f"stray {stray} in a message header at char {pos}: {header.strip()[:60]!r}")
            recipient = _RECIPIENT.search(header)
            channel = _CHANNEL.search(header)
            if recipient is not None:
                where = f"tool call {index} (char {pos})"
                index += 1
                got = json_then(text, body_at, ("<|call|>", "<|end|>"), end_ok=True)
                if got is None:
                    end, mark = _first(text, body_at, _ENDS + ("<|start|>",))
                    result.errors.append(f"{where}: the arguments of {recipient.group(1)!r} are not one JSON object "
                                         f"ended by <|call|>: {text[body_at:body_at + 60]!r}")
                    pos = end + (0 if mark == "<|start|>" else len(mark))
                    continue
                args, pos, _ = got
                result.add(named_call(recipient.group(1).removeprefix("functions."), args, where))
                continue
            end, mark = _first(text, body_at, _ENDS + ("<|start|>",))
            body = text[body_at:end]
            name = channel.group(1) if channel else ""
            (finals if name == "final" else [] if name == "analysis" else others).append(body)
            if mark == "<|call|>":
                result.errors.append(f"<|call|> at char {end} ends a message without a recipient; "
                                     "a call's header needs to=functions.NAME")
            pos = end + (0 if mark == "<|start|>" else len(mark))
        result.content = "".join(finals if finals else others).strip()
        return result
