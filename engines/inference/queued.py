"""What the in-process transformers engines (hf.py, hf_reward.py) share: their constructor options,
checked; requests wait in a queue that one scheduler task drains onto a worker thread. Their load
figures and their shutdown."""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Callable
from typing import Any

import torch

from engines.inference.base import EngineStats

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

EARLY_ABORTS_KEPT = 10_000  # aborts of requests not (yet) seen, remembered so their generate returns at once


class QueuedEngine:
    """Mixed into an engine with `_stats` (EngineStats), `_pending` (queued requests), `_running`,
    `max_batch_size`, `_scheduler` (its task), `_live` (request id -> request with a `future`),
    `_early_aborts` (an OrderedDict), `_pool` (the worker thread's executor) and `_has_work` (the
    scheduler's wake-up)."""

    _stats: EngineStats
    _pending: Any
    _running: int
    max_batch_size: int
    _scheduler: asyncio.Task | None
    _live: dict[str, Any]
    _early_aborts: collections.OrderedDict[str, None]
    _pool: Any
    _has_work: asyncio.Event

    def _take_options(self, model: str, device: str, dtype: str, max_batch_size: int, seed: int) -> None:
        """The options both engines take, checked: the model, its device and dtype, the most rows a
        batch holds, the seed."""
        if dtype not in DTYPES:
            raise ValueError(f"dtype={dtype!r} is not supported; use one of {sorted(DTYPES)}")
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size={max_batch_size} must be >= 1")
        self.model_name = model
        self.device = torch.device(device)
        self.dtype = DTYPES[dtype]
        self.max_batch_size = max_batch_size
        self.seed = seed

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
