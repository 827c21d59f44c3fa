"""Stand-ins for a trained vision-language policy's habits, for tests whose subject is the image
path, not the model: a parser that reads every reply as a call of each tool (a random tiny model
never writes call markup) and a tool_agent whose replies end after a few tokens (a random model
rarely ends one), so a trajectory reaches its tool and the tool's image within a few tokens."""

from __future__ import annotations

from typing import Any

from agent.parsers import ParseResult, ToolCall, ToolParser
from agent.tool_agent import ToolAgentLoop

SHORT_REPLIES = {"stop_token_ids": list(range(0, 49152, 4))}  # every 4th token id ends a reply


class CallEveryTool(ToolParser):
    """Each reply becomes one call of every tool; bar_chart gets numbers taken from the reply's
    length, so the drawn chart depends on what the engine generated."""

    name = "call_every_tool"

    def parse(self, text: str) -> ParseResult:
        calls = [ToolCall(n, {"values": [len(text) % 7 + 1, 3, 5]} if n == "bar_chart" else {}) for n in self.tools]
        return ParseResult(text, calls)


class ShortReplyToolAgent(ToolAgentLoop):
    """tool_agent whose generations stop at the first token id divisible by 4, rewarded with the
    share of its model tokens whose id is odd (a signal any policy gets from any start, so GRPO
    has nonzero advantages without a model that can solve anything)."""

    async def run(self, sampling_params: dict[str, Any], **row: Any) -> Any:
        out = await super().run({**sampling_params, **SHORT_REPLIES}, **row)
        model = out.model_token_ids()
        out.reward = sum(t % 2 for t in model) / max(1, len(model))
        return out
