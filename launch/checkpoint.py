"""Checkpoints that survive `kill -9`: each is written to a temporary directory and renamed into
place, so `latest()` only ever sees complete ones. A checkpoint holds everything a resumed run
needs to continue exactly: actor (model, optimizer, schedule), the RL step, the data stream's
position and the RNG states."""

from __future__ import annotations

import os
import random
import shutil
from pathlib import Path
from typing import Any, Callable

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

    def save(self, step: int, state: dict[str, Any] | None, shard: dict[str, Any] | None = None, rank: int = 0,
             barrier: Callable[[], None] = lambda: None) -> Path:
        """Rank 0 passes `state`; with a sharded actor (Megatron) every rank calls this with its own
        `shard` (saved as shard_rank{r}.pt) and `barrier`, and rank 0 renames once all are written."""
        import torch

        final = self.dir / f"{_PREFIX}{step:06d}"
        tmp = self.dir / f".tmp-{final.name}"
        if rank == 0:
            self.dir.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir()
        barrier()
        if shard is not None:
            torch.save(shard, tmp / f"shard_rank{rank}.pt")
        barrier()
        if rank == 0:
            assert state is not None
            torch.save({**state, "step": step, "rng": rng_state()}, tmp / "state.pt")
            shutil.rmtree(final, ignore_errors=True)
            os.replace(tmp, final)
            for old in sorted(p for p in self.dir.iterdir() if p.name.startswith(_PREFIX))[:-self.keep]:
                shutil.rmtree(old, ignore_errors=True)
        barrier()
        return final

    def load(self, path: Path, rank: int | None = None) -> dict[str, Any]:
        """The checkpoint's state; with `rank`, also that rank's shard under "shard"."""
        import torch

        state = torch.load(path / "state.pt", map_location="cpu", weights_only=False)
        set_rng_state(state["rng"])
        if rank is not None:
            shard = path / f"shard_rank{rank}.pt"
            if not shard.exists():
                raise FileNotFoundError(f"{path} has no {shard.name}; it was saved by a run with fewer ranks or an "
                                        "unsharded actor; resume with the same actor.backend, tp, pp and world size")
            state["shard"] = torch.load(shard, map_location="cpu", weights_only=False)
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


def save_run(ckpt: Checkpointer, step: int, actor: Any, stream: Any, version: int, rank: int, sharded: bool,
             barrier: Callable[[], None], rollout: dict[str, Any] | None = None, critic: Any = None) -> None:
    """A run's checkpoint: the data position and weight version, and the actor (rank 0's replica,
    or every rank's own shard when `sharded`) with the critic beside it when there is one (held the
    same way: a sharded actor's critic is saved by every rank, under its shard's "critic" key);
    under asynchronous RL also the running rollout's state (`rollout`, rank 0: buffered groups and
    rows in flight, with its own data position)."""
    common = {"data": rollout["stream"] if rollout else stream.state_dict(), "version": version, "rollout": rollout}
    if sharded:
        shard = actor.state_dict()
        if critic is not None:
            shard = {**shard, "critic": critic.state_dict()}
        ckpt.save(step, common if rank == 0 else None, shard=shard, rank=rank, barrier=barrier)
        return
    critic_state = critic.state_dict() if critic is not None else None  # every rank: a sharded critic gathers
    if rank == 0:
        ckpt.save(step, {**common, "actor": actor.state_dict(),
                         **({"critic": critic_state} if critic is not None else {})})


def load_run(ckpt: Checkpointer, path: Path, actor: Any, stream: Any, rank: int,
             sharded: bool, critic: Any = None) -> tuple[int, int, dict[str, Any] | None]:
    """Restore what `save_run` wrote; (step, weight version, the running rollout's state or None)."""
    state = ckpt.load(path, rank=rank if sharded else None)
    held = dict(state["shard"]) if sharded else state
    critic_state = held.pop("critic", None)
    actor.load_state_dict(held if sharded else state["actor"])
    if critic is not None:
        if critic_state is None:
            raise ValueError(f"{path} holds no critic; it was saved by a run without one (algorithm.advantage was "
                             "not gae): resume with that estimator, or start a new trainer.output_dir")
        critic.load_state_dict(critic_state)
    stream.load_state_dict(state["data"])
    return int(state["step"]), int(state["version"]), state.get("rollout")
