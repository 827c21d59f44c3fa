"""The record of one finished trajectory (`AgentLoopOutput`): what an agent loop returns
(`agent/loop.py`), rollout carries, and `pad_outputs` (`engines/training/batch.py`) turns into
training rows. It lives with the training engines, which must not import the agent loops."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

# Why a trajectory ended. Trainers may treat the budget/turn-limit ones as truncation.
TERMINATIONS = ("stop", "length", "max_assistant_turns", "max_user_turns", "token_budget", "interaction_done",
                "abort", "error", "env_done", "max_steps")


@dataclass
class AgentLoopOutput:
    """One finished trajectory, ready to be padded into a training batch.

    `response_logprobs[i]` is the engine's logprob where `response_mask[i] == 1` and 0.0 where
    the loop added the token itself. `turns` holds one dict of metrics per step of the loop
    (generation, tool round, interaction), `request_ids` the bus ids of every generation in order
    (what EngineServers write to their request logs), `weight_versions` the policy version each
    generation reported (the oldest, for a generation a weight update preempted and continued),
    and `version_segments` [version, tokens] runs over the model tokens in order: which weights
    produced which tokens (the agent worker fills it in; loops need not). `turn_rewards` lists
    [position, reward] pairs: a part of `reward` earned by the response tokens before `position`
    alone (a tool's step reward, an interaction's turn score), which the turn-level estimator
    credits to those turns only; outcome-only estimators read just `reward`.
    """

    prompt_ids: list[int]
    response_ids: list[int]
    response_mask: list[int]
    response_logprobs: list[float]
    reward: float
    num_turns: int
    termination: str
    turns: list[dict[str, Any]] = field(default_factory=list)
    weight_versions: list[int] = field(default_factory=list)
    request_ids: list[str] = field(default_factory=list)
    reward_extra: dict[str, float] = field(default_factory=dict)
    messages: list[dict[str, Any]] = field(default_factory=list)
    session_id: str = ""
    error: str = ""
    version_segments: list[list[int]] = field(default_factory=list)
    # further token sequences of the same sample (as AgentLoopOutput dicts), trained as rows of their own
    extra_segments: list[dict[str, Any]] = field(default_factory=list)
    # images the trajectory's image tokens stand for: {"pixel_values": [n, C, H, W] float32 array}
    multi_modal: dict[str, Any] = field(default_factory=dict)
    turn_rewards: list[list[float]] = field(default_factory=list)  # [response position, reward] pairs
    # the text the rule scorer reads for the outcome (agent/rewards/outcome.py): the final answer;
    # None where the loop scored the outcome itself (an environment's reward) or has none
    answer_text: str | None = None

    @classmethod
    def failed(cls, prompt_ids: Sequence[int], error: str, session_id: str = "",
               messages: list[dict[str, Any]] | None = None) -> "AgentLoopOutput":
        """A trajectory that failed before it produced anything: its prompt (so the row still lines
        up with its group), an empty response, reward 0 and termination "error"."""
        return cls(prompt_ids=list(prompt_ids), response_ids=[], response_mask=[], response_logprobs=[], reward=0.0,
                   num_turns=0, termination="error", messages=list(messages or []), session_id=session_id,
                   error=error)

    def check(self) -> None:
        """Raise if the response lists disagree in length or a mask-0 token carries a logprob."""
        n = len(self.response_ids)
        if len(self.response_mask) != n or len(self.response_logprobs) != n:
            raise AssertionError(f"trajectory {self.session_id}: {n} response ids, {len(self.response_mask)} mask "
                                 f"entries, {len(self.response_logprobs)} logprobs; they must be equal")
        if self.termination not in TERMINATIONS:
            raise AssertionError(f"trajectory {self.session_id}: termination {self.termination!r} is not one of "
                                 f"{TERMINATIONS}")

    def model_token_ids(self) -> list[int]:
        """The mask-1 tokens in order: exactly what the engines returned."""
        return [t for t, m in zip(self.response_ids, self.response_mask) if m]
