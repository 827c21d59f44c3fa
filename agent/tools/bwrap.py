"""The strongest isolation of `PythonTool` (`isolation: bwrap`): bubblewrap (Debian's `bubblewrap`
package), the program running as uid 65534 ("nobody") with no capabilities in a user namespace
of its own, so it

- sees only the system's read-only `/usr` (and the interpreter's own tree, read-only), a fresh
  `/proc` and `/dev`, and a working dir that is a size-capped tmpfs (the disk quota): not the
  checkout, not /etc, not /root, not the trainer's files or environment;
- has no network at all and no host unix sockets (new network, IPC, PID, UTS and user
  namespaces), cannot see or signal the trainer (its own PID namespace), and dies with it;
- shares one memory cap and one process cap across its whole process tree when cgroups can be
  made (`TreeCaps`), besides the per-process rlimits the caller sets; whatever it leaves behind is
  killed through them (and by its PID namespace's end).
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import sys
import time
import uuid
from pathlib import Path

log = logging.getLogger("switchyard.sandbox")
# how long the end of a run waits for its killed tree to exit (a budget of 1 s once ran out in a suite run on
# a loaded 2-core box: a sandboxed process was still there when the call returned)
KILL_DEADLINE_S = 10.0

CGROUP_V1 = Path("/sys/fs/cgroup")  # with memory/ and pids/ hierarchies
CGROUP_V2 = Path("/sys/fs/cgroup")  # unified, when it has cgroup.controllers


def interpreter_roots(python: str) -> list[str]:
    """The directories the interpreter needs, outside /usr (e.g. a pyenv or venv prefix)."""
    roots = set()  # a venv's own prefix (its pyvenv.cfg) and the tree its symlinked interpreter lives in
    for p in (sys.base_prefix, sys.prefix, str(Path(python).absolute().parents[1]),
              str(Path(os.path.realpath(python)).parents[1])):
        p = os.path.realpath(p)
        if not p.startswith("/usr/") and p != "/usr" and os.path.isdir(p):
            roots.add(p)
    return sorted(roots)


def sandbox_workdir(python: str) -> str:
    """The program's working directory inside the sandbox: /work, unless the interpreter lives under a
    /work of the host (a venv in a checkout there), whose bind would then show in the program's folder."""
    roots = interpreter_roots(python)
    for name in ("/work", "/sandbox", "/sandbox-work"):
        if not any(r == name or r.startswith(name + "/") for r in roots):
            return name
    raise RuntimeError(f"the interpreter's folders {roots} cover every working directory the sandbox could use")


def bwrap_argv(python: str, main_py: str, disk_bytes: int, env: dict[str, str]) -> list[str]:
    """bwrap + the interpreter: main.py read-only in a tmpfs working directory of `disk_bytes`
    (`sandbox_workdir`; the caller's `env` names it)."""
    work = sandbox_workdir(python)
    exe = shutil.which("bwrap")
    if exe is None:
        raise FileNotFoundError("bwrap is not installed (apt install bubblewrap)")
    argv = [exe, "--unshare-all", "--die-with-parent", "--new-session", "--clearenv", "--cap-drop", "ALL",
            "--uid", "65534", "--gid", "65534",
            "--ro-bind", "/usr", "/usr", "--proc", "/proc", "--dev", "/dev"]
    for link in ("lib", "lib64", "bin", "sbin"):  # merged-/usr systems: /lib -> usr/lib, ...
        target = f"/{link}"
        if os.path.islink(target):
            argv += ["--symlink", os.readlink(target), target]
        elif os.path.isdir(target):
            argv += ["--ro-bind", target, target]
    # the tmpfs mounts first: an interpreter under /tmp (a venv there) is then bound on top of them
    argv += ["--size", str(16 << 20), "--tmpfs", "/tmp",
             "--size", str(disk_bytes), "--tmpfs", work, "--ro-bind", main_py, f"{work}/main.py", "--chdir", work]
    for root in interpreter_roots(python):
        argv += ["--ro-bind", root, root]
    for k, v in env.items():
        argv += ["--setenv", k, v]
    return argv + ["--", python]


class TreeCaps:
    """Cgroups capping one sandboxed process tree as a whole: memory (no swap) and number of
    processes, under cgroup v2 or v1, whichever this box lets the trainer create. `paths` is
    empty where none can be made; the per-process rlimits then remain the only caps."""

    def __init__(self, memory_bytes: int, max_procs: int) -> None:
        self.paths: list[Path] = []
        name = f"switchyard-{uuid.uuid4().hex[:12]}"
        if (CGROUP_V2 / "cgroup.controllers").exists():
            wanted = {"memory.max": memory_bytes, "memory.swap.max": 0, "pids.max": max_procs}
            self._make(CGROUP_V2 / name, wanted)
        else:
            self._make(CGROUP_V1 / "memory" / name, {"memory.limit_in_bytes": memory_bytes,
                                                     "memory.memsw.limit_in_bytes": memory_bytes})
            self._make(CGROUP_V1 / "pids" / name, {"pids.max": max_procs})

    def _make(self, path: Path, limits: dict[str, int]) -> None:
        try:
            path.mkdir()
        except OSError:
            return
        for key, value in limits.items():
            if (path / key).exists():
                try:
                    (path / key).write_text(str(value))
                except OSError:
                    pass
        self.paths.append(path)

    @property
    def capped(self) -> bool:
        return bool(self.paths)

    def join(self) -> None:
        """Move the calling process (the child, before exec) into every cgroup."""
        for path in self.paths:
            (path / "cgroup.procs").write_text(str(os.getpid()))

    def kill_and_remove(self, deadline_s: float = KILL_DEADLINE_S) -> None:
        """SIGKILL whatever the tree left behind, wait (at most `deadline_s`) until it has exited,
        then remove the cgroups. Blocking: call it off the event loop. A process still there at
        the deadline is named in a warning (its cgroup cannot be removed then)."""
        end = time.monotonic() + deadline_s
        for path in self.paths:
            pause = 0.005
            while True:
                try:
                    pids = [int(x) for x in (path / "cgroup.procs").read_text().split()]
                except OSError:
                    break
                if not pids:
                    break
                if time.monotonic() > end:  # a killed process that takes this long to exit: the box is stalled
                    log.warning("sandbox: processes %s of cgroup %s were still exiting %.0f s after SIGKILL",
                                pids, path, deadline_s)
                    break
                for pid in pids:
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                time.sleep(pause)
                pause = min(0.1, pause * 2)
            try:
                path.rmdir()
            except OSError:
                pass
        self.paths = []
