"""The tool-parser registry: names in config (`tool_parser`) to parser classes.

Built-in names are listed in `known_parsers()`; a dotted path ("my_pkg.parsers.MyParser") names a
`ToolParser` subclass of the user's own, and `register_tool_parser` adds a name from code.
"""

from __future__ import annotations

from typing import Any, Mapping

from agent.dotted import import_class
from agent.parsers.base import ToolParser
from agent.parsers.gemma import FunctionGemmaParser, GemmaParser
from agent.parsers.harmony import HarmonyParser
from agent.parsers.json_calls import HermesParser, Llama3JsonParser, MistralParser
from agent.parsers.marked_json import DeepSeekParser, KimiK2Parser
from agent.parsers.xml_args import DeepSeekV4Parser, Glm4Parser, MiniMaxParser, Qwen3CoderParser, SeedOssParser

_PARSERS: dict[str, type[ToolParser]] = {cls.name: cls for cls in (
    HermesParser, Llama3JsonParser, MistralParser, Qwen3CoderParser, Glm4Parser,
    HarmonyParser, DeepSeekParser, KimiK2Parser, GemmaParser, FunctionGemmaParser, SeedOssParser, MiniMaxParser,
    DeepSeekV4Parser)}
# other spellings users bring from vLLM, SGLang and verl configs
_ALIASES = {"qwen": "hermes", "qwen25": "hermes", "llama3": "llama3_json", "gpt_oss": "gpt-oss",
            "harmony": "gpt-oss", "qwen3_xml": "qwen3_coder", "glm45": "glm4", "glm47": "glm4",
            "deepseek_v3": "deepseek", "deepseek_v31": "deepseek", "deepseekv3": "deepseek",
            "deepseekv31": "deepseek", "kimi": "kimi_k2", "gemma4": "gemma", "minimax_m2": "minimax"}


def register_tool_parser(name: str, cls: type[ToolParser]) -> None:
    """Make `cls` available as `tool_parser: name`."""
    if not (isinstance(cls, type) and issubclass(cls, ToolParser)):
        raise TypeError(f"tool parser {name!r}: {cls!r} is not a subclass of agent.parsers.ToolParser")
    _PARSERS[name] = cls


def known_parsers() -> list[str]:
    return sorted(_PARSERS)


def get_tool_parser(name: str, tools: Mapping[str, Mapping[str, Any]] | None = None) -> ToolParser:
    """The parser `name` names (a registered name, an alias, or a dotted path to a ToolParser
    subclass); `tools` maps tool names to their JSON-schema parameters (see ToolParser)."""
    key = _ALIASES.get(name, name)
    if key in _PARSERS:
        return _PARSERS[key](tools)
    if "." in str(name):
        return import_class(name, ToolParser, "tool_parser")(tools)
    raise ValueError(f"unknown tool parser {name!r}; known parsers: {', '.join(known_parsers())} "
                     "(or a dotted path to a subclass of agent.parsers.ToolParser)")


def parameter_schemas(tools: Mapping[str, Any]) -> dict[str, Mapping[str, Any]]:
    """{tool name: its schema's function.parameters} for tool objects that carry `tool_schema`."""
    out: dict[str, Mapping[str, Any]] = {}
    for name, tool in tools.items():
        schema = getattr(tool, "tool_schema", None) or {}
        fn = schema.get("function") if isinstance(schema, Mapping) else None
        params = fn.get("parameters") if isinstance(fn, Mapping) else None
        if isinstance(params, Mapping):
            out[name] = params
    return out
