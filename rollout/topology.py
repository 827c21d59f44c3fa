"""What every rank knows of the run's engines once they started: each engine's `EngineInfo`, and the
frozen `Topology` that `EngineFleet.start` (`rollout/fleet.py`) returns. The weight sync
(`rollout/weights/sync.py`) is given this and nothing else of the fleet, as a route is given its
`Link` (`rollout/weights/link.py`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class EngineInfo:
    """One engine as every rank knows it after the address exchange."""

    engine_id: str
    node: int
    devices: tuple[int, ...]  # cores (cpu) or GPU indices on its node
    ipc: str
    tcp: str | None
    pid: int


@dataclass(frozen=True)
class Topology:
    """The run's ranks and engines as this rank knows them once they started."""

    rank: int
    world: int
    node: int  # this process's node, of `nodes`
    nodes: int
    local_rank: int
    leaders: tuple[int, ...]  # the global rank that started each node's engines (its local rank 0)
    engines: tuple[EngineInfo, ...]
    placement: str  # rollout.placement, `auto` decided
    keys: Any = None  # the bus keys of the run's engines (None: none)
    inproc: Any = None  # rollout.in_process: the engine this process serves
