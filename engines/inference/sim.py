"""A model-free engine whose timing follows a stated GPU model: the cluster simulator's backend.

It answers like `echo` (a real Engine behind a real EngineServer; the server cannot tell the
difference), but each reply takes the time the modelled card would take, on a clock that may run
`time_scale` times faster than the wall clock:
- prefill: the prompt tokens not found in the prefix cache, at `prefill_tok_s`;
- decode: one step per generated token for the whole running batch; a step reads the weights once
  and every running sequence's KV cache once, so it grows with the batch and its context;
- KV cache: a request is admitted when its prompt and its longest reply fit in the free tokens,
  else it waits (vLLM's scheduler queues it the same way, first come first served);
- prefix cache: 16-token blocks chained by hash, kept in LRU order up to the cache's size; a hit
  skips that part of the prefill and is reported as `cached_prompt_tokens`;
- sleep / wake and weight loading: `load_s_per_gb` per GB of the modelled weights (not of the
  bytes actually pushed, which a simulator scales down).
Replies are `filler_id` tokens of a log-normal length (`reply_median`, `reply_p99`), ended by one of
`suffixes` (token lists the caller tokenized, e.g. a tool call or a final answer) drawn at random
with the weights `suffix_weights`; logprobs are filled with a plausible constant.

The figures of MODELS (a 7B llama-class model, fp16, on one H100 SXM 80 GB):
- weights: 6.7e9 parameters x 2 bytes = 13.5 GB (Llama 2 paper, Touvron et al. 2023, table 1 sizes).
- HBM bandwidth 3.35 TB/s and dense BF16 989 TFLOP/s: NVIDIA H100 SXM datasheet.
- decode step = weights / bandwidth (4.0 ms) at an achieved 80% of peak bandwidth = 5.0 ms at batch 1,
  in line with the 6-7 ms per token that public vLLM runs of 7B models on one H100 show; plus the KV
  read: 2 (K, V) x 32 layers x 4096 hidden x 2 bytes = 0.5 MiB per context token at the same bandwidth.
- prefill: 2 x 6.7e9 FLOPs per token at 40% of the dense peak = about 30k tokens/s.
- KV capacity: 0.9 x 80 GB - 13.5 GB weights = 58.5 GB / 0.5 MiB = about 110k tokens.
- loading weights: 25 GB/s host to device (PCIe Gen5 x16, about half its 64 GB/s peak), 0.04 s/GB.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Any, Iterable

import numpy as np

from engines.inference.base import EngineStats, GenerateOutput, SamplingParams, check_sleep_level

BLOCK = 16  # tokens per prefix-cache block, as vLLM's default block size


@dataclass(frozen=True)
class GpuModel:
    """One model on one card, in seconds, tokens and GB of the simulated clock."""

    weights_gb: float
    prefill_tok_s: float
    step_base_s: float  # one decode step at batch 1 with an empty context
    step_per_ctx_token_s: float  # what each context token of the running batch adds to a step
    kv_tokens: int
    load_s_per_gb: float

    def step_s(self, context_tokens: int) -> float:
        return self.step_base_s + self.step_per_ctx_token_s * context_tokens


_BW = 3.35e12 * 0.8  # achieved HBM bytes/s of an H100 SXM
MODELS: dict[str, GpuModel] = {
    "7b-h100": GpuModel(weights_gb=13.5, prefill_tok_s=989e12 * 0.4 / (2 * 6.7e9), step_base_s=13.5e9 / _BW,
                        step_per_ctx_token_s=2 * 32 * 4096 * 2 / _BW, kv_tokens=110_000, load_s_per_gb=0.04),
}


@dataclass
class SimStats(EngineStats):
    busy_sim_s: float = 0.0  # simulated seconds the card computed (prefill, decode, loading)
    sim_s: float = 0.0  # simulated seconds since start
    prefills: int = 0


class _Request:
    __slots__ = ("prompt_len", "uncached", "reply", "done", "kv", "future", "aborted")

    def __init__(self, prompt_len: int, uncached: int, reply: int, future: "asyncio.Future[int]") -> None:
        self.prompt_len, self.uncached, self.reply, self.done = prompt_len, uncached, reply, 0
        self.kv = prompt_len + reply  # reserved at admission, freed at the end
        self.future, self.aborted = future, False


class SimEngine:
    def __init__(self, model: str = "7b-h100", time_scale: float = 1.0, reply_median: float = 200.0,
                 reply_p99: float = 1000.0, filler_id: int = 0, suffixes: list[list[int]] | None = None,
                 suffix_weights: list[float] | None = None, logprob: float = -0.7, seed: int = 0,
                 max_model_len: int = 32768, kv_tokens: int | None = None, **_: Any) -> None:
        if model not in MODELS:
            raise ValueError(f"sim engine model {model!r} is unknown; choose one of {sorted(MODELS)}")
        if time_scale <= 0:
            raise ValueError(f"time_scale={time_scale} must be > 0 (10 runs a simulated second in 0.1 s)")
        if not 0 < reply_median < reply_p99:
            raise ValueError(f"reply_median={reply_median} and reply_p99={reply_p99}: need 0 < median < p99")
        self.gpu = MODELS[model]
        self.kv_capacity = int(kv_tokens or self.gpu.kv_tokens)
        self.time_scale = float(time_scale)
        self.mu, self.sigma = math.log(reply_median), math.log(reply_p99 / reply_median) / 2.326
        self.filler_id, self.logprob, self.max_model_len = int(filler_id), float(logprob), int(max_model_len)
        self.suffixes = [list(s) for s in (suffixes or [[]])]
        w = np.asarray(suffix_weights or [1.0] * len(self.suffixes), dtype=np.float64)
        if len(w) != len(self.suffixes) or (w < 0).any() or w.sum() <= 0:
            raise ValueError(f"suffix_weights={suffix_weights}: one weight >= 0 per suffix, not all 0")
        self.suffix_p = w / w.sum()
        self.rng = np.random.default_rng(seed)
        self.cache: OrderedDict[int, None] = OrderedDict()  # block-chain hashes, least recently used first
        self.waiting: deque[_Request] = deque()
        self.running: list[_Request] = []
        self.kv_used = 0
        self._carry = 0.0  # simulated seconds of a decode step begun before an arrival cut the wait
        self._stats = SimStats()
        self._wake = asyncio.Event()
        self._loop_task: asyncio.Task[None] | None = None
        self._t0 = time.monotonic()
        self._asleep = False
        self._ids: dict[str, _Request] = {}
        self.weight_bytes = 0  # bytes of the last pushed update, as received

    # ------------------------------------------------------------ clock
    def sim_now(self) -> float:
        return (time.monotonic() - self._t0) * self.time_scale

    async def _spend(self, sim_s: float, interruptible: bool = False) -> float:
        """Let `sim_s` simulated seconds pass; with `interruptible`, return early on a new arrival.
        Returns the simulated seconds that passed."""
        start = time.monotonic()
        if interruptible:
            self._wake.clear()
            try:
                await asyncio.wait_for(self._wake.wait(), sim_s / self.time_scale)
            except asyncio.TimeoutError:
                pass
        else:
            await asyncio.sleep(sim_s / self.time_scale)
        return min(sim_s, (time.monotonic() - start) * self.time_scale)

    # ------------------------------------------------------------ prefix cache
    def _match(self, prompt: np.ndarray) -> int:
        """Prompt tokens found in the prefix cache (whole blocks from the start); the prompt's
        blocks become the most recently used."""
        h, hit, matching = 0, 0, True
        for start in range(0, len(prompt) - len(prompt) % BLOCK, BLOCK):
            h = hash((h, prompt[start:start + BLOCK].tobytes()))
            if matching and h in self.cache:
                hit += BLOCK
                self.cache.move_to_end(h)
            else:
                matching = False
                self.cache[h] = None
        while len(self.cache) * BLOCK > self.kv_capacity:
            self.cache.popitem(last=False)
        return min(hit, max(0, len(prompt) - 1))  # the last token is always computed, as in vLLM

    # ------------------------------------------------------------ scheduler
    async def start(self) -> None:
        self._t0 = time.monotonic()
        self._loop_task = asyncio.ensure_future(self._schedule())

    async def _schedule(self) -> None:
        while True:
            while self.waiting and not self._asleep:  # admit in arrival order while the KV cache has room
                r = self.waiting[0]
                if r.aborted:
                    self.waiting.popleft()
                    continue
                if self.kv_used + r.kv > self.kv_capacity and self.running:
                    break  # full: it waits for a running request to end
                self.waiting.popleft()
                self.kv_used += r.kv
                self.running.append(r)
                if r.uncached:
                    self._stats.prefills += 1
                    self._stats.busy_sim_s += await self._spend(r.uncached / self.gpu.prefill_tok_s)
            self.running = [r for r in self.running if not self._finish_if(r, r.aborted)]
            if not self.running:
                self._wake.clear()
                await self._wake.wait()
                continue
            step = self.gpu.step_s(sum(r.prompt_len + r.done for r in self.running))
            left = min(r.reply - r.done for r in self.running)
            passed = await self._spend(left * step - self._carry, interruptible=True)
            self._stats.busy_sim_s += passed
            steps = min(left, int((passed + self._carry) / step + 1e-9))
            self._carry = 0.0 if steps == left else passed + self._carry - steps * step  # a step part-done
            if not steps:
                continue
            for r in self.running:
                r.done += steps
            self._stats.generated_tokens += steps * len(self.running)
            self.running = [r for r in self.running if not self._finish_if(r, r.done >= r.reply)]

    def _finish_if(self, r: _Request, ended: bool) -> bool:
        if ended:
            self.kv_used -= r.kv
            if not r.future.done():
                r.future.set_result(r.done)
        return ended

    async def generate(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> GenerateOutput:
        prompt = np.asarray(prompt_ids, dtype=np.int32)
        room = max(0, min(params.max_tokens, self.max_model_len - len(prompt)))
        suffix = self.suffixes[int(self.rng.choice(len(self.suffixes), p=self.suffix_p))]
        want = int(round(math.exp(self.rng.normal(self.mu, self.sigma)))) + len(suffix)
        n = min(room, max(len(suffix), 1, want))
        cached = self._match(prompt)
        self._stats.prompt_tokens += len(prompt)
        self._stats.cached_prompt_tokens += cached
        if min(len(prompt) + n, self.max_model_len) > self.kv_capacity:
            raise ValueError(f"a request of {len(prompt)} prompt + {n} reply tokens cannot fit the simulated KV "
                             f"cache of {self.kv_capacity} tokens; lower max_tokens or raise kv_tokens")
        r = _Request(len(prompt), len(prompt) - cached, n, asyncio.get_running_loop().create_future())
        self._ids[request_id] = r
        self.waiting.append(r)
        self._wake.set()
        try:
            done = await r.future
        finally:
            self._ids.pop(request_id, None)
        if r.aborted:
            return GenerateOutput([], [], "abort")
        ids = np.full(done, self.filler_id, np.int32)
        tail = suffix[max(0, len(suffix) - done):]
        if len(tail):
            ids[done - len(tail):] = tail
        reason = "stop" if done == n and suffix and n < room else "length"
        return GenerateOutput(ids, np.full(done, self.logprob, np.float32), reason, cached_prompt_tokens=cached)

    async def abort(self, request_id: str) -> None:
        r = self._ids.get(request_id)
        if r is not None:
            r.aborted = True
            self._wake.set()
            if r in self.waiting and not r.future.done():
                r.future.set_result(0)

    # ------------------------------------------------------------ weights, sleep
    async def update_weights(self, weights: Iterable[tuple[str, Any]]) -> None:
        self.weight_bytes = sum(t.numel() * t.element_size() for _, t in weights)

    async def finish_weight_update(self) -> None:
        """The modelled weights, not the pushed bytes, set the time: a simulator pushes fewer."""
        self._stats.busy_sim_s += await self._spend(self.gpu.weights_gb * self.gpu.load_s_per_gb)

    async def sleep(self, level: int = 1) -> None:
        check_sleep_level(level)
        self._asleep = True
        self._stats.sleeping = True
        self.cache.clear()  # the KV cache (and the prefixes in it) is given back at either level

    async def wake(self) -> None:
        self._stats.busy_sim_s += await self._spend(self.gpu.weights_gb * self.gpu.load_s_per_gb)
        self._asleep = False
        self._stats.sleeping = False
        self._wake.set()

    def stats(self) -> SimStats:
        self._stats.running = len(self.running)
        self._stats.waiting = len(self.waiting)
        self._stats.kv_cache_usage = self.kv_used / self.kv_capacity
        self._stats.sim_s = self.sim_now()
        return self._stats

    async def close(self) -> None:
        if self._loop_task is not None:
            self._loop_task.cancel()
            self._loop_task = None
        for r in [*self.waiting, *self.running]:
            if not r.future.done():
                r.future.cancel()
