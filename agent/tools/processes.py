"""Processes a trajectory's tools (and its reward function) start belong to that trajectory: they end with it.

A tool that starts a process (`subprocess.Popen`, `asyncio.create_subprocess_exec`, `os.fork`, a
helper server) and never stops it would leave it running after the trajectory, its release and
even the worker. Inside an agent worker, every such process started while a trajectory runs (on the
worker's loop, in a task of the trajectory, in the thread a tool call runs in, in a thread that
code starts, or in an executor it submits to) is put in a process group of its own and recorded
under the trajectory; when the trajectory has ended (after its tools' release) the recorded groups
are killed, and whatever is left when the worker closes is killed too. Threads and executor work
items carry the trajectory with them: a thread started, or a call submitted to a thread pool, inside
a trajectory runs in a copy of the starter's context.

Processes meant to outlive a trajectory are started outside any: at tool construction, or in a
task created with an empty context (`McpSession` does this for its shared server). A descendant
that left its group (a grandchild that called `setsid`) is found by parent pid while its parent
still runs, and killed too. Not covered: a process started with `os.posix_spawn` or a C extension's
own fork, and a daemon that double-forks (its parent exits, it moves to init's children, nothing
ties it to the trajectory any more). A tool that calls `os.fork` itself should `exec` or `os._exit` in the child promptly: a
forked child that runs on keeps every descriptor it inherited, among them the pipe through which a
`subprocess.Popen` on another thread waits for its own child's exec, and that Popen then waits as
long as the forked child lives.
"""

from __future__ import annotations

import contextlib
import concurrent.futures
import contextvars
import logging
import os
import signal
import subprocess
import threading
from typing import Any, Iterator

log = logging.getLogger("switchyard.tools")
_owner: contextvars.ContextVar[str | None] = contextvars.ContextVar("switchyard_trajectory", default=None)
_owned: dict[str, list[subprocess.Popen | int]] = {}  # Popen, or a forked pid
_lock = threading.Lock()
_real_init = subprocess.Popen.__init__
_real_fork = os.fork
_real_thread_start = threading.Thread.start
_real_submit = concurrent.futures.ThreadPoolExecutor.submit


def _init(self: subprocess.Popen, *args: Any, **kwargs: Any) -> None:
    owner = _owner.get()
    if owner is not None and "process_group" not in kwargs and not kwargs.get("start_new_session"):
        kwargs["start_new_session"] = True  # a group of its own: its children go with it
    _real_init(self, *args, **kwargs)
    if owner is not None:
        with _lock:
            _owned.setdefault(owner, []).append(self)


def _fork() -> int:
    """os.fork: inside a trajectory the child leads a session of its own and its pid is recorded."""
    owner = _owner.get()
    pid = _real_fork()
    if pid == 0:
        if owner is not None:
            with contextlib.suppress(OSError):
                os.setsid()
        return 0
    if owner is not None:
        with _lock:
            _owned.setdefault(owner, []).append(pid)
    return pid


def _thread_start(self: threading.Thread) -> None:
    """Thread.start: a thread started inside a trajectory runs in a copy of the starter's context."""
    if _owner.get() is not None and not getattr(self, "_switchyard_context", False):
        run, ctx = self.run, contextvars.copy_context()
        self.run = lambda: ctx.run(run)  # type: ignore[method-assign]
        self._switchyard_context = True
    _real_thread_start(self)


def _submit(self: concurrent.futures.ThreadPoolExecutor, fn: Any, /, *args: Any, **kwargs: Any) -> Any:
    """ThreadPoolExecutor.submit: the call runs in the submitter's context, whichever thread runs it
    (a pool's threads outlive the trajectory that happened to start them)."""
    return _real_submit(self, contextvars.copy_context().run, fn, *args, **kwargs)


def install() -> None:
    """Record the processes trajectories start (in this process, from now on; idempotent)."""
    subprocess.Popen.__init__ = _init  # type: ignore[method-assign]
    os.fork = _fork
    threading.Thread.start = _thread_start  # type: ignore[method-assign]
    concurrent.futures.ThreadPoolExecutor.submit = _submit  # type: ignore[method-assign]


@contextlib.contextmanager
def owned_by(trajectory: str) -> Iterator[None]:
    """Processes started in this context (and the tasks and tool threads it spawns) are `trajectory`'s."""
    token = _owner.set(trajectory)
    try:
        yield
    finally:
        _owner.reset(token)


def kill_owned(trajectory: str) -> int:
    """Kill the process groups `trajectory` started, and every descendant of theirs that left its
    group (a grandchild that called setsid while its parent lives); how many were still running."""
    with _lock:
        procs = _owned.pop(trajectory, [])
    live = []
    for p in procs:
        try:
            if isinstance(p, int):  # a forked child: running unless it has been reaped
                if os.waitpid(p, os.WNOHANG)[0] == 0:
                    live.append(p)
            elif p.poll() is None:  # else ended (and reaped now: its pid cannot be another process's)
                live.append(p)
        except ChildProcessError:  # reaped by the code that made it
            pass
    strays = _descendants([p if isinstance(p, int) else p.pid for p in live]) if live else []
    killed = 0
    for p in live:
        pid = p if isinstance(p, int) else p.pid
        try:
            if os.getpgid(pid) == pid:
                os.killpg(pid, signal.SIGKILL)
            else:  # it chose a group of its own making: only the process itself is known to be ours
                os.kill(pid, signal.SIGKILL)
            killed += 1
        except (ProcessLookupError, PermissionError):  # gone
            pass
    for pid in strays:  # those in a session or group of their own; the others went with their group
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
    for p in live:  # reaped, so no pid of theirs is reused while recorded elsewhere
        with contextlib.suppress(ChildProcessError, subprocess.TimeoutExpired):
            os.waitpid(p, 0) if isinstance(p, int) else p.wait(timeout=5)
    if killed:
        log.info("trajectory %s left %d tool process(es) running; killed them", trajectory, killed)
    return killed


def _descendants(roots: list[int]) -> list[int]:
    """Every live descendant of `roots`, found by parent pid in /proc (Linux; none elsewhere)."""
    children: dict[int, list[int]] = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return []
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read()
            ppid = int(stat[stat.rindex(b")") + 2:].split()[1])  # after the name: state, then the parent's pid
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    found, todo = [], list(roots)
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def kill_all() -> int:
    """Kill what every trajectory left (the worker is closing)."""
    with _lock:
        owners = list(_owned)
    return sum(kill_owned(o) for o in owners)
