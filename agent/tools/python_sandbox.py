"""Run model-written Python in a throw-away subprocess that cannot hurt the trainer's machine.

Layers (each one checked by tests/test_sandbox.py):
- resource limits set in the child before exec: RLIMIT_AS (memory), RLIMIT_CPU, RLIMIT_FSIZE
  (largest file), RLIMIT_NPROC (fork bombs), RLIMIT_NOFILE, RLIMIT_CORE=0;
- a wall-clock deadline enforced by the parent, which SIGKILLs the whole process group;
- output read by the parent up to `max_output_bytes`, the rest drained and replaced by a marker;
- a Python audit hook in the child refusing writes outside its working dir and socket
  connect/bind/send (the only write/network guard when not running as root; bypassable by
  native code such as ctypes or by a spawned non-Python program, hence the next layer).
When the parent is root ("namespaces" isolation), additionally:
- new network namespace (only a down loopback: nothing, not even 127.0.0.1, is reachable);
- new mount namespace where the usual world-writable dirs (/tmp, /var/tmp, /dev/shm, ...) are
  re-mounted read-only, except the fresh working dir;
- the child runs as a fresh unprivileged uid (one per call), so file permissions stop writes
  everywhere else, RLIMIT_NPROC applies (it does not for root), and after the call
  `kill -KILL -1` run as that uid removes every process it left behind, even ones that
  escaped the process group. If the interpreter sits under a dir that uid cannot enter
  (e.g. pyenv in /root), that dir is replaced in the namespace by a tmpfs holding only the
  interpreter's tree, which also hides the rest of it.
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import os
import random
import resource
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

from agent.tools.base import BaseTool, ToolResponse
from agent.tools.bwrap import TreeCaps, bwrap_argv, sandbox_workdir

log = logging.getLogger("switchyard.tools")
ISOLATIONS = ("auto", "bwrap", "namespaces", "rlimits")

_CLONE_NEWNS, _CLONE_NEWNET = 0x00020000, 0x40000000
_MS_RDONLY, _MS_NOSUID, _MS_NODEV, _MS_REMOUNT = 1, 2, 4, 32
_MS_BIND, _MS_MOVE, _MS_REC, _MS_PRIVATE = 4096, 8192, 16384, 1 << 18
_WORLD_WRITABLE = ("/tmp", "/var/tmp", "/dev/shm", "/run/lock", "/dev/mqueue")

# Runs in the child before the user's code: the audit hook, then main.py as __main__.
_BOOTSTRAP = r'''
import os, sys
def _install():
    root = os.path.realpath(os.getcwd())
    wflags = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
    def inside(p):
        try:
            p = os.path.realpath(os.fsdecode(p))
        except Exception:
            return False
        return p == root or p.startswith(root + os.sep)
    one_path = {"os.remove", "os.rmdir", "os.mkdir", "os.chmod", "os.chown", "os.truncate", "os.utime",
                "shutil.rmtree", "os.mkfifo", "os.mknod"}
    two_paths = {"os.rename", "os.link", "os.symlink", "shutil.copyfile", "shutil.move"}
    net = {"socket.connect", "socket.bind", "socket.sendto", "socket.sendmsg"}
    def hook(event, args):
        if event == "open":
            path, mode, flags = args
            if isinstance(path, int) or path is None:
                return
            writing = (flags & wflags) if isinstance(flags, int) else any(c in str(mode) for c in "wax+")
            if writing and not inside(path):
                raise PermissionError(f"sandbox: writing outside the working directory is refused: {path!r}")
        elif event in net:
            raise PermissionError(f"sandbox: network access is refused ({event})")
        elif event in one_path or event in two_paths:
            paths = [args[0]] if event in one_path else [args[0], args[1]]
            for p in paths:
                if not isinstance(p, int) and not inside(p):
                    raise PermissionError(f"sandbox: {event} outside the working directory is refused: {p!r}")
    sys.addaudithook(hook)
_install()
del _install
sys.argv = ["main.py"]
import runpy
runpy.run_path("main.py", run_name="__main__")
'''


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def _check(rc: int, what: str) -> None:
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _blocked_ancestor(path: str) -> tuple[str, str] | None:
    """(dir an unprivileged uid cannot enter, its child on the way to `path`), or None."""
    parts = Path(path).resolve().parts
    for i in range(1, len(parts) - 1):
        d = Path(*parts[: i + 1])
        if not os.stat(d).st_mode & stat.S_IXOTH:
            return str(d), str(Path(*parts[: i + 2]))
    return None


async def _wait_exit(pid: int) -> None:
    """Return once `pid` has exited (zombie or reaped), without reaping it: asyncio's child
    watcher does that. A pidfd becomes readable on exit; without pidfd support, poll /proc."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return  # already exited and reaped
    except (AttributeError, OSError):
        while _running(pid):
            await asyncio.sleep(0.05)
        return
    loop = asyncio.get_running_loop()
    done: asyncio.Future[None] = loop.create_future()
    loop.add_reader(fd, lambda: done.done() or done.set_result(None))
    try:
        await done
    finally:
        loop.remove_reader(fd)
        os.close(fd)


