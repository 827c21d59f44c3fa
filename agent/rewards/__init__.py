"""Rewards for one finished trajectory: the outcome (the rule scorer picked by the row's
`data_source`, or the run's `reward.function` or `reward.model`: `outcome.py`, composed once per
trajectory after its loop ends) plus the tool, interaction and shaping terms the loop earned
(`loop_reward`), summed into one scalar with every part kept for logging.

Rows are in verl's format:

    {"data_source": "openai/gsm8k", "prompt": [...],
     "reward_model": {"style": "rule", "ground_truth": "72", "method": "strict"}, ...}

`reward_model.method` (optional) overrides the scorer's answer extraction ("strict" or
"flexible"); `reward_model.format_score` (optional) is what a wrong but readable answer earns.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Callable, Mapping

from agent.rewards.gsm8k import extract_answer, gsm8k_reward
from agent.rewards.shaping import ShapingConfig, TrajectoryStats, shape

# (response_text, ground_truth, reward_model) -> reward
RuleScorer = Callable[[str, Any, Mapping[str, Any]], float]


def _gsm8k_scorer(default_method: str) -> RuleScorer:
    """A gsm8k scorer whose extraction method defaults to `default_method` unless the row names one."""

    def score(text: str, ground_truth: Any, reward_model: Mapping[str, Any]) -> float:
        return gsm8k_reward(text, ground_truth, method=str(reward_model.get("method") or default_method),
                            format_score=float(reward_model.get("format_score") or 0.0))

    return score


# GSM8K rows are prompted for the "#### N" format, so they are scored strictly; the synthetic
# arithmetic rows are not, so any final number counts.
RULE_SCORERS: Mapping[str, RuleScorer] = MappingProxyType({
    "openai/gsm8k": _gsm8k_scorer("strict"),
    "gsm8k": _gsm8k_scorer("strict"),
    "arithmetic": _gsm8k_scorer("flexible"),
})
# Rows whose data_source has no scorer but which carry a ground truth are compared as numbers,
# taking the last number of the response: the most common case for math-like datasets, and
# better than silently training on a reward of 0. A non-numeric ground truth raises instead.
FALLBACK_SCORER: RuleScorer = _gsm8k_scorer("flexible")


@dataclass
class Outcome:
    """What one source said of one trajectory: its score, the parts it logs, and why it failed."""

    score: float = 0.0
    parts: dict[str, float] = field(default_factory=dict)
    error: str = ""
    turns: list[dict[str, Any]] = field(default_factory=list)  # recorded steps (a judge's verdict)
    turn_rewards: list[list[float]] = field(default_factory=list)  # [position, reward]: part of score, per turn


def rule_reward(row: Mapping[str, Any], response_text: str) -> float | None:
    """The rule reward of `response_text` for a dataset row, or None when the row asks for none.

    None when the row has no `reward_model` with `style: rule` (e.g. a model-based reward), or
    when its data_source has no scorer and it has no ground_truth. A known data_source without a
    ground_truth is a dataset bug and raises.
    """
    rm = row.get("reward_model")
    if not isinstance(rm, Mapping) or rm.get("style") != "rule":
        return None
    source = row.get("data_source")
    scorer = RULE_SCORERS.get(source) if isinstance(source, str) else None
    ground_truth = rm.get("ground_truth")
    if ground_truth is None:
        if scorer is None:
            return None
        raise ValueError(f"row with data_source {source!r} has reward_model.style='rule' but no ground_truth; "
                         "add reward_model.ground_truth to the dataset")
    return float((scorer or FALLBACK_SCORER)(response_text, ground_truth, rm))


def compute_score(data_source: str | None, solution_str: str, ground_truth: Any,
                  extra_info: Mapping[str, Any] | None = None) -> float:
    """The built-in rule scorers as a reward function (`reward.function=agent.rewards:compute_score`,
    or called from one of your own): the scorer of `data_source`, else the last number of the
    response against `ground_truth`, with the extraction method of a gsm8k row's `reward_model`
    passed in `extra_info["reward_model"]` if any."""
    rm = dict((extra_info or {}).get("reward_model") or {})
    scorer = RULE_SCORERS.get(str(data_source)) or FALLBACK_SCORER
    return float(scorer(solution_str, ground_truth, rm))


def loop_reward(shaping: Mapping[str, Any] | ShapingConfig | None = None, stats: TrajectoryStats | None = None,
                tool_reward: float = 0.0, interaction_score: float | None = None,
                step_reward: float = 0.0) -> tuple[float, dict[str, float]]:
    """The part of a trajectory's reward its agent loop earned: tool + tool steps + interaction +
    shaping terms, and every part by name.

    The parts dict always has "tool", "tool_step" (the step rewards tools returned with their
    calls), "interaction" and every shaping term (0.0 where absent), so a trainer can log each one
    and the parts always sum to the total. The outcome (rule, `reward.function` or `reward.model`)
    is never a loop's: `agent/rewards/outcome.py` adds it once, after the loop ends. The sources
    are summed, not chosen between: a config that scores the same answer by the outcome and by a
    tool or interaction counts it twice, which is the config's choice to make.
    """
    cfg = shaping if isinstance(shaping, ShapingConfig) else ShapingConfig.from_mapping(shaping)
    parts = {
        "tool": float(tool_reward),
        "tool_step": float(step_reward),
        "interaction": 0.0 if interaction_score is None else float(interaction_score),
        **shape(stats or TrajectoryStats(), cfg),
    }
    return sum(parts.values()), parts


__all__ = ["Outcome", "compute_score", "RULE_SCORERS", "FALLBACK_SCORER", "RuleScorer", "ShapingConfig", "TrajectoryStats", "extract_answer",
           "gsm8k_reward", "loop_reward", "rule_reward", "shape"]
