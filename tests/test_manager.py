"""AgentLoopManager on real engine servers and real agent worker processes: order, GRPO groups
kept on one worker and one engine, padding that unpads to exactly what the loops produced (and
the servers logged), worker crashes that raise instead of hanging, and the in-process path."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import psutil
import pytest
import torch
import yaml

from agent.loop import AgentLoopBase, AgentLoopOutput, Trajectory
from agent.tools import BaseTool, ToolResponse
from engines.training.batch import Batch, pad_outputs
from rollout.manager import AgentLoopManager, ManagerConfig, WorkerCrashed
from tool_model import CALCULATOR_SCHEMA, gsm8k_rows
from procs import pythonpath

GSM8K = Path(__file__).resolve().parents[2] / "shared" / "data" / "gsm8k"
needs_gsm8k = pytest.mark.skipif(not (GSM8K / "test.jsonl").exists(), reason=f"GSM8K jsonl not found in {GSM8K}")
TOOL_AGENT = {"max_assistant_turns": 3, "max_turn_tokens": 48, "max_response_tokens": 256}


def tools_yaml(tmp: Path) -> Path:
    path = tmp / "tools.yaml"
    path.write_text(yaml.safe_dump({"tools": [{"class_name": "agent.tools.calculator.CalculatorTool", "config": {},
                                               "tool_schema": CALCULATOR_SCHEMA}]}))
    return path


def server_log(paths: list[Path]) -> dict[str, dict[str, Any]]:
    return {rec["rid"]: rec for p in paths if p.exists() for rec in map(json.loads, p.read_text().splitlines())}


def unpad(batch: Batch, i: int) -> tuple[list[int], list[int], list[int], list[float]]:
    p = batch.prompts.shape[1]
    prompt = batch.prompts[i][batch.attention_mask[i, :p].bool()].tolist()
    n = int(batch.attention_mask[i, p:].sum())
    return (prompt, batch.responses[i, :n].tolist(), batch.response_mask[i, :n].tolist(),
            batch.rollout_logprobs[i, :n].tolist())


def check_padding(batch: Batch, outs: list[AgentLoopOutput], pad_id: int) -> None:
    """Unpadding gives back every output exactly (a failed one as padded: its last prompt token, no
    response); padding is where it should be."""
    from engines.training.batch import _cut_failed

    outs = [_cut_failed(o) for o in outs]
    p = batch.prompts.shape[1]
    assert batch.responses.shape[1] == max(len(o.response_ids) for o in outs)
    assert p == max(len(o.prompt_ids) for o in outs)
    for i, o in enumerate(outs):
        prompt, resp, mask, lps = unpad(batch, i)
        assert prompt == o.prompt_ids and resp == o.response_ids and mask == o.response_mask
        assert lps == [float(torch.tensor(x, dtype=torch.float32)) for x in o.response_logprobs]
        lp, lr = len(o.prompt_ids), len(o.response_ids)
        assert batch.attention_mask[i].tolist() == [0] * (p - lp) + [1] * (lp + lr) + [0] * (batch.responses.shape[1] - lr)
        assert (batch.prompts[i, :p - lp] == pad_id).all() and (batch.responses[i, lr:] == pad_id).all()
        assert (batch.response_mask[i, lr:] == 0).all() and (batch.rollout_logprobs[i, lr:] == 0).all()
        assert batch.position_ids[i, p - lp:p + lr].tolist() == list(range(lp + lr))
        assert batch.rewards[i].item() == pytest.approx(o.reward)
    assert batch.termination == [o.termination for o in outs] and batch.num_turns == [o.num_turns for o in outs]
    assert batch.valid.tolist() == [o.termination != "error" for o in outs]


def _out(prompt: list[int], model: list[list[int]], glue: list[int], reward: float, term: str = "stop",
         extra: dict[str, float] | None = None) -> AgentLoopOutput:
    traj = Trajectory(prompt)
    turns = []
    for k, ids in enumerate(model):
        if k:
            traj.add_context(glue)
        traj.add_model(ids, [-0.5 - 0.01 * t for t in range(len(ids))])
        turns.append({"kind": "generate", "tokens": len(ids), "latency_s": 0.1 * (k + 1)})
        if k:
            turns.insert(-1, {"kind": "tools", "calls": 2, "failed": 1, "timeouts": 0, "parse_errors": 0})
    return AgentLoopOutput(traj.prompt_ids, traj.response_ids, traj.response_mask, traj.response_logprobs, reward,
                           len(model), term, turns=turns, reward_extra=extra or {}, session_id=f"s{len(prompt)}")


def test_pad_outputs_round_trip_and_error_rows():
    outs = [_out([5, 6, 7], [[1, 2]], [], 1.0, extra={"acc": 1.0}),
            _out([8], [[3, 4, 5], [6]], [9, 9], 0.0, term="max_assistant_turns"),
            _out([1, 2, 3, 4, 5], [[7]], [], 0.5, extra={"fmt": 0.5}),
            AgentLoopOutput([4, 4], [], [], [], 0.0, 0, "error", error="RuntimeError: boom")]
    batch = pad_outputs(outs, pad_id=0, group_index=[0, 0, 1, 1])
    assert batch.prompts.shape == (4, 5) and batch.responses.shape == (4, 6)
    check_padding(batch, outs, 0)
    assert batch.group_index.tolist() == [0, 0, 1, 1] and batch.valid.tolist() == [True, True, True, False]
    assert batch.loss_mask[3].sum() == 0 and batch.loss_mask[1].tolist() == [1, 1, 1, 0, 0, 1]
    assert batch.input_ids.shape == (4, 11)
    extra = batch.reward_extra
    assert extra["acc"][0] == 1.0 and extra["fmt"][2] == 0.5 and all(v != v for v in (extra["acc"][1], extra["fmt"][0]))
    m = batch.metrics()
    assert m["rollout/invalid"] == 1 and m["rollout/termination/error"] == 1 and m["rollout/termination/stop"] == 2
    assert m["rollout/reward_mean"] == pytest.approx(0.5)  # the error row is left out
    assert m["rollout/tool_calls"] == 2 and m["rollout/tool_failed"] == 1
    assert m["rollout/generate_latency_mean_s"] == pytest.approx((0.1 + 0.1 + 0.2 + 0.1) / 4)
    assert m["rollout/reward_extra/acc"] == 1.0
    fixed = pad_outputs(outs, 0, [0, 0, 1, 1], prompt_length=8, response_length=10)
    assert fixed.prompts.shape == (4, 8) and fixed.attention_mask.shape == (4, 18)
    check_padding_fixed = [unpad(fixed, i)[:3] for i in range(4)]
    assert check_padding_fixed == [(o.prompt_ids, o.response_ids, o.response_mask) for o in outs[:3]] + [([4], [], [])]
    with pytest.raises(ValueError, match="response_length=3 but a trajectory has 6 tokens"):
        pad_outputs(outs, 0, [0, 0, 1, 1], response_length=3)
    bad = _out([1], [[2, 3]], [], 0.0)
    bad.response_mask.pop()
    with pytest.raises(ValueError, match="output 0 is inconsistent"):
        pad_outputs([bad], 0, [0])


@needs_gsm8k
def test_two_workers_two_servers_mixed_agents(servers, tool_caller, tmp_path):
    srv = servers(2, backend="hf", model=str(tool_caller))
    n = 4
    rows = gsm8k_rows(GSM8K / "test.jsonl", 6)
    for i, row in enumerate(rows):
        row["agent_name"] = "tool_agent" if i % 2 == 0 else "single_turn_agent"
    cfg = ManagerConfig(addresses=srv.addresses, tokenizer=str(tool_caller), num_workers=2, n=n,
                        sampling={"temperature": 1.0, "max_tokens": 48}, tools_config=str(tools_yaml(tmp_path)),
                        agent_configs={"tool_agent": TOOL_AGENT, "single_turn_agent": {"max_response_tokens": 48}})
    with AgentLoopManager(cfg) as mgr:
        assert len(set(mgr.worker_pids)) == 2
        bad = rows[:2] + [{**rows[2], "agent_name": "no_such_agent"}]
        with pytest.raises(ValueError, match=r"row 2: unknown agent_name 'no_such_agent'; known: "
                                             r"\['gym_agent', 'langgraph_agent', 'openai_agent', "
                                             r"'single_turn_agent', 'tool_agent'\]"):
            mgr.generate(bad)
        assert server_log(srv.request_logs) == {}  # refused before anything was dispatched
        outs = mgr.generate_outputs(rows)
        pad_id = mgr.pad_id
        # poll() waits as long as asked and no longer, and wake() from another thread ends the wait
        t0 = time.monotonic()
        assert mgr.poll(timeout_s=0.05) == [] and time.monotonic() - t0 < 0.5
        threading.Timer(0.2, mgr.wake).start()
        t0 = time.monotonic()
        assert mgr.poll(timeout_s=60) == [] and time.monotonic() - t0 < 5
    assert len(outs) == len(rows) * n
    from engines.models import load_tokenizer

    tok = load_tokenizer(str(tool_caller))
    sent = server_log(srv.request_logs)
    group_engines, client_of_group = [], []
    for i, out in enumerate(outs):
        row = rows[i // n]
        assert out.termination != "error", out.error
        assert row["prompt"][1]["content"] in tok.decode(out.prompt_ids)  # input order kept
        if row["agent_name"] == "single_turn_agent":
            assert out.num_turns == 1 and all(t["kind"] == "generate" for t in out.turns)
        # the mask-1 tokens are exactly what the servers generated, request by request
        assert out.model_token_ids() == [t for rid in out.request_ids for t in sent[rid]["token_ids"]]
        assert sent[out.request_ids[0]]["prompt_len"] == len(out.prompt_ids)
        assert {sent[rid]["session_id"] for rid in out.request_ids} == {out.session_id}
    for g in range(len(rows)):
        first = [sent[o.request_ids[0]] for o in outs[g * n:(g + 1) * n]]
        assert len({r["group_id"] for r in first}) == 1 and len({r["engine_id"] for r in first}) == 1
        group_engines.append(first[0]["engine_id"])
        client_of_group.append({rid.split("-")[0] for o in outs[g * n:(g + 1) * n] for rid in o.request_ids})
    assert len({tuple(sorted(c)) for c in client_of_group}) == 2  # two workers, one per group
    assert all(len(c) == 1 for c in client_of_group)
    assert all(client_of_group[g] == client_of_group[g % 2] for g in range(len(rows)))  # groups dealt round-robin
    assert len({sent[rid]["group_id"] for rid in sent}) == len(rows)
    assert set(group_engines) == {"e0", "e1"}  # groups spread over both engines
    tool_outs = [o for i, o in enumerate(outs) if rows[i // n]["agent_name"] == "tool_agent"]
    assert sum(t.get("calls", 0) for o in tool_outs for t in o.turns if t["kind"] == "tools") > 0

    batch = pad_outputs(outs, pad_id, [k // n for k in range(len(outs))])
    check_padding(batch, outs, pad_id)
    assert batch.group_index.tolist() == [k // n for k in range(len(outs))]
    m = batch.metrics()
    assert m["rollout/trajectories"] == len(outs) and m["rollout/invalid"] == 0 and m["rollout/tool_calls"] > 0


class SlowLoop(AgentLoopBase):
    """One real generation, then a long wait: a worker busy mid-trajectory when it is killed."""

    async def run(self, sampling_params: dict[str, Any], **row: Any) -> AgentLoopOutput:
        traj = Trajectory([1, 2, 3])
        await self.generate(traj, {"max_tokens": 4}, row["session_id"], row["group_id"], [])
        await asyncio.sleep(300)
        raise AssertionError("unreachable: the test kills this worker")


def test_killed_worker_raises_instead_of_hanging(servers):
    srv = servers(1, backend="hf", model="tiny-llama")
    cfg = ManagerConfig(addresses=srv.addresses, tokenizer="tiny-llama", num_workers=2, n=2,
                        agent_loops={"slow_agent": f"{__name__}.SlowLoop"}, progress=False)
    rows = [{"agent_name": "slow_agent", "prompt": [{"role": "user", "content": f"q{i}"}]} for i in range(4)]
    mgr = AgentLoopManager(cfg).start()
    try:
        victim = mgr.worker_pids[1]

        def kill_when_busy() -> None:
            deadline = time.monotonic() + 60
            while len(server_log(srv.request_logs)) < 8 and time.monotonic() < deadline:
                time.sleep(0.2)  # every trajectory has had its generation: both workers are mid-loop
            os.kill(victim, signal.SIGKILL)

        killer = threading.Thread(target=kill_when_busy, daemon=True)
        killer.start()
        t0 = time.monotonic()
        with pytest.raises(WorkerCrashed, match=rf"agent worker 1 \(pid {victim}\) died with exit code -9 "
                                                r"\(killed by SIGKILL\)"):
            mgr.generate(rows, timeout_s=120)
        assert time.monotonic() - t0 < 90
        killer.join()
        with pytest.raises(RuntimeError, match="unusable.*agent worker 1"):
            mgr.generate(rows)
    finally:
        t0 = time.monotonic()
        mgr.close()
    assert time.monotonic() - t0 < 20  # the busy survivor is stopped promptly, not waited for
    assert mgr.worker_pids == []


class _StuckTool(BaseTool):
    async def execute(self, instance_id: str, arguments: dict[str, Any]) -> ToolResponse:
        await asyncio.to_thread(time.sleep, 90)  # a thread of the tool's own executor, stuck long after
        return ToolResponse("late")


class StuckToolLoop(AgentLoopBase):
    """One call of a tool that outlives its 1 s deadline in a thread of its own, then a finished trajectory."""

    async def run(self, sampling_params: dict[str, Any], **row: Any) -> AgentLoopOutput:
        from agent.tools.guard import call_tool

        tool = _StuckTool({}, {"type": "function", "function": {"name": "stuck", "parameters": {}}})
        resp = await call_tool(tool, await tool.create(), {}, timeout_s=1.0)
        assert resp.metrics.get("timeout"), resp.text
        return AgentLoopOutput([1, 2], [3], [1], [-0.5], 1.0, 1, "stop", session_id=row["session_id"])


def test_closing_does_not_wait_for_a_stuck_tool_thread(servers):
    srv = servers(1, backend="echo", model="tiny-llama")
    cfg = ManagerConfig(addresses=srv.addresses, tokenizer="tiny-llama", num_workers=1, n=1,
                        agent_loops={"stuck": f"{__name__}.StuckToolLoop"}, progress=False)
    mgr = AgentLoopManager(cfg).start()
    try:
        outs = mgr.generate_outputs([{"agent_name": "stuck", "prompt": [{"role": "user", "content": "q"}]}],
                                    timeout_s=60)
        assert [o.termination for o in outs] == ["stop"]
        pid = mgr.worker_pids[0]
    finally:
        t0 = time.monotonic()
        mgr.close()
    assert time.monotonic() - t0 < 10  # the worker exits at once: abandoned threads do not hold it (was 30 s)
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


def test_in_process_workers_pad_and_flag_failed_trajectories(servers):
    srv = servers(1, backend="hf", model="tiny-llama")
    cfg = ManagerConfig(addresses=srv.addresses, tokenizer="tiny-llama", num_workers=0, n=2,
                        sampling={"temperature": 1.0, "max_tokens": 8}, progress=False)
    rows = [{"prompt": [{"role": "user", "content": f"What is {i} + {i}?"}], "reward_model": {"ground_truth": "2"},
             "data_source": "openai/gsm8k"} for i in range(3)]
    rows.append({"prompt": "not a list of messages", "data_source": "openai/gsm8k"})  # the loop will raise
    with AgentLoopManager(cfg) as mgr:
        assert mgr.worker_pids == []
        batch = mgr.generate(rows, weight_version=0)
        sent = server_log(srv.request_logs)
        assert len(batch) == 8 and batch.group_index.tolist() == [0, 0, 1, 1, 2, 2, 3, 3]
        assert batch.valid.tolist() == [True] * 6 + [False] * 2
        assert all(batch.errors[6:]) and not any(batch.errors[:6])
        for i in range(6):
            prompt, resp, mask, _ = unpad(batch, i)
            rid, = batch.request_ids[i]
            assert resp == sent[rid]["token_ids"] and mask == [1] * len(resp)
            assert sent[rid]["prompt_len"] == len(prompt) and sent[rid]["session_id"] == batch.session_ids[i]
        assert len(set(batch.session_ids)) == 8
        assert batch.loss_mask[6:].sum() == 0
        m = batch.metrics()
        assert m["rollout/invalid"] == 2 and m["rollout/termination/error"] == 2 and m["rollout/num_turns_mean"] == 0.75
        # the call's weight version is every request's floor: these servers are at version 0
        with pytest.raises(TimeoutError, match="did not finish in time"):
            mgr.generate(rows[:1], weight_version=1, timeout_s=3)
        assert len(server_log(srv.request_logs)) == 6


@pytest.mark.cold  # reads the process tree
def test_workers_exit_when_their_trainer_is_killed_while_they_start(tmp_path):
    """The trainer is killed with -9 while its agent workers wait for engines that never answer:
    the workers notice their parent is gone and exit (they would otherwise wait ready_timeout_s)."""
    import subprocess
    import sys

    import psutil

    script = tmp_path / "trainer.py"
    script.write_text(
        "from rollout.manager import AgentLoopManager, ManagerConfig\n"
        "if __name__ == '__main__':\n"
        f"    cfg = ManagerConfig(addresses=['ipc://{tmp_path}/nobody.sock'], tokenizer='tiny-llama', num_workers=2,\n"
        "                        ready_timeout_s=900, progress=False)\n"
        "    AgentLoopManager(cfg).start()\n")
    env = {**os.environ, "PYTHONPATH": pythonpath(Path(__file__).resolve().parents[1]), "HF_HUB_OFFLINE": "1"}
    proc = subprocess.Popen([sys.executable, str(script)], env=env, start_new_session=True)
    workers: list[psutil.Process] = []
    try:
        deadline = time.monotonic() + 120
        while len(workers) < 2:  # both workers spawned (they then wait for the engine)
            assert time.monotonic() < deadline and proc.poll() is None
            workers = psutil.Process(proc.pid).children()
            time.sleep(0.2)
        time.sleep(3)  # into start(): imports done, waiting for the engine
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
        gone, alive = psutil.wait_procs(workers, timeout=15)
        assert not alive, [p.pid for p in alive]
    finally:
        if proc.poll() is None:
            proc.kill()
        for w in workers:
            if w.is_running():
                w.kill()
