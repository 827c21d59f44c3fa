"""Load tools from a tools.yaml in verl's format:

    tools:
      - class_name: agent.tools.calculator.CalculatorTool
        config: {max_expression_chars: 200}
        tool_schema: {type: function, function: {name: calculator, description: ..., parameters: {...}}}

plus, optionally, plain Python functions as tools (`functions:`, see agent/tools/functions.py).
A bad entry fails loudly at start-up, naming the entry, rather than mid-rollout.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from agent.dotted import import_class
from agent.tools.base import BaseTool, schema_name
from agent.tools.verl_compat import VerlTool, is_verl_tool_class
from agent.yaml_file import read_yaml_map


class ToolConfigError(ValueError):
    """A tools.yaml entry that cannot be turned into a tool; the message names the entry."""


def load_tools(path: str | Path) -> dict[str, BaseTool]:
    """Read a tools.yaml and build every tool in it, keyed by function name."""
    path = Path(path)
    expect = "a top-level `tools:` list (and/or `functions:`)"
    data = read_yaml_map(path, "tools", ToolConfigError, expect)
    if not isinstance(data.get("tools", []), list) or not (data.get("tools") or data.get("functions")):
        raise ToolConfigError(f"{path}: expected {expect}, got {sorted(data)}")
    tools = build_tools(data.get("tools") or [], source=str(path))
    for name, tool in build_function_tools(data.get("functions") or [], str(path), path.parent).items():
        if name in tools:
            raise ToolConfigError(f"{path}: function tool {name!r} has the name of a tool already listed; rename one")
        tools[name] = tool
    return tools


def build_function_tools(entries: Any, source: str = "<tools>", base: Path | None = None) -> dict[str, BaseTool]:
    """Tools from `functions:` entries ({source, names?, config?}; see agent/tools/functions.py)."""
    from agent.tools.functions import function_tools

    if not isinstance(entries, list):
        raise ToolConfigError(f"{source}: `functions:` must be a list of {{source: file.py or module, names: [...]}}")
    tools: dict[str, BaseTool] = {}
    for i, entry in enumerate(entries):
        where = f"{source}: functions[{i}]"
        if not isinstance(entry, dict) or not isinstance(entry.get("source"), str):
            raise ToolConfigError(f"{where} is {entry!r}; expected {{source: my_tools.py, names: [f, g]}}")
        try:
            made = function_tools(entry["source"], entry.get("names"), entry.get("config"), base)
        except ValueError as e:
            raise ToolConfigError(f"{where}: {e}") from None
        for tool in made:
            if tool.name in tools:
                raise ToolConfigError(f"{where}: duplicate function tool name {tool.name!r}")
            tools[tool.name] = tool
    return tools


def build_tools(entries: list[dict[str, Any]], source: str = "<tools>") -> dict[str, BaseTool]:
    """Build tools from already-parsed entries (what the yaml's `tools:` list holds)."""
    tools: dict[str, BaseTool] = {}
    for i, entry in enumerate(entries):
        where = f"{source}: tools[{i}]"
        if not isinstance(entry, dict):
            raise ToolConfigError(f"{where} is {entry!r}; expected a mapping with class_name, config, tool_schema")
        dotted = entry.get("class_name")
        if not isinstance(dotted, str) or not dotted:
            raise ToolConfigError(f"{where} has no class_name; add e.g. "
                                  "`class_name: agent.tools.calculator.CalculatorTool`")
        where = f"{where} ({dotted})"
        cls = _import_tool_class(dotted, where)
        try:
            name = schema_name(entry.get("tool_schema"))
        except ValueError as e:
            raise ToolConfigError(f"{where}: {e}") from None
        if name in tools:
            raise ToolConfigError(f"{where}: duplicate tool name {name!r} (already used by an earlier entry); "
                                  "give each tool_schema.function.name a unique value")
        try:
            tools[name] = (VerlTool(cls, entry.get("config") or {}, entry["tool_schema"]) if is_verl_tool_class(cls)
                           else cls(entry.get("config") or {}, entry["tool_schema"]))
        except Exception as e:
            raise ToolConfigError(f"{where}: constructing tool {name!r} failed: {e}") from e
    return tools


def _import_tool_class(dotted: str, where: str) -> type:
    """A BaseTool subclass, or a class written to verl's tool contract (agent/tools/verl_compat.py)."""
    try:
        cls = import_class(dotted, object, "class_name")
    except ValueError as e:
        raise ToolConfigError(f"{where}: {e}") from e
    if not (issubclass(cls, BaseTool) or is_verl_tool_class(cls)):
        raise ToolConfigError(f"{where}: {dotted!r} is neither a subclass of agent.tools.base.BaseTool nor a class with "
                              "verl's tool methods (create, execute, calc_reward, release)")
    return cls
