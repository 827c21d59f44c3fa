"""AgentLoopManager: fans dataset rows × n samples out to agent worker processes, collects their
AgentLoopOutputs in input order and pads them into a training `Batch` (`engines/training/batch.py`).

Why worker processes: tokenization, chat templating, reward scoring and tool glue are Python CPU
work; one event loop saturates one core long before the engines do. Each worker is long-lived
(started once per run) and builds its GenerateClient, tokenizer, tools and interactions once;
its trajectories run concurrently under asyncio. Workers are spawned, not forked, because the
parent (the trainer) holds threads, ZMQ sockets and CUDA state a fork must not copy. Each worker
has its own pair of pipes, so a worker killed mid-write corrupts nothing the others use, and its
process sentinel tells the parent at once that it died.

All n samples of a row share a `group_id` and go to the same worker, so that worker's router
starts them on one engine (the shared prompt is prefilled once) and GRPO's group statistics are
computed over samples that saw the same engine state.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import os
import queue
import signal
import threading
import time
import uuid
from multiprocessing.connection import Connection, wait
from typing import Any, Mapping, Sequence

from tqdm import tqdm

from agent.loop import DEFAULT_AGENT_NAME, AgentLoopOutput, AgentLoopRegistry
from agent.traces import prepare_experiment
from engines.training.batch import Batch, pad_outputs
from rollout.config import ManagerConfig
from rollout.worker import AgentWorker, worker_main

log = logging.getLogger("switchyard.manager")


class WorkerCrashed(RuntimeError):
    """An agent worker process died; its trajectories are lost and the manager must be restarted."""


# ==================================================================== the parent side
def _describe_exit(code: int | None) -> str:
    if code is not None and code < 0:
        try:
            return f"exit code {code} (killed by {signal.Signals(-code).name})"
        except ValueError:
            pass
    return f"exit code {code}"


class AgentLoopManager:
    """Long-lived agent workers: `start()` once (or use as a context manager), `generate()` per step.

    Scripts that use num_workers > 0 must create the manager under `if __name__ == "__main__":`
    (spawned workers re-import the main module). Agent loops in the dataset must be registered:
    unknown `agent_name`s are refused before anything is dispatched.
    """

    def __init__(self, cfg: ManagerConfig) -> None:
        self.cfg = cfg
        self.registry = AgentLoopRegistry(cfg.agent_loops)  # bad dotted paths fail here
        unknown = sorted(set(cfg.agent_configs) - set(self.registry.names))
        if unknown:
            raise ValueError(f"agent_configs for unknown agent loop(s) {unknown}; known: {self.registry.names}. "
                             "Register them under agent_loops or fix the names")
        self.pad_id: int | None = None
        self._procs: list[Any] = []
        self._tasks: list[Connection] = []
        self._results: list[Connection] = []
        self._inproc: tuple[AgentWorker, asyncio.AbstractEventLoop, threading.Thread] | None = None
        self._calls = itertools.count()
        self._next_worker = itertools.count()
        self._inbox: queue.Queue = queue.Queue()  # streaming results of the in-process worker
        self._inproc_calls: dict[int, Any] = {}  # call id -> the in-process worker's future of it
        self._broken: str | None = None
        self._wake: tuple[int, int] | None = None  # a pipe: wake() makes a poll() waiting on the workers return

    @property
    def worker_pids(self) -> list[int]:
        return [p.pid for p in self._procs]

    # ---------------------------------------------------------------- life cycle
    def start(self) -> "AgentLoopManager":
        """Start workers and wait until each has built its tools and reached every engine."""
        from engines.models import load_tokenizer

        tok = load_tokenizer(self.cfg.tokenizer)
        pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        if pad is None:
            raise ValueError(f"tokenizer {self.cfg.tokenizer!r} has neither pad_token_id nor eos_token_id; set one")
        self.pad_id = int(pad)
        experiment_id = prepare_experiment(self.cfg.tracing)  # mlflow missing fails here, before any worker
        try:
            if self.cfg.num_workers == 0:
                self._start_in_process(experiment_id)
            else:
                self._start_processes(experiment_id)
        except BaseException:
            self.close()
            raise
        return self

    def _start_in_process(self, experiment_id: str | None) -> None:
        loop = asyncio.new_event_loop()
        thread = threading.Thread(target=loop.run_forever, name="agent-worker-0", daemon=True)
        thread.start()
        worker = AgentWorker(self.cfg, 0, experiment_id)
        self._inproc = (worker, loop, thread)
        asyncio.run_coroutine_threadsafe(worker.start(), loop).result(self.cfg.ready_timeout_s + 60)

    def _start_processes(self, experiment_id: str | None) -> None:
        import multiprocessing as mp

        ctx = mp.get_context(self.cfg.start_method)
        cfg_dict = dataclasses.asdict(self.cfg)
        for i in range(self.cfg.num_workers):
            task_r, task_w = ctx.Pipe(duplex=False)
            res_r, res_w = ctx.Pipe(duplex=False)
            proc = ctx.Process(target=worker_main, args=(i, cfg_dict, experiment_id, task_r, res_w),
                               name=f"agent-worker-{i}", daemon=True)
            proc.start()
            task_r.close()
            res_w.close()
            self._procs.append(proc)
            self._tasks.append(task_w)
            self._results.append(res_r)
        self._wake = os.pipe()  # after the workers start: no forked worker holds it
        for fd in self._wake:
            os.set_blocking(fd, False)
        waiting = set(range(len(self._procs)))
        deadline = time.monotonic() + self.cfg.ready_timeout_s + 120  # + process start and imports
        while waiting:
            for w, msg in self._receive(waiting, deadline, "start"):
                if msg["op"] == "start_failed":
                    raise RuntimeError(f"agent worker {w} failed to start:\n{msg['error']}")
                waiting.discard(w)

    def wake(self) -> None:
        """Make a `poll()` that is waiting return now (another thread has work for its caller)."""
        if self._inproc is not None:
            self._inbox.put({"op": "wake"})
            return
        if self._wake is not None:
            try:
                os.write(self._wake[1], b"w")
            except OSError:  # full: a wake is pending anyway
                pass

    def _receive(self, workers: set[int], deadline: float, what: str,
                 wait_s: float = 1.0) -> list[tuple[int, dict[str, Any]]]:
        """Messages from `workers`, waiting at most `wait_s` (or until `wake()`); a dead worker or
        the deadline raises."""
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"agent workers {sorted(workers)} did not finish {what} in time; check their "
                               f"logs and that the engines at {self.cfg.addresses} answer (a run's deadline per "
                               "step is rollout.step_timeout_s)")
        conns = {self._results[w]: w for w in workers}
        sentinels = {self._procs[w].sentinel: w for w in workers}
        got: list[tuple[int, dict[str, Any]]] = []
        dead: set[int] = set()
        wake = [self._wake[0]] if self._wake is not None else []
        for obj in wait([*conns, *sentinels, *wake], timeout=min(wait_s, left)):
            if obj in wake:
                assert self._wake is not None
                try:
                    while os.read(self._wake[0], 4096):
                        pass
                except BlockingIOError:
                    pass
            elif obj in conns:
                w = conns[obj]
                try:
                    while obj.poll():
                        got.append((w, obj.recv()))
                except (EOFError, OSError):
                    dead.add(w)
            else:
                dead.add(sentinels[obj])
        for w in sorted(dead):
            proc = self._procs[w]
            proc.join(timeout=5)
            self._broken = (f"agent worker {w} (pid {proc.pid}) died with {_describe_exit(proc.exitcode)} during "
                            f"{what}; its trajectories are lost. Look for its log lines above (a SIGKILL is often "
                            "the out-of-memory killer)")
            raise WorkerCrashed(f"{self._broken}; close() this manager and start a new one")
        return got

    def close(self) -> None:
        """Stop the workers (closing their clients, tools and interactions); safe to call twice."""
        for conn in self._tasks:
            try:
                conn.send({"op": "stop"})
            except (OSError, ValueError):
                pass
        for proc in self._procs:
            proc.join(timeout=30)
            if proc.is_alive():
                log.warning("agent worker %s did not stop in 30 s; terminating it", proc.name)
                proc.terminate()
                proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()
                proc.join()
        for conn in [*self._tasks, *self._results]:
            conn.close()
        self._procs, self._tasks, self._results = [], [], []
        if self._wake is not None:
            for fd in self._wake:
                os.close(fd)
            self._wake = None
        if self._inproc is not None:
            worker, loop, thread = self._inproc
            self._inproc = None
            try:  # trajectories still running (streaming rollout) end first, then the worker's parts
                asyncio.run_coroutine_threadsafe(_cancel_others(), loop).result(30)
                asyncio.run_coroutine_threadsafe(worker.close(), loop).result(60)
            finally:
                loop.call_soon_threadsafe(loop.stop)
                thread.join(timeout=30)
                loop.close()

    def __enter__(self) -> "AgentLoopManager":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ---------------------------------------------------------------- rollout
    def generate(self, rows: Sequence[Mapping[str, Any]], weight_version: int | None = None,
                 sampling: Mapping[str, Any] | None = None, n: int | None = None,
                 timeout_s: float | None = None) -> Batch:
        """Roll out `n` (default cfg.n) samples of every row and pad them; row i's samples are rows
        i*n .. i*n+n-1 of the batch with group_index i."""
        n = int(n or self.cfg.n)
        outputs = self.generate_outputs(rows, weight_version, sampling, n, timeout_s)
        assert self.pad_id is not None
        return pad_outputs(outputs, self.pad_id, [k // n for k in range(len(outputs))])

    def generate_outputs(self, rows: Sequence[Mapping[str, Any]], weight_version: int | None = None,
                         sampling: Mapping[str, Any] | None = None, n: int | None = None,
                         timeout_s: float | None = None, desc: str = "rollout") -> list[AgentLoopOutput]:
        """The unpadded outputs, in input order (row i's samples at i*n .. i*n+n-1); `desc` names
        the progress bar."""
        if self._broken:
            raise RuntimeError(f"this AgentLoopManager is unusable: {self._broken}. close() it and start a new one")
        if self.pad_id is None:
            raise RuntimeError("AgentLoopManager.generate() before start(); call start() or use `with manager:`")
        n = int(n or self.cfg.n)
        if n < 1:
            raise ValueError(f"n={n} must be >= 1")
        self._validate(rows)
        if not rows:
            return []
        call = self.submit(rows, weight_version, sampling, n)
        found: list[AgentLoopOutput | None] = [None] * (len(rows) * n)
        deadline = time.monotonic() + (timeout_s if timeout_s is not None else float("inf"))
        with tqdm(total=len(found), desc=desc, unit="traj", disable=not self.cfg.progress) as bar:
            try:
                self._collect(call, found, deadline, bar)
            finally:  # an in-process call that failed or ran out of time stops here
                fut = self._inproc_calls.pop(call, None)
                if fut is not None and not fut.done():
                    fut.cancel()
        return [o for o in found if o is not None]

    def _collect(self, call: int, found: list[AgentLoopOutput | None], deadline: float, bar: Any) -> None:
        """Fill `found` with the outputs of `call` as they arrive, by `deadline`."""
        missing = sum(o is None for o in found)
        while missing:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"the agent workers did not finish in time: {missing} of {len(found)} "
                                   f"trajectories of rollout call {call} missing; check their logs and that the engines "
                                   f"at {self.cfg.addresses} answer (a run's deadline per step is "
                                   "rollout.step_timeout_s)")
            for got_call, index, out in self.poll(timeout_s=min(1.0, left)):
                if got_call == call and found[index] is None:  # others: left over from an earlier call that raised
                    found[index] = out
                    missing -= 1
                    bar.update(1)

    def _validate(self, rows: Sequence[Mapping[str, Any]]) -> None:
        for i, row in enumerate(rows):
            name = row.get("agent_name") or DEFAULT_AGENT_NAME
            try:
                self.registry.get(name)
            except KeyError as e:
                raise ValueError(f"row {i}: {e.args[0]}") from None
            if "prompt" not in row:
                raise ValueError(f"row {i} has no `prompt` column (columns: {sorted(row)}); every row needs its "
                                 "chat messages under `prompt`")

    # ---------------------------------------------------------------- streaming (asynchronous RL)
    def submit(self, rows: Sequence[Mapping[str, Any]], weight_version: int | None = None,
               sampling: Mapping[str, Any] | None = None, n: int | None = None) -> int:
        """Start `n` samples of every row without waiting; returns the call id that `poll()`
        tags their outputs with (row i's samples have indices i*n .. i*n+n-1). Calls overlap:
        each worker runs the trajectories of every call it holds concurrently."""
        if self._broken:
            raise RuntimeError(f"this AgentLoopManager is unusable: {self._broken}. close() it and start a new one")
        if self.pad_id is None:
            raise RuntimeError("AgentLoopManager.submit() before start(); call start() or use `with manager:`")
        n = int(n or self.cfg.n)
        self._validate(rows)
        sampling = dict(self.cfg.sampling if sampling is None else sampling)
        call, tag = next(self._calls), uuid.uuid4().hex[:12]
        num_workers = max(1, len(self._procs))
        chunks: list[list[dict[str, Any]]] = [[] for _ in range(num_workers)]
        for i, row in enumerate(rows):
            gid = f"{tag}-g{i}"
            w = next(self._next_worker) % num_workers  # calls of one group each spread over the workers
            chunks[w] += [{"index": i * n + j, "row": {**row, "group_id": gid, "session_id": f"{gid}-s{j}"}}
                          for j in range(n)]
        if self._inproc is not None:
            worker, loop, _ = self._inproc
            self._inproc_calls[call] = asyncio.run_coroutine_threadsafe(
                worker.run_items(chunks[0], sampling, weight_version,
                                 lambda d: self._inbox.put({**d, "call": call})), loop)
            return call
        for w, items in enumerate(chunks):
            if items:
                self._tasks[w].send({"op": "run", "call": call, "items": items, "sampling": sampling,
                                     "weight_version": weight_version})
        return call

    def poll(self, timeout_s: float = 1.0) -> list[tuple[int, int, AgentLoopOutput]]:
        """(call, index, output) of the trajectories that finished since the last poll, waiting
        up to `timeout_s` for the first; a failed call or a dead worker raises."""
        if self._inproc is not None:
            got = []
            try:
                got.append(self._inbox.get(timeout=timeout_s))
                while True:
                    got.append(self._inbox.get_nowait())
            except queue.Empty:
                pass
            msgs = [(0, m) for m in got]
            for call, fut in list(self._inproc_calls.items()):
                if fut.done():
                    del self._inproc_calls[call]
                    if not fut.cancelled() and fut.exception() is not None:
                        raise RuntimeError(f"the in-process agent worker failed running call {call}: "
                                           f"{fut.exception()!r}") from fut.exception()
        else:
            msgs = self._receive(set(range(len(self._procs))), time.monotonic() + max(timeout_s, 1e-3) + 3600,
                                 "a streaming rollout", wait_s=max(timeout_s, 1e-3))
        out = []
        for w, msg in msgs:
            if msg["op"] == "call_failed":
                raise RuntimeError(f"agent worker {w} failed running its trajectories:\n{msg['error']}")
            if msg["op"] == "result":
                out.append((int(msg["call"]), int(msg["index"]), msg["output"]))
        return out


async def _cancel_others(wait_s: float = 10.0) -> None:
    """Cancel every other task of this loop and give them `wait_s` to finish."""
    me = asyncio.current_task()
    tasks = [t for t in asyncio.all_tasks() if t is not me]
    for t in tasks:
        t.cancel()
    if tasks:
        await asyncio.wait(tasks, timeout=wait_s)
