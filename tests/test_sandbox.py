"""The Python sandbox refuses and survives: real subprocesses, a real listening socket, real
fork bombs and allocations, with small limits so the file runs in seconds on 2 cores."""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import time
from pathlib import Path

import pytest

from agent.tools.base import ToolResponse
from agent.tools.python_sandbox import PythonTool
from waiting import wait_until

SCHEMA = {"type": "function", "function": {"name": "python", "description": "run python",
                                            "parameters": {"type": "object", "properties": {"code": {"type": "string"}}}}}


def make(**config: object) -> PythonTool:
    # a deadline no program here reaches unless a test means it to: a loaded box starts interpreters slowly
    return PythonTool({"timeout_s": 60, "memory_mb": 512, "max_procs": 16, **config}, SCHEMA)


def run(tool: PythonTool, code: str) -> ToolResponse:
    async def go() -> ToolResponse:
        iid = await tool.create()
        try:
            return await tool.execute(iid, {"code": code})
        finally:
            await tool.release(iid)
    return asyncio.run(go())


STRONG = ("bwrap", "namespaces")


def sandbox_processes() -> list[int]:
    """Host pids of sandboxed programs still running (their command line holds the bootstrap)."""
    import psutil

    found = []
    for p in psutil.process_iter(["cmdline", "status"]):
        cmd = " ".join(p.info["cmdline"] or [])
        if "def _install()" in cmd and p.info["status"] != psutil.STATUS_ZOMBIE:
            found.append(p.pid)
    return found


def alive(pid: int) -> bool:
    """Running (not a zombie waiting for init to reap it)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"


def test_normal_program_prints_result() -> None:
    r = run(make(), "import math\nprint(sum(i * i for i in range(10)), math.factorial(5))")
    assert r.success and r.text.strip() == "285 120", r.text
    assert r.metrics["exit_code"] == 0


def test_error_is_an_observation() -> None:
    r = run(make(), "raise ValueError('boom')")
    assert not r.success and "ValueError: boom" in r.text and "[exit code 1]" in r.text


def test_writes_outside_workdir_refused(tmp_path: Path) -> None:
    tool = make()
    target = tmp_path / "escape.txt"
    os.chmod(tmp_path, 0o777)  # world-writable, so only the sandbox (not file modes) can stop it
    code = f"""
import os
for p in [{str(target)!r}, '../escape.txt', '/tmp/switchyard-escape.txt']:
    try:
        open(p, 'w').write('x'); print('WROTE', p)
    except OSError as e:
        print('refused', p, type(e).__name__)
open('inside.txt', 'w').write('ok'); print('inside', open('inside.txt').read())
os.system('echo x > {target}.sh 2>/dev/null')  # a non-Python writer: no audit hook there
"""
    r = run(tool, code)
    assert "WROTE" not in r.text and r.text.count("refused") == 3, r.text
    assert "inside ok" in r.text
    assert not target.exists() and not Path("/tmp/switchyard-escape.txt").exists()
    if tool.isolation in STRONG:  # the shell escape is stopped by the read-only mounts
        assert not Path(f"{target}.sh").exists()


def test_socket_to_local_listener_blocked() -> None:
    tool = make()
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(4)
    listener.setblocking(False)
    port = listener.getsockname()[1]
    code = f"""
import socket, subprocess, sys
try:
    socket.create_connection(('127.0.0.1', {port}), timeout=2); print('CONNECTED')
except OSError as e:
    print('refused', type(e).__name__)
"""
    if tool.isolation in STRONG:  # also from a child Python without the audit hook
        code += f"""
r = subprocess.run([sys.executable, '-I', '-c', "import socket; socket.create_connection(('127.0.0.1', {port}), timeout=2)"],
                   capture_output=True, text=True)
print('child rc', r.returncode, r.stderr.strip().splitlines()[-1])
"""
    try:
        r = run(tool, code)
        with pytest.raises(BlockingIOError):
            listener.accept()  # nobody reached the listener
    finally:
        listener.close()
    assert "CONNECTED" not in r.text and "refused" in r.text, r.text
    if tool.isolation in STRONG:  # no route out (namespaces) or only the sandbox's own loopback (bwrap)
        assert "child rc 1" in r.text and ("unreachable" in r.text or "refused" in r.text.split("child rc")[1]), r.text


def test_fork_bomb_bounded_and_cleaned_up() -> None:
    tool = make(max_procs=12, timeout_s=60)
    code = """
import os, time
pids = []
try:
    for _ in range(200):
        pid = os.fork()
        if pid == 0:
            time.sleep(60); os._exit(0)
        pids.append(pid)
except OSError as e:
    print('fork refused after', len(pids), type(e).__name__)
