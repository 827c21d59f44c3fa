"""What the in-process transformers engines (hf.py, hf_reward.py) share: their constructor options,
checked; the queue their requests wait in, which one scheduler task drains onto a worker thread
once the model has loaded there (`start`); their load figures and their shutdown."""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
from collections.abc import Callable
from typing import Any

import torch

from engines.inference.base import EngineStats

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

EARLY_ABORTS_KEPT = 10_000  # aborts of requests not (yet) seen, remembered so their generate returns at once


class QueuedEngine:
    """The base of an engine whose requests wait in a queue (`_pending`) that one scheduler task
    (`_schedule`, the engine's own) drains onto one worker thread (`_pool`), where `_load` loads
    the model at `start`. `_live` maps a request id to its request, which has a `future`."""

    def __init__(self, model: str, device: str, dtype: str, max_batch_size: int, seed: int, name: str) -> None:
        """The options both engines take, checked: the model, its device and dtype, the most rows a
        batch holds, the seed. `name` names the worker thread and the scheduler task."""
        if dtype not in DTYPES:
            raise ValueError(f"dtype={dtype!r} is not supported; use one of {sorted(DTYPES)}")
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size={max_batch_size} must be >= 1")
        self.model_name = model
        self.device = torch.device(device)
        self.dtype = DTYPES[dtype]
        self.max_batch_size = max_batch_size
        self.seed = seed
        self._name = name
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=name)
        self._pending: collections.deque[Any] = collections.deque()
        self._live: dict[str, Any] = {}
        self._early_aborts: collections.OrderedDict[str, None] = collections.OrderedDict()
        self._running = 0
        self._stats = EngineStats()
        self._has_work = asyncio.Event()  # the scheduler's wake-up
        self._scheduler: asyncio.Task | None = None

    def _load(self) -> None:
        raise NotImplementedError

    async def _schedule(self) -> None:
        raise NotImplementedError

    async def start(self) -> None:
        """Load the model in the worker thread so the server can answer health while it loads."""
        await asyncio.get_running_loop().run_in_executor(self._pool, self._load)
        self._scheduler = asyncio.create_task(self._schedule(), name=f"{self._name}-scheduler:{self.model_name}")

    def _admit(self, request_id: str) -> bool:
        """Whether a generate for `request_id` may queue: False when `abort` named it first (its
        generate returns 'abort' at once). Before start(), or for an id already running, it raises."""
        if self._scheduler is None:
            raise RuntimeError(f"{type(self).__name__}.generate() called before start(); await engine.start() first")
        if self._aborted_early(request_id):
            return False
        if request_id in self._live:
            raise ValueError(f"request_id {request_id!r} is already running; request ids must be unique")
        return True

    async def _queued(self, req: Any, dropped: Callable[[Any], Any]) -> Any:
        """`req` queued for the scheduler, and its answer once its row is done. A caller that goes
        away marks it aborted, and `dropped(req)` frees its place at once."""
        self._live[req.request_id] = req
        self._pending.append(req)
        self._has_work.set()
        try:
            return await req.future
        except asyncio.CancelledError:
            req.aborted = True
            dropped(req)
            raise

    def _aborted_early(self, request_id: str) -> bool:
        """Whether `abort` named this request before it arrived (then it is forgotten, and its
        generate returns 'abort' at once)."""
        if request_id in self._early_aborts:
            del self._early_aborts[request_id]
            return True
        return False

    def _abort_target(self, request_id: str) -> Any:
        """The live request `abort` names, or None after remembering the id (the newest
        EARLY_ABORTS_KEPT of them) for a generate that arrives later."""
        req = self._live.get(request_id)
        if req is None:
            self._early_aborts[request_id] = None
            while len(self._early_aborts) > EARLY_ABORTS_KEPT:
                self._early_aborts.popitem(last=False)
        return req

    def stats(self) -> EngineStats:
        """Counters plus load; kv_cache_usage is the fraction of batch slots in use (no fixed KV pool)."""
        s = self._stats
        s.waiting = len(self._pending)
        s.running = self._running
        s.kv_cache_usage = self._running / self.max_batch_size
        return EngineStats(**s.to_dict())

    async def close(self) -> None:
        """Stop the scheduler, fail what is still in flight, and let the worker thread finish."""
        if self._scheduler is not None:
            self._scheduler.cancel()
            try:
                await self._scheduler
            except asyncio.CancelledError:
                pass
        for req in list(self._live.values()):
            if not req.future.done():
                req.future.set_exception(RuntimeError(f"engine closed while {req.request_id!r} was in flight"))
        self._live.clear()
        self._pending.clear()
        await asyncio.get_running_loop().run_in_executor(None, self._pool.shutdown, True)
