"""What a weight route is given: the push (tensors, version, how to bucket and cast them) and the
link to the engines from this rank (control clients, the collective group, an in-process engine)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterable

if TYPE_CHECKING:
    import torch


@dataclass
class Placement:
    """What decides a run's route: each route's `applies(placement)` reads it (rollout/weights/routes.py)."""

    in_process: bool = False  # rollout.in_process: the engine is served from the trainer's process
    weight_path: str = "auto"  # rollout.weight_path: "auto", or a route's name to force it
    shm_room: bool = True  # shared memory holds two buckets
    nodes: int = 1
    engines_on_my_gpu: bool = False  # colocated, every engine on rank 0's GPU


@dataclass
class Push:
    """One weight version on its way: what every route sends."""

    named: Iterable[tuple[str, "torch.Tensor"]]  # HF-named tensors; every rank iterates them (sharded gathers)
    version: int
    preempt: bool = False  # running generations stop and continue on the new weights
    bucket_bytes: int = 256 << 20
    dtype: "torch.dtype | None" = None  # the engines' dtype, cast to on the way (None: as the actor has it)
    timeout_s: float = 600.0
    engines: list[int] | None = None  # the bus routes: only these engines (a restarted one caught up); None = all


@dataclass
class Link:
    """What a route may use to reach the engines from this rank."""

    rank: int = 0
    local_rank: int = 0
    control: Any = None  # rank 0's control client (run(coro), client, loop) over every engine
    local_control: Any = None  # a node leader's control client over its own node's engines
    weight_group: Any = None  # the collective route's process group (rank 0 + every node leader)
    inproc: Any = None  # the engine this process serves (rollout/inproc.py)


def drain(named: Iterable[Any]) -> int:
    """Take part in the actor's gathers without sending (ranks that are not a route's source)."""
    for _ in named:
        pass
    return 0
