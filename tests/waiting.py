"""Waiting in tests: for a condition, with a deadline, never for a fixed time.

A fixed sleep followed by an assertion passes on a quiet box and fails on a loaded one; these poll
the condition until it holds or the deadline passes, and the failure names what was awaited. The
deadlines are generous on purpose: a passing test returns as soon as the condition holds."""

from __future__ import annotations

import asyncio
import inspect
import time
import os
from typing import Awaitable, Callable, TypeVar

T = TypeVar("T")
POLL_S = 0.02


def wait_until(check: Callable[[], T], what: str = "the condition holds", seconds: float = 30.0) -> T:
    """Poll `check` until it returns something truthy (returned), or fail naming `what`."""
    deadline = time.monotonic() + seconds
    while not (value := check()):
        assert time.monotonic() < deadline, f"timed out after {seconds:g} s waiting until {what}"
        time.sleep(POLL_S)
    return value


async def until(check: Callable[[], T | Awaitable[T]], what: str = "the condition holds", seconds: float = 30.0) -> T:
    """The same on an event loop; `check` may be a coroutine function."""
    deadline = time.monotonic() + seconds
    while True:
        value = check()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out after {seconds:g} s waiting until {what}"
        await asyncio.sleep(POLL_S)


def wait_for_unlocked(output_dir: "os.PathLike[str] | str", seconds: float = 60.0) -> None:
    """Wait until no trainer holds `output_dir`'s run lock (launch/run_lock.py): a killed trainer that a
    warm start forked ends a moment after the process the test killed, and a run started before then
    is rightly refused."""
    import fcntl
    from pathlib import Path

    path = Path(output_dir) / ".lock"

    def free() -> bool:
        try:
            fd = os.open(path, os.O_RDWR)
        except FileNotFoundError:
            return True
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            fcntl.flock(fd, fcntl.LOCK_UN)
            return True
        except BlockingIOError:
            return False
        finally:
            os.close(fd)

    wait_until(free, f"the run lock of {output_dir} is released (the killed trainer has ended)", seconds)
