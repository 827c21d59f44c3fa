"""Processes a trajectory's tools start belong to that trajectory: they end with it.

A tool that starts a process (`subprocess.Popen`, `asyncio.create_subprocess_exec`, a helper
server) and never stops it would leave it running after the trajectory, its release and even the
worker. Inside an agent worker, every such process started while a trajectory runs (on the worker's
loop, in a task of the trajectory, or in the thread a tool call runs in) is put in a process group
of its own and recorded under the trajectory; when the trajectory has ended (after its tools'
release) the recorded groups are killed, and whatever is left when the worker closes is killed too.

Processes meant to outlive a trajectory are started outside any: at tool construction, or in a
task created with an empty context (`McpSession` does this for its shared server). Not covered: a
process started with a raw `os.fork`/`os.posix_spawn`, or one that leaves its process group.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import os
import signal
import subprocess
import threading
from typing import Any, Iterator

log = logging.getLogger("switchyard.tools")
_owner: contextvars.ContextVar[str | None] = contextvars.ContextVar("switchyard_trajectory", default=None)
_owned: dict[str, list[subprocess.Popen]] = {}
_lock = threading.Lock()
_real_init = subprocess.Popen.__init__


def _init(self: subprocess.Popen, *args: Any, **kwargs: Any) -> None:
    owner = _owner.get()
    if owner is not None and "process_group" not in kwargs and not kwargs.get("start_new_session"):
        kwargs["start_new_session"] = True  # a group of its own: its children go with it
    _real_init(self, *args, **kwargs)
    if owner is not None:
        with _lock:
            _owned.setdefault(owner, []).append(self)


def install() -> None:
    """Record the processes trajectories start (in this process, from now on; idempotent)."""
    subprocess.Popen.__init__ = _init  # type: ignore[method-assign]


@contextlib.contextmanager
def owned_by(trajectory: str) -> Iterator[None]:
    """Processes started in this context (and the tasks and tool threads it spawns) are `trajectory`'s."""
    token = _owner.set(trajectory)
    try:
        yield
    finally:
        _owner.reset(token)


def kill_owned(trajectory: str) -> int:
    """Kill the process groups `trajectory` started; how many were still running."""
    with _lock:
        procs = _owned.pop(trajectory, [])
    killed = 0
    for p in procs:
        try:
            if p.poll() is not None:  # ended (and reaped now: its pid cannot be another process's)
                continue
            if os.getpgid(p.pid) == p.pid:
                os.killpg(p.pid, signal.SIGKILL)
            else:  # it chose a group of its own making: only the process itself is known to be ours
                p.kill()
            killed += 1
        except (ProcessLookupError, PermissionError, ChildProcessError):
            pass
    if killed:
        log.info("trajectory %s left %d tool process(es) running; killed them", trajectory, killed)
    return killed


def kill_all() -> int:
    """Kill what every trajectory left (the worker is closing)."""
    with _lock:
        owners = list(_owned)
    return sum(kill_owned(o) for o in owners)
