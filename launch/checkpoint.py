"""Checkpoints that survive `kill -9` and a tampered or damaged run directory.

Each is written to a temporary directory and renamed into place, so only complete ones are ever
seen. A checkpoint holds everything a resumed run needs to continue exactly: actor (model,
optimizer, schedule), the RL step, the data stream's position and the RNG states. Every file is
read back with `torch.load(weights_only=True)`: tensors and plain containers only, so a payload
written into the run directory is refused, never executed. Beside each file its SHA-256
(`<file>.sha256`, written by the rank that wrote the file) is checked before it is read; a resume
takes the newest checkpoint whose files all verify on every rank and says which it skipped and why.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import random
import shutil
from pathlib import Path
from typing import Any, Callable

_PREFIX = "step_"


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be trusted: a file missing, its checksum wrong, or not tensors and data."""


class ResumeError(RuntimeError):
    """The earlier run in the output directory cannot be continued as configured (launch/resume.py
    decides); the message says what to do."""


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


class CheckpointWriteError(OSError):
    """A checkpoint that could not be written: no space, no permission; says which and what to do."""


def _save(obj: Any, path: Path) -> None:
    """torch.save, then the file's SHA-256 beside it (the file first: a sidecar is never ahead of it).
    torch's own writer reports a full disk as `basic_ios::clear: iostream error`: it is told apart
    here by the free space left after the write failed."""
    import torch

    try:
        torch.save(obj, path)
    except RuntimeError as e:
        if shutil.disk_usage(path.parent).free < max(estimate_bytes(obj) - _written(path), 1 << 20):
            raise OSError(errno.ENOSPC, f"no space left on device (torch.save: {str(e).splitlines()[0][:120]})",
                          str(path)) from None
        if not os.access(path.parent, os.W_OK):
            raise OSError(errno.EACCES, "permission denied", str(path)) from None
        raise
    Path(f"{path}.sha256").write_text(_sha256(path) + "\n")


def _written(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def estimate_bytes(obj: Any) -> int:
    """What torch.save of `obj` takes on disk, about: every tensor's storage once, plus some room for
    the rest (names, numbers, the archive's headers)."""
    import torch

    seen: set[tuple[int, int]] = set()
    total = 1 << 16

    def walk(o: Any) -> None:
        nonlocal total
        if isinstance(o, torch.Tensor):
            try:
                s = o.untyped_storage()
                key, n = (s.data_ptr(), s.nbytes()), s.nbytes()
            except (RuntimeError, NotImplementedError):  # a tensor subclass without one storage
                key, n = (id(o), 0), o.nelement() * o.element_size()
            if key not in seen or key[0] == 0:
                seen.add(key)
                total += n + 512
        elif isinstance(o, dict):
            for v in o.values():
                walk(v)
        elif isinstance(o, (list, tuple)):
            for v in o:
                walk(v)
        else:
            total += 64

    walk(obj)
    return total


def _size(n: int) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e8 else f"{n / 1e6:.1f} MB"


def _advice(latest: Path | None) -> str:
    kept = f"the last complete checkpoint, {latest}, is intact" if latest else "no earlier checkpoint was touched"
    return (f"free space there or set trainer.output_dir to a filesystem with room ({kept}; the same command "
            "resumes from it)")


def _write_error(e: OSError, final: Path, latest: Path | None, need: int) -> OSError:
    """The write's failure in words that say what to do."""
    if isinstance(e, CheckpointWriteError):
        return e
    where = e.filename or final
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        try:
            free = f"{_size(shutil.disk_usage(final.parent).free)} free"
        except OSError:
            free = "free space unknown"
        quota = " (disk quota exceeded)" if e.errno == errno.EDQUOT else ""
        what = (f"needed ~{_size(need)} for the checkpoint at {final}; writing {where} failed ({free})" if need
                else f"writing the checkpoint at {final} failed ({where}, {free})")
        return CheckpointWriteError(f"no space left on device{quota}: {what}; " + _advice(latest))
    if e.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return CheckpointWriteError(f"permission denied writing the checkpoint at {final} ({where}: {e.strerror}); make "
                                    "trainer.output_dir writable by this user or set it to a directory that is")
    return CheckpointWriteError(f"the checkpoint at {final} could not be written ({where}: {e.strerror or e}); "
                                + _advice(latest))


def _load(path: Path) -> Any:
    """A file `_save` wrote, checked against its SHA-256 and unpickled with tensors and plain data only."""
    import pickle

    import torch

    why = _verify(path)
    if why:
        raise CheckpointError(why)
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError, ValueError) as e:
        raise CheckpointError(f"{path} holds more than tensors and plain data, or is damaged "
                              f"({type(e).__name__}: {str(e).splitlines()[0][:200]}); it was not loaded") from None


