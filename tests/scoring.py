"""What the agent worker does after a loop ends, for tests that run a loop by itself: its outcome
(rule, `reward.function` or `reward.model`) added once by `agent/rewards/outcome.py`."""

from __future__ import annotations

import asyncio
from typing import Any, Mapping

from agent.rewards.outcome import OutcomeScorer


async def add_outcome(row: Mapping[str, Any], out: Any, tokenizer: Any = None,
                      reward: Mapping[str, Any] | None = None) -> Any:
    scorer = OutcomeScorer(reward)
    try:
        await scorer.score(row, out, tokenizer)
    finally:
        await scorer.close()
    return out


def with_outcome(row: Mapping[str, Any], out: Any, tokenizer: Any = None,
                 reward: Mapping[str, Any] | None = None) -> Any:
    return asyncio.run(add_outcome(row, out, tokenizer, reward))
