"""Validation on held-out rows: pass@k and the per-source numbers against hand computations, and
through `launch/train.py` on a tiny llama taught to call the calculator: it runs at step 0 and
every `val_every` steps, its rows never enter a training batch (also beside asynchronous
rollout), greedy validation gives the same samples twice (the standalone evaluator on the run's
checkpoint and export reproduces the run's own last validation), and a kill -9 + resume neither
repeats nor skips one."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_train import REPO, _env, _wait_for, metrics  # noqa: E402
from waiting import wait_for_unlocked  # noqa: E402
from tool_model import gsm8k_rows  # noqa: E402

from agent.loop import AgentLoopOutput  # noqa: E402
from launch.data.rows import row_uid  # noqa: E402
from launch.validation import ks_for, pass_at_k, summarize  # noqa: E402

GSM8K = REPO.parent / "shared" / "data" / "gsm8k"


def test_pass_at_k_matches_a_hand_computation():
    assert pass_at_k(4, 1, 1) == 0.25
    assert pass_at_k(4, 1, 2) == 0.5  # 1 - C(3,2)/C(4,2) = 1 - 3/6
    assert pass_at_k(4, 2, 2) == pytest.approx(1 - 1 / 6)
    assert pass_at_k(4, 0, 4) == 0.0 and pass_at_k(4, 1, 4) == 1.0 and pass_at_k(4, 3, 2) == 1.0
    assert pass_at_k(5, 2, 3) == pytest.approx(1 - math.comb(3, 3) / math.comb(5, 3))
    assert ks_for(1) == [1] and ks_for(4) == [1, 2, 4] and ks_for(6) == [1, 2, 4, 6]
    with pytest.raises(ValueError, match="k=5"):
        pass_at_k(4, 1, 5)


def _out(reward: float, termination: str = "stop", calls: int = 0, failed: int = 0, length: int = 10) -> AgentLoopOutput:
    turns = [{"kind": "tools", "calls": calls, "failed": failed}] if calls else []
    return AgentLoopOutput(prompt_ids=[1], response_ids=[2] * length, response_mask=[1] * length,
                           response_logprobs=[0.0] * length, reward=reward, num_turns=1 + bool(calls),
                           termination=termination, turns=turns)


def test_summary_per_data_source_from_known_rewards():
    rows = [{"data_source": "a"}, {"data_source": "a"}, {"data_source": "b"}]
    rewards = [[1, 0, 0, 0], [1, 1, 0.5, 0], [0, 0, 0, 0]]  # passes (threshold 1): 1, 2, 0 of 4
    outputs = [_out(r, calls=1, failed=int(r == 0)) for rs in rewards for r in rs]
    outputs[-1] = _out(0.0, termination="length")
    m = summarize(rows, outputs, n=4, threshold=1.0)
    assert m["val/rows"] == 3 and m["val/a/rows"] == 2 and m["val/b/rows"] == 1
    assert m["val/accuracy"] == 3 / 12 and m["val/a/accuracy"] == 3 / 8 and m["val/b/accuracy"] == 0
    assert m["val/a/reward_mean"] == m["val/a/mean@4"] == 3.5 / 8
    # pass@k per row, averaged: row 1 (c=1): 1/4, 1/2, 1; row 2 (c=2): 1/2, 5/6, 1
    assert m["val/a/pass@1"] == pytest.approx((0.25 + 0.5) / 2)
    assert m["val/a/pass@2"] == pytest.approx((0.5 + 5 / 6) / 2)
    assert m["val/a/pass@4"] == 1.0 and m["val/b/pass@4"] == 0.0
    assert m["val/pass@4"] == pytest.approx(2 / 3)
    # 11 calls, 7 of them failed (3 + 1 + 3 samples of reward 0; the last sample made none)
    assert m["val/tool_calls_per_trajectory"] == 11 / 12 and m["val/tool_success"] == pytest.approx(1 - 7 / 11)
    assert m["val/b/termination/length"] == 0.25 and m["val/b/termination/stop"] == 0.75
    assert "val/a/termination/length" not in m
    greedy = summarize(rows[:1], outputs[:1], n=1, threshold=1.0)
    assert greedy["val/accuracy"] == 1.0 and not any("pass@" in k for k in greedy)


# ---------------------------------------------------------------------------- through launch/train.py
@pytest.fixture(scope="module")
def task(tmp_path_factory: pytest.TempPathFactory, tool_caller: Path) -> dict[str, Path]:
    """The calculator-calling tiny llama, 32 training rows of GSM8K's train split and 12 held-out
    rows of its test split, in the rows format."""
    tmp = tmp_path_factory.mktemp("val-task")
    files = {"model": tool_caller}
    for name, split, n in (("train", "train", 32), ("val", "test", 12)):
        files[name] = tmp / f"{name}.jsonl"
        files[name].write_text("".join(json.dumps(r) + "\n" for r in gsm8k_rows(GSM8K / f"{split}.jsonl", n)))
    return files


def _args(task: dict[str, Path], out: Path, *extra: str) -> list[str]:
    # the engine served from the trainer's process (its own process is what test_train and test_fidelity
    # run): validation is the subject here, and each run saves an engine process's start-up
    return [f"model.path={task['model']}", "rollout.engine=hf", "rollout.in_process=true", "sft.enabled=false",
            "data.task=rows",
            f"data.train_path={task['train']}", f"data.val_path={task['val']}", "data.prompts_per_step=2",
            "rollout.n=2", "rollout.max_tokens=48", f"trainer.output_dir={out}", *extra]


def _run(script: str, args: list[str], timeout: int = 600) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, script, *args], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout, env=_env())
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _val_uids(task: dict[str, Path]) -> set[str]:
    return {row_uid(json.loads(line)) for line in task["val"].read_text().splitlines()}


def _trained_uids(rows: list[dict]) -> set[str]:
    return {u for m in rows for u in m.get("data/row_uids", [])}


def test_validation_runs_at_step_0_and_every_val_every_steps_and_the_evaluator_reproduces_it(
        task: dict[str, Path], tmp_path: Path):
    out = tmp_path / "run"
    proc = _run("launch/train.py", _args(task, out, "trainer.steps=3", "trainer.val_every=2"))
    rows = metrics(out)
    val = [m for m in rows if "val/accuracy" in m]
    assert [m["step"] for m in val] == [0, 2, 3] and [m["step"] for m in rows] == [0, 1, 2, 3]
    assert sorted(p.name for p in (out / "val").iterdir()) == ["step_0.jsonl", "step_2.jsonl", "step_3.jsonl"]
    for m in val:  # the weights the step ended with (no SFT: the engines start at version 0)
        assert m["val/weight_version"] == m.get("weight_version", 0) == m["val/weight_version_max"], m
        assert m["val/rows"] == m["val/openai/gsm8k/rows"] == 12 and m["val/samples"] == 12
        assert m["val/tool_calls_per_trajectory"] > 0  # the model calls its calculator: a real multi-turn path
    summary = next(line for line in proc.stdout.splitlines() if line.startswith("SUMMARY"))
    assert f"val_before={val[0]['val/accuracy']:.4g}" in summary and f"val_after={val[-1]['val/accuracy']:.4g}" in summary
    assert "validation after step 2: accuracy=" in proc.stdout

    last = _records(out / "val" / "step_3.jsonl")
    assert [r["row"] for r in last] == list(range(12)) and {r["row_uid"] for r in last} == _val_uids(task)
    assert _trained_uids(rows) and not _trained_uids(rows) & _val_uids(task)  # never trained on
    assert len({r["response"] for r in last}) > 1  # greedy, yet the rows' replies differ: a real comparison
    assert all(r["messages"][-1]["role"] == "assistant" and "reward_parts" in r for r in last)

    # the same weights evaluated again, from the checkpoint and from the export: the same samples
    for how, extra in (("checkpoint", ["--checkpoint", str(out / "checkpoints" / "step_000003")]),
                       ("export", [f"model.path={out / 'hf'}"])):
        ev = tmp_path / f"eval-{how}"
        proc = _run("launch/evaluate.py", [*_args(task, out, "rollout.max_tokens=48"), *extra, "--out", str(ev)])
        again = _records(ev / "val" / "eval.jsonl")
        assert [(r["response"], r["reward"]) for r in again] == [(r["response"], r["reward"]) for r in last], how
        got = json.loads((ev / "eval_metrics.json").read_text())
        for key in ("val/accuracy", "val/reward_mean", "val/tool_calls_per_trajectory", "val/response_length_mean"):
            assert got[key] == val[-1][key], (how, key)
        assert "EVAL accuracy=" in proc.stdout
        # and a table: a line per data source and one for all, the numbers of the metrics file
        head = next(i for i, line in enumerate(proc.stdout.splitlines()) if line.startswith("data source"))
        lines = proc.stdout.splitlines()[head:head + 8]
        assert lines[0].split()[2:] == ["rows", "accuracy", "reward", "turns", "tool", "calls"], lines
        everything = next(line for line in lines if line.startswith("all "))
        assert everything.split()[1:3] == [str(int(got["val/rows"])), f"{got['val/accuracy']:.3f}"], lines


def test_sampled_validation_beside_asynchronous_rollout(task: dict[str, Path], tmp_path: Path):
    """val.n=4 at temperature 1 while rollout runs on (staleness 1): pass@k equals the estimate
    computed by hand from the per-sample records, and no held-out row is trained on."""
    out = tmp_path / "run"
    _run("launch/train.py", _args(task, out, "trainer.steps=2", "trainer.val_every=1", "rollout.staleness=1",
                                  "val.n=4", "val.temperature=1.0", "val.pass_threshold=0.1",
                                  "rollout.agent.tool_agent.reward_shaping.tool_success_bonus=0.1"))
    rows = metrics(out)
    assert [m["step"] for m in rows if "val/accuracy" in m] == [0, 1, 2]
    assert not _trained_uids(rows) & _val_uids(task) and len(_trained_uids(rows)) >= 2
    for m in (r for r in rows if "val/accuracy" in r):
        recs = _records(out / "val" / f"step_{m['step']}.jsonl")
        assert len(recs) == 48 and m["val/samples"] == 48
        passes = [sum(r["passed"] for r in recs if r["row"] == i) for i in range(12)]
        assert [r["passed"] for r in recs] == [r["reward"] >= 0.1 for r in recs]
        for k in (1, 2, 4):
            assert m[f"val/pass@{k}"] == pytest.approx(sum(pass_at_k(4, c, k) for c in passes) / 12)
        assert m["val/pass@4"] >= m["val/pass@2"] >= m["val/pass@1"] == pytest.approx(m["val/accuracy"])
        assert m["val/weight_version_max"] >= m["val/weight_version_min"] >= m["val/weight_version"]
    assert 0 < rows[-1]["val/accuracy"] < 1, rows[-1]  # sampled tool calls: some pass, some do not


def _kill_when(args: list[str], path: Path, log: Path, out: Path) -> None:
    """Start a run on `out` and kill -9 it as soon as `path` exists; back once it has ended."""
    proc = subprocess.Popen([sys.executable, "launch/train.py", *args], cwd=REPO, env=_env(), stdout=log.open("w"),
                            stderr=subprocess.STDOUT, start_new_session=True)
    try:
        _wait_for(path, proc, 300)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
    wait_for_unlocked(out)


def test_kill_9_and_resume_neither_repeat_nor_skip_a_validation(task: dict[str, Path], tmp_path: Path):
    out = tmp_path / "run"
    args = _args(task, out, "trainer.steps=4", "trainer.val_every=1")
    # killed in step 1, before any checkpoint: the run starts over, but step 0's validation is logged already
    _kill_when(args, out / "metrics.jsonl", tmp_path / "first.log", out)
    assert [m["step"] for m in metrics(out)] == [0]
    # killed in step 3 (its rollout or its validation), after step 2's checkpoint
    _kill_when(args, out / "checkpoints" / "step_000002" / "state.pt", tmp_path / "second.log", out)
    assert "validation after step 0" not in (tmp_path / "second.log").read_text()
    assert [m["step"] for m in metrics(out) if "val/accuracy" in m][:3] == [0, 1, 2]
    third = _run("launch/train.py", args)
    assert "resuming from" in third.stdout and "validation after step 0" not in third.stdout
    rows = metrics(out)
    assert [m["step"] for m in rows if "val/accuracy" in m] == [0, 1, 2, 3, 4]  # each once
    assert [m["step"] for m in rows] == [0, 1, 2, 3, 4]
    assert sorted(p.name for p in (out / "val").iterdir()) == [f"step_{i}.jsonl" for i in range(5)]


@pytest.mark.parametrize("args, message", [
    (["--checkpoint", "/nonexistent/step_000001"], "has no state.pt"),
    (["data.val_path=null"], "data.val_path is not set"),
    (["--out"], "--out needs a value"),
    (["--bogus"], "unknown option '--bogus'"),
    (["val.n=3"], "val.n=3 greedy samples would all be the same"),
])
def test_the_evaluator_refuses_bad_input_before_any_model_loads(tmp_path: Path, args: list[str], message: str):
    proc = subprocess.run([sys.executable, "launch/evaluate.py", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=120, env={**_env(), "SWITCHYARD_CACHE": str(tmp_path / "cache")})
    assert proc.returncode == 2 and message in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert not (tmp_path / "cache").exists()
