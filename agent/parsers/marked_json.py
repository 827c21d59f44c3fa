"""Formats that wrap JSON arguments in special-token markers: deepseek (V3 and V3.1), kimi_k2.

- `deepseek` V3 / R1: `<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME` then the
  arguments in a ```json fence, then `<｜tool▁call▁end｜>`, once per call, then `<｜tool▁calls▁end｜>`.
  V3.1: `<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{...}<｜tool▁call▁end｜>`. Both are read by one parser
  (the word before the separator tells them apart). The bars are U+FF5C, the spaces U+2581. DSML markup
  (V3.2 and V4; `deepseek_v4` in xml_args.py reads V4's) is reported as an error, not silently dropped.
- `kimi_k2`: `<|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:0<|tool_call_argument_begin|>{...}
  <|tool_call_end|>...<|tool_calls_section_end|>`; the id is `functions.NAME:INDEX`.
"""

from __future__ import annotations

from agent.parsers.base import ParseResult, ToolParser, json_then, named_call, plain_name, skip_ws


class _SectionParser(ToolParser):
    """Calls inside a section `section_begin ... section_end`, each `call_begin HEAD arg_sep JSON
    call_end`. Text outside the sections is content; an unclosed section (a reply cut by the length
    limit) still yields the complete calls in it and an error for the cut one.

    Forced call (required): `section_begin call_begin`; the model writes the head, the separator and
    the arguments."""

    section_begin = section_end = call_begin = call_end = arg_sep = ""

    def call_prefix(self, name: str | None = None) -> str | None:
        return self.section_begin + self.call_begin if name is None else None

    def name_and_args(self, text: str, at: int, head: str) -> tuple[str, int] | str:
        """(tool name, where the arguments' JSON starts) for a call whose text before the separator
        is `head` and whose separator ends at `at`; or an error message."""
        return head, at

    def json_closers(self) -> tuple[str, ...]:
        return (self.call_end,)

    def parse(self, text: str) -> ParseResult:
        result = ParseResult(content="")
        pieces: list[str] = []
        pos, index = 0, 0
        while True:
            start = text.find(self.section_begin, pos)
            if start < 0:
                pieces.append(text[pos:])
                break
            pieces.append(text[pos:start])
            pos, index = self._section(text, start + len(self.section_begin), result, index)
        content = "".join(pieces)
        for stray in (self.section_end, self.call_begin, self.call_end):
            if stray in content:
                result.errors.append(f"stray {stray} outside {self.section_begin}...{self.section_end}")
                content = content.replace(stray, "")
        result.content = content.strip()
        return result

    def _section(self, text: str, at: int, result: ParseResult, index: int) -> tuple[int, int]:
        """Read the calls of one section starting at `at`; (position after it, next call index)."""
        first = index
        while True:
            k = skip_ws(text, at)
            if text.startswith(self.section_end, k):
                if index == first:
                    result.errors.append(f"a {self.section_begin} section with no calls in it (char {k})")
                return k + len(self.section_end), index
            if not text.startswith(self.call_begin, k):
                if k == len(text):
                    result.errors.append(f"unclosed {self.section_begin} (no {self.section_end} before the end of the reply)")
                    return k, index
                end = text.find(self.section_end, k)
                result.errors.append(f"tool call {index} (char {k}): expected {self.call_begin} or {self.section_end}, "
                                     f"got {text[k:k + 40]!r}")
                return (len(text) if end < 0 else end + len(self.section_end)), index + 1
            where = f"tool call {index} (char {k})"
            index += 1
            head_at = k + len(self.call_begin)
            sep = text.find(self.arg_sep, head_at)
            close = text.find(self.call_end, head_at)
            if sep < 0 or 0 <= close < sep:
                result.errors.append(f"{where}: no {self.arg_sep} after the tool name "
                                     f"{text[head_at:head_at + 40]!r}")
                at = len(text) if close < 0 else close + len(self.call_end)
                continue
            split = self.name_and_args(text, sep + len(self.arg_sep), text[head_at:sep])
            got = json_then(text, split[1], self.json_closers()) if not isinstance(split, str) else None
            if got is None:
                why = split if isinstance(split, str) else (
                    f"the arguments are not one JSON object followed by {self.call_end}")
                result.errors.append(f"{where}: {why}: {text[sep:sep + 80]!r}")
                at = len(text) if close < 0 else close + len(self.call_end)
                if close < 0:
                    return at, index
                continue
            args, at, closer = got
            if closer != self.call_end:  # the fence's closing ``` came first
                k = skip_ws(text, at)
                if not text.startswith(self.call_end, k):
                    result.errors.append(f"{where}: no {self.call_end} after the arguments")
                    continue
                at = k + len(self.call_end)
            result.add(named_call(split[0], args, where))


