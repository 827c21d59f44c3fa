"""The agentic workload of `benchmarks/async_rl.py`: trajectories of several tool rounds whose
tool latency has a long tail, as search or code execution tools do.

`RoundsLoop` (agent name `rounds`): `rounds` times, generate up to `max_tokens`, then call a
"tool" that answers after a log-normal delay (median `median_s`, 99th percentile `p99_s`) and
append its fixed answer as context (mask 0). The delays are drawn from a generator seeded by the
row's prompt, the sample's place in its group and how often this worker has run that sample before,
so every run of the same rows meets the same delays (the modes of `async_rl.py` are compared on one
workload) while a group generated again meets new ones. The reward is the share of the model's tokens whose id is even: a target any
policy can learn from any start, so reward against wall-clock time compares training loops, not
models.
"""

from __future__ import annotations

import asyncio
import collections
import json
import math
import random
import re
from typing import Any

from agent.chat import ChatEncoder
from agent.loop import AgentLoopBase, AgentLoopOutput, Trajectory, new_session_id

Z99 = 2.3263  # the standard normal's 99th percentile


def lognormal_delay(rng: random.Random, median_s: float, p99_s: float) -> float:
    """A draw with the given median and 99th percentile (mu = ln median, sigma from the ratio)."""
    sigma = math.log(p99_s / median_s) / Z99 if p99_s > median_s else 0.0
    return rng.lognormvariate(math.log(median_s), sigma) if median_s > 0 else 0.0


_RUNS: collections.Counter = collections.Counter()  # (prompt, sample) -> times this process drew its delays


def delay_rng(row: dict[str, Any], session_id: str) -> random.Random:
    """The generator of one trajectory's tool delays: the same for the same row and sample in every
    run, new for each repeat within a run (a session id without a sample suffix seeds it alone)."""
    sample = re.search(r"-s(\d+)$", session_id)
    if sample is None or "prompt" not in row:
        return random.Random(session_id)
    key = (json.dumps(row["prompt"], sort_keys=True), int(sample.group(1)))
    _RUNS[key] += 1
    return random.Random(f"{key[0]}|{key[1]}|{_RUNS[key]}")


class RoundsLoop(AgentLoopBase):
    async def run(self, sampling_params: dict[str, Any], **row: Any) -> AgentLoopOutput:
        session_id = row.get("session_id") or new_session_id()
        rng = delay_rng(row, session_id)
        traj = Trajectory(ChatEncoder(self.tokenizer).initial(list(row["prompt"])))
        answer = self.tokenizer.encode("\nresult: 42\n", add_special_tokens=False)
        turns: list[dict[str, Any]] = []
        versions, request_ids = [], []
        rounds = int(self.config.get("rounds", 3))
        try:
            for r in range(rounds):
                result = await self.generate(traj, sampling_params, session_id, row.get("group_id"), turns)
                versions.append(result.weight_version)
                request_ids.append(result.request_id)
                if r < rounds - 1:
                    delay = lognormal_delay(rng, float(self.config.get("median_s", 1.0)),
                                            float(self.config.get("p99_s", 10.0)))
                    await asyncio.sleep(delay)
                    turns.append({"kind": "tools", "calls": 1, "latency_s": delay})
                    traj.add_context(answer)
        finally:
            self.client.end_session(session_id)
        model = [t for t, m in zip(traj.response_ids, traj.response_mask) if m]
        reward = sum(1 for t in model if t % 2 == 0) / max(1, len(model))
        return AgentLoopOutput(prompt_ids=traj.prompt_ids, response_ids=traj.response_ids,
                               response_mask=traj.response_mask, response_logprobs=traj.response_logprobs,
                               reward=reward, num_turns=rounds, termination="stop", turns=turns,
                               weight_versions=versions, request_ids=request_ids, session_id=session_id)
