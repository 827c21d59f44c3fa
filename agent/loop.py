"""The base class every agent loop derives from, the registry that picks a loop by the dataset's
`agent_name` column, and the record one trajectory produces (`AgentLoopOutput`, declared with the
batch it becomes: `engines/training/trajectory.py`).

An agent loop owns one trajectory: it encodes the row's messages once, asks the engines for
tokens through the GenerateClient, and appends everything else it adds (tool results, user
turns, template glue) with mask 0. `Trajectory` is the only way tokens enter the output, so the
three response lists can never drift apart.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Mapping, Sequence

from agent.dotted import import_class
from engines.training.trajectory import TERMINATIONS, AgentLoopOutput  # noqa: F401  (the record loops return)

if TYPE_CHECKING:
    from agent.interactions.base import BaseInteraction
    from agent.tools.base import BaseTool
    from rollout.bus.client import GenerateClient, GenerateResult

class Trajectory:
    """The growing token sequence of one trajectory; every append keeps ids, mask and logprobs aligned."""

    def __init__(self, prompt_ids: Sequence[int]) -> None:
        self.prompt_ids = list(prompt_ids)
        self.response_ids: list[int] = []
        self.response_mask: list[int] = []
        self.response_logprobs: list[float] = []
        self.pixel_values: list[Any] = []  # [n, C, H, W] float32 arrays, in the order of the image tokens
        self._joined: Any = None  # all_pixel_values(), made once per added image turn

    def add_images(self, pixel_values: Any) -> None:
        """Pixel values of images whose tokens were (or are about to be) added, in token order."""
        if len(pixel_values):
            self.pixel_values.append(pixel_values)
            self._joined = None

    def all_pixel_values(self) -> Any:
        """Every image's pixel values as one [n, C, H, W] array, or None without images."""
        if not self.pixel_values:
            return None
        if self._joined is None:
            import numpy as np

            self._joined = self.pixel_values[0] if len(self.pixel_values) == 1 else np.concatenate(self.pixel_values)
        return self._joined

    def multi_modal(self) -> dict[str, Any]:
        """What `AgentLoopOutput.multi_modal` carries for this trajectory."""
        pv = self.all_pixel_values()
        return {} if pv is None else {"pixel_values": pv}

    def add_model(self, token_ids: Sequence[int], logprobs: Sequence[float]) -> None:
        if len(token_ids) != len(logprobs):
            raise ValueError(f"engine returned {len(token_ids)} tokens but {len(logprobs)} logprobs")
        self.response_ids += list(token_ids)
        self.response_mask += [1] * len(token_ids)
        self.response_logprobs += [float(x) for x in logprobs]

    def add_context(self, token_ids: Sequence[int]) -> None:
        """Tokens the loop adds itself (tool/user turns, template glue): mask 0, never trained on."""
        self.response_ids += list(token_ids)
        self.response_mask += [0] * len(token_ids)
        self.response_logprobs += [0.0] * len(token_ids)

    def all_ids(self) -> list[int]:
        """What the engine continues from: prompt + every response token so far."""
        return self.prompt_ids + self.response_ids

    def __len__(self) -> int:
        return len(self.response_ids)


@dataclass
class AgentContext:
    """What a loop needs from its worker: the bus client, the tokenizer, tools and interactions
    (shared by all trajectories of the worker; their state is per instance), and the loop's config."""

    client: "GenerateClient"
    tokenizer: Any
    tools: Mapping[str, "BaseTool"] = field(default_factory=dict)
    interactions: Mapping[str, "BaseInteraction"] = field(default_factory=dict)
    config: Mapping[str, Any] = field(default_factory=dict)
    vision: Any = None  # agent.vision.Vision when the policy is a vision-language model


