"""The run's one rollout path: a feeder that keeps GRPO groups (one row x `n` samples) running on the
agent workers, with a staleness bound `k` (`rollout.staleness`). k = 0 is synchronous RL: one batch
of groups runs on the current weights, nothing runs while the trainer updates, and the next batch
starts once the new weights are in the engines. k >= 1 is asynchronous RL: rollout runs on through
the updates, at most k batches ahead.

On rank 0 a feeder thread keeps at most (k + 1) batches' worth of groups outstanding (running or
finished, and not yet trained; at k >= 1 the groups a waiting `take()` has already picked make room
for new ones until the batch is complete: see `_outstanding`). Rows come from the stream a batch at a time
(`stream.next_batch`, so a curriculum's schedule advances per step). Finished groups wait in a
buffer; `take()` hands the trainer the first `prompts_per_step` of them whose every model token
was produced by weights no older than `version - k` (`Batch.version_segments`, recorded per token
segment by the workers' clients), in the order their rows were drawn. A group that is older - a
straggler whose first tokens came from weights the trainer has since moved past, or one an engine
that restarted produced - is dropped and its row generated again (`async/dropped_stale_groups`),
so no prompt is lost. With dynamic sampling, groups whose rewards are all equal are used up
without training (`rollout/filtered_groups`) and further rows fill their places; every group's
rewards reach the stream's `record` (an adaptive curriculum), filtered ones included.

Weight updates preempt running generations (`push_weights(preempt=True)`): the engines stop them
and the clients continue them on the new weights, so a sync never waits for the longest
trajectory (partial rollout). Everything the feeder holds is in `state_dict()`: the data position,
the finished groups and the rows drawn but not trained (generated again on resume), so a
checkpoint loses and repeats no prompt. Row ids are the rows' places in the stream's draw order.
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


MAX_FILTERED_BATCHES = 10  # dynamic sampling: batches' worth of groups a take() may filter before it gives up


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


def _order(row_id: str) -> tuple[int, str]:
    """A row id's place in the draw order (ids are draw numbers; others sort after, by text)."""
    return (int(row_id), "") if row_id.isdigit() else (1 << 62, row_id)


def _mixed(out: Any) -> bool:
    """The trajectory's model tokens come from more than one weight version (a generation preempted
    by a weight push and continued, or turns on either side of one)."""
    return len({v for v, n in out.version_segments if n}) > 1


@dataclass
class Taken:
    """What `take()` returns: a batch's groups in draw order and the feeder's numbers for the step."""

    outputs: list[AgentLoopOutput]
    group_index: list[int]
    row_ids: list[str]
    rows: list[dict[str, Any]]
    metrics: dict[str, Any] = field(default_factory=dict)


