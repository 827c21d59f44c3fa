"""A reward function of the user's own, by path: verl's signature and the whole-trajectory one, sync
and async, in a thread or a process pool; a dict's parts logged; a scorer that raises, hangs or
returns garbage fails only its trajectory; the batch form (reward.batch_size) in both signatures,
its batches collected from concurrent calls, and its failures (a raise, a hang, a list of the wrong
length fail the batch; one bad element fails only its trajectory). One GRPO step through
launch/train.py with a file in a temporary directory."""

from __future__ import annotations

import asyncio
import json
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from agent.loop import AgentLoopOutput  # noqa: E402
from agent.rewards.function import RewardConfig, RewardFunction, load_function  # noqa: E402
from agent.rewards.outcome import OutcomeScorer  # noqa: E402
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
    return AgentLoopOutput([1, 2], ids, [1] * len(ids), [-0.1] * len(ids), reward=0.5, num_turns=1, termination="stop",
                           reward_extra={"tool": 0.5}, messages=[{"role": "user", "content": "q"}])


ROW = {"data_source": "arithmetic", "reward_model": {"style": "rule", "ground_truth": "42"}, "extra_info": {"i": 3}}


def test_every_form_scores_and_every_failure_stays_with_its_trajectory(tmp_path: Path, tok):  # noqa: F811
    path = tmp_path / "scorers.py"
    path.write_text(SCORERS)

    async def score(name: str, **cfg) -> AgentLoopOutput:
        fn = OutcomeScorer(dict(function=f"{path}:{name}", **cfg))
        out = _out(tok, "the answer is 42")
        try:
            await fn.score(ROW, out, tok)
        finally:
            await fn.close()
        return out

    async def body():
        fn = OutcomeScorer(dict(function=f"{path}:compute_score", timeout_s=1.0))
        outs = [_out(tok, "the answer is 42") for _ in range(3)]
        try:
            for o in outs:
                await fn.score(ROW, o, tok)
        finally:
            await fn.close()
        return outs, await score("whole"), await score("later"), await score("cpu", processes=1), \
            await score("garbage")

    (raised, hung, good), whole, later, cpu, garbage = asyncio.run(body())
    assert raised.termination == "error" and "RuntimeError: scorer bug" in raised.error
    assert hung.termination == "error" and "reward.timeout_s=1.0" in hung.error
    assert raised.reward_extra["function_error"] == 1.0 and raised.reward == pytest.approx(0.5)  # the tool part stays
    assert good.termination == "stop" and good.reward == pytest.approx(1.5)  # the tool's 0.5 and the score 1.0, no rule
    assert good.reward_extra["function"] == 1.0 and good.reward_extra["rule"] == 0.0
    assert good.reward_extra["function/acc"] == 1.0 and good.reward_extra["function/source_len"] == len("arithmetic")
    assert whole.reward_extra["function"] == pytest.approx(1.01)  # one turn, one message
    assert later.reward_extra["function"] == 0.5
    assert cpu.reward_extra["function"] != float(__import__("os").getpid())  # ran in a process of its own
    assert garbage.termination == "error" and "without 'score'" in garbage.error


EXITS = """
import sys

def quits(data_source, solution_str, ground_truth, extra_info=None):
    sys.exit(3)

async def quits_async(data_source, solution_str, ground_truth, extra_info=None):
    raise KeyboardInterrupt

def quits_batch(data_sources, solution_strs, ground_truths, extra_infos=None):
    raise SystemExit("bye")
"""


@pytest.mark.parametrize("name, cfg, raised", [("quits", {}, "SystemExit(3)"), ("quits", {"processes": 1}, "SystemExit(3)"),
                                               ("quits_async", {}, "KeyboardInterrupt"),
                                               ("quits_batch", {"batch_size": 2}, "SystemExit(bye)")],
                         ids=["thread", "process", "async", "batch"])