class AgentLoopBase:
    """Subclass and implement `run`. Register the class in YAML under `agent_loops:` by dotted path,
    then put its name in the dataset's `agent_name` column.

    `run(sampling_params, **row)` receives the dataset row's columns as keyword arguments
    (`raw_prompt` messages, `reward_model`, `extra_info`, `interaction_kwargs`, ...) plus
    `session_id` and `group_id` from the manager.
    """

    def __init__(self, ctx: AgentContext) -> None:
        self.ctx = ctx
        self.client = ctx.client
        self.tokenizer = ctx.tokenizer
        self.config = dict(ctx.config)

    async def run(self, sampling_params: dict[str, Any], **row: Any) -> AgentLoopOutput:
        raise NotImplementedError(f"{type(self).__name__} must implement run()")

    def prompt_messages(self, row: Mapping[str, Any]) -> list[dict[str, Any]]:
        """The row's prompt messages; a verl-style `images` column fills the `<image>` placeholders."""
        messages = [dict(m) for m in row["prompt"]]
        images = row.get("images")
        if images is not None and len(images):
            from agent.vision import placeholders_to_parts

            messages = placeholders_to_parts(messages, list(images))
        return messages

    def start_trajectory(self, encoder: Any, messages: Sequence[dict[str, Any]]) -> Trajectory:
        """The trajectory of `messages` (the one full template render), with their images' pixels."""
        traj = Trajectory(encoder.initial(messages))
        self.add_turn_images(traj, messages)
        return traj

    def add_turn_images(self, traj: Trajectory, messages: Sequence[dict[str, Any]]) -> None:
        """Pixel values of the images in `messages`, whose tokens were just added to `traj`."""
        if self.ctx.vision is not None:
            pv = self.ctx.vision.pixels_in(messages)
            if pv is not None:
                traj.add_images(pv)

    async def generate(self, traj: Trajectory, sampling_params: dict[str, Any], session_id: str,
                       group_id: str | None, turns: list[dict[str, Any]]) -> "GenerateResult":
        """One generation continuing `traj`; appends the model tokens (mask 1) and records a turn."""
        t0 = time.perf_counter()
        pv = traj.all_pixel_values()
        result = await self.client.generate(traj.all_ids(), sampling_params, session_id=session_id,
                                            group_id=group_id, **({"pixel_values": pv} if pv is not None else {}))
        traj.add_model(result.token_ids, result.logprobs)
        turns.append({"kind": "generate", "request_id": result.request_id, "tokens": len(result.token_ids),
                      "prompt_tokens": len(traj.prompt_ids) + len(traj) - len(result.token_ids),
                      "cached_prompt_tokens": result.cached_prompt_tokens, "finish_reason": result.finish_reason,
                      "weight_version": result.weight_version, "engine_id": result.engine_id,
                      "latency_s": time.perf_counter() - t0})
        return result


def new_session_id() -> str:
    return uuid.uuid4().hex


# Built-in loops by name; user loops are added by dotted path in the config (`agent_loops:`).
BUILTIN_AGENT_LOOPS: Mapping[str, str] = {
    "single_turn_agent": "agent.single_turn.SingleTurnAgentLoop",
    "tool_agent": "agent.tool_agent.ToolAgentLoop",
    "langgraph_agent": "agent.langgraph.LangGraphAgentLoop",  # needs langgraph (imported on first use)
    "openai_agent": "agent.openai_agent.OpenAIAgentLoop",  # any OpenAI-API agent, through agent/gateway
    "gym_agent": "agent.gym_loop.GymAgentLoop",  # an environment with reset() / step(action)
}
DEFAULT_AGENT_NAME = "single_turn_agent"


class AgentLoopRegistry:
    """Maps `agent_name` values to loop classes: the built-ins plus `extra` ({name: "pkg.mod.Class"}).

    Every name is imported and checked at construction, so a typo fails at start-up, not mid-rollout.
    """

    def __init__(self, extra: Mapping[str, str] | None = None) -> None:
        self._paths = {**BUILTIN_AGENT_LOOPS, **dict(extra or {})}
        self._classes: dict[str, type[AgentLoopBase]] = {}
        for name, dotted in (extra or {}).items():
            self._classes[name] = _import_loop(name, dotted)

    @property
    def names(self) -> list[str]:
        return sorted(self._paths)

    def get(self, name: str | None) -> type[AgentLoopBase]:
        name = name or DEFAULT_AGENT_NAME
        if name not in self._paths:
            raise KeyError(f"unknown agent_name {name!r}; known: {self.names}. Register your loop in the config "
                           f"under `agent_loops: {{{name}: your.module.YourLoop}}`")
        if name not in self._classes:
            self._classes[name] = _import_loop(name, self._paths[name])
        return self._classes[name]


def _import_loop(name: str, dotted: str) -> type[AgentLoopBase]:
    try:
        return import_class(dotted, AgentLoopBase, "class")
    except ValueError as e:
        raise ValueError(f"agent_loops.{name}: {e}") from e
