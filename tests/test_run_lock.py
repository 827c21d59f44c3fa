"""One trainer per output directory (launch/run_lock.py): a second one is refused at once naming the
holder's host and pid; a lock left by a holder killed with -9 is taken over, saying so; the lock goes
on every exit path. The holders are real processes."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from launch.run_lock import RunLock, RunLockError

REPO = Path(__file__).resolve().parents[1]
HOLD = ("import sys, time\nfrom launch.run_lock import RunLock\n"
        "with RunLock(sys.argv[1]):\n    print('held', flush=True)\n"
        "    if sys.argv[2] == 'raise':\n        raise SystemExit(3)\n    time.sleep(120)\n")


def holder(out: Path, how: str = "sleep") -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(out), how], cwd=REPO, stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.stdout is not None and proc.stdout.readline().strip() == "held"  # a deadline: the test's timeout
    return proc


def test_a_second_trainer_is_refused_naming_the_holder_and_a_dead_ones_lock_is_taken_over(
        tmp_path: Path, capsys: pytest.CaptureFixture):
    out = tmp_path / "run"
    first = holder(out)
    try:
        t0 = time.monotonic()
        with pytest.raises(RunLockError) as e:
            RunLock(out).acquire()
        assert time.monotonic() - t0 < 1  # at once, not after a wait
        assert f"in use by another trainer (host {socket.gethostname()}, pid {first.pid}," in str(e.value), str(e.value)
        first.send_signal(signal.SIGKILL)  # no exit path of its own runs: the kernel drops its lock
        first.wait(30)
    finally:
        first.kill()
    assert json.loads((out / ".lock").read_text())["pid"] == first.pid  # its record is left behind
    with RunLock(out):
        assert json.loads((out / ".lock").read_text())["pid"] == os.getpid()
        said = capsys.readouterr().out
        assert f"taking over the lock on {out}: its holder (host {socket.gethostname()}, pid {first.pid}" in said
        assert "is gone" in said
    assert (out / ".lock").read_text() == ""  # released: no record of a holder
    with RunLock(out):  # and taken again without a word
        assert "taking over" not in capsys.readouterr().out


def test_the_lock_goes_when_its_holder_exits_by_an_exception(tmp_path: Path):
    out = tmp_path / "run"
    proc = holder(out, "raise")
    assert proc.wait(30) == 3
    with RunLock(out):
        pass