def test_a_scorer_that_exits_fails_its_trajectory_and_the_loop_goes_on(tmp_path: Path, tok, name, cfg, raised):  # noqa: F811
    """SystemExit or KeyboardInterrupt from the user's scorer, in every form it can run in: its trajectory
    fails naming it, at once (not at the step's deadline), and the worker's event loop scores on."""
    path = tmp_path / "exits.py"
    path.write_text(EXITS)

    async def body() -> tuple[list[AgentLoopOutput], float, bool]:
        fn = OutcomeScorer(dict(function=f"{path}:{name}", timeout_s=30.0, **cfg))
        outs = [_out(tok, "the answer is 42") for _ in range(2)]
        t0 = time.monotonic()
        try:
            await asyncio.gather(*(fn.score(ROW, o, tok) for o in outs))
        finally:
            await fn.close()
        await asyncio.sleep(0.01)  # the loop still runs
        return outs, time.monotonic() - t0, True

    outs, took, alive = asyncio.run(body())
    assert alive and took < 20, took
    for o in outs:
        assert o.termination == "error" and f"the reward function raised {raised}" in o.error, o.error


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


BATCH_SCORERS = '''
import asyncio, time

LOG = __file__ + ".calls"  # one line per call: the batch's size


def _log(n):
    with open(LOG, "a") as f:
        f.write(f"{n}\\n")


def verl_batch(data_sources, solution_strs, ground_truths, extra_infos):
    _log(len(solution_strs))
    return [{"score": 1.0 if str(g) in s else 0.25, "i": float(e["i"]), "source_len": len(d)}
            for d, s, g, e in zip(data_sources, solution_strs, ground_truths, extra_infos)]


async def traj_batch(trajectories):
    await asyncio.sleep(0.01)
    _log(len(trajectories))
    return [t["num_turns"] + t["row"]["extra_info"]["i"] / 10 for t in trajectories]


def short(data_sources, solution_strs, ground_truths, extra_infos):
    return [1.0] * (len(solution_strs) - 1)


def one_nan(data_sources, solution_strs, ground_truths, extra_infos):
    return [float("nan") if e["i"] == 1 else 1.0 for e in extra_infos]


def slow(data_sources, solution_strs, ground_truths, extra_infos):
    time.sleep(3)
    return [1.0] * len(solution_strs)
'''


def _batch(tmp_path: Path, tok, name: str, texts: list[str], **cfg) -> list[AgentLoopOutput]:  # noqa: F811
    """`score()` called concurrently for each text (row i has extra_info.i = i), as a worker's tasks do."""
    path = tmp_path / "batch_scorers.py"
    path.write_text(BATCH_SCORERS)

    async def body() -> list[AgentLoopOutput]:
        fn = OutcomeScorer(dict(function=f"{path}:{name}", **cfg))
        outs = [_out(tok, t) for t in texts]
        try:
            await asyncio.gather(*(fn.score({**ROW, "extra_info": {"i": i}}, o, tok) for i, o in enumerate(outs)))
        finally:
            await fn.close()
        return outs

    return asyncio.run(body())


def _calls(tmp_path: Path) -> list[int]:
    log = tmp_path / "batch_scorers.py.calls"
    return [int(n) for n in log.read_text().split()] if log.exists() else []


def test_batch_form_verl_signature_collects_concurrent_calls(tmp_path: Path, tok):  # noqa: F811
    texts = ["the answer is 42", "no idea", "42", "it is 41", "42 again"]
    outs = _batch(tmp_path, tok, "verl_batch", texts, batch_size=4, batch_wait_s=0.2, timeout_s=5)
    assert _calls(tmp_path) == [4, 1]  # a full batch at once, the rest after batch_wait_s
    for i, (text, o) in enumerate(zip(texts, outs)):
        want = 1.0 if "42" in text else 0.25
        assert o.termination == "stop" and o.reward_extra["function_error"] == 0.0, o.error
        assert o.reward_extra["function"] == want and o.reward == pytest.approx(0.5 + want)  # the tool part stays
        assert o.reward_extra["function/i"] == float(i)  # each trajectory got its own element, in order
        assert o.reward_extra["function/source_len"] == len("arithmetic")


