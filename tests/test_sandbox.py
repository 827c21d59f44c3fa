"""The Python sandbox refuses and survives: real subprocesses, a real listening socket, real
fork bombs and allocations, with small limits so the file runs in seconds on 2 cores."""

from __future__ import annotations

import asyncio
import os
import socket
import time
from pathlib import Path

import pytest

from agent.tools.base import ToolResponse
from agent.tools.python_sandbox import PythonTool

SCHEMA = {"type": "function", "function": {"name": "python", "description": "run python",
                                            "parameters": {"type": "object", "properties": {"code": {"type": "string"}}}}}


def make(**config: object) -> PythonTool:
    return PythonTool({"timeout_s": 5, "memory_mb": 512, "max_procs": 16, **config}, SCHEMA)


def run(tool: PythonTool, code: str) -> ToolResponse:
    async def go() -> ToolResponse:
        iid = await tool.create()
        try:
            return await tool.execute(iid, {"code": code})
        finally:
            await tool.release(iid)
    return asyncio.run(go())


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
    if tool.isolation == "namespaces":  # the shell escape is stopped by the read-only mounts
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
    if tool.isolation == "namespaces":  # also from a child Python without the audit hook
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
    if tool.isolation == "namespaces":
        assert "child rc 1" in r.text and "unreachable" in r.text, r.text


def test_fork_bomb_bounded_and_cleaned_up() -> None:
    tool = make(max_procs=12, timeout_s=4)
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
    start = time.monotonic()
    r = run(tool, code)
    assert time.monotonic() - start < 4, "sleeping children must not hold the call until the deadline"
    assert "fork refused after" in r.text, r.text
    pids = [int(p) for p in r.text.split("PIDS", 1)[1].split()]
    assert 0 < len(pids) < 12
    time.sleep(0.2)
    assert not [p for p in pids if alive(p)], "children outlived the call"


def test_recursive_fork_bomb_ends_at_deadline() -> None:
    tool = make(max_procs=8, timeout_s=2)
    start = time.monotonic()
    r = run(tool, "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n")
    assert time.monotonic() - start < 2 + 3
    assert r.metrics["timed_out"] and not r.success


def test_memory_limit() -> None:
    r = run(make(memory_mb=256), "x = bytearray(600 * 2**20)\nprint('ALLOCATED')")
    assert "ALLOCATED" not in r.text and "MemoryError" in r.text and not r.success, r.text


def test_deadline_kills_busy_and_sleeping_programs() -> None:
    for code in ("while True:\n    pass", "import time\ntime.sleep(60)"):
        start = time.monotonic()
        r = run(make(timeout_s=1), code)
        took = time.monotonic() - start
        assert r.metrics["timed_out"] and "deadline" in r.text and took < 1 + 1.5, (code, took)


def test_huge_output_capped() -> None:
    r = run(make(max_output_bytes=1000), "import sys\nsys.stdout.write('x' * 5_000_000)")
    assert r.metrics["truncated"] and r.metrics["output_bytes"] == 5_000_000
    assert r.text.startswith("x" * 1000) and "output truncated" in r.text and len(r.text) < 1200


def test_file_size_limit() -> None:
    r = run(make(max_file_bytes=1 << 16), "open('big', 'wb').write(b'x' * (1 << 20))\nprint('WROTE')")
    assert "WROTE" not in r.text and "File too large" in r.text, r.text


def test_isolation_reported() -> None:
    tool = make()
    expected = "namespaces" if os.geteuid() == 0 and os.uname().sysname == "Linux" else "rlimits"
    assert tool.isolation == expected  # as root on Linux the strong layer must be on
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
    tool = make(isolation="rlimits", timeout_s=2)
    r = run(tool, "import socket\ntry:\n    open('/tmp/switchyard-rl.txt', 'w')\nexcept OSError as e:\n    print('w', e)\n"
                  "try:\n    socket.create_connection(('127.0.0.1', 9))\nexcept OSError as e:\n    print('n', e)\n"
                  "x = bytearray(800 * 2**20)")
    assert "w sandbox: writing outside" in r.text and "n sandbox: network" in r.text and "MemoryError" in r.text
    assert not Path("/tmp/switchyard-rl.txt").exists()
