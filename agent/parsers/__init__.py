"""Tool-call parsers: a model's decoded reply -> content text plus tool calls (see base.py)."""

from agent.parsers.base import ParseResult, ToolCall, ToolParser
from agent.parsers.registry import get_tool_parser, known_parsers, parameter_schemas, register_tool_parser

__all__ = ["ParseResult", "ToolCall", "ToolParser", "get_tool_parser", "known_parsers", "parameter_schemas",
           "register_tool_parser"]
