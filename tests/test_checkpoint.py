"""Checkpoints (launch/checkpoint.py) read back tensors and plain data only, each file checked against
the SHA-256 written beside it; a resume takes the newest checkpoint that verifies and says which it
skipped. No model: the state is what a run saves (tensors, optimizer-like dicts, RNG states)."""

from __future__ import annotations

import errno
import pickle
import random
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from launch.checkpoint import CheckpointError, Checkpointer


def state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"actor": {"w": torch.randn(4, 4, generator=g), "opt": {"step": seed, "lr": [1e-5, 2e-5]}},
            "data": {"epoch": 0, "index": 2 * seed, "order": [3, 1, 2]}, "version": seed + 1, "rollout": None}


def test_a_checkpoint_round_trips_with_its_rng_states(tmp_path: Path):
    ckpt = Checkpointer(tmp_path)
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    path = ckpt.save(1, state(1))
    want = (random.random(), float(np.random.rand()), float(torch.rand(1)))
    random.seed(9), np.random.seed(9), torch.manual_seed(9)
    got = ckpt.load(path)
    assert (random.random(), float(np.random.rand()), float(torch.rand(1))) == want  # the RNGs continue exactly
    assert torch.equal(got["actor"]["w"], state(1)["actor"]["w"]) and got["data"] == state(1)["data"]
    assert sorted(p.name for p in path.iterdir()) == ["state.pt", "state.pt.sha256"]


class Payload:
    """What an attacker who can write the run directory would put in state.pt."""

    def __reduce__(self):
        return (Path.write_text, (MARKER, "executed"))


MARKER = Path("/nonexistent")


def test_a_pickled_payload_is_never_executed(tmp_path: Path):
    global MARKER
    MARKER = tmp_path / "pwned"
    ckpt = Checkpointer(tmp_path)
    path = ckpt.save(1, state(1))
    (path / "state.pt").write_bytes(pickle.dumps({"actor": Payload()}))
    import hashlib  # the attacker rewrites the checksum beside it too: the load itself must refuse the payload

    (path / "state.pt.sha256").write_text(hashlib.sha256((path / "state.pt").read_bytes()).hexdigest())
    with pytest.raises(CheckpointError, match="holds more than tensors and plain data"):
        ckpt.load(path)
    assert not MARKER.exists()


@pytest.mark.parametrize("damage", ["truncated", "empty", "no checksum"])
def test_a_damaged_newest_checkpoint_falls_back_to_the_one_before(tmp_path: Path, damage: str,
                                                                  capsys: pytest.CaptureFixture):
    ckpt = Checkpointer(tmp_path)
    ckpt.save(1, state(1))
    newest = ckpt.save(2, state(2)) / "state.pt"
    if damage == "truncated":
        newest.write_bytes(newest.read_bytes()[:100])
    elif damage == "empty":
        newest.write_bytes(b"")
    else:
        Path(f"{newest}.sha256").unlink()
    with pytest.raises(CheckpointError):  # never a bare EOFError or unpickling error
        ckpt.load(newest.parent)
    chosen, skipped = ckpt.resumable()
    assert skipped and skipped[0][0] == newest.parent
    assert chosen is not None and chosen.name == "step_000001" and ckpt.load(chosen)["version"] == 2
    why = {"truncated": "does not match its checksum", "empty": "does not match its checksum",
           "no checksum": "has no checksum beside it"}[damage]
    assert f"skipping checkpoint {newest.parent}: {newest} {why}" in capsys.readouterr().out
    # every rank must verify its own files: one that cannot makes all of them fall back alike
    assert ckpt.resumable(agree=lambda ok: False)[0] is None


