"""An engine served from the trainer's own process (`rollout.in_process=true`), so weights reach it
by reference: no bytes, no checksum, no second copy (the in-process path of the weight routes).

The engine and its EngineServer run on a thread with their own event loop and bind the same ipc
socket a separate server would, so agent loops, the router and sleep/wake reach it over the bus
as usual; only the weight push skips the bus, queued on the server's loop in order with every
other weight job. A CPU trainer idles while synchronous rollout runs and the engine idles (or
sleeps, colocated) while the trainer updates, so the two share the process without contending.
The handle looks like the server process it replaces (`pid`, `poll`, `terminate`, `wait`, `kill`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import threading
from typing import Any, Iterable

import torch

from engines.inference import ENGINES, make_engine
from rollout.bus.server import EngineServer
from rollout.weights.inproc import LocalLoad


class InProcessEngine:
    def __init__(self, backend: str, model: str, addresses: list[str], engine_id: str, options: dict[str, Any],
                 request_log: str | None = None) -> None:
        self.pid = os.getpid()
        self._args = (backend, model, addresses, engine_id, options, request_log)
        self._bound: concurrent.futures.Future = concurrent.futures.Future()
        self._loop: asyncio.AbstractEventLoop | None = None
        self.server: Any = None
        self.returncode: int | None = None
        self._thread = threading.Thread(target=self._main, name=f"engine-{engine_id}", daemon=True)
        self._thread.start()

    def _main(self) -> None:
        backend, model, addresses, engine_id, options, request_log = self._args
        try:
            loop = asyncio.new_event_loop()
            asyncio.set_event_loop(loop)
            self._loop = loop
            backend = ENGINES[backend].in_process or backend  # e.g. vllm's engine core in this process
            self.server = EngineServer(make_engine(backend, model, **options), addresses, engine_id, request_log)

            async def serve() -> None:
                running = asyncio.create_task(self.server.run())
                bound = asyncio.create_task(self.server.wait_bound())
                await asyncio.wait([bound, running], return_when=asyncio.FIRST_COMPLETED)
                if bound.done():
                    self._bound.set_result(bound.result())
                await running

            loop.run_until_complete(serve())
            self.returncode = self.server.exit_code
        except BaseException as e:  # noqa: BLE001 - reported to the trainer thread that waits
            self.returncode = 1
            if not self._bound.done():
                self._bound.set_exception(e)
            raise
        finally:
            if not self._bound.done():
                self._bound.set_exception(RuntimeError("the in-process engine stopped before it bound its socket"))

    def endpoints(self, timeout_s: float) -> list[str]:
        return self._bound.result(timeout=timeout_s)

    def load(self, named: Iterable[tuple[str, torch.Tensor]], version: int, bucket_bytes: int,
             dtype: torch.dtype | None = None, preempt: bool = False, timeout_s: float = 3600.0) -> Any:
        """Load `named` into the engine as `version` and wait; the SyncReport. The tensors are taken by
        reference (cast only where the engine's dtype differs), so nothing is copied before the
        engine copies them into its parameters."""
        tensors = ((n, t.detach().to(dtype) if dtype is not None and t.dtype != dtype else t.detach())
                   for n, t in named)  # lazily, on the engine's loop: never the whole model at once
        done: concurrent.futures.Future = concurrent.futures.Future()
        self.server.submit_local(LocalLoad(tensors, int(version), int(bucket_bytes), bool(preempt), done))
        return done.result(timeout=timeout_s)

    # the subprocess.Popen surface the plane uses for its engines
    def poll(self) -> int | None:
        return None if self._thread.is_alive() else (self.returncode if self.returncode is not None else 0)

    def terminate(self) -> None:
        if self._loop is not None and self.server is not None and self._thread.is_alive():
            self._loop.call_soon_threadsafe(self.server.stop)

    kill = terminate

    def wait(self, timeout: float | None = None) -> int:
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise TimeoutError(f"the in-process engine did not stop within {timeout} s")
        return self.returncode or 0
