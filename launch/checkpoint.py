"""Checkpoints that survive `kill -9`: each is written to a temporary directory and renamed into
place, so `latest()` only ever sees complete ones. A checkpoint holds everything a resumed run
needs to continue exactly: actor (model, optimizer, schedule), the RL step, the data stream's
position and the RNG states."""

from __future__ import annotations

import os
import random
import shutil
from pathlib import Path
from typing import Any

_PREFIX = "step_"


class Checkpointer:
    def __init__(self, output_dir: Path, keep: int = 2) -> None:
        self.dir = output_dir / "checkpoints"
        self.keep = keep

    def latest(self) -> Path | None:
        if not self.dir.exists():
            return None
        done = sorted(p for p in self.dir.iterdir() if p.name.startswith(_PREFIX) and (p / "state.pt").exists())
        return done[-1] if done else None

    def save(self, step: int, state: dict[str, Any]) -> Path:
        import torch

        self.dir.mkdir(parents=True, exist_ok=True)
        final = self.dir / f"{_PREFIX}{step:06d}"
        tmp = self.dir / f".tmp-{final.name}-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        torch.save({**state, "step": step, "rng": rng_state()}, tmp / "state.pt")
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        for old in sorted(p for p in self.dir.iterdir() if p.name.startswith(_PREFIX))[:-self.keep]:
            shutil.rmtree(old, ignore_errors=True)
        return final

    def load(self, path: Path) -> dict[str, Any]:
        import torch

        state = torch.load(path / "state.pt", map_location="cpu", weights_only=False)
        set_rng_state(state["rng"])
        return state


def rng_state() -> dict[str, Any]:
    import numpy as np
    import torch

    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}


def set_rng_state(s: dict[str, Any]) -> None:
    import numpy as np
    import torch

    random.setstate(s["python"])
    np.random.set_state(s["numpy"])
    torch.set_rng_state(s["torch"])