def test_batch_form_trajectory_signature_async(tmp_path: Path, tok):  # noqa: F811
    outs = _batch(tmp_path, tok, "traj_batch", ["a", "b", "c"], batch_size=3, batch_wait_s=0.2)
    assert _calls(tmp_path) == [3]
    assert [o.reward_extra["function"] for o in outs] == pytest.approx([1.0, 1.1, 1.2])  # one turn + i/10
    assert all(o.termination == "stop" for o in outs)


def test_batch_form_a_wrong_length_fails_the_batch_and_a_nan_only_its_trajectory(tmp_path: Path, tok):  # noqa: F811
    outs = _batch(tmp_path, tok, "short", ["42"] * 3, batch_size=3, timeout_s=5)
    for o in outs:
        assert o.termination == "error" and o.reward_extra["function_error"] == 1.0
        assert "returned 2 scores for a batch of 3" in o.error and o.reward == pytest.approx(0.5)
    outs = _batch(tmp_path, tok, "one_nan", ["42"] * 3, batch_size=3, timeout_s=5)
    assert [o.termination for o in outs] == ["stop", "error", "stop"]
    assert "returned nan" in outs[1].error and outs[1].reward_extra["function"] == 0.0
    assert outs[0].reward_extra["function"] == 1.0 and outs[2].reward_extra["function_error"] == 0.0


def test_batch_form_a_hanging_call_fails_each_trajectory_at_its_own_deadline(tmp_path: Path, tok):  # noqa: F811
    path = tmp_path / "batch_scorers.py"
    path.write_text(BATCH_SCORERS)

    async def body() -> tuple[list[AgentLoopOutput], list[float]]:
        fn = OutcomeScorer(dict(function=f"{path}:slow", batch_size=2, batch_wait_s=0.45, timeout_s=0.5))
        outs, done = [_out(tok, "42") for _ in range(2)], [0.0, 0.0]
        t0 = time.monotonic()

        async def one(i: int) -> None:
            await asyncio.sleep(0.4 * i)  # the second joins the batch 0.4 s after the first
            await fn.score(ROW, outs[i], tok)
            done[i] = time.monotonic() - t0

        try:
            await asyncio.gather(one(0), one(1))
        finally:
            await fn.close()
        return outs, done

    outs, done = asyncio.run(body())
    assert done[1] < 2.0  # not waiting for the call (it sleeps 3 s)
    assert done[1] - done[0] > 0.2  # each deadline counted from when it was handed in (0.5 s, 0.9 s)
    for o in outs:
        assert o.termination == "error" and "reward.timeout_s=0.5" in o.error
        assert o.reward_extra["function_error"] == 1.0 and o.reward_extra["function"] == 0.0


def test_a_bad_batch_config_is_refused_naming_the_fix(tmp_path: Path):
    with pytest.raises(ValueError, match=r"reward.batch_size=-1 must be an integer >= 0"):
        RewardConfig(batch_size=-1)
    with pytest.raises(ValueError, match=r"reward.batch_wait_s=-0.1 must be a number of seconds >= 0"):
        RewardConfig(batch_size=2, batch_wait_s=-0.1)
    with pytest.raises(ValueError, match=r"reward.batch_wait_s=2.0 must be below reward.timeout_s=1.0"):
        RewardConfig(batch_size=2, batch_wait_s=2.0, timeout_s=1.0)
    path = tmp_path / "batch_scorers.py"
    path.write_text(BATCH_SCORERS)
    with pytest.raises(ValueError, match="set reward.batch_size=N"):
        OutcomeScorer(dict(function=f"{path}:traj_batch"))


