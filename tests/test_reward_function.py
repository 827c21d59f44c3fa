"""A reward function of the user's own, by path: verl's signature and the whole-trajectory one, sync
and async, in a thread or a process pool; a dict's parts logged; a scorer that raises, hangs or
returns garbage fails only its trajectory. One GRPO step through launch/train.py with a file in a
temporary directory."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from agent.loop import AgentLoopOutput  # noqa: E402
from agent.rewards.function import RewardConfig, RewardFunction, load_function  # noqa: E402
from test_tool_agent_states import tok  # noqa: E402,F401
from test_train import TINY, metrics, train  # noqa: E402

SCORERS = '''
import asyncio, time

calls = {"n": 0}

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    calls["n"] += 1
    if calls["n"] == 1:
        raise RuntimeError("scorer bug")
    if calls["n"] == 2:
        time.sleep(30)
    return {"score": 1.0 if str(ground_truth) in solution_str else 0.25, "acc": 1.0, "source_len": len(data_source)}

def whole(trajectory):
    return float(trajectory["num_turns"]) + len(trajectory["messages"]) / 100

async def later(data_source, solution_str, ground_truth, extra_info=None):
    await asyncio.sleep(0.01)
    return 0.5

def cpu(data_source, solution_str, ground_truth, extra_info=None):
    import os
    return float(os.getpid())

def garbage(data_source, solution_str, ground_truth, extra_info=None):
    return {"acc": 1.0}
'''


def _out(tok, text: str) -> AgentLoopOutput:  # noqa: F811
    ids = tok.encode(text, add_special_tokens=False)
    return AgentLoopOutput([1, 2], ids, [1] * len(ids), [-0.1] * len(ids), reward=1.5, num_turns=1, termination="stop",
                           reward_extra={"rule": 1.0, "tool": 0.5}, messages=[{"role": "user", "content": "q"}])


ROW = {"data_source": "arithmetic", "reward_model": {"style": "rule", "ground_truth": "42"}, "extra_info": {"i": 3}}


def test_every_form_scores_and_every_failure_stays_with_its_trajectory(tmp_path: Path, tok):  # noqa: F811
    path = tmp_path / "scorers.py"
    path.write_text(SCORERS)

    async def score(name: str, **cfg) -> AgentLoopOutput:
        fn = RewardFunction(RewardConfig(function=f"{path}:{name}", **cfg))
        out = _out(tok, "the answer is 42")
        try:
            await fn.score(ROW, out, tok)
        finally:
            fn.close()
        return out

    async def body():
        fn = RewardFunction(RewardConfig(function=f"{path}:compute_score", timeout_s=1.0))
        outs = [_out(tok, "the answer is 42") for _ in range(3)]
        try:
            for o in outs:
                await fn.score(ROW, o, tok)
        finally:
            fn.close()
        return outs, await score("whole"), await score("later"), await score("cpu", processes=1), \
            await score("garbage")

    (raised, hung, good), whole, later, cpu, garbage = asyncio.run(body())
    assert raised.termination == "error" and "RuntimeError: scorer bug" in raised.error
    assert hung.termination == "error" and "reward.timeout_s=1.0" in hung.error
    assert raised.reward_extra["function_error"] == 1.0 and raised.reward == pytest.approx(0.5)  # the tool part stays
    assert good.termination == "stop" and good.reward == pytest.approx(1.5)  # rule 1.0 replaced by the score 1.0
    assert good.reward_extra["function"] == 1.0 and good.reward_extra["rule"] == 0.0
    assert good.reward_extra["function/acc"] == 1.0 and good.reward_extra["function/source_len"] == len("arithmetic")
    assert whole.reward_extra["function"] == pytest.approx(1.01)  # one turn, one message
    assert later.reward_extra["function"] == 0.5
    assert cpu.reward_extra["function"] != float(__import__("os").getpid())  # ran in a process of its own
    assert garbage.termination == "error" and "without 'score'" in garbage.error


def test_a_bad_reward_function_is_refused_naming_the_fix(tmp_path: Path):
    with pytest.raises(ValueError, match="is not a file"):
        load_function(f"{tmp_path}/missing.py:f")
    (tmp_path / "r.py").write_text("x = 1\n")
    with pytest.raises(ValueError, match="has no function 'f'"):
        load_function(f"{tmp_path}/r.py:f")
    with pytest.raises(ValueError, match="cannot import 'no_such_pkg_xyz.mod'"):
        load_function("no_such_pkg_xyz.mod:f")
    with pytest.raises(ValueError, match="path/to/file.py:name"):
        RewardConfig(function="compute_score")


def test_one_grpo_step_with_a_reward_function_from_a_file(tmp_path: Path):
    path = tmp_path / "my_reward.py"
    path.write_text(SCORERS)
    out = tmp_path / "run"
    proc = train([*TINY, "data.prompts_per_step=3", "trainer.steps=1", f"trainer.output_dir={out}",
                  f"reward.function={path}:compute_score", "reward.timeout_s=3"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    step = [m for m in metrics(out) if m.get("step") == 1][0]
    assert step["rollout/invalid"] == 2.0  # the call that raised and the one that hung; the step went on
    assert step["rollout/trajectories"] == 6.0
    assert step["rollout/reward_extra/function/acc"] == 1.0  # the dict's parts, logged
    assert step["rollout/reward_extra/function_error"] == pytest.approx(2 / 6)
    assert json.dumps(step)  # the line is plain JSON
