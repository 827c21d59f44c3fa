"""A verifiers environment trained through launch/train.py (agent/verifiers_env.py).

verifiers pins openai and mcp versions that differ from switchyard's, so it runs in a virtual
environment of its own: made with --system-site-packages (torch, transformers and switchyard come
from the main environment), with verifiers and uv (its built-in harnesses run as uv scripts)
installed, built once per verifiers and Python version under the switchyard cache and reused. The
test skips only when that environment cannot be built because the package index is unreachable.

A taskset written here (four prompts; two reward functions, a weighted constant and a
reply-length score that also logs what it scored and refuses the fourth task) runs under verifiers'
own chat harness, one episode per trajectory: for one GRPO step of three tasks, whose rewards are
the rubric's and whose trained tokens are the engine's, checked against the engine's request log;
and through the openai_agent loop on a scripted bus client, where the rubric's reward of each known
reply is exact, a failed scoring and a stale row become error trajectories that say why. Malformed
rows and a missing verifiers are refused with errors that name the fix, without that environment.
"""

from __future__ import annotations

import asyncio
import fcntl
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

REPO = Path(__file__).resolve().parents[1]
VERIFIERS = "0.4.0"
TASKSET_ID = "sy-reply-length"  # imported as the module sy_reply_length

TASKSET = '''
import json
import os

import verifiers.v1 as vf


class ReplyTask(vf.Task[vf.TaskData]):
    @vf.reward(weight=0.5)
    async def answered(self, trace) -> float:
        return 1.0

    @vf.reward
    async def reply_length(self, trace) -> float:
        if self.data.idx == 3:
            raise ValueError("this rubric refuses to score task 3")
        score = len(trace.last_reply) / 1000
        with open(os.environ["SY_RUBRIC_LOG"], "a") as f:
            f.write(json.dumps({"task": self.data.idx, "reply": trace.last_reply, "score": score}) + "\\n")
        return score


class ReplyTaskset(vf.Taskset[ReplyTask]):
    def load(self):
        for prompt in ("Name a colour.", "Count from one to three, please.", "What is the capital of France?",
                       "Say anything."):
            yield ReplyTask(vf.TaskData(prompt=prompt), self.config.task)


__all__ = ["ReplyTaskset"]
'''


def _run(cmd: list[str], timeout: int = 900, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=timeout, **kw)


