"""A tool cannot end its agent worker: SystemExit raised in a tool's create() or execute() (sys.exit,
argparse) fails that trajectory or that call, and the training step completes, under
`launch/train.py` with the loops in a worker process, for tools run in a thread and on the worker's
event loop. Before, the exception ended the worker's event loop while its process lived on, and the
trainer waited for the rollout forever; `rollout.step_timeout_s` now bounds that wait too."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_train import REPO, _env, metrics  # noqa: E402
from tool_model import CALCULATOR_SCHEMA, gsm8k_rows  # noqa: E402

from conftest import GSM8K  # noqa: E402

NOOP_SCHEMA = {"type": "function", "function": {"name": "noop", "description": "Does nothing.",
                                                "parameters": {"type": "object", "properties": {}}}}


@pytest.mark.parametrize("isolation", ["thread", "loop"])
def test_system_exit_in_a_tool_fails_the_trajectory_not_the_worker(tool_caller: Path, tmp_path: Path,
                                                                    isolation: str):
    rows = tmp_path / "rows.jsonl"
    huge = {**gsm8k_rows(GSM8K / "train.jsonl", 1)[0], "prompt": [{"role": "user", "content": "x" * 10_000_000}]}
    rows.write_text("".join(json.dumps(r) + "\n" for r in [*gsm8k_rows(GSM8K / "train.jsonl", 8), huge]))
    tools = tmp_path / "tools.yaml"
    tools.write_text(yaml.safe_dump({"tools": [
        {"class_name": "exiting_tools.ExitingCalculator", "config": {"isolation": isolation},
         "tool_schema": CALCULATOR_SCHEMA},
        {"class_name": "exiting_tools.ExitOnEveryOtherCreate", "config": {}, "tool_schema": NOOP_SCHEMA}]}))
    out = tmp_path / "run"
    env = {**_env(), "PYTHONPATH": os.pathsep.join([str(REPO / "tests"), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(
        [sys.executable, "launch/train.py", f"model.path={tool_caller}", "data.val_path=null", "rollout.engine=hf",
         "rollout.in_process=true",
         "sft.enabled=false", "data.task=rows", f"data.train_path={rows}", f"rollout.tools_config={tools}",
         "data.prompts_per_step=2", "rollout.n=4", "rollout.max_tokens=48", "rollout.num_workers=1",
         "rollout.step_timeout_s=120", "trainer.steps=1", f"trainer.output_dir={out}"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    m = metrics(out)[-1]
    assert m["step"] == 1 and m["rollout/trajectories"] == 8
    assert m["rollout/invalid"] == 4, m  # every other create() raised SystemExit(2): those trajectories failed
    assert m["rollout/tool_calls"] >= 1 and m["rollout/tool_failed"] == m["rollout/tool_calls"], m
    assert "SystemExit" in proc.stderr
    # a 10 MB prompt is left out before the run, named by its row id; the other rows train
    from launch.data.rows import row_uid

    assert "left out 1 training row(s) whose prompt holds more than data.max_prompt_tokens=" in proc.stdout
    assert row_uid(huge) in proc.stdout
