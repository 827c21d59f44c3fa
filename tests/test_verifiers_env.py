"""A verifiers environment trained through launch/train.py (agent/verifiers_env.py).

verifiers pins openai and mcp versions that differ from switchyard's, so it runs in a virtual
environment of its own: made with `python -m launch.venv` (torch, transformers and switchyard come
from the main environment), with verifiers and uv (its built-in harnesses run as uv scripts)
installed, built once per verifiers and Python version under the switchyard cache and reused. The
test skips only when that environment cannot be built because the package index is unreachable.

A GSM8K taskset written here (the first rows of the shared GSM8K test set, a calculator offered as
a verifiers MCP toolset, a reward for the right final number plus a logged, deterministic
reply-length score) trains one GRPO step through launch/train.py on the session's tool-calling
tiny model with verifiers' train client (verifiers renders token ids, the gateway's
/inference/v1/generate records them): rewards are the rubric's, and the token ids in each
episode's verifiers trace are the engine's request log (its replies the only sampled tokens, the
calculator's results between them). On a scripted bus client that calls the calculator and then
answers, the eval client (the chat route) and the train client record the same trajectory, which
is exactly the train client's own trace. A second taskset (four prompts, a reply-length score that
refuses the fourth) runs through the openai_agent loop on a scripted bus client, where the rubric's
reward of each known reply is exact, a failed scoring and a stale row become error trajectories that
say why. Malformed rows and a missing verifiers are refused with errors that name the fix, without
that environment.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
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


GSM8K_ID = "sy-gsm8k-calc"  # the module sy_gsm8k_calc; verifiers starts its tool server as `python -m` of it
GSM8K_TASKSET = """
import ast, json, operator, os, re

import verifiers.v1 as vf

OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
       ast.USub: operator.neg, ast.UAdd: operator.pos}


def value(node):
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in OPS:
        return OPS[type(node.op)](value(node.left), value(node.right))
    if isinstance(node, ast.UnaryOp) and type(node.op) in OPS:
        return OPS[type(node.op)](value(node.operand))
    raise ValueError("only numbers, + - * / and parentheses")


class CalculatorToolset(vf.Toolset[vf.ToolsetConfig]):
    TOOL_PREFIX = None  # offered as `calculator`, the name the tool caller was taught

    @vf.tool
    async def calculator(self, expression: str) -> str:
        \"\"\"Evaluate an arithmetic expression.\"\"\"
        try:
            v = value(ast.parse(expression, mode="eval").body)
        except (SyntaxError, ValueError, ZeroDivisionError) as e:
            return f"error: {e}"
        return str(int(v)) if float(v).is_integer() else str(round(v, 6))


class GSM8KData(vf.TaskData):
    answer: str


class GSM8KTask(vf.Task[GSM8KData]):
    @classmethod
    def toolsets(cls, config):
        return [CalculatorToolset(vf.ToolsetConfig())]

    @vf.reward
    async def correct(self, trace) -> float:
        found = re.findall(r"####\\s*\\$?\\s*(-?[\\d,]*\\.?\\d+)", trace.last_reply)
        return float(bool(found) and float(found[-1].replace(",", "")) == float(self.data.answer))

    @vf.reward(weight=0.5)
    async def reply_length(self, trace) -> float:  # deterministic, and logs what the episode was
        score = len(trace.last_reply) / 1000
        with open(os.environ["SY_RUBRIC_LOG"], "a") as f:
            f.write(json.dumps({
                "task": self.data.idx, "reply": trace.last_reply, "score": score,
                "tools": [t.name for t in trace.tools],
                "messages": [m.model_dump(mode="json", exclude_none=True) for m in trace.messages],
                "branches": [{"token_ids": b.token_ids, "mask": b.sampled_mask, "logprobs": b.logprobs}
                             for b in trace.branches]}) + "\\n")
        return score


class GSM8KConfig(vf.TasksetConfig):
    data_path: str
    rows: int = 2


