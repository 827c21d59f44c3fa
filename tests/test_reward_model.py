"""A reward model or an LLM judge on engines of its own: the verdict parsing, the config's errors,
and one GRPO step through launch/train.py judged by a real model served on the bus, whose
requests reach the judge's engine while the policy's other trajectories still generate."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from agent.rewards.model import RewardModelConfig, question_of, verdict  # noqa: E402
from waiting import until  # noqa: E402

GSM8K = Path(__file__).resolve().parents[2] / "shared" / "data" / "gsm8k"


def test_the_verdict_is_the_last_number_scaled_and_clamped():
    assert verdict("I think 3, no: 7", r"-?\d+(?:\.\d+)?", 10) == pytest.approx(0.7)
    assert verdict("score: 42", r"-?\d+(?:\.\d+)?", 10) == 1.0
    assert verdict("-3", r"-?\d+(?:\.\d+)?", 10) == 0.0
    assert verdict("<tool_call>12*3</tool_call> #### 36", r"####\s*(-?\d+)", 100) == pytest.approx(0.36)
    assert verdict("no number here", r"-?\d+(?:\.\d+)?", 10) is None
    assert question_of({"prompt": [{"role": "system", "content": "s"}, {"role": "user", "content": "q?"}]}) == "q?"


@pytest.mark.parametrize("given, words", [
    ({"kind": "critic"}, "reward.model.kind='critic'"),
    ({"template": "{question} {answer}"}, "unknown field 'answer'"),
    ({"pattern": "(["}, "not a regular expression"),
    ({"max_score": 0}, "reward.model.max_score=0"),
])
def test_a_bad_reward_model_config_is_refused_naming_the_key(given: dict, words: str):
    with pytest.raises(ValueError, match=words.replace("(", r"\(").replace("[", r"\[")):
        RewardModelConfig(path="tiny-llama", **given)
    assert RewardModelConfig(kind="critic").path is None  # no model: nothing to check


@pytest.mark.skipif(not (GSM8K / "train.jsonl").exists(), reason=f"GSM8K jsonl not found in {GSM8K}")
def test_one_grpo_step_judged_by_a_model_on_its_own_engine(tmp_path: Path, tool_caller: Path):
    """The judge is the tool-calling test model, asked the policy's question: it answers '#### N',
    and the verdict is N / 100 (a mechanism test: that judge knows nothing of the policy's answer)."""
    from test_train import metrics, train
    from tool_model import SYSTEM, gsm8k_rows

    rows = tmp_path / "rows.jsonl"  # the policy is the tool caller too: trajectories of 1 to 3 turns
    rows.write_text("".join(json.dumps(r) + "\n" for r in gsm8k_rows(GSM8K / "train.jsonl", 16)))
    out = tmp_path / "run"
    proc = train([f"model.path={tool_caller}", "data.task=rows", f"data.train_path={rows}", "data.val_path=null",
                  "rollout.engine=hf", "rollout.in_process=true", "rollout.max_tokens=48",
                  "rollout.tools_config=launch/configs/tools_calculator.yaml",
                  "sft.enabled=false", "data.prompts_per_step=4", "rollout.n=2", "trainer.steps=1", f"trainer.output_dir={out}",
                  "rollout.request_log=true", f"reward.model.path={tool_caller}", f"reward.model.system={json.dumps(SYSTEM)}",
                  "reward.model.template=\"{question}\"", "reward.model.pattern=\"####\\\\s*(-?\\\\d+)\"",
                  "reward.model.max_score=100", "reward.model.max_tokens=48", "reward.model.temperature=1.0"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "reward model (judge)" in proc.stdout
    step = [m for m in metrics(out) if m.get("step") == 1][0]
    assert step["rollout/reward_extra/model_error"] == 0.0
    assert step["rollout/reward_extra/model/latency_s"] > 0
    assert "rollout/reward_extra/model" in step and "rollout/reward_extra/model/unparsed" in step
    logs = sorted((out / "engines").glob("*.jsonl"))
    judge = [json.loads(x) for x in (out / "engines" / "reward0.jsonl").read_text().splitlines()]
    policy = [json.loads(x) for p in logs if p.name != "reward0.jsonl" for x in p.read_text().splitlines()]
    assert len(judge) == 8  # one judgement per trajectory of the step (validation is off)
    assert all(r["session_id"].startswith("judge-") for r in judge)
    # asynchronous scoring: the first trajectory went to the judge before the step's last generation
    # started (log times: when an engine took a request, and when it answered)
    print("judge took", sorted(round(r["started"] % 1000, 2) for r in judge))
    print("policy took", sorted(round(r["started"] % 1000, 2) for r in policy))
    assert min(r["started"] for r in judge) < max(r["started"] for r in policy)


def test_a_judge_engine_killed_mid_request_is_restarted_and_serves_the_request_it_held(tmp_path: Path):
    """The reward model's engine killed with -9 while it holds a request: the group's watcher starts it
    again at the same address at once (nobody calls `revive`), and the agents' client, never rebuilt,
    re-issues the held request to it, which is answered (the echo engine, answering after 1 s, stands
    in for the judge's model: the test is about the processes)."""
    import asyncio
    import signal
    import time

    from rollout.bus.client import GenerateClient
    from rollout.reward_engines import RewardEngines

    engines = RewardEngines({"path": "tiny-llama", "engine": "echo", "kind": "judge", "num_engines": 1,
                             "engine_options": {"delay_s": 1.0}}, "float32", tmp_path, request_log=False,
                            startup_timeout_s=120)
    (address,) = engines.start()
    try:
        async def body() -> tuple[int, float]:
            async with GenerateClient([address]) as client:
                await client.wait_ready(timeout_s=60)
                before = await client.generate([1, 2, 3], {"max_tokens": 2}, session_id="a")
                assert engines.revive() == []  # nothing died: nothing restarted
                held = asyncio.create_task(client.generate([1, 2, 3], {"max_tokens": 2}, session_id="b"))
                async def inside() -> bool:  # the request is inside the engine (it answers after 1 s)
                    return (await client.status(0)).stats["running"] == 1

                await until(inside, "the held request is inside the engine")
                first = engines.procs[0]
                first.send_signal(signal.SIGKILL)
                t0 = time.monotonic()
                after = await asyncio.wait_for(held, 60)
                assert first.poll() is not None and engines.procs[0] is not first
                return len(before.token_ids) + len(after.token_ids), time.monotonic() - t0

        tokens, waited = asyncio.run(body())
        assert engines.restarts == 1 and tokens == 4
        assert "restarted after exit code -9" in engines.logs[0].read_text()
        print(f"the held request was answered {waited:.1f}s after the kill")
    finally:
        engines.close()
    assert engines.procs == []  # stopped, and not restarted by the watcher


@pytest.mark.cold  # reads the process tree
def test_a_judge_killed_mid_run_is_restarted_within_a_step_through_train_py(tmp_path: Path):
    """launch/train.py with a judge on an engine of its own (the echo engine standing in for its model):
    the judge's engine killed with -9 once step 1 is logged is started again at once (not at the next
    step), the scores it held are re-issued to it, so no trajectory of any step scores with an error;
    the run says so and exits 0."""
    import os
    import signal
    import subprocess
    import time

    import psutil

    from test_train import REPO, _env, metrics

    out = tmp_path / "run"
    cmd = [sys.executable, "launch/train.py", "model.path=tiny-llama", "rollout.engine=hf", "data.val_path=null",
           "sft.enabled=false", "trainer.steps=4", "rollout.n=2", "data.prompts_per_step=2", "rollout.max_tokens=8",
           "reward.model.path=tiny-llama", "reward.model.engine=echo", "reward.model.max_tokens=4",
           "trainer.export_hf=false", f"trainer.output_dir={out}"]
    proc = subprocess.Popen(cmd, cwd=REPO, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while not ((out / "metrics.jsonl").exists() and (out / "metrics.jsonl").read_text().strip()):
            assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read()[-3000:]
            time.sleep(0.05)
        judges = [p for p in psutil.Process(proc.pid).children(recursive=True)
                  if any("reward0" in part for part in p.cmdline())]
        assert len(judges) == 1, [p.cmdline() for p in psutil.Process(proc.pid).children(recursive=True)]
        os.kill(judges[0].pid, signal.SIGKILL)
        text, _ = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 0, text[-3000:]
    assert "reward model engine reward0 died (exit code -9); restarting it" in text, text[-3000:]
    rows = metrics(out)
    assert [m["step"] for m in rows] == [1, 2, 3, 4] and rows[-1]["reward_model/restarts"] == 1, rows
    erred = [m["step"] for m in rows if m["rollout/reward_extra/model_error"] > 0]
    assert not erred, erred
