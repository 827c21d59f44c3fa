"""Routing policies as pure decisions: stickiness, group affinity, load that falls, failover."""

import pytest

from rollout.bus.router import NoEngineAvailable, Router


def test_sticky_group_keeps_sessions_and_groups_together():
    r = Router(4, "sticky_group")
    for g in range(8):
        first = r.pick(f"g{g}-s0", f"g{g}")
        r.sent(first)
        for s in range(1, 8):
            assert r.pick(f"g{g}-s{s}", f"g{g}") == first
        for turn in range(3):
            assert r.pick(f"g{g}-s3", f"g{g}") == first
    # 8 groups spread over the 4 engines, two each: placement follows load
    assert sorted(r.inflight) == [2, 2, 2, 2]


def test_least_loaded_follows_reported_load_down_as_well_as_up():
    r = Router(3, "least_loaded")
    r.report_load(0, 10)
    r.report_load(1, 5)
    r.report_load(2, 7)
    assert r.pick() == 1
    r.report_load(0, 0)  # engine 0 drained
    assert r.pick() == 0


def test_sticky_moves_a_session_off_a_dead_engine_and_keeps_it_there():
    r = Router(2, "sticky")
    e = r.pick("s", None)
    r.mark_down(e)
    moved = r.pick("s", None)
    assert moved != e
    r.mark_up(e)
    assert r.pick("s", None) == moved  # the prefix now lives on the new engine


def test_exclude_and_all_down():
    r = Router(2, "sticky_group")
    assert r.pick("s", "g", exclude={0}) == 1
    r.mark_down(0)
    r.mark_down(1)
    with pytest.raises(NoEngineAvailable, match="all 2 engines are down"):
        r.pick("s", "g")


def test_round_robin_cycles_and_bad_policy_is_named():
    r = Router(3, "round_robin")
    assert sorted(r.pick(f"s{i}") for i in range(3)) == [0, 1, 2]
    with pytest.raises(ValueError, match="unknown routing policy 'fastest'"):
        Router(2, "fastest")


def test_session_map_is_bounded():
    r = Router(2, "sticky", capacity=100)
    for i in range(1000):
        r.pick(f"s{i}")
    assert len(r.sessions) == 100
