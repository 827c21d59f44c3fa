"""The suite's warm starts (tests/warm): a program forked from the warm interpreter gets its argv,
cwd, environment and descriptors, sees the process that started it as its parent, and its stand-in
reads as the program to whoever started it: exit status, signals, kill -9. Anything the warm
interpreter cannot honour starts cold."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
CHILD = "tests/warm/child.py"

pytestmark = pytest.mark.skipif(not os.environ.get("SWITCHYARD_WARM"), reason="warm starts are off")


@pytest.fixture(autouse=True)
def _zygote_up() -> None:
    deadline = time.monotonic() + 120
    while not os.path.exists(os.environ["SWITCHYARD_WARM"]):  # it imports torch and transformers first
        assert time.monotonic() < deadline, "the warm interpreter did not come up in 120 s"
        time.sleep(0.2)


def start(arg: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, CHILD, arg], cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, **(env or {})})


def report(proc: subprocess.Popen) -> dict:
    proc.stdin.write("hello\n")
    proc.stdin.flush()
    return json.loads(proc.stdout.readline())


def test_a_warm_program_gets_what_python_would_give_it_and_exits_as_it_did():
    proc = start("3", {"WARM_TEST_VALUE": "x1"})
    seen = report(proc)
    assert proc.wait(30) == 3 and proc.stderr.read() == "to stderr\n"
    assert seen["warm"] and seen["pid"] != proc.pid, seen  # forked, not the stand-in
    assert seen == {**seen, "ppid": os.getpid(), "argv": [CHILD, "3"], "cwd": str(REPO), "stdin": "hello",
                    "env": "x1", "file": str(REPO / CHILD)}


def test_multiprocessing_spawn_from_a_warm_program_finds_its_main_file():
    proc = start("spawn")
    assert report(proc)["warm"]
    assert proc.stdout.readline() == "spawned from child.py\n"
    assert proc.wait(60) == 0, proc.stderr.read()


def test_signals_reach_the_program_and_kill_9_of_the_stand_in_takes_it_along():
    proc = start("sleep")
    assert report(proc)["warm"]
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(30) == -signal.SIGTERM

    proc = start("sleep")
    child = report(proc)["pid"]
    proc.kill()
    assert proc.wait(30) == -signal.SIGKILL
    deadline = time.monotonic() + 10
    while Path(f"/proc/{child}").exists() and "Z" not in Path(f"/proc/{child}/stat").read_text().split()[2]:
        assert time.monotonic() < deadline, "the program outlived its stand-in"
        time.sleep(0.05)


def test_an_environment_read_at_import_time_starts_cold():
    proc = start("0", {"HF_HOME": "/nonexistent/hf-home"})
    seen = report(proc)
    assert proc.wait(60) == 0
    assert not seen["warm"] and seen["pid"] == proc.pid, seen
