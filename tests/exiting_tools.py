"""Tools that end their process the way careless code does, for tests/test_tool_exits.py: argparse or
sys.exit inside a tool raise SystemExit, which is a BaseException and not an Exception."""

from __future__ import annotations

import itertools
from typing import Any

from agent.tools import BaseTool, ToolResponse
from agent.tools.calculator import CalculatorTool

_creates = itertools.count()


class ExitOnEveryOtherCreate(BaseTool):
    """create() raises SystemExit(2) on every other call (as argparse does on a bad argument)."""

    async def create(self, **kwargs: Any) -> str:
        if next(_creates) % 2:
            raise SystemExit(2)
        return await super().create(**kwargs)

    async def execute(self, instance_id: str, arguments: dict[str, Any]) -> ToolResponse:
        return ToolResponse("ok")


class ExitingCalculator(CalculatorTool):
    """A calculator whose execute() calls sys.exit."""

    async def execute(self, instance_id: str, arguments: dict[str, Any]) -> ToolResponse:
        raise SystemExit("the calculator gave up")
