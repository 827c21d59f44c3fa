"""Interaction classes written to verl's interaction contract run as they are, without verl.

verl's contract: `__init__(config)`; `start_interaction(instance_id=None, **kwargs)` returns the id;
`generate_response(instance_id, messages, **kwargs)` returns `(should_terminate, response_text,
turn_score, extra)`; `calculate_score(...)` and `finalize_interaction(...)`, whose arguments vary
between verl's base class (none) and its examples (`instance_id, **kwargs`). Methods may be async.

A class named in interaction.yaml that does not subclass switchyard's `BaseInteraction` but has
`start_interaction`, `generate_response` and `finalize_interaction` is wrapped in `VerlInteraction`.
As verl does, the row's `interaction_kwargs` (minus `name`) reach `start_interaction` and every
`generate_response`. verl keeps each turn's score and adds none of them to the reward by itself;
here the score of the last turn is the interaction's part of the reward (`interaction`), and every
turn's score is in the trajectory's `turns`.
"""

from __future__ import annotations

import inspect
from typing import Any

from agent.interactions.base import BaseInteraction

METHODS = ("start_interaction", "generate_response", "finalize_interaction")


def is_verl_interaction_class(cls: Any) -> bool:
    """A class with verl's interaction methods that is not one of ours."""
    return (isinstance(cls, type) and not issubclass(cls, BaseInteraction)
            and all(callable(getattr(cls, m, None)) for m in METHODS))


async def _maybe_await(value: Any) -> Any:
    return await value if inspect.isawaitable(value) else value


def _takes_instance_id(method: Any) -> bool:
    """Whether a bound method accepts an instance id (verl's base class methods take nothing)."""
    try:
        params = inspect.signature(method).parameters.values()
    except (TypeError, ValueError):
        return True
    return any(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.VAR_POSITIONAL) for p in params)


class VerlInteraction(BaseInteraction):
    """Adapts a verl-contract interaction to switchyard's lifecycle (start / generate_response /
    calculate_score / finalize)."""

    default_name = "interaction_agent"  # verl's default name

    def __init__(self, cls: type, config: dict[str, Any]) -> None:
        super().__init__(config)
        self.inner = cls(dict(self.config))

    async def start(self, instance_id: str | None = None, **kwargs: Any) -> str:
        iid = await _maybe_await(self.inner.start_interaction(instance_id, **kwargs))
        iid = str(iid if iid is not None else instance_id)
        await super().start(iid, **kwargs)
        self.instances[iid]["_turn_scores"] = []
        return iid

    async def generate_response(self, instance_id: str, messages: list[dict[str, Any]]) -> tuple[bool, str, float]:
        state = self.state(instance_id)
        kwargs = {k: v for k, v in state.items() if not k.startswith("_")}
        out = await _maybe_await(self.inner.generate_response(instance_id, messages, **kwargs))
        if not isinstance(out, tuple) or len(out) not in (3, 4):
            raise TypeError(f"interaction {self.name!r}: {type(self.inner).__name__}.generate_response returned "
                            f"{out!r}; verl's contract is (should_terminate, response_text, turn_score, extra)")
        done, text, score = out[0], out[1], out[2]
        state["_turn_scores"].append(float(score or 0.0))
        return bool(done), "" if text is None else str(text), float(score or 0.0)

    async def calculate_score(self, instance_id: str) -> float:
        scores = self.state(instance_id)["_turn_scores"]
        return scores[-1] if scores else 0.0

    async def finalize(self, instance_id: str) -> None:
        if instance_id not in self.instances:
            return
        kwargs = {k: v for k, v in self.instances[instance_id].items() if not k.startswith("_")}
        try:
            method = self.inner.finalize_interaction
            await _maybe_await(method(instance_id, **kwargs) if _takes_instance_id(method) else method())
        finally:
            await super().finalize(instance_id)
