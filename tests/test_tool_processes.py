"""Processes a trajectory's tools start end with the trajectory: one started by a tool call in its
thread (with a child of its own, and one whose child leaves its session with setsid), one from a
thread the tool starts itself, one from a thread pool
it submits to, a raw os.fork child, and one started on the worker's event loop are gone once the
trajectory's output is back; so are the processes its reward function forks and starts; a process
started outside any trajectory lives on."""

from __future__ import annotations

import asyncio
import json
import subprocess
import time
from typing import Any

import psutil

from agent.loop import AgentLoopBase, AgentLoopOutput
from agent.tools import BaseTool, ToolResponse
from rollout.manager import AgentLoopManager, ManagerConfig

SCHEMA = {"type": "function", "function": {"name": "spawn", "parameters": {}}}


def _sleeper() -> int:
    return subprocess.Popen(["sleep", "300"]).pid


class _Spawner(BaseTool):
    async def execute(self, instance_id: str, arguments: dict[str, Any]) -> ToolResponse:
        import concurrent.futures
        import os
        import threading

        p = subprocess.Popen(["sh", "-c", "sleep 300 & sleep 300"])  # a process with a child, never stopped
        # one whose child leaves its group and session (setsid) while it waits for it
        q = subprocess.Popen(["sh", "-c", "setsid sleep 300 & wait"])
        from_thread: list[int] = []
        t = threading.Thread(target=lambda: from_thread.append(_sleeper()))  # a thread of the tool's own
        t.start()
        t.join()
        with concurrent.futures.ThreadPoolExecutor(1) as pool:  # and a pool it submits to
            from_pool = pool.submit(_sleeper).result()
        forked = os.fork()
        if forked == 0:  # a raw fork: the child sleeps on (as a new program: a forked child that ran on
            os.execvp("sleep", ["sleep", "300"])  # as Python would keep every fd it inherited, among them the
            # pipe through which a Popen on another thread waits for its child's exec: that Popen would hang)
        deadline = time.monotonic() + 60  # the setsid grandchild started (slower on a loaded box)
        while not (left := [c.pid for c in psutil.Process(q.pid).children() if os.getsid(c.pid) != os.getsid(q.pid)]):
            assert time.monotonic() < deadline, "the setsid grandchild did not start"
            time.sleep(0.05)
        return ToolResponse(json.dumps([p.pid, *(c.pid for c in psutil.Process(p.pid).children()), *from_thread,
                                        from_pool, forked, q.pid, *left]))


REWARD = """
import os, subprocess

def forks(data_source, solution_str, ground_truth, extra_info=None):
    pids = [subprocess.Popen(["sleep", "300"]).pid]
    pid = os.fork()
    if pid == 0:
        os.execvp("sleep", ["sleep", "300"])
    with open(os.environ["SPAWNED_PIDS"], "a") as f:
        f.write(" ".join(map(str, pids + [pid])) + "\\n")
    return 1.0
"""


class SpawningLoop(AgentLoopBase):
    async def run(self, sampling_params: dict[str, Any], **row: Any) -> AgentLoopOutput:
        from agent.tools.guard import call_tool

        tool = _Spawner({}, SCHEMA)
        resp = await call_tool(tool, await tool.create(), {}, timeout_s=30)  # in a thread of its own
        on_loop = await asyncio.create_subprocess_exec("sleep", "300")
        pids = [*json.loads(resp.text), on_loop.pid]
        return AgentLoopOutput([1], [2], [1], [-0.5], 1.0, 1, "stop", turns=[{"kind": "pids", "pids": pids}],
                               session_id=row["session_id"])


def _running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_tool_processes_end_with_their_trajectory(servers, tmp_path, monkeypatch):
    srv = servers(1, backend="echo", model="tiny-llama")
    bystander = subprocess.Popen(["sleep", "300"])  # not a trajectory's: must live on
    (tmp_path / "reward.py").write_text(REWARD)
    monkeypatch.setenv("SPAWNED_PIDS", str(tmp_path / "pids.txt"))
    cfg = ManagerConfig(addresses=srv.addresses, tokenizer="tiny-llama", num_workers=1, n=2,
                        agent_loops={"spawn": f"{__name__}.SpawningLoop"}, progress=False,
                        reward={"function": f"{tmp_path / 'reward.py'}:forks"})
    try:
        with AgentLoopManager(cfg) as mgr:
            outs = mgr.generate_outputs([{"agent_name": "spawn", "prompt": [{"role": "user", "content": "q"}]}],
                                        timeout_s=120)
            assert all(o.termination != "error" for o in outs), [o.error for o in outs]
            pids = [pid for o in outs for pid in o.turns[0]["pids"]]
            # per trajectory: the tool's process and its child, the thread's, the pool's, the fork, the one with
            # a setsid grandchild and that grandchild, the loop's
            assert len(pids) >= 2 * 8, pids
            rewarded = [int(x) for x in (tmp_path / "pids.txt").read_text().split()]
            assert len(rewarded) == 2 * 2, rewarded  # per trajectory: the reward function's Popen and fork
            pids += rewarded
            deadline = time.monotonic() + 5
            while any(map(_running, pids)) and time.monotonic() < deadline:
                time.sleep(0.1)
            assert not [p for p in pids if _running(p)], "tool processes outlived their trajectory"
        assert _running(bystander.pid)
    finally:
        bystander.kill()
        bystander.wait()
