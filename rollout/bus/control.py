"""A bus client on a background event loop, for synchronous callers: the trainer's control client
(status, sleep/wake, weight pushes; `rollout/fleet.py`), and a node leader's client to its own
engines on the collective weight route (`rollout/weights/sync.py`)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from typing import Any


class ControlClient:
    """A `GenerateClient` (with the trainer's key, for the control role) on a background event loop:
    status, sleep/wake and weight pushes without restarting a client per call."""

    def __init__(self, addresses: list[str], keys: Any, ready_timeout_s: float) -> None:
        from rollout.bus.client import GenerateClient

        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="rollout-control", daemon=True)
        self.thread.start()
        self.client = GenerateClient(addresses, keys=keys)
        self.run(self.client.start())
        self.run(self.client.wait_ready(timeout_s=ready_timeout_s))

    def run(self, coro: Coroutine[Any, Any, Any]) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    def close(self) -> None:
        try:
            self.run(self.client.close())
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(timeout=30)
            self.loop.close()
