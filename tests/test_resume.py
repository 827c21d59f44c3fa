"""Resuming a run as a user does, through launch/train.py (launch/resume.py, launch/run_lock.py): a
second trainer on a running one's output_dir is refused naming its holder; a resumed config is
compared with the saved one (every change printed, those that alter the run refused unless
confirmed); checkpoints none of which loads stop the run instead of restarting it; a fresh start
keeps the earlier run's metrics."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from launch.checkpoint import ResumeError
from launch.resume import compare
from test_train import REPO, TINY, _env, metrics, train
from waiting import wait_until

FAST = [*TINY, "rollout.in_process=true", "sft.enabled=false", "trainer.export_hf=false"]


def test_every_change_is_printed_and_those_that_alter_the_run_are_refused_unless_confirmed(
        capsys: pytest.CaptureFixture):
    saved = {"actor.lr": 1e-5, "model.dtype": "float32", "rollout.n": 4, "trainer.steps": 3, "val.n": 1}
    now = {**saved, "actor.lr": 10.0, "model.dtype": "bfloat16", "trainer.steps": 9}
    with pytest.raises(ResumeError, match=r"actor.lr, model.dtype changed .* trainer.resume_changes=\[actor.lr,model.dtype\]"):
        compare(saved, now, [], Path("ckpt"))
    said = capsys.readouterr().out
    assert "actor.lr: 1e-05 -> 10.0 (alters the run)" in said and "trainer.steps: 3 -> 9 (allowed)" in said
    with pytest.raises(ResumeError, match="model.dtype changed"):
        compare(saved, now, ["actor.lr"], Path("ckpt"))
    assert len(compare(saved, now, ["actor", "model.dtype"], Path("ckpt"))) == 3
    assert len(compare(saved, now, ["all"], Path("ckpt"))) == 3
    assert compare(saved, {**saved, "trainer.steps": 9}, [], Path("ckpt")) == ["  trainer.steps: 3 -> 9 (allowed)"]


def _lock_holder(out: Path, proc: subprocess.Popen, timeout: float = 300) -> int:
    """The pid the running trainer wrote into its lock (the program's own, which a warm start forks)."""
    def holder() -> int:
        assert proc.poll() is None, f"the trainer exited with {proc.returncode} before taking its lock"
        text = (out / ".lock").read_text().strip() if (out / ".lock").exists() else ""
        return int(json.loads(text)["pid"]) if text else 0

    return wait_until(holder, f"the trainer holds {out / '.lock'}", timeout)


def test_a_resume_is_refused_when_it_would_lose_or_change_the_run(tmp_path: Path):
    out = tmp_path / "run"
    args = [*FAST, f"trainer.output_dir={out}"]
    first = subprocess.Popen([sys.executable, "launch/train.py", *args, "trainer.steps=3"], cwd=REPO, env=_env(),
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        pid = _lock_holder(out, first)
        os.kill(pid, signal.SIGSTOP)  # held still while the second trainer tries: it must not wait for it
        try:
            second = train([*args, "trainer.steps=3"], timeout=120)
        finally:
            os.kill(pid, signal.SIGCONT)
        assert second.returncode == 1, second.stderr[-3000:]
        assert f"is in use by another trainer (host {socket.gethostname()}, pid {pid}," in second.stderr, \
            second.stderr[-3000:]
        assert first.wait(300) == 0, first.stderr.read()[-3000:] if first.stderr else ""
    finally:
        if first.poll() is None:
            first.kill()
    assert [m["step"] for m in metrics(out)] == [1, 2, 3]

    # lr x20 on resume: printed, refused; the harmless changes beside it are printed as allowed
    changed = train([*args, "trainer.steps=4", "actor.lr=1e-3", "trainer.save_every=2"])
    assert changed.returncode == 1, changed.stderr[-3000:]
    assert "actor.lr: 5e-05 -> 0.001 (alters the run)" in changed.stdout, changed.stdout[-3000:]
    assert "trainer.save_every: 1 -> 2 (allowed)" in changed.stdout and "trainer.steps: 3 -> 4 (allowed)" in changed.stdout
    assert "error: resuming from" in changed.stderr and "trainer.resume_changes=[actor.lr]" in changed.stderr
    assert [m["step"] for m in metrics(out)] == [1, 2, 3]
    confirmed = train([*args, "trainer.steps=4", "actor.lr=1e-3", "trainer.resume_changes=[actor.lr]"])
    assert confirmed.returncode == 0, confirmed.stderr[-3000:]
    assert "actor.lr: 5e-05 -> 0.001 (accepted by trainer.resume_changes)" in confirmed.stdout
    assert [m["step"] for m in metrics(out)] == [1, 2, 3, 4]

    # one byte flipped in each kept checkpoint: the run stops naming both, the metrics as they were
    kept = sorted((out / "checkpoints").iterdir())
    for ckpt in kept:
        data = bytearray((ckpt / "state.pt").read_bytes())
        data[len(data) // 2] ^= 0xFF
        (ckpt / "state.pt").write_bytes(bytes(data))
    damaged = train([*args, "trainer.steps=5", "actor.lr=1e-3"])
    assert damaged.returncode == 1, damaged.stderr[-3000:]
    for ckpt in kept:
        assert f"{ckpt}: {ckpt / 'state.pt'} does not match its checksum" in damaged.stderr, damaged.stderr[-3000:]
    assert [m["step"] for m in metrics(out)] == [1, 2, 3, 4]

    # asked for explicitly: a fresh start, the earlier run's metrics and checkpoints moved aside, not overwritten
    fresh = train([*args, "trainer.steps=1", "trainer.resume=fresh"])
    assert fresh.returncode == 0, fresh.stderr[-3000:]
    earlier = list((out / "earlier").iterdir())
    assert len(earlier) == 1 and f"moved into {earlier[0]}" in fresh.stdout
    assert [m["step"] for m in metrics(earlier[0])] == [1, 2, 3, 4]
    assert [m["step"] for m in metrics(out)] == [1]
