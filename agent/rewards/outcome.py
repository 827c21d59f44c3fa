"""The outcome part of every trajectory's reward, composed once, in the agent worker, after the
trajectory's loop ended: exactly one source scores it.

    reward.function   the user's function (function.py), in place of the rule scorer
    reward.model      a reward model or judge on the bus (model.py), in place of the rule scorer
    neither           the rule scorer of the row's data_source (agent/rewards/__init__.py), on the
                      text the loop names as its answer (`AgentLoopOutput.answer_text`)

The loop's own parts (tool, tool steps, interaction, shaping: `loop_reward`) are already in
`out.reward`; the outcome is added to them and logged as its own part ("rule", "function" or
"model", the other two 0.0). A source that fails (a rule scorer given a ground truth it cannot read,
a function that raises or hangs, a judge that is down) fails only its trajectory: outcome 0,
termination "error" (not trained on), the reason in the trajectory's `error`.
"""

from __future__ import annotations

from typing import Any, Mapping

from agent.rewards import Outcome, rule_reward


def rule_outcome(row: Mapping[str, Any], out: Any) -> Outcome:
    """The rule scorer's outcome of the loop's answer text (none: 0, for loops that score themselves)."""
    text = getattr(out, "answer_text", None)
    if text is None:
        return Outcome(parts={"rule": 0.0})
    try:
        score = rule_reward(row, text)
    except Exception as e:  # noqa: BLE001 - a row the rule cannot score fails its trajectory
        return Outcome(parts={"rule": 0.0}, error=f"the rule scorer failed: {type(e).__name__}: {e}; a dataset "
                       "whose answers are not numbers needs reward.function or reward.model")
    value = 0.0 if score is None else score
    return Outcome(value, {"rule": value})


class OutcomeScorer:
    """The run's outcome source in one agent worker: `await start()`, `await score(row, out, tokenizer)`."""

    def __init__(self, reward: Mapping[str, Any] | None) -> None:
        reward = dict(reward or {})
        self.function: Any = None
        self.model: Any = None
        if reward.get("function"):
            from agent.rewards.function import RewardConfig, RewardFunction

            self.function = RewardFunction(RewardConfig.from_mapping(reward))
        elif (reward.get("model") or {}).get("path"):
            from agent.rewards.model import RewardModel, RewardModelConfig

            self.model = RewardModel(RewardModelConfig.from_mapping(reward["model"]))

    @property
    def name(self) -> str:
        return "function" if self.function is not None else "model" if self.model is not None else "rule"

    async def start(self, timeout_s: float) -> None:
        if self.model is not None:
            await self.model.start(timeout_s)

    async def score(self, row: Mapping[str, Any], out: Any, tokenizer: Any) -> None:
        """Add the outcome to `out` (a trajectory that already failed is left as it is)."""
        if out.termination == "error":
            return
        if self.function is not None:
            got = await self.function.score(row, out, tokenizer)
        elif self.model is not None:
            got = await self.model.score(row, out, tokenizer)
        else:
            got = rule_outcome(row, out)
        score = 0.0 if got.error else got.score
        out.reward = float(out.reward) + score
        out.reward_extra = {**out.reward_extra, "rule": 0.0, **got.parts}
        if self.name != "rule":
            out.reward_extra[self.name] = score
            out.reward_extra[f"{self.name}_error"] = 1.0 if got.error else 0.0
        out.turns = [*out.turns, *got.turns]
        if got.turn_rewards and not got.error:
            out.turn_rewards = [*out.turn_rewards, *got.turn_rewards]
        if got.error:
            out.termination, out.error = "error", "; ".join(e for e in (out.error, got.error) if e)
        for seg in out.extra_segments:  # the sample's other segments (gateway agents) share its reward
            seg.update(reward=out.reward, reward_extra=dict(out.reward_extra))
            if got.error:
                seg.update(termination="error", error=out.error)

    async def close(self) -> None:
        if self.function is not None:
            self.function.close()
        if self.model is not None:
            await self.model.close()
