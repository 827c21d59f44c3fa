"""The tool contract agent loops rely on.

A tool lives for the whole training run, but its state is per trajectory: the loop calls
`create` once when a trajectory starts, `execute` for each tool call the model makes,
`calc_reward` when the trajectory ends, and `release` always (also after a failure), so that
per-trajectory state (answers, temp dirs, handles) never leaks between trajectories.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any


@dataclass
class ToolResponse:
    """What a tool call returns to the loop: `text` becomes the tool message the model sees;
    `success=False` marks an observation that reports a failure (the loop keeps going);
    `metrics` are numbers the trainer may log (latency, truncation, exit code); `reward` is a step
    reward for this call, summed into the trajectory's reward as its own part (`tool_step`);
    `images` (PIL images, arrays, PNG bytes: any form `agent.vision.to_pil` reads) are shown to
    a vision-language policy before the text, in the same tool message."""

    text: str
    success: bool = True
    metrics: dict[str, Any] = field(default_factory=dict)
    reward: float = 0.0
    images: list[Any] = field(default_factory=list)


class BaseTool:
    """A tool described by an OpenAI function-tool schema, with per-trajectory instances.

    Subclasses override `execute` (and `calc_reward` when the tool scores the trajectory).
    `self.instances[instance_id]` holds the create_kwargs plus whatever the tool stores there.
    """

    def __init__(self, config: dict[str, Any], tool_schema: dict[str, Any]) -> None:
        self.config: dict[str, Any] = dict(config or {})
        self.tool_schema: dict[str, Any] = tool_schema
        self._name = schema_name(tool_schema)
        self.instances: dict[str, dict[str, Any]] = {}

    @property
    def name(self) -> str:
        """The function name the model uses to call this tool (from the schema)."""
        return self._name

    async def create(self, instance_id: str | None = None, **create_kwargs: Any) -> str:
        """Open per-trajectory state; returns the id later calls use. Kwargs come from the
        dataset row (`extra_info.tools_kwargs.<name>.create_kwargs`), e.g. `ground_truth`."""
        iid = instance_id or uuid.uuid4().hex
        if iid in self.instances:
            raise ValueError(f"tool {self.name!r}: instance {iid!r} already exists; release it first "
                             "or pass a fresh instance_id")
        self.instances[iid] = dict(create_kwargs)
        return iid

    async def execute(self, instance_id: str, arguments: dict[str, Any]) -> ToolResponse:
        """Run one call with the model's parsed arguments."""
        raise NotImplementedError(f"{type(self).__name__} must implement execute()")

    async def calc_reward(self, instance_id: str) -> float:
        """The tool's score for the trajectory; tools that do not score return 0.0."""
        return 0.0

    async def release(self, instance_id: str) -> None:
        """Drop per-trajectory state. Idempotent: releasing twice (or an unknown id) is fine,
        because the loop releases in a `finally` whatever happened before."""
        self.instances.pop(instance_id, None)

    def state(self, instance_id: str) -> dict[str, Any]:
        """The instance's state; a clear error if the loop forgot `create`."""
        try:
            return self.instances[instance_id]
        except KeyError:
            raise KeyError(f"tool {self.name!r}: unknown instance {instance_id!r}; call "
                           f"`await tool.create(...)` first and pass the id it returns") from None


def schema_name(tool_schema: Any) -> str:
    """The function name of an OpenAI function-tool schema, or a ValueError saying what is wrong."""
    fn = tool_schema.get("function") if isinstance(tool_schema, dict) else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str) or not name:
        raise ValueError(f"tool_schema has no function name: {tool_schema!r}; expected "
                         '{"type": "function", "function": {"name": ..., "description": ..., "parameters": {...}}}')
    return name
