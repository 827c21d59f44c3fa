"""Environments with reset() and step(action): the gym-style loop trains one GRPO step through
launch/train.py on an environment written here (a guessing game, sync and async forms, gym and
gymnasium step tuples), each step's reward attached to its turn; a broken environment fails only
its trajectory; a bad config is refused before any model loads."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from agent.gym_loop import GymAgentLoop, as_messages, unpack_step  # noqa: E402
from agent.loop import AgentContext  # noqa: E402

GUESS = '''
import asyncio


class Guess:
    """Guess a digit; the environment says higher or lower. 1 for the right digit, -0.1 per wrong one."""

    def __init__(self, max_guesses=3):
        self.max_guesses = max_guesses

    def reset(self, target=7):
        self.target, self.guesses = int(target), 0
        return "Guess my digit (0-9). Answer with one digit."

    def step(self, action):
        self.guesses += 1
        digits = [int(c) for c in action if c.isdigit()]
        if digits and digits[0] == self.target:
            return "right", 1.0, True, {}
        hint = "higher" if digits and digits[0] < self.target else "lower"
        return f"No, {hint}.", -0.1, False, self.guesses >= self.max_guesses, {}


class AsyncGuess(Guess):
    async def reset(self, target=7):
        await asyncio.sleep(0)
        return super().reset(target), {}

    async def step(self, action):
        await asyncio.sleep(0)
        return super().step(action)

    async def close(self):
        pass


class Broken(Guess):
    def step(self, action):
        raise RuntimeError("the simulator crashed")
'''


def test_observations_and_step_tuples():
    assert as_messages("hi") == [{"role": "user", "content": "hi"}]
    assert as_messages([{"role": "tool", "content": "x"}]) == [{"role": "tool", "content": "x"}]
    with pytest.raises(TypeError, match="a string"):
        as_messages(3)
    assert unpack_step(("o", 1, False, {})) == ("o", 1.0, False)
    assert unpack_step(("o", 0, False, True, {})) == ("o", 0.0, True)  # truncated ends it too
    with pytest.raises(ValueError, match="finite"):
        unpack_step(("o", float("nan"), False, {}))


def test_async_and_broken_environments_on_a_real_engine(tmp_path: Path, servers):
    from engines.models import load_tokenizer
    from rollout.bus.client import GenerateClient

    (tmp_path / "guess.py").write_text(GUESS)
    srv = servers(1, backend="hf", model="tiny-llama")
    tok = load_tokenizer("tiny-llama")
    row = {"prompt": [{"role": "user", "content": "Play."}], "env_kwargs": {"target": 3}}

    async def main() -> list:
        async with GenerateClient(srv.addresses) as client:
            await client.wait_ready(timeout_s=300)
            outs = []
            for name in ("AsyncGuess", "Broken"):
                loop = GymAgentLoop(AgentContext(client, tok, config={"env": f"{tmp_path}/guess.py:{name}",
                                                                      "max_steps": 3}))
                outs.append(await loop.run({"temperature": 1.0, "max_tokens": 4}, **row))
            return outs

    ok, broken = asyncio.run(main())
    ok.check()
    assert ok.termination in ("env_done", "max_steps") and ok.num_turns == len(ok.request_ids) >= 1
    assert ok.reward == pytest.approx(sum(r for _, r in ok.turn_rewards)) == ok.reward_extra["env"]
    assert [t for t in ok.turns if t["kind"] == "env"] and ok.messages[1]["content"].startswith("Guess my digit")
    assert broken.termination == "error" and "the simulator crashed" in broken.error and broken.reward == 0.0


def test_one_grpo_step_on_a_gym_environment(tmp_path: Path):
    from test_train import TINY, metrics, train

    (tmp_path / "guess.py").write_text(GUESS)
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"agent_name": "gym_agent", "data_source": "guess",
                                        "prompt": [{"role": "user", "content": "Let's play."}],
                                        "env_kwargs": {"target": t}}) + "\n" for t in range(10)))
    out = tmp_path / "run"
    proc = train([*TINY, "rollout.in_process=true", "data.task=rows", f"data.train_path={rows}", "sft.enabled=false",
                  "trainer.steps=1", "rollout.max_tokens=4", f"rollout.agent.gym_agent.env={tmp_path}/guess.py:Guess",
                  "rollout.agent.gym_agent.max_steps=3", "algorithm.advantage=turn_grpo",
                  f"trainer.output_dir={out}"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    step = [m for m in metrics(out) if m.get("step") == 1][0]
    assert step["rollout/invalid"] == 0.0 and step["rollout/num_turns_mean"] > 1  # several steps per episode
    assert step["rollout/turn_rewards_per_trajectory"] > 0 and step["rollout/reward_extra/env_steps"] >= 1
    bad = train([*TINY, "data.task=rows", f"data.train_path={rows}", "rollout.agent.gym_agent.env=no.such.Env"],
                timeout=120)
    assert bad.returncode == 2 and "rollout.agent.gym_agent" in bad.stderr and "no.such" in bad.stderr
