"""Continuous rollout for asynchronous RL with a staleness bound `k` (`rollout.staleness`).

On rank 0 a feeder thread keeps GRPO groups (one row x `n` samples) running on the agent workers
while the trainer updates: at most (k + 1) batches' worth of groups are outstanding (running or
finished and not yet trained), so rollout runs at most k batches ahead of the trainer. Finished
groups wait in a buffer; `take()` hands the trainer the first `prompts_per_step` of them whose
every model token was produced by weights no older than `version - k` (`Batch.version_segments`,
recorded per token segment by the workers' clients). A group that is older - a straggler whose
first tokens came from weights the trainer has since moved past - is dropped and its row is
generated again (`async/dropped_stale_groups`), so no prompt is lost.

Weight updates preempt running generations (`push_weights(preempt=True)`): the engines stop them
and the clients continue them on the new weights, so a sync never waits for the longest
trajectory. Everything the buffer holds is in `state_dict()`: the data position, the finished
groups and the rows still running (they are generated again on resume), so a checkpoint loses and
repeats no prompt. Row ids are the rows' places in the data stream, "epoch:index".
"""

from __future__ import annotations

import collections
import dataclasses
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from agent.loop import AgentLoopOutput
from engines.training.batch import equal_rewards


@dataclass
class Group:
    row_id: str
    row: dict[str, Any]
    outputs: list[AgentLoopOutput | None]
    submitted_t: float = 0.0
    finished_t: float = 0.0

    def oldest_version(self) -> int | None:
        """The oldest weight version behind any model token of the group (None: no token)."""
        versions = []
        for o in self.outputs:
            assert o is not None
            versions += [v for v, n in o.version_segments if n] or list(o.weight_versions)
        return min(versions) if versions else None


@dataclass
class Taken:
    """What `take()` returns: a batch's groups in order and the buffer's numbers for the step."""

    outputs: list[AgentLoopOutput]
    group_index: list[int]
    row_ids: list[str]
    metrics: dict[str, Any] = field(default_factory=dict)


