"""SGLang behind the Engine protocol. UNTESTED: SGLang cannot be installed on a CPU box.

Written against SGLang's offline `sglang.Engine` API as of late 2026 (`async_generate` with
`input_ids`, `return_logprob=True` and `rid`; `meta_info["output_token_logprobs"]` as
(logprob, token_id, text) triples; `meta_info["finish_reason"]["type"]`; `meta_info
["cached_tokens"]`). `Engine.update_weights_from_tensor` and the memory-occupation calls wrap
`loop.run_until_complete`, which cannot run inside the EngineServer's loop, so this backend
awaits the tokenizer manager's async versions of the same requests instead.

Not verified: whether SGLang's returned logprobs are of the temperature-scaled distribution
(the Engine contract) for every version; the `gpu` test in tests/test_sglang_engine.py checks
that against transformers where SGLang is installed.
"""

from __future__ import annotations

from typing import Any, Iterable

from engines.inference.base import EngineStats, GenerateOutput, SamplingParams

_FINISH = {"stop": "stop", "length": "length", "abort": "abort"}


class SGLangEngine:
    def __init__(self, model: str, dtype: str = "auto", tp_size: int = 1, mem_fraction_static: float = 0.8,
                 context_length: int | None = None, seed: int = 0, **engine_kwargs: Any) -> None:
        self.model = model
        self.kwargs = dict(dtype=dtype, tp_size=tp_size, mem_fraction_static=mem_fraction_static,
                           random_seed=seed, enable_memory_saver=True, **engine_kwargs)
        if context_length:
            self.kwargs["context_length"] = context_length
        self.tp_size = tp_size
        self._engine: Any = None
        self._running = 0
        self._sleeping = False
        self._stats = EngineStats()

    async def start(self) -> None:
        try:
            import sglang
        except ImportError as e:
            raise ImportError(f"the sglang backend needs SGLang ({e}); install it on a CUDA node: "
                              f"pip install 'sglang[all]'") from e
        from engines.models import resolve_model

        self._engine = sglang.Engine(model_path=str(resolve_model(self.model)), **self.kwargs)

    async def generate(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> GenerateOutput:
        sp: dict[str, Any] = {"max_new_tokens": params.max_tokens, "temperature": params.temperature,
                              "top_p": params.top_p, "top_k": params.top_k,
                              "stop_token_ids": list(params.stop_token_ids), "ignore_eos": params.ignore_eos}
        if params.seed is not None:
            sp["sampling_seed"] = params.seed
        self._running += 1
        try:
            out = await self._engine.async_generate(input_ids=list(prompt_ids), sampling_params=sp,
                                                    return_logprob=True, rid=request_id)
        finally:
            self._running -= 1
        meta = out["meta_info"]
        triples = meta.get("output_token_logprobs") or []
        ids = [int(t[1]) for t in triples] or list(out.get("output_ids", []))
        lps = [float(t[0]) for t in triples]
        if len(ids) != len(lps):
            raise RuntimeError(f"SGLang returned {len(ids)} tokens but {len(lps)} logprobs for {request_id}")
        finish = meta.get("finish_reason") or {}
        reason = _FINISH.get(finish.get("type", "") if isinstance(finish, dict) else str(finish), "abort")
        cached = int(meta.get("cached_tokens", 0) or 0)
        self._stats.prompt_tokens += len(prompt_ids)
        self._stats.cached_prompt_tokens += cached
        self._stats.generated_tokens += len(ids)
        return GenerateOutput(ids, lps, reason, cached)

    async def abort(self, request_id: str) -> None:
        self._engine.tokenizer_manager.abort_request(rid=request_id)

    async def update_weights(self, weights: Iterable[tuple[str, Any]]) -> None:
        from sglang.srt.managers.io_struct import UpdateWeightsFromTensorReqInput
        from sglang.srt.utils import MultiprocessingSerializer

        named = list(weights)
        req = UpdateWeightsFromTensorReqInput(
            serialized_named_tensors=[MultiprocessingSerializer.serialize(named) for _ in range(self.tp_size)],
            load_format=None, flush_cache=True)
        ok, message = await self._engine.tokenizer_manager.update_weights_from_tensor(req, None)
        if not ok:
            raise RuntimeError(f"SGLang refused the weight bucket: {message}")

    async def finish_weight_update(self) -> None:
        return None  # each bucket is loaded (and the cache flushed) as it arrives

    async def sleep(self) -> None:
        from sglang.srt.managers.io_struct import ReleaseMemoryOccupationReqInput

        await self._engine.tokenizer_manager.release_memory_occupation(ReleaseMemoryOccupationReqInput(), None)
        self._sleeping = True

    async def wake(self) -> None:
        from sglang.srt.managers.io_struct import ResumeMemoryOccupationReqInput

        await self._engine.tokenizer_manager.resume_memory_occupation(ResumeMemoryOccupationReqInput(), None)
        self._sleeping = False

    def stats(self) -> EngineStats:
        self._stats.running = self._running
        self._stats.sleeping = self._sleeping
        return self._stats

    async def close(self) -> None:
        if self._engine is not None:
            self._engine.shutdown()
            self._engine = None