class GSM8KTaskset(vf.Taskset[GSM8KTask, GSM8KConfig]):
    def load(self):
        with open(self.config.data_path) as f:
            lines = f.read().splitlines()[:self.config.rows]
        for line in lines:
            row = json.loads(line)
            answer = row["answer"].split("####")[-1].strip().replace(",", "")
            yield GSM8KTask(GSM8KData(system_prompt=@SYSTEM@, prompt=row["question"], answer=answer), self.config.task)


__all__ = ["GSM8KTaskset"]

if __name__ == "__main__":
    CalculatorToolset.run()
"""

def _run(cmd: list[str], timeout: int = 900, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=timeout, **kw)


def verifiers_python() -> Path:
    """The python of a venv with verifiers (and uv) over the main environment's packages
    (`python -m launch.venv`, the README's recipe), built once per machine."""
    from venvs import cached_venv

    return cached_venv("verifiers", [f"verifiers=={VERIFIERS}", "uv"], overlay=True)


@pytest.fixture(scope="module")
def vf_python() -> Path:
    return verifiers_python()


def _env(tmp_path: Path, python: Path) -> dict[str, str]:
    return {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1",
            "PYTHONPATH": os.pathsep.join([str(tmp_path), str(REPO)]),
            "PATH": os.pathsep.join([str(python.parent), os.environ.get("PATH", "")]),  # its uv
            "SY_RUBRIC_LOG": str(tmp_path / "rubric.jsonl")}


def _gsm8k_rows(python: Path, tmp_path: Path, client: str, n: int,
                extra: dict | None = None) -> tuple[list[dict], dict, list[str]]:
    """The GSM8K taskset written to tmp_path, `n` rows of it for `client` (written by the CLI), the
    episodes' environment and the rows' reference answers (read from the jsonl here)."""
    from conftest import GSM8K
    from tool_model import SYSTEM

    data = GSM8K / "test.jsonl"
    if not data.exists():
        pytest.skip(f"GSM8K test.jsonl not found in {GSM8K} (the shared data folder beside the repository)")
    (tmp_path / "sy_gsm8k_calc.py").write_text(GSM8K_TASKSET.replace("@SYSTEM@", repr(SYSTEM)))
    env, rows = _env(tmp_path, python), tmp_path / f"rows-{client}.jsonl"
    config = {"taskset": {"data_path": str(data), "rows": n}, **(extra or {})}
    made = _run([python, "-m", "agent.verifiers_env", "--taskset", GSM8K_ID, "--env", json.dumps(config),
                 "--client", client, "--out", rows], cwd=REPO, env=env)
    assert made.returncode == 0, made.stderr[-3000:]
    answers = [json.loads(line)["answer"].split("####")[-1].strip().replace(",", "")
               for line in data.read_text().splitlines()[:n]]
    return [json.loads(line) for line in rows.read_text().splitlines()], env, answers


def gsm8k_reward(reply: str, answer: str) -> float:
    """The reference reward: 1.0 for the right final `#### <number>`, plus 0.5 x the length score."""
    found = re.findall(r"####\s*\$?\s*(-?\d[\d,]*(?:\.\d+)?)", reply)
    right = bool(found) and float(found[-1].replace(",", "")) == float(answer)
    return float(right) + 0.5 * len(reply) / 1000


def calculate(expression: object) -> str | None:
    """What the calculator answers to plain arithmetic (the reference: + - * / and parentheses);
    None for anything else (the tool answers an error then)."""
    if not isinstance(expression, str) or not re.fullmatch(r"[0-9\s.+\-*/()]+", expression) or re.search(
            r"\*\*|//", expression):
        return None
    try:
        value = eval(expression, {"__builtins__": {}})  # noqa: S307 - digits and operators only
    except (SyntaxError, ZeroDivisionError):
        return None
    return str(int(value)) if float(value).is_integer() else str(round(value, 6))


def test_one_grpo_step_on_a_verifiers_environment(vf_python: Path, tool_caller: Path, tmp_path: Path):
    from test_tool_agent import _tokenizer
    from test_train import metrics

    written, env, answers = _gsm8k_rows(vf_python, tmp_path, "train", 2, {"agent": {"max_turns": 3}})
    rows = tmp_path / "rows-train.jsonl"
    assert [r["verifiers"]["task"] for r in written] == [0, 1] and written[0]["verifiers"]["client"] == "train"
    assert written[0]["prompt"][1]["content"].startswith("Janet")  # the first GSM8K test question

    out = tmp_path / "run"
    proc = _run([vf_python, "launch/train.py", f"model.path={tool_caller}", "data.val_path=null", "rollout.engine=hf",
                 "rollout.in_process=true",
                 "sft.enabled=false", "data.task=rows", f"data.train_path={rows}", "data.agent_name=openai_agent",
                 "data.prompts_per_step=2", "rollout.n=2", "rollout.max_tokens=48", "trainer.steps=1",
                 "rollout.request_log=true",
                 "rollout.agent.openai_agent.agent_function=agent.verifiers_env.run_episode",
                 f"trainer.output_dir={out}"], timeout=900, cwd=REPO, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    m = metrics(out)[-1]
    assert m["step"] == 1 and m["rollout/trajectories"] == 4 and m["rollout/invalid"] == 0, m

    # the rewards are the rubric's: the GSM8K answer's, plus 0.5 x the length score each episode logged
    scored = [json.loads(line) for line in (tmp_path / "rubric.jsonl").read_text().splitlines()]
    assert len(scored) == 4 and all(s["tools"] == ["calculator"] for s in scored)  # the calculator is offered
    mean = sum(gsm8k_reward(s["reply"], answers[s["task"]]) for s in scored) / 4
    assert m["rollout/reward_extra/agent"] == pytest.approx(mean, abs=1e-9)
    assert m["rollout/reward_mean"] == pytest.approx(mean, abs=1e-6)

    # the tokens verifiers' train client got back are the engine's: each episode's branch holds, at every
    # request's prompt length, exactly the tokens the engine generated (mask 1), and nothing else sampled
    log = [json.loads(line) for p in sorted((out / "engines").glob("*.jsonl")) for line in p.read_text().splitlines()]
    sessions: dict[str, list[dict]] = {}
    for r in sorted(log, key=lambda r: r["started"]):
        sessions.setdefault(r["session_id"], []).append(r)
    assert len(sessions) == 4
    tok = _tokenizer(tool_caller)
    rounds = 0
    for s in scored:
        (branch,) = s["branches"]
        ids, mask = branch["token_ids"], branch["mask"]
        prompt = tok.apply_chat_template(written[s["task"]]["prompt"], add_generation_prompt=True, tokenize=True,
                                         return_dict=True)["input_ids"]
        match = [k for k, reqs in sessions.items() if len(ids) == reqs[-1]["prompt_len"] + len(reqs[-1]["token_ids"])
                 and all(ids[r["prompt_len"]:r["prompt_len"] + len(r["token_ids"])] == r["token_ids"] for r in reqs)]
        assert match, (s, [[r["token_ids"] for r in reqs] for reqs in sessions.values()])  # (twins are alike)
        reqs = sessions.pop(match[0])
        assert ids[:len(prompt)] == prompt and reqs[0]["prompt_len"] == len(prompt)  # the task's prompt, as chat
        sampled = [False] * len(ids)
        for r in reqs:
            sampled[r["prompt_len"]:r["prompt_len"] + len(r["token_ids"])] = [True] * len(r["token_ids"])
        assert mask == sampled
        between = [tok.decode(ids[a["prompt_len"] + len(a["token_ids"]):b["prompt_len"]])
                   for a, b in zip(reqs, reqs[1:])]  # the context (mask 0) between two replies
        turn, calls = -1, {}
        for msg in s["messages"][2:]:  # each tool result: the calculator's answer, in the context after its call
            if msg["role"] == "assistant":
                turn, calls = turn + 1, {c["id"]: c for c in msg.get("tool_calls") or []}
            elif msg["role"] == "tool":
                expected = calculate(json.loads(calls[msg["tool_call_id"]]["arguments"]).get("expression"))
                assert msg["content"] == expected or expected is None, (msg, calls)
                assert turn >= len(between) or msg["content"] in between[turn], (msg, between)
        assert turn + 1 == len(reqs)  # one assistant message per request
        rounds += len(between)
        s["response"] = len(ids) - len(prompt)
    assert m["rollout/model_tokens_mean"] * 4 == sum(len(r["token_ids"]) for r in log)
    assert m["rollout/response_length_mean"] * 4 == sum(s["response"] for s in scored)  # model + tool tokens
    assert m["rollout/num_turns_mean"] * 4 == len(log)
    assert rounds >= 1  # the tool caller used the calculator at least once


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


CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "(16 - 3 - 4) * 2"}}\n</tool_call>'
TOOL_EPISODES = """
import asyncio, json, os, sys

from transformers import AutoTokenizer

from agent.loop import AgentContext
from agent.openai_agent import OpenAIAgentLoop
from engines.models import resolve_model
from test_tool_agent_states import ScriptedClient


class Recording(ScriptedClient):  # the engine's side: the prompts and sampling it is sent
    async def generate(self, prompt_ids, sampling, **kw):
        self.sampling = getattr(self, "sampling", []) + [dict(sampling)]
        return await super().generate(prompt_ids, sampling, **kw)


async def main(call, *runs):  # (rows, out, rubric log) for each client, one after the other in this process
    for rows, out, log in zip(runs[::3], runs[1::3], runs[2::3]):
        os.environ["SY_RUBRIC_LOG"] = log
        await episodes(rows, out, call)


async def episodes(rows, out, call):
    tok = AutoTokenizer.from_pretrained(resolve_model("tiny-llama"))
    done = []
    for i, line in enumerate(open(rows)):
        client = Recording(tok, [call, "#### 18"])  # a calculator call, then the final answer
        loop = OpenAIAgentLoop(AgentContext(client, tok, config={"agent_function": "agent.verifiers_env.run_episode"}))
        o = await loop.run({"max_tokens": 64}, session_id=f"s{i}", **json.loads(line))
        done.append({"reward": o.reward, "termination": o.termination, "error": o.error, "turns": o.num_turns,
                     "segments": 1 + len(o.extra_segments), "prompt_ids": o.prompt_ids, "response_ids": o.response_ids,
                     "mask": o.response_mask, "logprobs": o.response_logprobs, "engine_prompts": client.prompts,
                     "sampling": client.sampling})
    json.dump(done, open(out, "w"))


asyncio.run(main(*sys.argv[1:]))
"""