class DeepSeekParser(_SectionParser):
    """Forced call: `<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>` (required only: V3 writes a named call
    `function<｜tool▁sep｜>NAME` and V3.1 `NAME<｜tool▁sep｜>`, so a named opening is not one string)."""

    name = "deepseek"
    section_begin = "<｜tool▁calls▁begin｜>"
    section_end = "<｜tool▁calls▁end｜>"
    call_begin = "<｜tool▁call▁begin｜>"
    call_end = "<｜tool▁call▁end｜>"
    arg_sep = "<｜tool▁sep｜>"
    markers = (section_begin,)

    def parse(self, text: str) -> ParseResult:
        """V3/V3.1 calls; DSML markup (V3.2, V4) outside them is an error, since this parser reads
        none of it and a reply whose calls vanish without a word would teach the policy nothing."""
        result = super().parse(text)
        if "｜DSML｜" in result.content:
            result.errors.append("DSML tool-call markup (<｜DSML｜...>, DeepSeek V3.2/V4) is not read by the deepseek "
                                 "parser (V3/V3.1 format); for DeepSeek V4 set tool_parser: deepseek_v4")
        return result

    def name_and_args(self, text: str, at: int, head: str) -> tuple[str, int] | str:
        if head.strip() != "function":
            return head, at  # V3.1: the head is the name and the JSON follows the separator
        line = text.find("\n", at)  # V3: the name, then a ```json fence on the next line
        if line < 0 or not text.startswith("```", skip_ws(text, line)):
            return "a V3 call needs the name on the separator's line and a ```json fence after it"
        k = skip_ws(text, line) + 3
        return text[at:line], (k + 4 if text.startswith("json", k) else k)

    def json_closers(self) -> tuple[str, ...]:
        return ("```", self.call_end)


class KimiK2Parser(_SectionParser):
    """Forced call: `<|tool_calls_section_begin|><|tool_call_begin|>` (required);
    `...<|tool_call_begin|>functions.f:` (named; the model writes the call's index, which counts the
    conversation's calls, and `<|tool_call_argument_begin|>{...}`)."""

    name = "kimi_k2"
    section_begin = "<|tool_calls_section_begin|>"
    section_end = "<|tool_calls_section_end|>"
    call_begin = "<|tool_call_begin|>"
    call_end = "<|tool_call_end|>"
    arg_sep = "<|tool_call_argument_begin|>"
    markers = (section_begin,)

    def call_prefix(self, name: str | None = None) -> str | None:
        if name is None:
            return self.section_begin + self.call_begin
        return None if plain_name(name) is None else f"{self.section_begin}{self.call_begin}functions.{name}:"

    def name_and_args(self, text: str, at: int, head: str) -> tuple[str, int] | str:
        """The id `functions.NAME:INDEX` names the tool (an id without the prefix or index is taken whole)."""
        name = head.strip()
        name = name.removeprefix("functions.")
        base, colon, idx = name.rpartition(":")
        return (base if colon and idx.isdigit() else name), at
