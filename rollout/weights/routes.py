"""One interface for every way weights reach the engines, and the registry of routes.

A route is a class with a `name` and `send(push, link) -> bytes sent`; the trainer's plane picks
one by placement (rollout/weight_route.py), keeps one instance per route (it may hold buffers
across pushes) and calls `send` on every rank, where rank 0 is the source. The engine side of
every route is `rollout/weights/receive.py`: buckets that ride as frames or name a buffer of one of
its `READERS` kinds. A new route is one module with its class plus an entry in `ROUTES` (and a
reader there if its buckets name a new kind of buffer).
"""

from __future__ import annotations

from typing import Protocol

from rollout.weights.bus import BusRoute
from rollout.weights.collective import CollectiveRoute
from rollout.weights.handle import HandleRoute
from rollout.weights.inproc import InProcessRoute
from rollout.weights.link import Link, Push
from rollout.weights.shm import ShmRoute


class Route(Protocol):
    name: str

    def send(self, push: Push, link: Link) -> int:
        """Load `push` into the engines; bytes sent from this rank (0 where it only took part)."""
        ...

    def close(self) -> None: ...


ROUTES: dict[str, type] = {r.name: r for r in (BusRoute, ShmRoute, HandleRoute, CollectiveRoute, InProcessRoute)}

