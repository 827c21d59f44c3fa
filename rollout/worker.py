"""The inside of an agent worker process (`rollout.manager` starts them): one event loop for the
process's whole life, one GenerateClient, tokenizer, tools and interactions built once, the
trajectories of every call running concurrently under asyncio.

Each finished trajectory is sent back as a dict with the (weight version, tokens) segments of
its generations attached (`AgentLoopOutput.version_segments`), recorded by the worker's client
so agent loops need not know that a generation was preempted and continued on newer weights.
"""

from __future__ import annotations

import asyncio
import logging
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from multiprocessing.connection import Connection
from typing import Any, Callable, Mapping

from agent.loop import DEFAULT_AGENT_NAME, AgentContext, AgentLoopOutput, AgentLoopRegistry
from agent.rewards.outcome import OutcomeScorer
from agent.tools.processes import install, kill_all, kill_owned, owned_by
from agent.traces import TrajectoryTracer
from rollout.bus.auth import ClientKeys
from rollout.bus.client import GenerateClient
from parallel.lifetime import watch_parent
from rollout.config import ManagerConfig

log = logging.getLogger("switchyard.manager")


class VersionedClient(GenerateClient):
    """Every request of a call asks for at least the call's weight version; servers hold it until
    they have loaded that version, so no trajectory mixes in stale weights after a sync. It also
    records, per session, which weight version produced which of its generated tokens."""

    min_weight_version = 0

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.segments: dict[str, list[list[int]]] = {}

    async def generate(self, prompt_ids: Any, sampling: Any = None, session_id: str | None = None,
                       group_id: str | None = None, min_weight_version: int = 0, pixel_values: Any = None) -> Any:
        result = await super().generate(prompt_ids, sampling, session_id, group_id,
                                        max(min_weight_version, self.min_weight_version), pixel_values)
        if session_id:
            self.segments.setdefault(session_id, []).extend([v, n] for v, n in result.segments if n)
        return result

    def take_segments(self, session_id: str) -> list[list[int]]:
        """The [version, tokens] segments of a finished session's generations, in order (forgotten here)."""
        return self.segments.pop(session_id, [])


class AgentWorker:
    """What one worker builds once and shares across its trajectories."""

    def __init__(self, cfg: "ManagerConfig", index: int, experiment_id: str | None) -> None:
        self.cfg, self.index, self.experiment_id = cfg, index, experiment_id
        self.client: VersionedClient | None = None
        self.tools: dict[str, Any] = {}
        self.interactions: dict[str, Any] = {}
        self.tracer: TrajectoryTracer | None = None
        self.outcome: Any = None  # the outcome's one source: rule, reward.function or reward.model
        self._trace_pool: ThreadPoolExecutor | None = None

    async def start(self) -> None:
        install()  # processes a trajectory's tools start are recorded under it (agent/tools/processes.py)
        from agent.interactions.registry import load_interactions
        from agent.tools.registry import load_tools
        from agent.vision import Vision
        from engines.models import load_tokenizer, resolve_model

        cfg = self.cfg
        self.tokenizer = load_tokenizer(cfg.tokenizer)
        self.vision = Vision.from_model(resolve_model(cfg.tokenizer))
        self.tools = load_tools(cfg.tools_config) if cfg.tools_config else {}
        self.interactions = load_interactions(cfg.interaction_config) if cfg.interaction_config else {}
        keys = ClientKeys(**cfg.bus_keys) if cfg.bus_keys else None
        self.client = VersionedClient(cfg.addresses, policy=cfg.policy, keys=keys)
        await self.client.start()
        self.registry = AgentLoopRegistry(cfg.agent_loops)
        self.contexts = {name: AgentContext(self.client, self.tokenizer, self.tools, self.interactions,
                                            dict(cfg.agent_configs.get(name) or {}), self.vision)
                         for name in self.registry.names}
        # a bad loop config fails here, at start-up; built-ins nobody configured are imported on
        # first use, so an optional package (langgraph) is only needed by datasets that use it
        for name in sorted({*cfg.agent_configs, *cfg.agent_loops}):
            self.registry.get(name)(self.contexts[name])
        self.outcome = OutcomeScorer(cfg.reward)
        await self.outcome.start(cfg.ready_timeout_s)
        self.tracer = TrajectoryTracer(cfg.tracing, self.experiment_id)
        self._trace_pool = ThreadPoolExecutor(1, thread_name_prefix="trace") if self.tracer.enabled else None
        await self.client.wait_ready(timeout_s=cfg.ready_timeout_s)
        self.sem = asyncio.Semaphore(cfg.max_concurrent)

    async def run_items(self, items: list[dict[str, Any]], sampling: dict[str, Any], weight_version: int | None,
                        emit: Callable[[dict[str, Any]], None]) -> None:
        assert self.client is not None
        self.client.min_weight_version = int(weight_version or 0)
        await asyncio.gather(*(self._run_one(it, sampling, emit) for it in items))

    async def _run_one(self, item: dict[str, Any], sampling: dict[str, Any],
                       emit: Callable[[dict[str, Any]], None]) -> None:
        row = item["row"]
        name = row.get("agent_name") or DEFAULT_AGENT_NAME
        owner = str(row.get("session_id") or f"item-{id(item)}")
        async with self.sem:
            t0 = time.time_ns()
            try:
                with owned_by(owner):  # the processes its tools start end with it
                    out = await self.registry.get(name)(self.contexts[name]).run(dict(sampling), **row)
                out.check()
            except asyncio.CancelledError:
                raise
            except BaseException as e:  # one broken trajectory (SystemExit included) is flagged, not fatal
                log.exception("worker %d: trajectory %s (%s) failed", self.index, row.get("session_id"), name)
                out = self._error_output(row, e)
            finally:
                kill_owned(owner)
            t1 = time.time_ns()
        try:
            with owned_by(f"{owner}:reward"):  # what the reward function starts ends with its call
                await self.outcome.score(row, out, self.tokenizer)  # a judge is asked the moment this loop ended
        finally:
            kill_owned(f"{owner}:reward")
        assert self.client is not None
        segments = self.client.take_segments(str(row.get("session_id", "")))
        if not out.version_segments and sum(n for _, n in segments) == len(out.model_token_ids()):
            out.version_segments = segments  # every model token accounted for, in order
        if self._trace_pool is not None and self.tracer is not None:
            await asyncio.get_running_loop().run_in_executor(self._trace_pool, self.tracer.record_trajectory,
                                                             out, row, t0, t1)
        emit({"op": "result", "index": item["index"], "output": out})  # pickled as it is: no deep copy

    def _error_output(self, row: Mapping[str, Any], err: BaseException) -> AgentLoopOutput:
        from agent.chat import ChatEncoder

        try:  # keep the prompt so the row still lines up with its group
            prompt_ids = ChatEncoder(self.tokenizer).initial(list(row["prompt"]))
        except Exception:
            prompt_ids = []
        return AgentLoopOutput.failed(prompt_ids, f"{type(err).__name__}: {err}", str(row.get("session_id", "")))

    async def close(self) -> None:
        """Close the client, every tool and interaction that has a close(), flush traces, and kill
        the processes trajectories left."""
        kill_all()
        if self.outcome is not None:
            await self.outcome.close()
        for obj in [*self.tools.values(), *self.interactions.values()]:
            close = getattr(obj, "close", None)
            if callable(close):
                try:
                    res = close()
                    if asyncio.iscoroutine(res):
                        await res
                except Exception:
                    log.exception("worker %d: closing %r failed", self.index, obj)
        if self.client is not None:
            await self.client.close()
        if self.tracer is not None:
            self.tracer.flush()
        if self._trace_pool is not None:
            self._trace_pool.shutdown(wait=True)


