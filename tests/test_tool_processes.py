"""Processes a trajectory's tools start end with the trajectory: one started by a tool call in its
thread (with a child of its own) and one started on the worker's event loop are gone once the
trajectory's output is back, while a process started outside any trajectory lives on."""

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


class _Spawner(BaseTool):
    async def execute(self, instance_id: str, arguments: dict[str, Any]) -> ToolResponse:
        p = subprocess.Popen(["sh", "-c", "sleep 300 & sleep 300"])  # a process with a child, never stopped
        time.sleep(0.3)
        return ToolResponse(json.dumps([p.pid, *(c.pid for c in psutil.Process(p.pid).children())]))


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


def test_tool_processes_end_with_their_trajectory(servers):
    srv = servers(1, backend="echo", model="tiny-llama")
    bystander = subprocess.Popen(["sleep", "300"])  # not a trajectory's: must live on
    cfg = ManagerConfig(addresses=srv.addresses, tokenizer="tiny-llama", num_workers=1, n=2,
                        agent_loops={"spawn": f"{__name__}.SpawningLoop"}, progress=False)
    try:
        with AgentLoopManager(cfg) as mgr:
            outs = mgr.generate_outputs([{"agent_name": "spawn", "prompt": [{"role": "user", "content": "q"}]}],
                                        timeout_s=120)
            pids = [pid for o in outs for pid in o.turns[0]["pids"]]
            assert len(pids) >= 2 * 3  # per trajectory: the tool's process, its children, the loop's process
            deadline = time.monotonic() + 10
            while any(map(_running, pids)) and time.monotonic() < deadline:
                time.sleep(0.1)
            assert not [p for p in pids if _running(p)], "tool processes outlived their trajectory"
        assert _running(bystander.pid)
    finally:
        bystander.kill()
        bystander.wait()
