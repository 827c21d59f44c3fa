"""Tools an agent loop can call inside one trajectory: the BaseTool lifecycle, the tools.yaml
loader, and the built-ins (calculator / gsm8k, python sandbox, BM25 search, and `agent.tools.mcp` for
stdio MCP servers, imported on its own so `mcp` loads only when used)."""

from agent.tools.base import BaseTool, ToolResponse
from agent.tools.registry import ToolConfigError, build_tools, load_tools

__all__ = ["BaseTool", "ToolResponse", "ToolConfigError", "build_tools", "load_tools"]
