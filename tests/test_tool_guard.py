"""Tools that misbehave cannot stall an agent worker (`agent/tools/guard.py`), written as attacks:
a tool that swallows its cancellation still times out at its deadline; one that blocks the event
loop is caught on its first call, answered as a timeout if that call overran, and moved to a
thread so the loop keeps serving every other trajectory; a tool stuck in a thread holds up
nothing."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from agent.tools.base import BaseTool, ToolResponse
from agent.tools.guard import call_tool
from waiting import wait_until

SCHEMA = {"type": "function", "function": {"name": "t", "description": "x", "parameters": {"type": "object"}}}


class Stubborn(BaseTool):
    async def execute(self, instance_id: str, arguments: dict[str, Any]) -> ToolResponse:
        for _ in range(20):  # 2 s of ignoring cancellation (asyncio.run waits for it at exit)
            try:
                await asyncio.sleep(0.1)
            except asyncio.CancelledError:
                pass  # swallowed: a plain asyncio.wait_for would wait for this tool forever
        return ToolResponse("late")


class Blocking(BaseTool):
    async def execute(self, instance_id: str, arguments: dict[str, Any]) -> ToolResponse:
        time.sleep(float(arguments.get("s", 0.6)))  # blocks whatever loop runs it
        return ToolResponse(f"slept {arguments.get('s')}")


async def _ticks_during(coro: Any) -> tuple[Any, int, float]:
    """Run `coro` beside a 10 ms ticker; (result, ticks, longest gap between ticks)."""
    ticks, gaps = 0, [0.0]
    stop = asyncio.Event()

    async def ticker() -> None:
        nonlocal ticks
        last = time.perf_counter()
        while not stop.is_set():
            await asyncio.sleep(0.01)
            now = time.perf_counter()
            gaps.append(now - last)
            last, ticks = now, ticks + 1

    t = asyncio.ensure_future(ticker())
    try:
        result = await coro
    finally:
        stop.set()
        await t
    return result, ticks, max(gaps)


def test_a_tool_that_swallows_cancellation_still_times_out():
    async def main() -> tuple[ToolResponse, float]:
        t0 = time.perf_counter()
        resp = await call_tool(Stubborn({}, SCHEMA), "i", {}, timeout_s=0.5)
        return resp, time.perf_counter() - t0

    resp, took = asyncio.run(main())
    assert resp.metrics.get("timeout") and not resp.success and took < 1.5


def test_by_default_a_blocking_tool_never_stalls_the_loop():
    tool = Blocking({}, SCHEMA)  # default isolation: every call in a thread of its own

    async def main() -> Any:
        return await _ticks_during(asyncio.gather(*(call_tool(tool, "i", {"s": 0.5}, 5.0) for _ in range(4)),
                                                  call_tool(tool, "i", {"s": 3.0}, 0.5)))

    results, ticks, gap = asyncio.run(main())
    assert [r.text for r in results[:4]] == ["slept 0.5"] * 4 and results[4].metrics.get("timeout")
    assert gap < 0.25 and ticks >= 20  # from the very first call, the other trajectories kept their pace


class LoopBound(Blocking):
    loop_bound = True  # like the MCP tool: watched on the loop, moved to threads once caught blocking


def test_a_loop_bound_tool_caught_blocking_is_timed_out_then_runs_off_the_loop():
    tool = LoopBound({}, SCHEMA)

    async def main() -> Any:
        # first call: blocks the loop 0.6 s, past its 0.4 s deadline: caught, answered as a timeout
        first, _, first_gap = await _ticks_during(call_tool(tool, "i", {"s": 0.6}, timeout_s=0.4))
        # later calls run in threads: four at once, the loop keeps ticking meanwhile
        later, ticks, gap = await _ticks_during(asyncio.gather(*(call_tool(tool, "i", {"s": 0.5}, 5.0)
                                                                for _ in range(4))))
        return first, first_gap, later, ticks, gap

    first, first_gap, later, ticks, gap = asyncio.run(main())
    assert first_gap >= 0.55 and first.metrics.get("timeout")  # the stall happened, and did not count as success
    assert getattr(tool, "_blocks_loop", False)
    assert [r.text for r in later] == ["slept 0.5"] * 4
    assert gap < 0.25 and ticks >= 20  # four blocking calls side by side, the loop never waited for them


def test_a_tool_stuck_in_its_thread_holds_up_nothing():
    tool = Blocking({"isolation": "thread"}, SCHEMA)

    async def main() -> tuple[ToolResponse, float]:
        t0 = time.perf_counter()
        resp = await call_tool(tool, "i", {"s": 30}, timeout_s=0.3)
        return resp, time.perf_counter() - t0

    t0 = time.perf_counter()
    resp, took = asyncio.run(main())  # asyncio.run returns without joining the stuck thread
    assert resp.metrics.get("timeout") and took < 1.0 and time.perf_counter() - t0 < 2.0


def test_isolation_loop_keeps_calls_on_the_loop_and_bad_values_are_named():
    tool = Blocking({"isolation": "loop"}, SCHEMA)
    asyncio.run(call_tool(tool, "i", {"s": 0.3}, 5.0))
    assert not getattr(tool, "_blocks_loop", False)  # opted out of detection and threads
    bad = Blocking({"isolation": "process"}, SCHEMA)
    try:
        asyncio.run(call_tool(bad, "i", {}, 1.0))
    except ValueError as e:
        assert "isolation='process'" in str(e)
    else:
        raise AssertionError("a bad isolation value must be refused")


class Patient(BaseTool):
    """Awaits a long sleep in its thread's loop and says how the sleep ended."""

    ended: list[str] = []

    async def execute(self, instance_id: str, arguments: dict[str, Any]) -> ToolResponse:
        try:
            await asyncio.sleep(arguments["s"])
        except asyncio.CancelledError:
            self.ended.append("cancelled")
            raise
        self.ended.append("slept")
        return ToolResponse("slept")


def test_an_abandoned_call_in_its_thread_is_cancelled_at_the_deadline():
    """A call past its deadline is answered as a timeout, and the coroutine in its thread is cancelled
    then, not left to run to its end in the background (a stuck request holding its connection)."""
    tool = Patient({}, SCHEMA)
    resp = asyncio.run(call_tool(tool, "i", {"s": 30.0}, timeout_s=0.3))
    assert resp.metrics.get("timeout")
    wait_until(lambda: tool.ended, "the abandoned call's coroutine ended", 10.0)
    assert tool.ended == ["cancelled"]
