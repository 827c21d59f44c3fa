"""The weight routes behind one interface: which route a placement gets, and that a new route is one
class plus its ROUTES entry (the engine side needs nothing new unless its buckets name a new buffer)."""

from __future__ import annotations

import pytest

from rollout.weights import routes
from rollout.weights.link import Link, Placement, Push
from rollout.weights.receive import READERS


@pytest.mark.parametrize("placement, route", [
    (Placement(), "shm"),
    (Placement(in_process=True), "in_process"),
    (Placement(weight_path="bus"), "bus"),
    (Placement(shm_room=False), "bus"),
    (Placement(nodes=3), "collective"),
    (Placement(engines_on_my_gpu=True), "handle"),
    (Placement(in_process=True, weight_path="bus"), "in_process"),
])
def test_each_placement_gets_its_route(placement, route):
    assert routes.choose(placement) == route


def test_every_route_has_the_interface_and_a_new_one_is_a_class_plus_an_entry(monkeypatch):
    for name, cls in routes.ROUTES.items():
        assert cls.name == name and all(callable(getattr(cls, m, None)) for m in ("applies", "send", "close"))
    assert set(READERS) == {"path", "handle"}  # the kinds of buffer a bucket may name

    class Carrier:  # what a new route module would define
        name = "carrier"
        sent: list[int] = []

        @staticmethod
        def applies(p: Placement) -> bool:
            return p.weight_path == "carrier"

        def send(self, push: Push, link: Link) -> int:
            tensors = list(push.named)
            self.sent.append(push.version)
            return sum(t.numel() for _, t in tensors)

        def close(self) -> None:
            pass

    monkeypatch.setattr(routes, "ROUTES", {"carrier": Carrier, **routes.ROUTES})
    assert routes.choose(Placement(weight_path="carrier")) == "carrier"
    assert routes.choose(Placement()) == "shm"
    import torch

    assert Carrier().send(Push([("w", torch.zeros(3))], version=4), Link()) == 3 and Carrier.sent == [4]