def verifiers_python() -> Path:
    """The python of a venv with verifiers (and uv) over the main environment's packages; built once
    per verifiers and Python version (a lock keeps parallel sessions from building it twice)."""
    import torch

    from engines.models import cache_root

    root = cache_root() / "test-venvs"
    root.mkdir(parents=True, exist_ok=True)
    venv = root / f"verifiers-{VERIFIERS}-py{sys.version_info[0]}{sys.version_info[1]}"
    python, ready = venv / "bin" / "python", venv / ".switchyard-ready"
    with open(root / f"{venv.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if ready.exists() and python.exists():
            return python
        shutil.rmtree(venv, ignore_errors=True)
        made = _run([sys.executable, "-m", "venv", "--system-site-packages", venv])
        assert made.returncode == 0, made.stderr[-2000:]
        pins = venv / "constraints.txt"
        pins.write_text(f"torch=={torch.__version__.split('+')[0]}\n")  # never replace the main torch
        got = _run([python, "-m", "pip", "install", "-q", "--disable-pip-version-check", "-c", pins,
                    f"verifiers=={VERIFIERS}", "uv"])
        if got.returncode != 0:
            probe = _run([python, "-m", "pip", "download", "-q", "--no-deps", "-d", venv / "probe",
                          f"verifiers=={VERIFIERS}"], timeout=300)
            shutil.rmtree(venv, ignore_errors=True)
            if probe.returncode != 0:
                pytest.skip(f"cannot build the verifiers venv: the package index is unreachable "
                            f"({probe.stderr.strip()[-300:]})")
            pytest.fail(f"pip could not install verifiers=={VERIFIERS} beside the main environment:\n"
                        f"{got.stderr[-3000:]}")
        ready.write_text(VERIFIERS + "\n")
    return python


@pytest.fixture(scope="module")
def vf_python() -> Path:
    return verifiers_python()


def _env(tmp_path: Path, python: Path) -> dict[str, str]:
    return {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1",
            "PYTHONPATH": os.pathsep.join([str(tmp_path), str(REPO)]),
            "PATH": os.pathsep.join([str(python.parent), os.environ.get("PATH", "")]),  # its uv
            "SY_RUBRIC_LOG": str(tmp_path / "rubric.jsonl")}


def test_one_grpo_step_on_a_verifiers_environment(vf_python: Path, tmp_path: Path):
    from test_tool_agent import _tokenizer
    from test_train import metrics

    (tmp_path / "sy_reply_length.py").write_text(TASKSET)
    env, rows = _env(tmp_path, vf_python), tmp_path / "rows.jsonl"
    made = _run([vf_python, "-m", "agent.verifiers_env", "--taskset", TASKSET_ID, "--limit", "3", "--out", rows],
                cwd=REPO, env=env)
    assert made.returncode == 0, made.stderr[-3000:]
    written = [json.loads(line) for line in rows.read_text().splitlines()]
    assert [r["verifiers"]["task"] for r in written] == [0, 1, 2]
    assert written[1]["prompt"] == [{"role": "user", "content": "Count from one to three, please."}]
    assert written[0]["verifiers"]["env"] == {"taskset": {"id": TASKSET_ID}, "agent": {
        "runtime": {"type": "subprocess"}, "harness": {"id": "null"}}}  # verifiers' plain chat loop

    out = tmp_path / "run"
    proc = _run([vf_python, "launch/train.py", "model.path=tiny-llama", "data.val_path=null", "rollout.engine=hf",
                 "sft.enabled=false", "data.task=rows", f"data.train_path={rows}", "data.agent_name=openai_agent",
                 "data.prompts_per_step=2", "rollout.n=2", "rollout.max_tokens=12", "trainer.steps=1",
                 "rollout.request_log=true",
                 "rollout.agent.openai_agent.agent_function=agent.verifiers_env.run_episode",
                 f"trainer.output_dir={out}"], timeout=600, cwd=REPO, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    m = metrics(out)[-1]
    assert m["step"] == 1 and m["rollout/trajectories"] == 4 and m["rollout/invalid"] == 0, m
    assert m["rollout/num_turns_mean"] == 1  # one episode, one conversation, one trajectory

    # the rewards are the rubric's: 0.5 x 1.0 + the length score each episode logged
    scored = [json.loads(line) for line in (tmp_path / "rubric.jsonl").read_text().splitlines()]
    assert len(scored) == 4
    mean = sum(0.5 + s["score"] for s in scored) / 4
    assert m["rollout/reward_extra/agent"] == pytest.approx(mean, abs=1e-9)
    assert m["rollout/reward_mean"] == pytest.approx(mean, abs=1e-6) and 0.5 <= mean <= 0.6

    # the tokens trained are the engine's: every request it served is one trajectory's only turn
    log = [json.loads(line) for p in sorted((out / "engines").glob("*.jsonl")) for line in p.read_text().splitlines()]
    assert len(log) == 4 and len({r["session_id"] for r in log}) == 4
    assert m["rollout/model_tokens_mean"] * 4 == sum(len(r["token_ids"]) for r in log)
    assert m["rollout/response_length_mean"] == m["rollout/model_tokens_mean"]  # no token but the engine's
    tok = _tokenizer("tiny-llama")
    prompts = {len(tok.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=True,
                                           return_dict=True)["input_ids"]): r["verifiers"]["task"] for r in written}
    assert len(prompts) == 3 and all(r["prompt_len"] in prompts for r in log)  # the task's prompt, rendered once
    replies = [tok.decode(r["token_ids"], skip_special_tokens=False) for r in log]
    for s in scored:  # what the rubric scored is what the engine generated
        match = next((i for i, text in enumerate(replies) if s["reply"] in text), None)
        assert match is not None, (s, replies)
        assert prompts[log[match]["prompt_len"]] == s["task"]
        replies.pop(match), log.pop(match)


EPISODES = """
import asyncio, json, sys

from transformers import AutoTokenizer

from agent.loop import AgentContext
from agent.openai_agent import OpenAIAgentLoop
from engines.models import resolve_model
from test_tool_agent_states import ScriptedClient


async def main(rows, out):
    tok = AutoTokenizer.from_pretrained(resolve_model("tiny-llama"))
    client = ScriptedClient(tok, ["Blue.", "One, two, three.", "Paris is the capital of France.", "No."])
    loop = OpenAIAgentLoop(AgentContext(client, tok, config={"agent_function": "agent.verifiers_env.run_episode"}))
    done = []
    for i, line in enumerate(open(rows)):  # one at a time: the scripted replies go out in order
        o = await loop.run({"max_tokens": 32}, session_id=f"s{i}", **json.loads(line))
        done.append({"reward": o.reward, "termination": o.termination, "error": o.error, "turns": o.num_turns,
                     "segments": 1 + len(o.extra_segments), "messages": o.messages, "model_ids": o.model_token_ids()})
    json.dump(done, open(out, "w"))


asyncio.run(main(*sys.argv[1:]))
"""


def test_episodes_through_the_openai_agent_loop(vf_python: Path, tmp_path: Path):
    from test_tool_agent import _tokenizer

    (tmp_path / "sy_reply_length.py").write_text(TASKSET)
    (tmp_path / "episodes.py").write_text(EPISODES)
    env, rows = _env(tmp_path, vf_python), tmp_path / "rows.jsonl"
    env["PYTHONPATH"] += os.pathsep + str(Path(__file__).resolve().parent)
    made = _run([vf_python, "-m", "agent.verifiers_env", "--taskset", TASKSET_ID, "--out", rows], cwd=REPO, env=env)
    assert made.returncode == 0, made.stderr[-3000:]
    written = [json.loads(line) for line in rows.read_text().splitlines()]
    stale = json.loads(json.dumps(written[0]))
    stale["verifiers"]["key"] = "0" * 64  # a row written from another version of the taskset
    rows.write_text("".join(json.dumps(r) + "\n" for r in [*written, stale]))
    ran = _run([vf_python, tmp_path / "episodes.py", rows, tmp_path / "out.json"], timeout=600, cwd=REPO, env=env)
    assert ran.returncode == 0, ran.stderr[-4000:]
    outs = json.loads((tmp_path / "out.json").read_text())
    tok = _tokenizer("tiny-llama")
    for o, reply, row in zip(outs, ["Blue.", "One, two, three.", "Paris is the capital of France."], written):
        assert o["termination"] == "stop" and not o["error"] and o["turns"] == 1 and o["segments"] == 1, o
        assert o["reward"] == pytest.approx(0.5 + len(reply) / 1000, abs=1e-12)  # 0.5 x 1.0 + the length score
        assert o["messages"] == [*row["prompt"], {"role": "assistant", "content": reply}]
        assert o["model_ids"] == tok.encode(reply, add_special_tokens=False) + [tok.eos_token_id]
    refused, old = outs[3], outs[4]
    assert refused["termination"] == "error" and "EpisodeFailed" in refused["error"], refused
    assert "this rubric refuses to score task 3" in refused["error"] and refused["turns"] == 1
    assert old["termination"] == "error" and "the taskset changed since the rows were written" in old["error"], old


def test_rows_are_checked_before_verifiers_is_needed(monkeypatch):
    from agent.verifiers_env import run_episode

    monkeypatch.setitem(sys.modules, "verifiers", None)  # as if verifiers were not installed
    monkeypatch.setitem(sys.modules, "verifiers.v1", None)
    good = {"verifiers": {"env": {"taskset": {"id": "my-taskset"}}, "task": 0}}
    bad = [({"prompt": []}, "row has no 'verifiers' mapping"),
           ({"verifiers": {"env": {"taskset": {}}, "task": 0}}, "must be an env config naming its taskset"),
           ({"verifiers": {**good["verifiers"], "task": -1}}, r"verifiers.task=-1 must be the task's position"),
           ({"verifiers": {**good["verifiers"], "task": "3"}}, r"verifiers.task='3'")]
    for row, message in bad:
        with pytest.raises(ValueError, match=message):
            asyncio.run(run_episode("http://127.0.0.1:1/v1", "k", row))
    with pytest.raises(ImportError, match=r"pip install verifiers"):
        asyncio.run(run_episode("http://127.0.0.1:1/v1", "k", good))