def test_checkpoints_none_of_which_loads_stop_the_resume_naming_each(tmp_path: Path):
    """Both kept checkpoints damaged: never a quiet restart from step 0 (which would discard the run);
    the error names each checkpoint and why. trainer.resume=fresh starts over with the earlier run
    moved aside, its metrics kept."""
    from launch.checkpoint import ResumeError
    from launch.resume import choose, set_aside

    ckpt = Checkpointer(tmp_path)
    one = ckpt.save(1, state(1)) / "state.pt"
    two = ckpt.save(2, state(2)) / "state.pt"
    data = bytearray(two.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one byte flipped
    two.write_bytes(bytes(data))
    one.write_bytes(one.read_bytes()[:50])  # truncated
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2}\n')
    with pytest.raises(ResumeError) as e:
        choose(ckpt, "auto", None, lambda ok: ok, show=False)
    for path in (one, two):
        assert f"{path.parent}: {path} does not match its checksum" in str(e.value)
    assert "trainer.resume=fresh" in str(e.value)
    assert choose(ckpt, "fresh", None, lambda ok: ok, show=False) is None
    moved = set_aside(tmp_path, show=False)
    assert moved is not None and moved.parent == tmp_path / "earlier"
    assert (moved / "metrics.jsonl").read_text() == '{"step": 1}\n{"step": 2}\n'
    assert sorted(p.name for p in (moved / "checkpoints").iterdir()) == ["step_000001", "step_000002"]
    assert not (tmp_path / "checkpoints").exists() and not (tmp_path / "metrics.jsonl").exists()
    assert choose(ckpt, "auto", None, lambda ok: ok, show=False) is None  # nothing left: a first run


@pytest.fixture
def small_fs(tmp_path: Path):
    """A real 3 MB filesystem (tmpfs): mounting needs root and the capability to mount."""
    where = tmp_path / "small"
    where.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(where)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here ({mounted.stderr.strip()}); needs root")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


def test_a_checkpoint_that_does_not_fit_says_so_and_keeps_the_last_one(small_fs: Path):
    """On a 3 MB filesystem: a 1 MB checkpoint is written; one of ~4 MB is refused before a byte is
    written, naming what it needs and the one that is intact; a write that runs out of space anyway
    (the disk filled by another writer after the check) says `no space left on device`, never
    torch's `basic_ios::clear: iostream error`, and leaves no partial files."""
    from launch.checkpoint import CheckpointWriteError, _save

    ckpt = Checkpointer(small_fs)
    first = ckpt.save(1, {"actor": {"w": torch.zeros(256, 1024)}})  # 1 MB
    big = {"actor": {"w": torch.zeros(1024, 1024)}}  # 4 MB
    with pytest.raises(CheckpointWriteError) as e:
        ckpt.save(2, big)
    assert f"no space left on device: needed ~4.3 MB for the checkpoint at {small_fs / 'checkpoints' / 'step_000002'}" \
        in str(e.value), str(e.value)
    assert "MB free on its filesystem" in str(e.value)  # the check before writing, not a failed write
    assert f"the last complete checkpoint, {first}, is intact" in str(e.value)
    assert [p.name for p in (small_fs / "checkpoints").iterdir()] == ["step_000001"]
    assert ckpt.resumable(show=False)[0] == first
    # past the check: torch's writer itself hits the full disk
    with pytest.raises(OSError) as e:
        _save(big, small_fs / "state.pt")
    assert e.value.errno == errno.ENOSPC and "no space left on device" in str(e.value), str(e.value)
    (small_fs / "state.pt").unlink()
    ckpt.preflight = lambda obj, final: 0  # as if the space was there when it was checked
    with pytest.raises(CheckpointWriteError, match="no space left on device: writing the checkpoint at .*step_000002 failed"):
        ckpt.save(2, big)
    assert [p.name for p in (small_fs / "checkpoints").iterdir()] == ["step_000001"]  # the partial one removed


def test_a_prune_cut_short_by_a_kill_leaves_nothing_that_lingers(tmp_path):
    """A kill -9 while an old checkpoint was being deleted left its folder half gone (state.pt removed, a
    file left) or renamed aside: the next save removes both, so only the `keep` newest remain."""
    ckpt = Checkpointer(tmp_path)
    for step in (0, 1):
        ckpt.save(step, {"step": step})
    half = ckpt.dir / "step_000000"
    (half / "state.pt").unlink()  # what rmtree had done when the kill came
    (half / "left.bin").write_bytes(b"x")
    aside = ckpt.dir / ".trash-step_000001"
    aside.mkdir()
    (aside / "state.pt").write_bytes(b"old")
    for step in (2, 3):
        ckpt.save(step, {"step": step})
    assert sorted(p.name for p in ckpt.dir.iterdir()) == ["step_000002", "step_000003"]
