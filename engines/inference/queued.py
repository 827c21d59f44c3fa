"""What the in-process transformers engines (hf.py, hf_reward.py) share: requests wait in a queue
that one scheduler task drains onto a worker thread. Their load figures and their shutdown."""

from __future__ import annotations

import asyncio
from typing import Any

from engines.inference.base import EngineStats


class QueuedEngine:
    """Mixed into an engine with `_stats` (EngineStats), `_pending` (queued requests), `_running`,
    `max_batch_size`, `_scheduler` (its task), `_live` (request id -> request with a `future`) and
    `_pool` (the worker thread's executor)."""

    _stats: EngineStats
    _pending: Any
    _running: int
    max_batch_size: int
    _scheduler: asyncio.Task | None
    _live: dict[str, Any]
    _pool: Any

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