def _verify(path: Path) -> str | None:
    """None when `path` matches its recorded SHA-256; else what is wrong."""
    side = Path(f"{path}.sha256")
    if not path.is_file():
        return f"{path} is missing"
    if not side.is_file():
        return f"{path} has no checksum beside it ({side.name}): not written by this version, or damaged"
    if _sha256(path) != side.read_text().strip():
        return f"{path} does not match its checksum: truncated or changed after it was written"
    return None


class Checkpointer:
    def __init__(self, output_dir: Path, keep: int = 2) -> None:
        self.dir = output_dir / "checkpoints"
        self.keep = keep

    def all(self) -> list[Path]:
        """Complete checkpoints, newest first."""
        if not self.dir.exists():
            return []
        return sorted((p for p in self.dir.iterdir() if p.name.startswith(_PREFIX) and (p / "state.pt").exists()),
                      reverse=True)

    def latest(self) -> Path | None:
        done = self.all()
        return done[0] if done else None

    def verify(self, path: Path, rank: int | None = None) -> str | None:
        """None when the checkpoint's state (and `rank`'s shard) match their checksums; else why not."""
        return _verify(path / "state.pt") or (_verify(path / f"shard_rank{rank}.pt") if rank is not None else None)

    def resumable(self, rank: int | None = None, agree: Callable[[bool], bool] = lambda ok: ok,
                  show: bool = True) -> tuple[Path | None, list[tuple[Path, str]]]:
        """The newest checkpoint whose files verify (on every rank: `agree` is True only when all
        ranks pass True), and those skipped before it with the reason, each named when `show`."""
        skipped: list[tuple[Path, str]] = []
        for path in self.all():
            why = self.verify(path, rank)
            if agree(why is None):
                return path, skipped
            why = why or "another rank could not verify its shard"
            skipped.append((path, why))
            if show:
                print(f"WARNING: skipping checkpoint {path}: {why}; trying the one before it", flush=True)
        return None, skipped

    def save(self, step: int, state: dict[str, Any] | None, shard: dict[str, Any] | None = None, rank: int = 0,
             barrier: Callable[[], None] = lambda: None) -> Path:
        """Rank 0 passes `state`; with a sharded actor (Megatron) every rank calls this with its own
        `shard` (saved as shard_rank{r}.pt) and `barrier`, and rank 0 renames once all are written.
        Each rank first checks that what it writes fits the free space (`preflight`); a write that
        fails for space or permission raises CheckpointWriteError saying so, its partial files removed."""
        final = self.dir / f"{_PREFIX}{step:06d}"
        tmp = self.dir / f".tmp-{final.name}"
        need = 0
        try:
            if rank == 0:
                self.dir.mkdir(parents=True, exist_ok=True)
                shutil.rmtree(tmp, ignore_errors=True)
                tmp.mkdir()
            barrier()
            if shard is not None:
                need += self.preflight(shard, final)
                _save(shard, tmp / f"shard_rank{rank}.pt")
            barrier()
            if rank == 0:
                assert state is not None
                full = {**state, "step": step, "rng": rng_state()}
                need += self.preflight(full, final)
                _save(full, tmp / "state.pt")
                shutil.rmtree(final, ignore_errors=True)
                os.replace(tmp, final)
                self._prune(final)
        except OSError as e:
            if rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)  # the space it took back; the last complete one stays
            raise _write_error(e, final, self.latest(), need) from None
        barrier()
        return final

    def _prune(self, newest: Path) -> None:
        """Remove all but the `keep` newest complete checkpoints. Each goes by an atomic rename to
        `.trash-<name>` first, so a process killed while deleting leaves a folder this sweep removes next
        time, never a half-deleted `step_*` that looks like a checkpoint; incomplete `step_*` folders
        older than `newest` (left so by an earlier version) go the same way."""
        doomed = self.all()[self.keep:]
        doomed += [p for p in self.dir.iterdir() if p.name.startswith(_PREFIX) and p.name < newest.name
                   and not (p / "state.pt").exists() and p not in doomed]
        for old in doomed:
            try:
                os.replace(old, self.dir / f".trash-{old.name}")
            except OSError:  # a trash folder of the same name is in the way: the sweep below clears it
                shutil.rmtree(old, ignore_errors=True)
        for trash in self.dir.glob(".trash-*"):
            shutil.rmtree(trash, ignore_errors=True)

    def preflight(self, obj: Any, final: Path) -> int:
        """`obj`'s estimated size on disk; CheckpointWriteError, before anything is written, when it
        exceeds the free space."""
        need = estimate_bytes(obj)
        free = shutil.disk_usage(self.dir).free
        if need > free:
            raise CheckpointWriteError(f"no space left on device: needed ~{_size(need)} for the checkpoint at {final}, "
                                       f"{_size(free)} free on its filesystem; " + _advice(self.latest()))
        return need

    def load(self, path: Path, rank: int | None = None) -> dict[str, Any]:
        """The checkpoint's state; with `rank`, also that rank's shard under "shard"."""
        state = _load(path / "state.pt")
        set_rng_state(state["rng"])
        if rank is not None:
            shard = path / f"shard_rank{rank}.pt"
            if not shard.exists():
                raise FileNotFoundError(f"{path} has no {shard.name}; it was saved by a run with fewer ranks or an "
                                        "unsharded actor; resume with the same actor.backend, tp, pp and world size")
            state["shard"] = _load(shard)
        return state