print('PIDS', *pids, flush=True)
"""
    r = run(tool, code)
    assert not r.metrics["timed_out"], "sleeping children must not hold the call until the deadline"
    assert "fork refused after" in r.text, r.text
    pids = [int(p) for p in r.text.split("PIDS", 1)[1].split()]
    assert 0 < len(pids) < 12
    # killed when the call returns; gone once the kernel has torn them down (slower on a loaded box)
    host_pids = pids if tool.isolation != "bwrap" else []  # bwrap's pids are its own namespace's
    wait_until(lambda: not [p for p in host_pids if alive(p)] and not sandbox_processes(),
               "the sandboxed children are gone", 10)


def test_recursive_fork_bomb_ends_at_deadline() -> None:
    tool = make(max_procs=8, timeout_s=2)
    start = time.monotonic()
    r = run(tool, "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n")
    assert time.monotonic() - start < 2 + 20  # at the deadline plus teardown, not the bomb's own end (never)
    assert r.metrics["timed_out"] and not r.success


def test_memory_limit() -> None:
    r = run(make(memory_mb=256), "x = bytearray(600 * 2**20)\nprint('ALLOCATED')")
    assert "ALLOCATED" not in r.text and "MemoryError" in r.text and not r.success, r.text


def test_deadline_kills_busy_and_sleeping_programs() -> None:
    for code in ("while True:\n    pass", "import time\ntime.sleep(60)"):
        start = time.monotonic()
        r = run(make(timeout_s=1), code)
        took = time.monotonic() - start
        # killed at the deadline (plus a loaded box's teardown), not when the program would end (never / 60 s)
        assert r.metrics["timed_out"] and "deadline" in r.text and took < 1 + 20, (code, took)


def test_huge_output_capped() -> None:
    r = run(make(max_output_bytes=1000), "import sys\nsys.stdout.write('x' * 5_000_000)")
    assert r.metrics["truncated"] and r.metrics["output_bytes"] == 5_000_000
    assert r.text.startswith("x" * 1000) and "output truncated" in r.text and len(r.text) < 1200


def test_file_size_limit() -> None:
    r = run(make(max_file_bytes=1 << 16), "open('big', 'wb').write(b'x' * (1 << 20))\nprint('WROTE')")
    assert "WROTE" not in r.text and "File too large" in r.text, r.text


def test_isolation_reported() -> None:
    tool = make()
    expected = "bwrap" if shutil.which("bwrap") else "namespaces"
    assert tool.isolation == expected  # the strongest layer this box offers is on
    with pytest.raises(ValueError, match="isolation='bogus'"):
        make(isolation="bogus")


def test_concurrent_calls_do_not_share_state() -> None:
    tool = make()
    code = "import os\nopen('f', 'w').write('x')\nprint(sorted(os.listdir('.')))"

    async def go() -> list[ToolResponse]:
        return await asyncio.gather(*(tool.run_code(code) for _ in range(4)))
    for r in asyncio.run(go()):
        assert r.success and r.text.strip() == "['f', 'main.py']", r.text


def test_rlimits_fallback_still_guards_python_code() -> None:
    """Without namespaces (non-root hosts) the audit hook and rlimits are the guard."""
    tool = make(isolation="rlimits")
    r = run(tool, "import socket\ntry:\n    open('/tmp/switchyard-rl.txt', 'w')\nexcept OSError as e:\n    print('w', e)\n"
                  "try:\n    socket.create_connection(('127.0.0.1', 9))\nexcept OSError as e:\n    print('n', e)\n"
                  "x = bytearray(800 * 2**20)")
    assert "w sandbox: writing outside" in r.text and "n sandbox: network" in r.text and "MemoryError" in r.text
    assert not Path("/tmp/switchyard-rl.txt").exists()


@pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed")
def test_bwrap_hides_the_host_and_caps_the_whole_tree(tmp_path: Path) -> None:
    """Attacks on isolation: bwrap: read secrets, the checkout and the trainer's environment, reach
    a host unix socket, signal the trainer, fill the disk, and out-allocate the memory cap with
    several processes that each stay under the per-process limit."""
    os.environ["SWITCHYARD_SECRET_PROBE"] = "hunter2"
    sock_path = tmp_path / "host.sock"
    os.chmod(tmp_path, 0o777)
    server = socket.socket(socket.AF_UNIX)
    server.bind(str(sock_path))
    os.chmod(sock_path, 0o777)
    server.listen(1)
    server.setblocking(False)
    tool = make(isolation="bwrap", memory_mb=400, disk_mb=8, max_procs=16)
    repo = Path(__file__).resolve().parents[1]
    code = f"""
import os, socket, subprocess, sys
for p in ['/etc/shadow', '/etc/passwd', {str(repo / "README.md")!r}, '/proc/{os.getpid()}/environ']:
    try:
        open(p).read(1); print('OPENED', p)
    except OSError as e:
        print('hidden', p)
print('SECRET' if 'hunter2' in str(os.environ) else 'no secret')
r = subprocess.run([sys.executable, '-I', '-c', "import socket; s = socket.socket(socket.AF_UNIX); s.connect({str(sock_path)!r})"],
                   capture_output=True, text=True)
print('unix rc', r.returncode)
try:
    os.kill({os.getpid()}, 9); print('KILLED')
except OSError as e:
    print('no kill', type(e).__name__)