class AsyncRollout:
    def __init__(self, manager: Any, stream: Any, prompts_per_step: int, n: int, staleness: int,
                 dynamic_sampling: bool = False) -> None:
        if staleness < 1:
            raise ValueError(f"AsyncRollout needs rollout.staleness >= 1 (got {staleness}); 0 is the synchronous loop")
        self.manager, self.stream = manager, stream
        self.per_step, self.n, self.k = int(prompts_per_step), int(n), int(staleness)
        self.dynamic_sampling = dynamic_sampling  # groups with equal rewards are dropped, not trained
        self.cond = threading.Condition()
        self.ready: collections.deque[Group] = collections.deque()
        self.running: dict[int, Group] = {}  # manager call id -> group
        self.aside: dict[int, list[AgentLoopOutput | None]] = {}  # call id -> outputs of run_aside (never trained)
        self.again: collections.deque[tuple[str, dict[str, Any]]] = collections.deque()  # rows to redo first
        self.training = False  # set by the trainer around its update, for the overlap count
        self.unpushed = 0  # batches taken whose weights are not in the engines yet
        self.counts = collections.Counter()  # since the last take()
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ the feeder thread
    def start(self) -> None:
        self._thread = threading.Thread(target=self._feed, name="async-rollout", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=60)
            self._thread = None

    def _feed(self) -> None:
        try:
            while not self._stop.is_set():
                with self.cond:
                    while len(self.running) + len(self.ready) < self._allowed():
                        self._submit_one()
                done = self.manager.poll(timeout_s=0.2)
                with self.cond:
                    for call, index, out in done:
                        group = self.running.get(call)
                        if group is None:
                            if call in self.aside:
                                self.aside[call][index] = out
                            continue
                        group.outputs[index] = out
                        if all(o is not None for o in group.outputs):
                            group.finished_t = time.time()
                            del self.running[call]
                            self.ready.append(group)
                            self.counts["groups_done"] += 1
                            self.counts["groups_done_during_update"] += int(self.training)
                    if done:
                        self.cond.notify_all()
        except BaseException as e:  # the trainer's take() raises it
            with self.cond:
                self.error = e
                self.cond.notify_all()

    def _allowed(self) -> int:
        """Groups that may be outstanding now. A group started on engine version u must be trained
        by version u + k: with FIFO batches that holds when at most k + 1 batches are outstanding
        after each weight push, one fewer while a taken batch is being trained and not yet pushed."""
        return max(0, self.k + 1 - self.unpushed) * self.per_step

    def weights_pushed(self) -> None:
        """The trainer pushed the weights it learned from its last batch: rollout may run further."""
        with self.cond:
            self.unpushed = max(0, self.unpushed - 1)

    def _submit_one(self) -> None:
        """One group: a row to redo first, else the stream's next row (caller holds the lock)."""
        if self.again:
            row_id, row = self.again.popleft()
        else:
            row = next(self.stream)
            epoch, index = self.stream.position
            row_id = f"{epoch}:{index - 1}"
        call = self.manager.submit([row], weight_version=None, n=self.n)
        self.running[call] = Group(row_id, row, [None] * self.n, submitted_t=time.time())
        self.counts["groups_submitted"] += 1

    def run_aside(self, rows: list[dict[str, Any]], sampling: dict[str, Any], n: int, weight_version: int | None,
                  timeout_s: float) -> list[AgentLoopOutput]:
        """`n` samples of every row on the same workers while rollout runs on (validation): the
        outputs come back here, in input order, and never enter the buffer."""
        with self.cond:
            call = self.manager.submit(rows, weight_version=weight_version, sampling=sampling, n=n)
            outputs: list[AgentLoopOutput | None] = [None] * (len(rows) * n)
            self.aside[call] = outputs
        deadline = time.monotonic() + timeout_s
        try:
            with self.cond:
                while any(o is None for o in outputs):
                    if self.error is not None:
                        raise RuntimeError(f"the rollout feeder failed: {self.error!r}") from self.error
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"{sum(o is None for o in outputs)} of {len(outputs)} trajectories set "
                                           f"aside (validation) did not finish in {timeout_s:.0f} s; check the engines "
                                           "and the agent workers' logs, or raise val.timeout_s")
                    self.cond.wait(timeout=1.0)
        finally:
            with self.cond:
                self.aside.pop(call, None)
        return [o for o in outputs if o is not None]

    # ------------------------------------------------------------------ the trainer's side
    def take(self, version: int, timeout_s: float = 24 * 3600.0) -> Taken:
        """The next batch for a trainer whose weights are `version`: the first `prompts_per_step`
        finished groups within the staleness bound, waiting for them as long as needed."""
        t0 = time.perf_counter()
        picked: list[Group] = []
        staleness: list[int] = []
        deadline = time.monotonic() + timeout_s
        with self.cond:
            while len(picked) < self.per_step:
                if self.error is not None:
                    raise RuntimeError(f"the rollout feeder failed: {self.error!r}") from self.error
                if not self.ready:
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"no finished rollout group in {timeout_s:.0f}s; check the engines and "
                                           "the agent workers' logs (the deadline is rollout.step_timeout_s)")
                    self.cond.wait(timeout=1.0)
                    continue
                group = self.ready.popleft()
                oldest = group.oldest_version()
                if oldest is not None and oldest < version - self.k:
                    self.counts["dropped_stale_groups"] += 1
                    self.again.append((group.row_id, group.row))
                    continue
                if self.dynamic_sampling and equal_rewards([o for o in group.outputs if o is not None]):
                    self.counts["filtered_groups"] += 1  # no signal: the row is used up, not generated again
                    continue
                picked.append(group)
                staleness.append(version - oldest if oldest is not None else 0)
            self.unpushed += 1
            counts, self.counts = self.counts, collections.Counter()
            buffered, running = len(self.ready), len(self.running)
        outputs = [o for g in picked for o in g.outputs if o is not None]
        # by a preempted generation or by turns on either side of a weight push
        mixed = sum(1 for o in outputs if len({v for v, n in o.version_segments if n}) > 1)
        tokens: collections.Counter = collections.Counter()  # model tokens per producing weight version
        for o in outputs:
            for v, n in o.version_segments:
                tokens[str(v)] += n
        metrics: dict[str, Any] = {
            "async/staleness_mean": sum(staleness) / len(staleness), "async/staleness_max": float(max(staleness)),
            "async/wait_s": time.perf_counter() - t0, "async/buffered_groups": float(buffered),
            "async/running_groups": float(running), "async/mixed_version_trajectories": float(mixed),
            "async/first_submit_t": min(g.submitted_t for g in picked),
            "async/last_finish_t": max(g.finished_t for g in picked),
            **{f"async/{k}": float(v) for k, v in sorted(counts.items())},
            "async/token_versions": dict(sorted(tokens.items())), "data/rows": [g.row_id for g in picked],
            "data/row_uids": [g.row.get("uid") for g in picked]}
        return Taken(outputs, [i for i, g in enumerate(picked) for _ in g.outputs], [g.row_id for g in picked], metrics)

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """The data position with everything between it and the trainer: finished groups (trained
        after a resume as they are) and rows still running (generated again)."""
        with self.cond:
            return {"stream": self.stream.state_dict(),
                    "ready": [(g.row_id, g.row, [dataclasses.asdict(o) for o in g.outputs if o is not None])
                              for g in self.ready],
                    "pending": list(self.again) + [(g.row_id, g.row) for g in self.running.values()]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Before `start()`: continue from a `state_dict()`."""
        self.stream.load_state_dict(state["stream"])
        self.ready = collections.deque(
            Group(row_id, row, [AgentLoopOutput(**o) for o in outs], time.time(), time.time())
            for row_id, row, outs in state["ready"])
        self.again = collections.deque((row_id, row) for row_id, row in state["pending"])
