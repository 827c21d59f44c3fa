"""Waiting in tests: for a condition, with a deadline, never for a fixed time.

A fixed sleep followed by an assertion passes on a quiet box and fails on a loaded one; these poll
the condition until it holds or the deadline passes, and the failure names what was awaited. The
deadlines are generous on purpose: a passing test returns as soon as the condition holds."""

from __future__ import annotations

import asyncio
import inspect
import time
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