def _running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False


class PythonTool(BaseTool):
    """`{"code": "..."}` -> the program's stdout+stderr and exit status.

    Each call gets a fresh working dir (deleted after the call), so calls share nothing.
    Config: timeout_s (wall clock, default 10), memory_mb (address space, 1024),
    max_output_bytes (8192), max_file_bytes (16 MiB), max_procs (32, counts threads too),
    isolation ("auto" = bwrap, else namespaces, else refuse | "bwrap" | "namespaces" | "rlimits",
    which runs the code with the trainer's rights), allow_unsafe (auto may fall back to rlimits),
    disk_mb (bwrap: the working dir's tmpfs size, 64), python (interpreter, default this one),
    uid_base/uid_count (the range of throw-away uids used under "namespaces" and "bwrap" as root).
    """

    def __init__(self, config: dict[str, Any], tool_schema: dict[str, Any]) -> None:
        super().__init__(config, tool_schema)
        c = self.config
        self.timeout_s = float(c.get("timeout_s", 10.0))
        self.memory_mb = int(c.get("memory_mb", 1024))
        self.max_output_bytes = int(c.get("max_output_bytes", 8192))
        self.max_file_bytes = int(c.get("max_file_bytes", 16 << 20))
        self.max_procs = int(c.get("max_procs", 32))
        self.python = str(c.get("python", sys.executable))
        self.uid_base, self.uid_count = int(c.get("uid_base", 200_000)), int(c.get("uid_count", 50_000))
        self._uids_in_use: set[int] = set()
        self._expose = _blocked_ancestor(self.python)
        self._libc = _libc()  # loaded here: no dlopen between fork and exec
        self.disk_mb = int(c.get("disk_mb", 64))
        wanted = c.get("isolation", "auto")
        if wanted not in ISOLATIONS:
            raise ValueError(f"PythonTool isolation={wanted!r}; use one of {list(ISOLATIONS)}")
        problems: dict[str, str] = {}
        for mode, probe in (("bwrap", self._probe_bwrap), ("namespaces", self._probe_namespaces)):
            if wanted in (mode, "auto"):
                problem = probe()
                if problem is None:
                    self.isolation = mode
                    if problems:  # auto settled for less than bwrap: say why, once, at start-up
                        log.warning("PythonTool runs model code with isolation: %s, weaker than bwrap (%s)", mode,
                                    "; ".join(f"{k}: {v.strip()[-300:]}" for k, v in problems.items()))
                    else:
                        log.info("PythonTool isolation: %s", mode)
                    return
                problems[mode] = problem
        if wanted != "rlimits" and not c.get("allow_unsafe", False):
            raise RuntimeError(
                f"PythonTool cannot isolate model code here ({'; '.join(f'{k}: {v}' for k, v in problems.items())}). "
                "Install bubblewrap (apt install bubblewrap), or run as root for isolation: namespaces; only if "
                "the model's code may act with the trainer's rights, set isolation: rlimits (or allow_unsafe: true)")
        self.isolation = "rlimits"
        log.warning("PythonTool runs model-written code with the trainer's rights (isolation: rlimits): it can read "
                    "and write what the trainer can and reach the network; use it only for code you trust")

    def _probe_bwrap(self) -> str | None:
        """None if bubblewrap can start this interpreter as a throw-away uid here; else why not."""
        if sys.platform != "linux" or shutil.which("bwrap") is None:
            return "bwrap is not installed (apt install bubblewrap)"
        base, work, stash = self._make_dirs(None)
        try:
            main = os.path.join(work, "main.py")
            Path(main).write_text("pass\n")
            argv = bwrap_argv(self.python, main, 1 << 20, self._env(sandbox_workdir(self.python))) + ["-I", "-c", "pass"]
            r = subprocess.run(argv, cwd=work, capture_output=True, timeout=30, preexec_fn=self._preexec_bwrap(None))
            return None if r.returncode == 0 else r.stderr.decode(errors="replace")[-500:]
        except (subprocess.SubprocessError, OSError) as e:
            return str(e)
        finally:
            shutil.rmtree(base, ignore_errors=True)

    def _preexec_bwrap(self, tree: TreeCaps | None) -> Callable[[], None]:
        """In the child before exec: join the tree's cgroups, set the per-process limits."""
        limits = [(resource.RLIMIT_AS, self.memory_mb << 20), (resource.RLIMIT_CPU, int(self.timeout_s) + 1),
                  (resource.RLIMIT_FSIZE, self.max_file_bytes), (resource.RLIMIT_NPROC, self.max_procs),
                  (resource.RLIMIT_NOFILE, 256), (resource.RLIMIT_CORE, 0)]

        def run() -> None:
            if tree is not None:
                tree.join()
            for res, value in limits:
                resource.setrlimit(res, (value, value))

        return run

    def _probe_namespaces(self) -> str | None:
        """None if a namespaced, uid-dropped child can start Python here; else why not."""
        if sys.platform != "linux" or os.geteuid() != 0:
            return "needs root on Linux"
        base, work, stash = self._make_dirs(self.uid_base)
        try:
            r = subprocess.run([self.python, "-I", "-c", "pass"], cwd=work, capture_output=True, timeout=30,
                               preexec_fn=self._preexec(work, stash, self.uid_base, True), env=self._env(work))
            return None if r.returncode == 0 else r.stderr.decode(errors="replace")[-500:]
        except (subprocess.SubprocessError, OSError) as e:
            return str(e)
        finally:
            shutil.rmtree(base, ignore_errors=True)

    def _make_dirs(self, uid: int | None) -> tuple[str, str, str]:
        base = tempfile.mkdtemp(prefix="switchyard-py-")
        os.chmod(base, 0o711)  # the sandbox uid may pass through, not list
        work, stash = os.path.join(base, "work"), os.path.join(base, "stash")
        os.mkdir(work, 0o700)
        os.mkdir(stash, 0o700)
        if uid is not None:
            os.chown(work, uid, uid)
        return base, work, stash

    def _env(self, work: str) -> dict[str, str]:
        threads = {k: "1" for k in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")}
        return {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": work, "LANG": "C.UTF-8", **threads}

    def _preexec(self, work: str, stash: str, uid: int, namespaces: bool) -> Callable[[], None]:
        """The function run in the child between fork and exec (as root when namespaces)."""
        libc, expose = self._libc, self._expose
        limits = [(resource.RLIMIT_AS, self.memory_mb << 20), (resource.RLIMIT_CPU, int(self.timeout_s) + 1),
                  (resource.RLIMIT_FSIZE, self.max_file_bytes), (resource.RLIMIT_NPROC, self.max_procs),
                  (resource.RLIMIT_NOFILE, 256), (resource.RLIMIT_CORE, 0)]
        writable = [d for d in _WORLD_WRITABLE if os.path.isdir(d)]

        def mount(src: str | None, dst: str, fstype: str | None, flags: int, data: str | None = None) -> None:
            enc = lambda s: s.encode() if s is not None else None  # noqa: E731
            _check(libc.mount(enc(src), enc(dst), enc(fstype), ctypes.c_ulong(flags), enc(data)),
                   f"mount {src} -> {dst}")

        def run() -> None:
            if namespaces:
                _check(libc.unshare(_CLONE_NEWNS | _CLONE_NEWNET), "unshare")
                mount(None, "/", None, _MS_REC | _MS_PRIVATE)
                if expose is not None:  # a tmpfs over e.g. /root holding only e.g. /root/.pyenv
                    blocked, child = expose
                    mount(child, stash, None, _MS_BIND | _MS_REC)
                    mount("tmpfs", blocked, "tmpfs", _MS_NOSUID | _MS_NODEV, "mode=0755,size=64k")
                    inner = os.path.join(blocked, os.path.basename(child))
                    os.mkdir(inner)
                    os.chmod(inner, 0o755)
                    mount(stash, inner, None, _MS_MOVE)
                mount(work, work, None, _MS_BIND)  # its own mount: stays writable below
                for d in writable:
                    mount(d, d, None, _MS_BIND | _MS_REC)
                    mount(None, d, None, _MS_BIND | _MS_REMOUNT | _MS_RDONLY | _MS_NOSUID | _MS_NODEV)
                os.setgroups([])
                os.setgid(uid)
                os.setuid(uid)
            for res, value in limits:
                resource.setrlimit(res, (value, value))
            os.chdir(work)  # re-enter through the new mounts, not the pre-unshare cwd

        return run

    async def execute(self, instance_id: str, arguments: dict[str, Any]) -> ToolResponse:
        code = arguments.get("code")
        if not isinstance(code, str):
            return ToolResponse(f"Error: `code` must be a string of Python source, got {type(code).__name__}",
                                success=False)
        return await self.run_code(code)

    async def run_code(self, code: str) -> ToolResponse:
        """Run one program; never raises for anything the program does."""
        namespaces, boxed = self.isolation == "namespaces", self.isolation == "bwrap"
        dropped = namespaces  # runs as a throw-away uid of the host (bwrap: uid 65534 in its own namespace)
        uid = self._take_uid() if dropped else os.getuid()
        base, work, stash = self._make_dirs(uid if dropped else None)
        start = time.monotonic()
        proc: asyncio.subprocess.Process | None = None
        tree = TreeCaps(self.memory_mb << 20, self.max_procs) if boxed else None
        try:
            main = os.path.join(work, "main.py")
            Path(main).write_text(code)
            if dropped:
                os.chown(main, uid, uid)
            if boxed:
                argv = bwrap_argv(self.python, main, self.disk_mb << 20, self._env(sandbox_workdir(self.python)))
                preexec = self._preexec_bwrap(tree)
            else:
                argv, preexec = [self.python], self._preexec(work, stash, uid, namespaces)
            proc = await asyncio.create_subprocess_exec(
                *argv, "-I", "-B", "-c", _BOOTSTRAP, cwd=work, env=self._env(work),
                stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
                start_new_session=True, preexec_fn=preexec)
            buf, total = bytearray(), [0]
            reader = asyncio.create_task(self._read(proc, buf, total))
            timed_out = False
            try:  # not proc.wait(): asyncio's wait also waits for the pipes, which leftover children hold
                await asyncio.wait_for(_wait_exit(proc.pid), self.timeout_s)
            except asyncio.TimeoutError:
                timed_out = True
            await self._kill_all(proc, uid if dropped else None)
            if tree is not None:
                await asyncio.to_thread(tree.kill_and_remove)
            for waitable in (reader, proc.wait()):  # writers are dead now: EOF and exit come promptly
                try:
                    await asyncio.wait_for(waitable, 2.0)
                except asyncio.TimeoutError:
                    pass
            out, total_bytes = bytes(buf), total[0]
            return self._response(out, total_bytes, proc.returncode, timed_out, time.monotonic() - start)
        except Exception as e:  # a sandbox that cannot start is an observation, not a crash
            return ToolResponse(f"Error: the sandbox could not run the code: {e}", success=False,
                                metrics={"wall_s": time.monotonic() - start})
        finally:
            if proc is not None and proc.returncode is None:
                await self._kill_all(proc, uid if dropped else None)
            if tree is not None:
                await asyncio.to_thread(tree.kill_and_remove)
            shutil.rmtree(base, ignore_errors=True)
            self._uids_in_use.discard(uid)

    def _take_uid(self) -> int:
        for _ in range(1000):
            uid = self.uid_base + random.randrange(self.uid_count)
            if uid not in self._uids_in_use:
                self._uids_in_use.add(uid)
                return uid
        raise RuntimeError(f"no free sandbox uid in [{self.uid_base}, {self.uid_base + self.uid_count}); "
                           "raise uid_count")

    async def _read(self, proc: asyncio.subprocess.Process, buf: bytearray, total: list[int]) -> None:
        """Keep at most max_output_bytes in `buf`, but drain everything so the child never blocks
        on a full pipe; `total[0]` counts all bytes. Filled in place so a cut-off read keeps its output."""
        assert proc.stdout is not None
        while chunk := await proc.stdout.read(1 << 16):
            total[0] += len(chunk)
            if len(buf) < self.max_output_bytes:
                buf += chunk[: self.max_output_bytes - len(buf)]

    async def _kill_all(self, proc: asyncio.subprocess.Process, uid: int | None) -> None:
        """SIGKILL the process group, and under namespaces every process of the throw-away uid."""
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        if uid is not None:
            def become() -> None:
                os.setgroups([])
                os.setgid(uid)
                os.setuid(uid)
            sweeper = await asyncio.create_subprocess_exec("/bin/kill", "-KILL", "--", "-1", preexec_fn=become,
                                                           stdout=asyncio.subprocess.DEVNULL,
                                                           stderr=asyncio.subprocess.DEVNULL)
            await sweeper.wait()

    def _response(self, out: bytes, total: int, rc: int | None, timed_out: bool, wall: float) -> ToolResponse:
        text = out.decode(errors="replace")
        truncated = total > len(out)
        if truncated:
            text += f"\n...[output truncated: {total} bytes, showing the first {len(out)}]"
        if timed_out:
            text += f"\n[killed: ran past the {self.timeout_s:g}s deadline]"
        elif rc is not None and rc < 0:
            text += f"\n[killed by signal {signal.Signals(-rc).name}]"
        elif rc:
            text += f"\n[exit code {rc}]"
        metrics = {"exit_code": rc, "timed_out": timed_out, "truncated": truncated, "output_bytes": total,
                   "wall_s": wall, "isolation": self.isolation}
        return ToolResponse(text, success=(rc == 0 and not timed_out), metrics=metrics)
