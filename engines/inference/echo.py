"""A model-free engine that answers instantly: the bus benchmark's and protocol tests' backend.

It replies with `max_tokens` tokens cycled from the prompt and logprob 0.0, so any time a
request takes is the transport's, not a model's. It is a real Engine (the server cannot tell
the difference) and never a stand-in for a model in tests about generation.
"""

from __future__ import annotations

import asyncio
from typing import Any, Iterable

import numpy as np

from engines.inference.base import (
    EngineStats,
    GenerateOutput,
    SamplingParams,
    check_sleep_level,
)


class EchoEngine:
    def __init__(self, model: str = "echo", delay_s: float = 0.0, max_model_len: int = 32768, **_: Any) -> None:
        self.delay_s = float(delay_s)
        self.max_model_len = int(max_model_len)  # replies stop there, as a model's context would
        self._running = 0
        self._aborted: set[str] = set()
        self._stats = EngineStats()
        self.loaded: dict[str, Any] = {}
        self.sleep_level = 0  # the level of the last sleep(), for tests of the control plane

    async def start(self) -> None:
        return None

    async def generate(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> GenerateOutput:
        self._running += 1
        try:
            if self.delay_s:
                await asyncio.sleep(self.delay_s)
            if request_id in self._aborted:
                self._aborted.discard(request_id)
                return GenerateOutput([], [], "abort")
            prompt = np.asarray(prompt_ids, dtype=np.int32)  # the server's array as it is; a list is converted
            n = max(0, min(params.max_tokens, self.max_model_len - len(prompt)))
            if n <= len(prompt):
                ids = prompt[:n]
            else:  # cycled from the prompt
                ids = np.resize(prompt, n) if len(prompt) else np.zeros(0, np.int32)
            self._stats.prompt_tokens += len(prompt)
            self._stats.generated_tokens += n
            return GenerateOutput(ids, np.zeros(n, np.float32), "length")
        finally:
            self._running -= 1

    async def abort(self, request_id: str) -> None:
        self._aborted.add(request_id)

    async def update_weights(self, weights: Iterable[tuple[str, Any]]) -> None:
        for name, tensor in weights:
            self.loaded[name] = tensor.clone()  # a bucket's tensors are only valid during the call

    async def finish_weight_update(self) -> None:
        return None

    async def sleep(self, level: int = 1) -> None:
        """No memory to give back; the level is checked so protocol tests see real refusals."""
        check_sleep_level(level)
        self.sleep_level = level
        self._stats.sleeping = True

    async def wake(self) -> None:
        self._stats.sleeping = False

    def stats(self) -> EngineStats:
        self._stats.running = self._running
        return self._stats

    async def close(self) -> None:
        return None
