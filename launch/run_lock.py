"""One trainer per output directory: `output_dir/.lock`, held for the whole run.

A second trainer started on the same `trainer.output_dir` (the same command twice, a Slurm requeue
that starts the job while it still runs) would write the same metrics and checkpoints over each
other. Rank 0 of a run takes an exclusive `flock` on the file and writes who holds it (host, pid,
start time); another trainer is refused at once, naming that holder. The kernel releases the lock
when its process ends however it ends (kill -9 included), so a lock file left by a holder that is
gone is taken over, saying whose it was. On a filesystem without locks the file's contents decide:
a holder on this host whose pid is gone is taken over, any other is refused.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import socket
import time
from pathlib import Path
from types import TracebackType

LOCK_NAME = ".lock"


def run_lock(output_dir: Path) -> "RunLock | contextlib.nullcontext[None]":
    """The lock this process holds for its run: rank 0's (RANK as torchrun sets it), none on other ranks."""
    return RunLock(output_dir) if int(os.environ.get("RANK", "0")) == 0 else contextlib.nullcontext()


class RunLockError(RuntimeError):
    """Another trainer holds the output directory, or it cannot be locked."""


class RunLock:
    """The output directory's lock; `with RunLock(dir):` holds it for the block (released on every exit)."""

    def __init__(self, output_dir: Path, show: bool = True) -> None:
        self.dir = Path(output_dir)
        self.path = self.dir / LOCK_NAME
        self.show = show
        self._fd: int | None = None

    def acquire(self) -> None:
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except PermissionError as e:
            raise RunLockError(f"permission denied: cannot create {self.path} ({e.strerror}); make "
                               "trainer.output_dir writable by this user or set it to a directory that is") from None
        except OSError as e:
            raise RunLockError(f"cannot create {self.path}: {e.strerror or e}; set trainer.output_dir to a "
                               "writable directory") from None
        try:
            import fcntl

            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                os.close(fd)
                raise RunLockError(self._refusal(self._holder())) from None
            if e.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
                os.close(fd)
                raise
            holder = self._holder()  # a filesystem without locks: the recorded holder decides
            if holder and not self._gone(holder) and holder.get("pid") != os.getpid():
                os.close(fd)
                raise RunLockError(self._refusal(holder)) from None
        earlier = self._holder()
        if earlier and earlier.get("pid") and self.show and (earlier.get("pid"), earlier.get("host")) != (
                os.getpid(), socket.gethostname()):
            print(f"taking over the lock on {self.dir}: its holder (host {earlier.get('host')}, pid "
                  f"{earlier.get('pid')}, since {earlier.get('since')}) is gone", flush=True)
        me = {"host": socket.gethostname(), "pid": os.getpid(),
              "since": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(me) + "\n").encode(), 0)
        self._fd = fd

    def release(self) -> None:
        """Empty the file (the record of a holder), then unlock; the file stays, so no second trainer
        ever locks a file the first one is about to remove."""
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        try:
            import fcntl

            os.ftruncate(fd, 0)
            fcntl.flock(fd, fcntl.LOCK_UN)  # for every process that shares the descriptor (forked children)
        except OSError:
            pass
        os.close(fd)

    def _holder(self) -> dict:
        try:
            text = self.path.read_text().strip()
            return json.loads(text) if text else {}
        except (OSError, ValueError):
            return {}

    @staticmethod
    def _gone(holder: dict) -> bool:
        if holder.get("host") != socket.gethostname():
            return False  # another host's process cannot be checked from here
        try:
            os.kill(int(holder["pid"]), 0)
        except ProcessLookupError:
            return True
        except (PermissionError, KeyError, ValueError, TypeError):
            return False
        return False

    def _refusal(self, holder: dict) -> str:
        who = (f"host {holder.get('host')}, pid {holder.get('pid')}, since {holder.get('since')}" if holder
               else "a process that has not yet written its name")
        elsewhere = (f" (if it is gone from host {holder.get('host')}, remove {self.path})"
                     if holder and holder.get("host") != socket.gethostname() else "")
        return (f"trainer.output_dir={str(self.dir)!r} is in use by another trainer ({who}); two runs on one "
                f"directory would overwrite each other's checkpoints and metrics. Wait for it to end or stop "
                f"it{elsewhere}, or set another trainer.output_dir")

    def __enter__(self) -> RunLock:
        self.acquire()
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.release()
