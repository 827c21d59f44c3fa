"""The interaction contract: a simulated user that answers the model between assistant turns.

An interaction lives for the whole training run, but its state is per trajectory, as a tool's
is: the loop calls `start` when a trajectory begins (with the row's `interaction_kwargs`),
`generate_response` each time the model ends a turn without calling a tool, `calculate_score`
when the trajectory ends, and `finalize` always (also after a failure), so per-trajectory state
never leaks between trajectories.
"""

from __future__ import annotations

import uuid
from typing import Any, ClassVar


class BaseInteraction:
    """Subclass and implement `generate_response` (and `calculate_score` when the interaction scores).

    `self.instances[instance_id]` holds the start kwargs plus whatever the interaction stores there.
    """

    default_name: ClassVar[str] = "interaction"

    def __init__(self, config: dict[str, Any]) -> None:
        self.config: dict[str, Any] = dict(config or {})
        self._name = str(self.config.get("name") or self.default_name)
        self.instances: dict[str, dict[str, Any]] = {}

    @property
    def name(self) -> str:
        """The name rows use to select this interaction (`interaction_kwargs.name`)."""
        return self._name

    async def start(self, instance_id: str | None = None, **kwargs: Any) -> str:
        """Open per-trajectory state; returns the id later calls use. Kwargs come from the dataset
        row's `interaction_kwargs` (minus `name`), e.g. `ground_truth`."""
        iid = instance_id or uuid.uuid4().hex
        if iid in self.instances:
            raise ValueError(f"interaction {self.name!r}: instance {iid!r} already exists; finalize it first "
                             "or pass a fresh instance_id")
        self.instances[iid] = dict(kwargs)
        return iid

    async def generate_response(self, instance_id: str, messages: list[dict[str, Any]]) -> tuple[bool, str, float]:
        """React to the conversation so far: (done, text of the next user turn, score of this turn)."""
        raise NotImplementedError(f"{type(self).__name__} must implement generate_response()")

    async def calculate_score(self, instance_id: str) -> float:
        """The interaction's score for the whole trajectory; interactions that do not score return 0.0."""
        return 0.0

    async def finalize(self, instance_id: str) -> None:
        """Drop per-trajectory state. Idempotent: finalizing twice (or an unknown id) is fine,
        because the loop finalizes in a `finally` whatever happened before."""
        self.instances.pop(instance_id, None)

    def state(self, instance_id: str) -> dict[str, Any]:
        """The instance's state; a clear error if the loop forgot `start`."""
        try:
            return self.instances[instance_id]
        except KeyError:
            raise KeyError(f"interaction {self.name!r}: unknown instance {instance_id!r}; call "
                           f"`await interaction.start(...)` first and pass the id it returns") from None


def last_assistant_text(messages: list[dict[str, Any]]) -> str:
    """The text of the last assistant message (string content or OpenAI-style text parts).

    Raises if there is none: an interaction is asked to respond only after the model spoke.
    """
    for message in reversed(messages):
        if message.get("role") != "assistant":
            continue
        content = message.get("content")
        if isinstance(content, list):
            return "".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
        return "" if content is None else str(content)
    roles = [m.get("role") for m in messages]
    raise ValueError(f"no assistant message in the conversation (roles: {roles}); call generate_response "
                     "after the model's turn has been appended to messages")
