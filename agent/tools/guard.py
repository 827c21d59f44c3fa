"""Tool calls that cannot stall an agent worker.

A worker runs hundreds of trajectories on one event loop, so one tool that blocks it (a
`time.sleep` or a CPU-bound computation inside `async def execute`) stops every trajectory of
the worker, and a tool that swallows its cancellation would never time out. `call_tool` guards
both:

- the deadline is hard: when it passes the call is abandoned (cancelled, in its thread's loop too,
  never awaited), so a tool that ignores cancellation still returns a timeout to its trajectory at
  the deadline, and one that honours it stops there;
- by default (`isolation: thread`) every call runs in a thread of its own with its own event
  loop, so a blocking `execute` stalls nothing but itself. A tool whose state is bound to the
  worker's loop (a class with `loop_bound = True`, like the MCP tool, or `isolation: auto`) runs
  on the loop with each synchronous step of `execute` timed: a step longer than `BLOCKING_STEP_S`
  marks it as blocking (logged once), that call is answered as a timeout if it overran, and its
  later calls run in threads. `isolation: loop` keeps every call on the loop, unwatched.
  Abandoned threads are daemons: a stuck tool never holds up shutdown.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import logging
import threading
import time
from typing import Any, Awaitable, Generator

from agent.tools.base import BaseTool, ToolResponse

log = logging.getLogger("switchyard.tools")
ISOLATION = ("auto", "loop", "thread")
BLOCKING_STEP_S = 0.25  # a synchronous step this long on the worker's loop stalls every trajectory


class _TimedSteps:
    """Awaits a coroutine step by step (exactly as the task would) and keeps the longest step."""

    def __init__(self, coro: Awaitable[Any]) -> None:
        self.coro, self.longest = coro, 0.0

    def __await__(self) -> Generator[Any, Any, Any]:
        it = self.coro.__await__()
        value: Any = None
        error: BaseException | None = None
        while True:
            t0 = time.perf_counter()
            try:
                step = it.throw(error) if error is not None else it.send(value)
            except StopIteration as stop:
                self.longest = max(self.longest, time.perf_counter() - t0)
                return stop.value
            finally:
                self.longest = max(self.longest, time.perf_counter() - t0)
            value, error = None, None
            try:
                value = yield step
            except BaseException as e:  # cancellation and the like go on into the tool
                error = e


class ToolExited(RuntimeError):
    """A tool raised a BaseException that is not an Exception (SystemExit from argparse or sys.exit,
    KeyboardInterrupt, GeneratorExit): its call failed. Left as it was, it would end the agent
    worker's event loop, and with it every trajectory of the worker."""


def contained(e: BaseException) -> BaseException:
    """What a tool's exception becomes: cancellation stays cancellation, an Exception stays itself,
    any other BaseException becomes ToolExited naming it."""
    if isinstance(e, (asyncio.CancelledError, Exception)):
        return e
    return ToolExited(f"{type(e).__name__}({', '.join(map(repr, e.args))}) raised in the tool")


def _in_thread(tool: BaseTool, instance_id: str, arguments: dict[str, Any]) -> concurrent.futures.Future:
    done: concurrent.futures.Future = concurrent.futures.Future()

    async def execute() -> Any:
        """The call, cancelled in its own loop when the caller abandons it at the deadline (a tool that
        honours cancellation stops there instead of running on in its thread)."""
        task, loop = asyncio.current_task(), asyncio.get_running_loop()

        def abandoned(f: concurrent.futures.Future) -> None:
            if f.cancelled() and task is not None:
                try:
                    loop.call_soon_threadsafe(task.cancel)
                except RuntimeError:  # the loop is closed: the call had ended anyway
                    pass

        done.add_done_callback(abandoned)
        return await tool.execute(instance_id, arguments)

    def run() -> None:
        try:
            result, error = asyncio.run(execute()), None
        except BaseException as e:
            result, error = None, contained(e)
        try:  # an abandoned call's future is already cancelled: nobody waits for the answer
            done.set_exception(error) if error is not None else done.set_result(result)
        except concurrent.futures.InvalidStateError:
            pass

    # the call's context goes with it: processes it starts are its trajectory's (agent/tools/processes.py)
    threading.Thread(target=contextvars.copy_context().run, args=(run,), name=f"tool-{tool.name}", daemon=True).start()
    return done


def _abandon(task: asyncio.Future) -> None:
    task.cancel()
    task.add_done_callback(lambda t: t.cancelled() or t.exception())  # never "exception was never retrieved"


async def call_tool(tool: BaseTool, instance_id: str, arguments: dict[str, Any], timeout_s: float) -> ToolResponse:
    """`tool.execute(...)` under a hard deadline and the tool's isolation; raises what the tool
    raises, returns a timeout ToolResponse at the deadline."""
    mode = tool.config.get("isolation", "auto" if getattr(tool, "loop_bound", False) else "thread")
    if mode not in ISOLATION:
        raise ValueError(f"tool {tool.name!r}: isolation={mode!r}; choose one of {list(ISOLATION)}")
    threaded = mode == "thread" or (mode == "auto" and getattr(tool, "_blocks_loop", False))
    timed = None
    if threaded:
        task: asyncio.Future = asyncio.wrap_future(_in_thread(tool, instance_id, arguments))
    else:
        timed = _TimedSteps(tool.execute(instance_id, arguments))

        async def on_loop() -> Any:
            try:
                return await timed
            except BaseException as e:  # SystemExit in a task would end the worker's event loop
                raise contained(e) from e

        task = asyncio.ensure_future(on_loop())
    t0 = time.perf_counter()
    try:
        done, _ = await asyncio.wait({task}, timeout=timeout_s)
    except asyncio.CancelledError:
        _abandon(task)
        raise
    if timed is not None and mode == "auto" and timed.longest > BLOCKING_STEP_S and not getattr(tool, "_blocks_loop",
                                                                                                 False):
        tool._blocks_loop = True  # type: ignore[attr-defined]
        log.warning("tool %r blocked the agent worker's event loop for %.2f s in one step (every trajectory of the "
                    "worker waited); its calls now run in a thread of their own. Make execute() await its I/O, or "
                    "set isolation: thread in the tools config", tool.name, timed.longest)
    late = time.perf_counter() - t0 > timeout_s  # a call that blocked the loop past its deadline
    if not done or late:
        _abandon(task)
        return ToolResponse(f"Error: tool {tool.name!r} did not answer within {timeout_s:g} s", False, {"timeout": True})
    return task.result()