def test_one_grpo_step_with_a_reward_function_from_a_file(tmp_path: Path):
    """verl rows whose rule-style ground truth is text ("tiger", which no built-in rule scorer reads):
    the user's function scores them, and the step trains."""
    path = tmp_path / "my_reward.py"
    path.write_text(SCORERS)
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"data_source": "animals", "agent_name": "tool_agent",
                                        "prompt": [{"role": "user", "content": f"Name a big cat ({i})."}],
                                        "reward_model": {"style": "rule", "ground_truth": "tiger"}}) + "\n"
                            for i in range(3)))
    out = tmp_path / "run"
    proc = train([*TINY, "rollout.in_process=true", "data.task=rows", f"data.train_path={rows}", "sft.enabled=false",
                  "data.prompts_per_step=3", "trainer.steps=1", f"trainer.output_dir={out}",
                  f"reward.function={path}:compute_score", "reward.timeout_s=3"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    step = [m for m in metrics(out) if m.get("step") == 1][0]
    assert step["rollout/invalid"] == 2.0  # the call that raised and the one that hung; the step went on
    assert step["rollout/trajectories"] == 6.0
    assert step["rollout/reward_extra/function/acc"] == 1.0  # the dict's parts, logged
    assert step["rollout/reward_extra/function_error"] == pytest.approx(2 / 6)
    assert step["rollout/reward_mean"] == pytest.approx(0.25)  # "tiger" is in no reply: the function's 0.25
    assert "step/failed" not in step or not step["step/failed"]
    assert json.dumps(step)  # the line is plain JSON


def test_a_run_whose_reward_function_always_raises_trains_nothing_and_exits_1_naming_it(tmp_path: Path):
    """Every trajectory invalid: each step fails (nothing learned or pushed, the reasons counted, the
    first error quoted), and a run of only failed steps exits 1 instead of 0."""
    path = tmp_path / "raises.py"
    path.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                    "    raise ValueError(f'no score for {ground_truth!r}')\n")
    out = tmp_path / "run"
    proc = train([*TINY, "rollout.in_process=true", "data.prompts_per_step=2", "trainer.steps=2",
                  f"trainer.output_dir={out}", f"reward.function={path}:compute_score"])
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "ERROR: step 1 failed: none of its" in proc.stderr and "reward_function_failed x" in proc.stderr
    assert "the first error: the reward function failed: ValueError: no score for" in proc.stderr
    assert "error: every one of the run's 2 steps failed" in proc.stderr, proc.stderr[-3000:]
    steps = [m for m in metrics(out) if m.get("step", 0) > 0]
    assert [m["step/failed"] for m in steps] == [1.0, 1.0] and all("weight_version" in m for m in steps)
    assert steps[0]["weight_version"] == steps[1]["weight_version"]  # nothing pushed
    assert all(m["rollout/invalid"] == m["rollout/trajectories"] > 0 for m in steps), steps


def test_the_rule_scorers_are_a_reward_function_and_turn_rewards_reach_their_turns(tok):  # noqa: F811
    from agent.rewards import compute_score, rule_reward

    row = {"data_source": "openai/gsm8k", "reward_model": {"style": "rule", "ground_truth": "72"}}
    for text in ("so #### 72", "#### 71", "72"):
        assert compute_score("openai/gsm8k", text, "72") == rule_reward(row, text)
    assert compute_score("arithmetic", "it is 72", "72") == 1.0

    async def run(spec: str, outs: list[AgentLoopOutput]) -> None:
        fn = OutcomeScorer(dict(function=spec, timeout_s=5))
        await asyncio.gather(*(fn.score({"data_source": "arithmetic", "reward_model": {"ground_truth": "4"}}, o, tok)
                               for o in outs))
        await fn.close()

    mod = sys.modules.setdefault("turn_scorers", type(sys)("turn_scorers"))
    mod.per_turn = lambda trajectory: {"score": 1.0, "turn_rewards": [0.25, 0.0, 0.5]}
    mod.too_many = lambda trajectory: {"score": 1.0, "turn_rewards": [1.0] * 9}
    out = _out(tok, "2 + 2 = 4")
    n = len(out.response_ids)
    out.response_mask = [1, 1, 0] + [1] * (n - 5) + [0, 1]  # three model turns
    bad = _out(tok, "2 + 2 = 4")
    asyncio.run(run("turn_scorers:per_turn", [out]))
    asyncio.run(run("turn_scorers:too_many", [bad]))
    assert out.turn_rewards == [[2, 0.25], [n, 0.5]]  # after turn 0 and after turn 2; turn 1 earned 0
    assert out.reward_extra["function"] == 1.75 and out.reward_extra["function/turn_rewards"] == 0.75
    assert bad.termination == "error" and "9 entries but the trajectory has 1 model turns" in bad.error
