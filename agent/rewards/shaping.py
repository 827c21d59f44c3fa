"""Reward shaping: small, named terms added to the outcome reward of a tool-using trajectory.

Outcome rewards alone are sparse; a bonus for tool calls that worked teaches a young policy that
tools help, a penalty per malformed call teaches the call format, and a penalty for running into
the turn limit discourages loops that never answer. Every term is reported on its own so a
trainer can log it and see which term is moving the total. All terms default to 0 (no shaping).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

from engines.config_checks import from_mapping


@dataclass
class ShapingConfig:
    """Magnitudes of the shaping terms; all must be >= 0 (penalties are subtracted).

    tool_success_bonus: added per successful tool call, for at most `max_tool_bonus_calls` calls
      (None: no cap). Cap it, or the policy learns to call tools for their own sake.
    invalid_call_penalty: subtracted per invalid call (unparsable call, unknown tool).
    turn_limit_penalty: subtracted once when the trajectory hit its turn limit.
    """

    tool_success_bonus: float = 0.0
    invalid_call_penalty: float = 0.0
    turn_limit_penalty: float = 0.0
    max_tool_bonus_calls: int | None = None

    def __post_init__(self) -> None:
        for name in ("tool_success_bonus", "invalid_call_penalty", "turn_limit_penalty"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"reward_shaping.{name}={value!r} must be a finite number >= 0")
            if value < 0:
                raise ValueError(f"reward_shaping.{name}={value!r} must be >= 0; penalties are subtracted "
                                 f"already, so write {abs(value)!r}")
            setattr(self, name, float(value))
        cap = self.max_tool_bonus_calls
        if cap is not None and (isinstance(cap, bool) or not isinstance(cap, int) or cap < 0):
            raise ValueError(f"reward_shaping.max_tool_bonus_calls={cap!r} must be an integer >= 0, "
                             "or null for no cap")

    @classmethod
    def from_mapping(cls, d: Mapping[str, Any] | None) -> "ShapingConfig":
        """Build from a config mapping; an unknown key is a typo that would silently disable a term,
        so it is an error."""
        return from_mapping(cls, dict(d or {}), "reward_shaping")


@dataclass
class TrajectoryStats:
    """What the agent loop counted during one trajectory; the input to `shape`."""

    tool_calls: int = 0
    tool_successes: int = 0
    invalid_calls: int = 0
    hit_turn_limit: bool = False

    def __post_init__(self) -> None:
        for name in ("tool_calls", "tool_successes", "invalid_calls"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"TrajectoryStats.{name}={value!r} must be an integer >= 0")
        if self.tool_successes > self.tool_calls:
            raise ValueError(f"TrajectoryStats.tool_successes={self.tool_successes} exceeds "
                             f"tool_calls={self.tool_calls}; count a success only for a call that ran")


def shape(stats: TrajectoryStats, cfg: ShapingConfig) -> dict[str, float]:
    """The shaping terms, signed as they are added to the reward (penalties <= 0).

    The keys are always the same three, so logged curves do not appear and vanish with the config.
    """
    rewarded = stats.tool_successes
    if cfg.max_tool_bonus_calls is not None:
        rewarded = min(rewarded, cfg.max_tool_bonus_calls)
    return {
        "tool_bonus": cfg.tool_success_bonus * rewarded,
        "invalid_call_penalty": 0.0 - cfg.invalid_call_penalty * stats.invalid_calls,
        "turn_limit_penalty": 0.0 - cfg.turn_limit_penalty if stats.hit_turn_limit else 0.0,
    }