def test_a_tool_round_on_both_clients_is_token_exact(vf_python: Path, tmp_path: Path):
    """The GSM8K taskset on a scripted engine that calls the calculator and then answers: through the
    eval client (the gateway's chat route) and the train client (verifiers renders, the token
    endpoint records) the trajectory is the same, and the train client's own trace holds exactly
    the trajectory's tokens, the engine's replies as its only sampled tokens, the tool result masked."""
    from test_tool_agent import _tokenizer

    tok = _tokenizer("tiny-llama")
    (tmp_path / "episodes.py").write_text(TOOL_EPISODES)
    rows = {client: _gsm8k_rows(vf_python, tmp_path, client, 1) for client in ("eval", "train")}
    env = rows["train"][1]
    env["PYTHONPATH"] += os.pathsep + str(Path(__file__).resolve().parent)
    ran = _run([vf_python, tmp_path / "episodes.py", CALL,  # each episode: a harness process
                *(str(tmp_path / f"{name}") for c in rows for name in (f"rows-{c}.jsonl", f"{c}.json", f"rubric-{c}.jsonl"))],
               timeout=600, cwd=REPO, env=env)
    assert ran.returncode == 0, ran.stderr[-4000:]
    outs = {}
    for client, (written, _, answers) in rows.items():
        outs[client] = json.loads((tmp_path / f"{client}.json").read_text())
        scored = {s["task"]: s for s in map(json.loads, (tmp_path / f"rubric-{client}.jsonl").read_text().splitlines())}
        call, answer = (tok.encode(t, add_special_tokens=False) + [tok.eos_token_id] for t in (CALL, "#### 18"))
        for i, (o, row) in enumerate(zip(outs[client], written)):
            assert o["termination"] == "stop" and not o["error"] and o["turns"] == 2 and o["segments"] == 1, o
            assert o["reward"] == pytest.approx(gsm8k_reward("#### 18", answers[i]), abs=1e-12)  # 18 is task 0's
            prompt = tok.apply_chat_template(row["prompt"], add_generation_prompt=True, tokenize=True,
                                             return_dict=True)["input_ids"]
            assert o["prompt_ids"] == prompt == o["engine_prompts"][0]  # the template, rendered once
            glue = o["response_ids"][len(call):len(o["response_ids"]) - len(answer)]
            assert o["response_ids"] == call + glue + answer  # the engine's replies, verbatim
            assert o["mask"] == [1] * len(call) + [0] * len(glue) + [1] * len(answer)
            assert tok.decode(glue) == "\n<|im_start|>tool\n18<|im_end|>\n<|im_start|>assistant\n"  # its result
            assert o["engine_prompts"][1] == prompt + call + glue  # the second prompt extends the first
            s = scored[i]
            assert s["tools"] == ["calculator"] and [m["role"] for m in s["messages"]] == [
                "system", "user", "assistant", "tool", "assistant"] and s["messages"][3]["content"] == "18"
            if client == "train":  # verifiers' own record of its token client: exactly the trajectory
                (branch,) = s["branches"]
                assert branch["token_ids"] == o["prompt_ids"] + o["response_ids"]
                assert branch["mask"] == [False] * len(prompt) + [bool(x) for x in o["mask"]]
                assert branch["logprobs"] == [0.0] * len(prompt) + [lp * x for lp, x in zip(o["logprobs"], o["mask"])]
                assert all(sp["stop_token_ids"] == [tok.eos_token_id] for sp in o["sampling"])  # its renderer's
            else:
                assert all("stop_token_ids" not in sp for sp in o["sampling"])
    for e, t in zip(outs["eval"], outs["train"]):  # both clients train the same tokens
        assert (e["prompt_ids"], e["response_ids"], e["mask"]) == (t["prompt_ids"], t["response_ids"], t["mask"])


