"""Run a coroutine's first step now, in the caller, and make a task only if it has to wait.

The server handles each request in a coroutine of its own; `asyncio.create_task` would run even
a request that never waits (an echo reply, a refusal, an error) one loop turn later, after a task
object, a scheduled callback and another poll of the sockets. Python 3.12 has this as
`asyncio.eager_task_factory`; this is the same for one coroutine on 3.11 and later.
"""

from __future__ import annotations

import asyncio
import collections.abc
from typing import Any, Coroutine, Generator


class _Resumed(collections.abc.Coroutine):
    """`coro` after its first step, as a coroutine a task can run: the task's first step gets the
    future that step yielded, and everything after (results, exceptions, a cancellation, even
    one that comes before the task's first step) goes on into `coro`."""

    def __init__(self, coro: Coroutine[Any, Any, Any], waiting: Any) -> None:
        self.coro, self.waiting = coro, waiting

    def send(self, value: Any) -> Any:
        if self.waiting is not None:
            waiting, self.waiting = self.waiting, None
            return waiting
        return self.coro.send(value)

    def throw(self, *exc: Any) -> Any:
        self.waiting = None
        return self.coro.throw(*exc)

    def close(self) -> None:
        self.coro.close()

    def __await__(self) -> Generator[Any, Any, Any]:
        return self  # type: ignore[return-value]

    def __next__(self) -> Any:
        return self.send(None)


def start_eagerly(coro: Coroutine[Any, Any, Any]) -> asyncio.Task | None:
    """Run `coro` up to its first wait; None when it finished without one (an exception it raised
    propagates to the caller), else the task that runs the rest on the current loop."""
    try:
        waiting = coro.send(None)
    except StopIteration:
        return None
    return asyncio.get_running_loop().create_task(_Resumed(coro, waiting))
