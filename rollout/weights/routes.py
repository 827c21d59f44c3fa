"""One interface for every way weights reach the engines, and the registry of routes.

A route is a class with a `name`, `applies(placement)` (does it serve a run placed so) and
`send(push, link) -> bytes sent`; the trainer's plane takes the first route of `ROUTES` that applies
(rollout/weights/sync.py), keeps one instance per route (it may hold buffers across pushes) and
calls `send` on every rank, where rank 0 is the source. The engine side of
every route is `rollout/weights/receive.py`: buckets that ride as frames or name a buffer of one of
its `READERS` kinds. A new route is one module with its class (`name`, `applies`, `send`, `close`)
plus an entry in `ROUTES` (and a reader there if its buckets name a new kind of buffer).
"""

from __future__ import annotations

from typing import Protocol

from rollout.weights.bus import BusRoute
from rollout.weights.collective import CollectiveRoute
from rollout.weights.handle import HandleRoute
from rollout.weights.inproc import InProcessRoute
from rollout.weights.link import Link, Placement, Push
from rollout.weights.shm import ShmRoute


class Route(Protocol):
    name: str

    @staticmethod
    def applies(placement: Placement) -> bool:
        """Whether this route serves a run placed so (the first route in ROUTES that applies wins)."""
        ...

    def send(self, push: Push, link: Link) -> int:
        """Load `push` into the engines; bytes sent from this rank (0 where it only took part)."""
        ...

    def close(self) -> None: ...


# in the order they are considered: the first whose `applies` holds is the run's route
ROUTES: dict[str, type] = {r.name: r for r in (InProcessRoute, BusRoute, CollectiveRoute, HandleRoute, ShmRoute)}


def choose(placement: Placement) -> str:
    """The route for `placement`: the first of ROUTES that applies."""
    for name, route in ROUTES.items():
        if route.applies(placement):
            return name
    raise ValueError(f"no weight route serves {placement}; known routes: {list(ROUTES)}")