class RolloutFeeder:
    def __init__(self, manager: Any, stream: Any, prompts_per_step: int, n: int, staleness: int,
                 dynamic_sampling: bool = False, version: int = 0) -> None:
        """`version`: the weights the engines serve now (the next `trained(version)` moves it on)."""
        if staleness < 0:
            raise ValueError(f"rollout.staleness={staleness} must be >= 0 (0: synchronous RL)")
        self.manager, self.stream = manager, stream
        self.per_step, self.n, self.k = int(prompts_per_step), int(n), int(staleness)
        self.dynamic_sampling = dynamic_sampling  # groups with equal rewards are dropped, not trained
        self.record = getattr(stream, "record", None)  # an adaptive curriculum hears every group's rewards
        self.version = int(version)
        self.cond = threading.Condition()
        self.ready: collections.deque[Group] = collections.deque()
        self.running: dict[int, Group] = {}  # manager call id -> group
        self.aside: dict[int, list[AgentLoopOutput | None]] = {}  # call id -> outputs of run_aside (never trained)
        self.again: collections.deque[tuple[str, dict[str, Any]]] = collections.deque()  # rows to redo first
        self.fresh: collections.deque[tuple[str, dict[str, Any]]] = collections.deque()  # drawn, not yet submitted
        self.drawn = 0  # rows drawn from the stream so far (the next row's id)
        self.taking = 0  # groups the trainer's take() holds and has not trained yet
        self.training = False  # set by the trainer around its update, for the overlap count
        self.untrained = 0  # batches taken whose weights are not in the engines yet
        self.counts = collections.Counter()  # since the last take()
        self.tokens = 0  # model tokens of every finished trajectory so far (the rollout bar's tokens/s)
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ the feeder thread
    def start(self) -> None:
        self._thread = threading.Thread(target=self._feed, name="rollout-feeder", daemon=True)
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
                    while self._outstanding() < self._allowed():
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
                        self.tokens += sum(out.response_mask) if out is not None else 0
                        self.counts["mixed_version_done"] += int(out is not None and _mixed(out))
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

    def _bar(self) -> Any:
        """The rollout's progress while the trainer waits for its batch: trajectories done of the step's
        prompts_per_step x n, and model tokens per second."""
        from tqdm import tqdm

        bar = tqdm(total=self.per_step * self.n, desc="rollout", unit="traj", leave=False,
                   disable=not getattr(getattr(self.manager, "cfg", None), "progress", True))
        bar.tokens0, bar.t0 = self.tokens, time.monotonic()
        return bar

    def _show(self, bar: Any, picked: list[Group]) -> None:
        """Under `cond`: the trajectories of the groups picked, ready and running, and tokens/s, on `bar`."""
        done = len(picked) * self.n + sum(o is not None for g in [*self.ready, *self.running.values()]
                                          for o in g.outputs)
        bar.n = min(done, bar.total)
        rate = (self.tokens - bar.tokens0) / max(time.monotonic() - bar.t0, 1e-9)
        bar.set_postfix_str(f"{rate:.0f} tok/s", refresh=False)
        bar.refresh()

    def _outstanding(self) -> int:
        """Groups counted against `_allowed()`. At k = 0 every group not yet trained, the ones a
        `take()` is picking included: synchronous, nothing more starts. At k >= 1 the picked ones of
        a take still waiting for the rest of its batch are not counted until the batch is complete:
        the trainer is idle then, waiting on rollout, and more groups in flight shorten its wait. A
        group started in that window can end up older than the bound by the time it is trained; the
        bound itself is kept by `take()`, which never trains such a group (it is generated again).
        Faster and more groups generated again than counting them (benchmarks/RESULTS.md,
        asynchronous RL)."""
        return len(self.running) + len(self.ready) + (self.taking if self.k == 0 else 0)

    def _allowed(self) -> int:
        """Groups that may be outstanding now. A group started on engine version u must be trained
        by version u + k: with batches in order that holds when at most k + 1 batches are outstanding
        after each weight push, one fewer while a taken batch is being trained and not yet pushed
        (k = 0: none while the trainer updates)."""
        return max(0, self.k + 1 - self.untrained) * self.per_step

    def trained(self, version: int) -> None:
        """The trainer is done with its last batch and the engines serve `version` (the weights it
        learned, or the same as before when the step learned nothing): rollout may run further."""
        with self.cond:
            self.untrained = max(0, self.untrained - 1)
            self.version = int(version)
        self.manager.wake()  # the feeder thread submits the rows this frees now, not at its next poll

    def _submit_one(self) -> None:
        """One group: a row to redo first, else the stream's next row (caller holds the lock)."""
        if self.again:
            row_id, row = self.again.popleft()
        else:
            if not self.fresh:  # a batch's rows at a time: a curriculum's schedule moves per step
                for row in self.stream.next_batch(self.per_step):
                    self.fresh.append((str(self.drawn), row))
                    self.drawn += 1
            row_id, row = self.fresh.popleft()
        # the engines must serve weights no older than the bound (a restarted engine catches up first)
        call = self.manager.submit([row], weight_version=max(0, self.version - self.k), n=self.n)
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
        finished groups within the staleness bound, waiting for them as long as needed, in the
        order their rows were drawn. The trainer calls `trained()` when it is done with it."""
        t0 = time.perf_counter()
        picked: list[Group] = []
        filtered = 0
        deadline = time.monotonic() + timeout_s
        bar = self._bar()
        try:
            with self.cond:
                while len(picked) < self.per_step:
                    self._show(bar, picked)
                    if self.error is not None:
                        raise RuntimeError(f"the rollout feeder failed: {self.error!r}") from self.error
                    if filtered >= MAX_FILTERED_BATCHES * self.per_step:
                        if picked:
                            break  # a smaller batch rather than none
                        raise RuntimeError(
                            f"{filtered} GRPO groups in a row had equal rewards, so rollout.dynamic_sampling left "
                            "nothing to train on; the task is too easy or too hard for the model, or the reward is "
                            "constant: check it, or turn dynamic_sampling off")
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
                        self.manager.wake()  # generated again at once
                        continue
                    outputs = [o for o in group.outputs if o is not None]
                    if self.record is not None:
                        self.record(group.row, [float(o.reward) for o in outputs])
                    if self.dynamic_sampling and equal_rewards(outputs):
                        self.counts["filtered_groups"] += 1  # no signal: the row is used up, not generated again
                        filtered += 1
                        continue
                    picked.append(group)
                    self.taking += 1
                    if self.k:
                        self.manager.wake()  # it made room for another group (`_outstanding`)
                self.untrained += 1
                counts, self.counts = self.counts, collections.Counter()
                buffered, running = len(self.ready), len(self.running)
        finally:
            bar.close()
            with self.cond:
                self.taking = 0  # taken: counted by `untrained` until the trainer is done with them
        picked.sort(key=lambda g: _order(g.row_id))
        staleness = [version - v if v is not None else 0 for v in (g.oldest_version() for g in picked)]
        outputs = [o for g in picked for o in g.outputs if o is not None]
        # by a preempted generation or by turns on either side of a weight push
        mixed = sum(1 for o in outputs if _mixed(o))
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
            **{f"async/{k}": float(v) for k, v in sorted(counts.items()) if k != "filtered_groups"},
            "async/token_versions": dict(sorted(tokens.items())), "data/rows": [g.row_id for g in picked],
            "data/row_uids": [g.row.get("uid") for g in picked]}
        if self.dynamic_sampling:
            metrics["rollout/filtered_groups"] = float(counts["filtered_groups"])
        return Taken(outputs, [i for i, g in enumerate(picked) for _ in g.outputs], [g.row_id for g in picked],
                     [g.row for g in picked], metrics)

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """The data position with everything between it and the trainer: finished groups (trained
        after a resume as they are) and rows drawn and not yet trained (generated again)."""
        with self.cond:
            return {"stream": self.stream.state_dict(), "drawn": self.drawn,
                    "ready": [(g.row_id, g.row, [dataclasses.asdict(o) for o in g.outputs if o is not None])
                              for g in self.ready],
                    "pending": list(self.again) + [(g.row_id, g.row) for g in self.running.values()]
                    + list(self.fresh)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Before `start()`: continue from a `state_dict()`."""
        self.stream.load_state_dict(state["stream"])
        self.drawn = int(state.get("drawn", 0))
        self.ready = collections.deque(
            Group(row_id, row, [AgentLoopOutput(**o) for o in outs], time.time(), time.time())
            for row_id, row, outs in state["ready"])
        self.again = collections.deque((row_id, row) for row_id, row in state["pending"])