def test_rows_are_checked_before_verifiers_is_needed(monkeypatch):
    from agent.verifiers_env import run_episode

    monkeypatch.setitem(sys.modules, "verifiers", None)  # as if verifiers were not installed
    monkeypatch.setitem(sys.modules, "verifiers.v1", None)
    good = {"verifiers": {"env": {"taskset": {"id": "my-taskset"}}, "task": 0}}
    bad = [({"prompt": []}, "row has no 'verifiers' mapping"),
           ({"verifiers": {"env": {"taskset": {}}, "task": 0}}, "must be an env config naming its taskset"),
           ({"verifiers": {**good["verifiers"], "task": -1}}, r"verifiers.task=-1 must be the task's position"),
           ({"verifiers": {**good["verifiers"], "task": "3"}}, r"verifiers.task='3'"),
           ({"verifiers": {**good["verifiers"], "client": "chat"}}, r"verifiers.client='chat' must be 'eval'"),
           ({"verifiers": {**good["verifiers"], "client": {"type": "eval", "renderer": {}}}},
            r"option\(s\) \['renderer'\] that the 'eval' client does not take"),
           ({"verifiers": {**good["verifiers"], "client": {"type": "train", "renderer": {}, "tool_parser": "x"}}},
            "both 'renderer' and 'tool_parser'")]
    for row, message in bad:
        with pytest.raises(ValueError, match=message):
            asyncio.run(run_episode("http://127.0.0.1:1/v1", "k", row))
    with pytest.raises(ImportError, match=r"pip install verifiers"):
        asyncio.run(run_episode("http://127.0.0.1:1/v1", "k", good))