def worker_main(index: int, cfg_dict: dict[str, Any], experiment_id: str | None, tasks: Connection,
                 results: Connection) -> None:
    """Entry point of a worker process: one event loop for the process's whole life."""
    import os
    import sys

    import multiprocessing

    # a trainer killed with -9 while this worker starts (or idles) takes it along; the trainer's pid as
    # multiprocessing knows it, not getppid(): a trainer killed before this line would already be gone
    spawner = multiprocessing.parent_process()
    watch_parent(lambda: os._exit(1), parent=spawner.pid if spawner is not None else None)
    logging.basicConfig(level=logging.WARNING, format=f"[agent-worker {index}] %(levelname)s %(name)s: %(message)s")
    loop = asyncio.new_event_loop()
    try:
        loop.run_until_complete(_serve(index, ManagerConfig(**cfg_dict), experiment_id, tasks, results))
    finally:  # not asyncio.run: it would wait for abandoned tool calls that ignore cancellation
        loop.close()
    # everything is closed and flushed; a thread a tool abandoned (an executor's: not a daemon) would
    # hold the interpreter's exit until it ends, so leave now
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


async def _serve(index: int, cfg: "ManagerConfig", experiment_id: str | None, tasks: Connection,
                 results: Connection) -> None:
    worker = AgentWorker(cfg, index, experiment_id)
    try:
        await worker.start()
    except Exception:
        results.send({"op": "start_failed", "error": traceback.format_exc()})
        await worker.close()
        return
    results.send({"op": "ready"})
    reader = ThreadPoolExecutor(1, thread_name_prefix="tasks")  # the event loop keeps running while idle
    # results leave from a thread of their own, in order: a full pipe (the parent busy submitting)
    # must not stop the event loop, else no task is read either and both sides wait on each other
    sender = ThreadPoolExecutor(1, thread_name_prefix="results")

    def send(msg: dict[str, Any]) -> None:
        sender.submit(results.send, msg)
    loop = asyncio.get_running_loop()
    running: set[asyncio.Task] = set()
    try:
        while True:  # keep reading while calls run, so `stop` is answered at once
            try:
                msg = await loop.run_in_executor(reader, tasks.recv)
            except (EOFError, OSError):
                break  # the parent is gone
            if msg["op"] == "stop":
                break
            task = asyncio.create_task(_run_call(worker, msg, send))
            running.add(task)
            task.add_done_callback(running.discard)
    finally:
        pending = list(running)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        reader.shutdown(wait=False)
        sender.shutdown(wait=False, cancel_futures=True)  # stopping: the parent reads no more results
        await worker.close()


async def _run_call(worker: AgentWorker, msg: dict[str, Any], send: Callable[[dict[str, Any]], None]) -> None:
    call = msg["call"]
    try:
        await worker.run_items(msg["items"], msg["sampling"], msg["weight_version"],
                               lambda d: send({**d, "call": call}))
    except Exception:
        send({"op": "call_failed", "call": call, "error": traceback.format_exc()})