def rng_state() -> dict[str, Any]:
    """The RNG states as tensors and plain data (what a weights_only load reads back)."""
    import numpy as np
    import torch

    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    return {"python": random.getstate(), "numpy": [kind, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, gauss],
            "torch": torch.get_rng_state()}


def set_rng_state(s: dict[str, Any]) -> None:
    import numpy as np
    import torch

    version, internal, gauss = s["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, pos, has_gauss, cached = s["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(s["torch"])


def save_run(ckpt: Checkpointer, step: int, actor: Any, stream: Any, version: int, rank: int, sharded: bool,
             barrier: Callable[[], None], rollout: dict[str, Any] | None = None, critic: Any = None,
             config: dict[str, Any] | None = None) -> None:
    """A run's checkpoint: the data position and weight version, and the actor (rank 0's replica,
    or every rank's own shard when `sharded`) with the critic beside it when there is one (held the
    same way: a sharded actor's critic is saved by every rank, under its shard's "critic" key);
    under asynchronous RL also the running rollout's state (`rollout`, rank 0: buffered groups and
    rows in flight, with its own data position); the run's config (launch/resume.py `flat_config`) as
    JSON, which a resume compares with its own."""
    common = {"data": rollout["stream"] if rollout else stream.state_dict(), "version": version, "rollout": rollout,
              "config": json.dumps(config) if config is not None else None}
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


def load_run(ckpt: Checkpointer, path: Path, actor: Any, stream: Any, rank: int, sharded: bool, critic: Any = None,
             check: Callable[[dict[str, Any] | None], Any] = lambda saved: None
             ) -> tuple[int, int, dict[str, Any] | None]:
    """Restore what `save_run` wrote, once `check` accepted the config it was saved with (None for a
    checkpoint that records none); (step, weight version, the running rollout's state or None)."""
    state = ckpt.load(path, rank=rank if sharded else None)
    check(json.loads(state["config"]) if state.get("config") else None)
    held = dict(state["shard"]) if sharded else state
    critic_state = held.pop("critic", None)
    actor.load_state_dict(held if sharded else state["actor"])
    if critic is not None:
        if critic_state is None:
            raise ResumeError(f"{path} holds no critic; it was saved by a run without one (algorithm.advantage was "
                              "not gae): resume with that estimator, or start over with trainer.resume=fresh, or set "
                              "another trainer.output_dir")
        critic.load_state_dict(critic_state)
    try:
        stream.load_state_dict(state["data"])
    except ValueError as e:  # another dataset behind the same config: the saved position points elsewhere
        raise ResumeError(f"{path}: {e}") from None
    return int(state["step"]), int(state["version"]), state.get("rollout")
