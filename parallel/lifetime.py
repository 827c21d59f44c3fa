"""A process must not outlive the one that started it: a trainer killed with -9 cannot stop its
engine servers and agent workers, which would hold their memory (a vLLM engine: gigabytes) forever.
Each of them watches its parent and, once it is gone (the process was re-parented), acts."""

from __future__ import annotations

import atexit
import logging
import os
import sys
import threading
import time
from typing import Callable, NoReturn


def watch_parent(on_gone: Callable[[], None], parent: int | None = None, every_s: float = 1.0,
                 name: str = "parent-watch") -> threading.Thread:
    """Call `on_gone` (from a daemon thread) once `parent` (default: the current parent) is gone."""
    pid = os.getppid() if parent is None else parent

    def watch() -> None:
        while os.getppid() == pid:
            time.sleep(every_s)
        on_gone()

    thread = threading.Thread(target=watch, name=name, daemon=True)
    thread.start()
    return thread


def exit_with_launcher(every_s: float = 1.0) -> None:
    """Under torchrun each rank runs in its own session, so a launcher killed with -9 (a node
    lost, a job cancelled) would leave its ranks and their engines running on; a rank whose
    launcher is gone exits, and its engines follow it (they watch their parent)."""

    def gone() -> None:
        print("the launcher is gone; this rank exits", file=sys.stderr, flush=True)
        os._exit(1)

    watch_parent(gone, every_s=every_s, name="launcher-watch")


def exit_now(status: int) -> NoReturn:
    """End a command-line process that finished its work: its exit handlers run and its output is
    flushed, then it leaves without the interpreter's teardown, which with torch and transformers
    loaded (their modules, threads nobody joins) costs ~2 s of doing nothing per process. Only for a
    process whose files and children are already closed (a run's, an engine server's)."""
    atexit._run_exitfuncs()  # what registered itself to run at exit (loggers' finish, temp folders)
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe: nothing left to say to it
            pass
    os._exit(status)
