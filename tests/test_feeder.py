"""The rollout feeder's rules, driven by a scripted stand-in for the agent-worker manager (the
feeder is under test, not the workers; those run for real in test_async_rl.py): the outstanding-
work bound (staleness 0: one batch, nothing while the trainer updates), stale groups generated
again, groups without signal filtered, a curriculum hearing every group, and a state that round-
trips through a checkpoint. Also the over-long filter on a real batch."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from agent.loop import AgentLoopOutput
from engines.training.batch import equal_rewards, filter_overlong, pad_outputs
from launch.data.rows import RowStream
from rollout.feeder import RolloutFeeder
from waiting import wait_until


def _out(version: int, reward: float, termination: str = "stop") -> AgentLoopOutput:
    return AgentLoopOutput(prompt_ids=[1, 2], response_ids=[5, 6, 7], response_mask=[1, 1, 1],
                           response_logprobs=[-0.1] * 3, reward=reward, num_turns=1, termination=termination,
                           weight_versions=[version], version_segments=[[version, 3]])


class ScriptedManager:
    """submit() records the row; poll() finishes what `release` allows, with the engine version
    `version` and the rewards `rewards(row)` gives."""

    def __init__(self, rewards: Any = lambda row, j: float(j)) -> None:
        self.calls: dict[int, dict[str, Any]] = {}
        self.finished: set[int] = set()
        self.version = 0
        self.rewards = rewards
        self.release: set[str] = set()  # row texts allowed to finish; "*" = all
        self.lock = threading.Lock()
        self.weights: list[Any] = []  # the weight version each submit asked the engines for
        self.wakes = 0

    def wake(self) -> None:
        self.wakes += 1

    def submit(self, rows: list[dict[str, Any]], weight_version: Any = None, n: int = 2) -> int:
        with self.lock:
            call = len(self.calls)
            self.calls[call] = {"row": rows[0], "n": n, "version": self.version}
            self.weights.append(weight_version)
            return call

    def poll(self, timeout_s: float = 1.0) -> list[tuple[int, int, AgentLoopOutput]]:
        time.sleep(0.01)
        out = []
        with self.lock:
            for call, c in self.calls.items():
                text = c["row"]["prompt"][0]["content"]
                if call not in self.finished and ("*" in self.release or text in self.release):
                    self.finished.add(call)
                    out += [(call, j, _out(c["version"], self.rewards(c["row"], j))) for j in range(c["n"])]
        return out


def _rows(k: int) -> list[dict[str, Any]]:
    return [{"prompt": [{"role": "user", "content": f"q{i}"}]} for i in range(k)]


def test_outstanding_groups_are_bounded_by_staleness_and_pushes():
    mgr = ScriptedManager()
    buf = RolloutFeeder(mgr, RowStream(_rows(50), shuffle=False), prompts_per_step=2, n=2, staleness=1)
    buf.start()
    try:
        wait_until(lambda: len(mgr.calls) == 4)  # (k + 1) batches of 2 groups, nothing finished yet
        time.sleep(0.1)  # a window in which no more groups may start
        assert len(mgr.calls) == 4
        mgr.release.add("*")
        taken = buf.take(version=0)
        assert taken.row_ids == ["0", "1"] and taken.group_index == [0, 0, 1, 1]
        wait_until(lambda: len(buf.ready) == 2, "the other batch's groups are collected")
        time.sleep(0.1)  # a window in which nothing may start: a taken batch not yet pushed is one batch of room fewer
        assert len(mgr.calls) == 4 + 0 and len(buf.ready) == 2
        buf.trained(0)
        wait_until(lambda: len(mgr.calls) == 6)
    finally:
        buf.close()


def test_a_waiting_take_lets_its_picked_groups_make_room_above_staleness_0():
    for k, room in ((1, 1), (0, 0)):
        mgr = ScriptedManager()
        buf = RolloutFeeder(mgr, RowStream(_rows(50), shuffle=False), prompts_per_step=2, n=2, staleness=k)
        buf.start()
        try:
            wait_until(lambda: len(mgr.calls) == 2 * (k + 1))
            mgr.release.add("q0")  # the take picks one group and waits for its second
            got: list[Any] = []
            taker = threading.Thread(target=lambda: got.append(buf.take(version=0)))
            taker.start()
            wait_until(lambda: buf.taking == 1)
            time.sleep(0.1)
            assert len(mgr.calls) == 2 * (k + 1) + room  # k >= 1: one more group while the trainer waits
            mgr.release.add("*")
            taker.join(timeout=5)
            assert got and got[0].row_ids == ["0", "1"]
            time.sleep(0.1)  # the batch is taken: counted again until it is trained
            assert len(mgr.calls) == 2 * (k + 1) + room
        finally:
            buf.close()


def test_staleness_0_is_synchronous_one_batch_on_the_current_weights_in_draw_order():
    mgr = ScriptedManager()
    buf = RolloutFeeder(mgr, RowStream(_rows(50), shuffle=False), prompts_per_step=3, n=2, staleness=0, version=4)
    mgr.release.update({"q2", "q1"})  # finishing out of order
    buf.start()
    try:
        wait_until(lambda: len(mgr.calls) == 3)
        time.sleep(0.1)  # a window in which no second batch may start
        assert len(mgr.calls) == 3  # one batch, not more
        done = threading.Event()
        got: list[Any] = []
        threading.Thread(target=lambda: (got.append(buf.take(version=0)), done.set()), daemon=True).start()
        time.sleep(0.2)  # a window: two groups taken, one running: nothing new starts meanwhile
        assert not done.is_set() and len(mgr.calls) == 3
        mgr.release.add("q0")
        assert done.wait(5)
        assert got[0].row_ids == ["0", "1", "2"]  # the order rows were drawn in, not the finishing order
        time.sleep(0.2)  # a window: the trainer updates, nothing runs
        assert len(mgr.calls) == 3
        buf.trained(5)
        wait_until(lambda: len(mgr.calls) == 6)
        assert mgr.weights[3:] == [5, 5, 5]  # the next batch asks for the weights just pushed
        assert mgr.weights[:3] == [4, 4, 4]
    finally:
        buf.close()


def test_a_curriculum_hears_every_group_and_hopeless_dynamic_sampling_stops():
    heard: list[tuple[str, list[float]]] = []

    class Recording(RowStream):
        def record(self, row: dict[str, Any], rewards: list[float]) -> None:
            heard.append((row["prompt"][0]["content"], rewards))

    mgr = ScriptedManager(rewards=lambda row, j: 1.0 if row["prompt"][0]["content"] == "q0" else float(j))
    mgr.release.add("*")
    buf = RolloutFeeder(mgr, Recording(_rows(50), shuffle=False), prompts_per_step=2, n=2, staleness=0,
                        dynamic_sampling=True)
    buf.start()
    try:
        got = buf.take(version=0)
        assert got.row_ids == ["1", "2"] and got.metrics["rollout/filtered_groups"] == 1
        assert heard[:3] == [("q0", [1.0, 1.0]), ("q1", [0.0, 1.0]), ("q2", [0.0, 1.0])]  # the filtered one too
    finally:
        buf.close()
    flat = ScriptedManager(rewards=lambda row, j: 0.0)  # no group ever carries signal
    flat.release.add("*")
    buf = RolloutFeeder(flat, RowStream(_rows(50), shuffle=False), prompts_per_step=2, n=2, staleness=0,
                        dynamic_sampling=True)
    buf.start()
    try:
        with pytest.raises(RuntimeError, match="20 GRPO groups in a row had equal rewards"):
            buf.take(version=0, timeout_s=30)
    finally:
        buf.close()


def test_stale_groups_are_generated_again_and_every_row_is_trained_once():
    mgr = ScriptedManager()
    buf = RolloutFeeder(mgr, RowStream(_rows(50), shuffle=False), prompts_per_step=2, n=2, staleness=1)
    mgr.release.update({"q1", "q2", "q3"})  # q0 straggles on version 0
    buf.start()
    try:
        first = buf.take(version=0)
        assert first.row_ids == ["1", "2"]
        mgr.version = 3  # the trainer moved on three versions; q0 was produced by version 0
        buf.trained(3)
        mgr.release.add("*")
        second = buf.take(version=3)
        assert "0" not in second.row_ids and second.metrics["async/dropped_stale_groups"] >= 1
        assert second.metrics["async/staleness_max"] <= 1  # only groups within version - k
        wait_until(lambda: any(c["row"]["prompt"][0]["content"] == "q0" and c["version"] == 3 for c in mgr.calls.values()))
        seen = first.row_ids + second.row_ids
        for _ in range(3):
            buf.trained(3)
            seen += buf.take(version=3).row_ids
        assert "0" in seen and len(seen) == len(set(seen))  # regenerated, trained once
    finally:
        buf.close()


def test_dynamic_sampling_drops_groups_without_signal_and_keeps_filling():
    mgr = ScriptedManager(rewards=lambda row, j: 1.0 if row["prompt"][0]["content"] in ("q0", "q2") else float(j))
    mgr.release.add("*")
    buf = RolloutFeeder(mgr, RowStream(_rows(50), shuffle=False), prompts_per_step=2, n=2, staleness=1,
                       dynamic_sampling=True)
    buf.start()
    try:
        got = buf.take(version=0)
        assert got.row_ids == ["1", "3"] and got.metrics["rollout/filtered_groups"] == 2
        assert not equal_rewards(got.outputs[:2]) and equal_rewards([_out(0, 1.0), _out(1, 1.0)])
    finally:
        buf.close()


def test_state_round_trips_ready_and_running_rows():
    mgr = ScriptedManager()
    mgr.release.add("q0")
    buf = RolloutFeeder(mgr, RowStream(_rows(50), shuffle=False), prompts_per_step=2, n=2, staleness=1)
    buf.start()
    wait_until(lambda: len(buf.ready) == 1 and len(mgr.calls) == 4)
    state = buf.state_dict()
    buf.close()
    assert [r for r, *_ in state["ready"]] == ["0"] and sorted(r for r, _ in state["pending"]) == ["1", "2", "3"]
    assert state["stream"]["index"] == 4

    again = ScriptedManager()
    again.release.add("*")
    resumed = RolloutFeeder(again, RowStream(_rows(50), shuffle=False), prompts_per_step=2, n=2, staleness=1)
    resumed.load_state_dict(state)
    resumed.start()
    try:
        rows = resumed.take(version=0).row_ids
        resumed.trained(0)
        rows += resumed.take(version=0).row_ids
        assert rows[0] == "0" and sorted(rows) == ["0", "1", "2", "3"]  # pending first, none lost
        resumed.trained(0)
        assert resumed.take(version=0).row_ids == ["4", "5"]  # then the stream where it was
    finally:
        resumed.close()


def test_overlong_trajectories_leave_the_loss():
    outs = [_out(0, 1.0), _out(0, 0.0, "length"), _out(0, 1.0, "token_budget"), _out(0, 0.0, "max_assistant_turns")]
    batch = pad_outputs(outs, 0, [0, 0, 1, 1])
    got = filter_overlong(batch)
    assert got == {"rollout/overlong_filtered": 2.0}
    assert batch.valid.tolist() == [True, False, False, True]
    assert batch.loss_mask[1].sum() == 0 and batch.loss_mask[3].sum() == 3