try:
    with open('fill', 'wb') as f:
        for _ in range(64):
            f.write(b'x' * (1 << 20))
    print('FILLED')
except OSError as e:
    print('disk full', e.errno)
os.remove('fill')
kids = [subprocess.Popen([sys.executable, '-c', 'import time; x = bytearray(150 * 2**20); x[::4096] = b"y" * len(x[::4096]); time.sleep(3); print("KEPT")'])
        for _ in range(4)]
print('kids', [k.wait() for k in kids], flush=True)
"""
    try:
        r = run(tool, code)
        with pytest.raises(BlockingIOError):
            server.accept()  # nothing reached the host's unix socket
    finally:
        server.close()
        del os.environ["SWITCHYARD_SECRET_PROBE"]
    assert "OPENED" not in r.text and r.text.count("hidden") == 4 and "no secret" in r.text, r.text
    assert "unix rc 1" in r.text and "KILLED" not in r.text and "disk full 28" in r.text and "FILLED" not in r.text
    kids = r.text.split("kids", 1)[1]
    assert "-9" in kids and r.text.count("KEPT") < 4, r.text  # 600 MB across the tree > 400 MB: some were killed
    assert not sandbox_processes()


def test_a_tree_that_outlives_its_kill_deadline_is_named_not_waited_for(tmp_path: Path, caplog) -> None:
    """The end of a bwrap run waits for its killed tree to leave the cgroup, up to a deadline, then
    says which processes were still there (a cgroup listing a pid that never goes stands in)."""
    from agent.tools.bwrap import TreeCaps

    tree = TreeCaps.__new__(TreeCaps)
    cgroup = tmp_path / "cg"
    cgroup.mkdir()
    (cgroup / "cgroup.procs").write_text("4194304\n")  # above pid_max's ceiling: no such process, ever
    tree.paths = [cgroup]
    start = time.monotonic()
    with caplog.at_level("WARNING", logger="switchyard.sandbox"):
        tree.kill_and_remove(deadline_s=0.3)
    assert 0.3 <= time.monotonic() - start < 3
    assert "[4194304]" in caplog.text and "still exiting" in caplog.text
    assert tree.paths == [] and cgroup.exists()  # not removable while it holds a process


def test_auto_refuses_without_isolation_unless_unsafe_is_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    import agent.tools.python_sandbox as sandbox

    monkeypatch.setattr(sandbox.shutil, "which", lambda name: None)  # no bubblewrap ...
    monkeypatch.setattr(sandbox.os, "geteuid", lambda: 1000)  # ... and not root: no namespaces
    with pytest.raises(RuntimeError, match="apt install bubblewrap"):
        make()
    assert make(allow_unsafe=True).isolation == "rlimits"
    assert make(isolation="rlimits").isolation == "rlimits"


@pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed")
def test_bwrap_runs_an_interpreter_in_a_venv_under_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                       caplog: pytest.LogCaptureFixture) -> None:
    """A venv under /tmp (as CI and many users have): its interpreter is bound over the sandbox's
    own /tmp, so `bwrap` works and `auto` picks it; without bubblewrap, the fallback is logged."""
    import logging
    import subprocess
    import sys

    import agent.tools.python_sandbox as sandbox

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = str(venv / "bin" / "python")
    assert python.startswith("/tmp/")
    for isolation in ("bwrap", "auto"):
        tool = make(isolation=isolation, python=python)
        assert tool.isolation == "bwrap"
        r = run(tool, "import sys, os; print(sys.prefix, os.getuid(), os.path.exists('/etc/passwd'))")
        assert r.success and r.text.split() == [str(venv), "65534", "False"], r.text
    if os.geteuid() == 0:  # root: namespaces are the next strongest
        which = shutil.which
        monkeypatch.setattr(sandbox.shutil, "which", lambda name: None if name == "bwrap" else which(name))
        with caplog.at_level(logging.WARNING, logger="switchyard"):
            assert make().isolation == "namespaces"  # (pytest's 0700 tmp dirs hide the venv from its uid)
        assert "weaker than bwrap" in caplog.text and "bwrap is not installed" in caplog.text


def test_the_working_directory_is_not_where_the_interpreter_lives(monkeypatch: pytest.MonkeyPatch) -> None:
    """A venv in a checkout under the host's /work is bound into the sandbox where it lives: the
    program's own folder is then elsewhere, or the venv's bind would show in it."""
    from agent.tools import bwrap

    monkeypatch.setattr(bwrap, "interpreter_roots", lambda python: ["/opt/py"])
    assert bwrap.sandbox_workdir("python") == "/work"
    monkeypatch.setattr(bwrap, "interpreter_roots", lambda python: ["/work/checkout/.venv", "/opt/py"])
    assert bwrap.sandbox_workdir("python") == "/sandbox"
    if shutil.which("bwrap"):
        argv = bwrap.bwrap_argv("python", "/tmp/main.py", 1 << 20, {})
        assert argv[argv.index("--chdir") + 1] == "/sandbox" and "/sandbox/main.py" in argv
