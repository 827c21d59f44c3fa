"""Checkpoints (launch/checkpoint.py) read back tensors and plain data only, each file checked against
the SHA-256 written beside it; a resume takes the newest checkpoint that verifies and says which it
skipped. No model: the state is what a run saves (tensors, optimizer-like dicts, RNG states)."""

from __future__ import annotations

import pickle
import random
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
    chosen = ckpt.resumable()
    assert chosen is not None and chosen.name == "step_000001" and ckpt.load(chosen)["version"] == 2
    why = {"truncated": "does not match its checksum", "empty": "does not match its checksum",
           "no checksum": "has no checksum beside it"}[damage]
    assert f"skipping checkpoint {newest.parent}: {newest} {why}" in capsys.readouterr().out
    # every rank must verify its own files: one that cannot makes all of them fall back alike
    assert ckpt.resumable(agree=lambda ok: False) is None
