"""SGLang behind the Engine protocol. UNTESTED here: SGLang cannot be installed on a CPU box.

Written against SGLang's offline `sglang.Engine` API as found on its main branch in 2026
(the 0.5.x line; the calls used exist since ~0.4.6):
- `Engine(model_path=..., dtype=..., tp_size=..., mem_fraction_static=..., random_seed=...,
  enable_memory_saver=True)`;
- `await engine.async_generate(input_ids=[...], sampling_params={...}, return_logprob=True,
  rid=request_id)` returning `{"output_ids", "meta_info": {"output_token_logprobs":
  [(logprob, token_id, text|None), ...], "finish_reason": {"type": "stop"|"length"|"abort", ...},
  "cached_tokens": int, ...}}`;
- sampling keys `max_new_tokens, temperature, top_p, top_k (-1 = off), stop_token_ids,
  ignore_eos, sampling_seed, frequency_penalty, presence_penalty` (OpenAI's semantics, on the output
  tokens) and `logit_bias` ({token id as a string: bias}); `top_logprobs_num=k` next to
  `return_logprob` adds `meta_info["output_top_logprobs"]`: per position k (logprob, token_id, text);
- `tokenizer_manager.abort_request(rid=...)`, and the tokenizer manager's async
  `update_weights_from_tensor(UpdateWeightsFromTensorReqInput(...), None) -> (ok, message)`,
  `flush_cache()`, `release_memory_occupation(...)` / `resume_memory_occupation(...)`.

Why the tokenizer manager and not `Engine.update_weights_from_tensor` / `release_memory_
occupation`: those wrap `loop.run_until_complete`, which cannot run inside the EngineServer's
already running loop; the async methods they wrap are what they await.

Logprobs: by default SGLang returns log_softmax(logits / T) before top-k/top-p/min-p filters,
and for greedy requests (it turns T == 0 into T = 1, top_k = 1) the raw log_softmax: exactly the
Engine contract. `SGLANG_RETURN_ORIGINAL_LOGPROB=1` switches it to pre-temperature logprobs,
so `start()` refuses to run with it set. Per-request seeds are honoured by SGLang only under
`enable_deterministic_inference=True`. SGLang applies the penalties and the logit bias to the
logits before its sampler takes log_softmax, so with them on the logprobs are of the adjusted
distribution (as vLLM's; the hf engine reports the unadjusted policy's), read from its code, not run.

Weight updates load each bucket in place as it arrives (SGLang's `load_weights` takes any
subset of tensors) without flushing; `finish_weight_update` flushes the radix cache once.
`stats()` counts in-flight requests locally: SGLang's load figures need a round trip to the
scheduler, too slow for a call made on every reply.

The `gpu` test in tests/test_sglang_engine.py checks ids and logprobs against transformers
where SGLang is installed.
"""

from __future__ import annotations

import os
from typing import Any, Iterable

from engines.inference.base import (
    EngineStats,
    GenerateOutput,
    SamplingParams,
    check_sleep_level,
    id_list,
)

_FINISH = {"stop": "stop", "length": "length", "abort": "abort"}


class SGLangEngine:
    """One `sglang.Engine` (tokenizer manager in-process, scheduler and detokenizer as children).

    `engine_kwargs` go straight to SGLang's `ServerArgs`, so any SGLang knob is reachable from
    the config without a code change.
    """

    def __init__(self, model: str, dtype: str = "auto", tp_size: int = 1, mem_fraction_static: float = 0.8,
                 context_length: int | None = None, seed: int = 0, **engine_kwargs: Any) -> None:
        if not 0 < mem_fraction_static < 1:
            raise ValueError(f"mem_fraction_static={mem_fraction_static} must be in (0, 1)")
        self.model = model
        self.tp_size = tp_size
        self.kwargs: dict[str, Any] = dict(dtype=dtype, tp_size=tp_size, mem_fraction_static=mem_fraction_static,
                                           random_seed=seed, enable_memory_saver=True)
        if context_length:
            self.kwargs["context_length"] = context_length
        self.kwargs.update(engine_kwargs)
        self._engine: Any = None
        self._in_flight = 0
        self._sleeping = False
        self._stats = EngineStats()

    async def start(self) -> None:
        """Launch SGLang; blocks the loop until the model is loaded (once, before serving)."""
        if os.environ.get("SGLANG_RETURN_ORIGINAL_LOGPROB", "").lower() in ("1", "true", "yes"):
            raise ValueError("SGLANG_RETURN_ORIGINAL_LOGPROB is set: SGLang would return pre-temperature "
                             "logprobs, not log_softmax(logits / T); unset it")
        try:
            import sglang
        except ImportError as e:
            raise ImportError(f"the sglang backend needs SGLang ({e}); install it on a CUDA node: "
                              f"pip install 'sglang[all]'") from e
        from engines.models import resolve_model

        self._engine = sglang.Engine(model_path=str(resolve_model(self.model)), **self.kwargs)

    async def generate(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> GenerateOutput:
        """Run one request to the end and return SGLang's own token ids and their logprobs."""
        if self._engine is None:
            raise RuntimeError("SGLangEngine.generate() called before start() (or after close())")
        prompt_ids = id_list(prompt_ids)
        if not prompt_ids:
            raise ValueError("prompt_ids is empty; a prompt needs at least one token")
        sp: dict[str, Any] = {"max_new_tokens": params.max_tokens, "temperature": params.temperature,
                              "top_p": params.top_p, "top_k": params.top_k,
                              "stop_token_ids": list(params.stop_token_ids), "ignore_eos": params.ignore_eos}
        if params.seed is not None:
            sp["sampling_seed"] = params.seed
        if params.frequency_penalty or params.presence_penalty:
            sp.update(frequency_penalty=params.frequency_penalty, presence_penalty=params.presence_penalty)
        if params.logit_bias:
            sp["logit_bias"] = {str(t): b for t, b in params.logit_bias.items()}
        if params.json_suffix or params.json_calls:  # SGLang's own constrained decoding (written for its API,
            from engines.inference.grammar import ebnf  # not run here)

            sp["ebnf"] = ebnf(params.json_schema, params.json_suffix, params.json_calls)
        elif params.json_schema:
            sp["json_schema"] = params.json_schema
        top_k = {"top_logprobs_num": params.top_logprobs} if params.top_logprobs else {}
        self._in_flight += 1
        try:
            out = await self._engine.async_generate(input_ids=list(prompt_ids), sampling_params=sp,
                                                    return_logprob=True, rid=request_id, **top_k)
        finally:
            self._in_flight -= 1
        meta = out["meta_info"]
        triples = meta.get("output_token_logprobs") or []
        ids = [int(t[1]) for t in triples]
        lps = [float(t[0]) for t in triples]
        output_ids = out.get("output_ids")
        if output_ids is not None and list(output_ids) != ids:
            raise RuntimeError(f"SGLang returned {len(output_ids)} output ids but logprobs for {len(ids)} "
                               f"(or for other tokens) in request {request_id}")
        finish = meta.get("finish_reason") or {}
        kind = finish.get("type", "") if isinstance(finish, dict) else str(finish)
        cached = int(meta.get("cached_tokens", 0) or 0)
        self._stats.prompt_tokens += len(prompt_ids)
        self._stats.cached_prompt_tokens += cached
        self._stats.generated_tokens += len(ids)
        top = None
        if params.top_logprobs:  # per position [(logprob, token_id, text), ...], most likely first
            steps = meta.get("output_top_logprobs") or []
            if len(steps) != len(ids):
                raise RuntimeError(f"SGLang returned top logprobs for {len(steps)} of {len(ids)} tokens in "
                                   f"request {request_id}")
            top = ([[int(e[1]) for e in step[:params.top_logprobs]] for step in steps],
                   [[float(e[0]) for e in step[:params.top_logprobs]] for step in steps])
        return GenerateOutput(ids, lps, _FINISH.get(kind, "abort"), cached, top_ids=top and top[0],
                              top_logprobs=top and top[1])

    async def abort(self, request_id: str) -> None:
        """Abort by our id (used as SGLang's rid); its generate() returns with 'abort'."""
        self._engine.tokenizer_manager.abort_request(rid=request_id)

    async def update_weights(self, weights: Iterable[tuple[str, Any]]) -> None:
        """Load one bucket of HF-named tensors in place (one serialized copy per TP rank)."""
        from sglang.srt.managers.io_struct import UpdateWeightsFromTensorReqInput
        from sglang.srt.utils import MultiprocessingSerializer

        named = list(weights)
        if not named:
            return
        req = UpdateWeightsFromTensorReqInput(
            serialized_named_tensors=[MultiprocessingSerializer.serialize(named) for _ in range(self.tp_size)],
            load_format=None, flush_cache=False)
        ok, message = await self._engine.tokenizer_manager.update_weights_from_tensor(req, None)
        if not ok:
            raise RuntimeError(f"SGLang refused a weight bucket of {len(named)} tensors "
                               f"(first {named[0][0]!r}): {message}")

    async def finish_weight_update(self) -> None:
        """Every bucket is already loaded; drop radix-cache KV computed with the old weights."""
        result = await self._engine.tokenizer_manager.flush_cache()
        if not getattr(result, "success", True):
            raise RuntimeError(f"SGLang could not flush its cache after a weight update: {result}")

    async def sleep(self, level: int = 1) -> None:
        """Release KV cache and weights from GPU memory (needs enable_memory_saver, set by default).

        Both levels release everything: SGLang keeps no host copy of the weights unless it was
        started with enable_weights_cpu_backup=True (where the version has it), so without it
        level 1 acts like level 2 and the next weight update must send the whole model (the
        trainer does).
        """
        from sglang.srt.managers.io_struct import ReleaseMemoryOccupationReqInput

        check_sleep_level(level)
        await self._engine.tokenizer_manager.release_memory_occupation(ReleaseMemoryOccupationReqInput(), None)
        self._sleeping = True

    async def wake(self) -> None:
        from sglang.srt.managers.io_struct import ResumeMemoryOccupationReqInput

        await self._engine.tokenizer_manager.resume_memory_occupation(ResumeMemoryOccupationReqInput(), None)
        self._sleeping = False

    def stats(self) -> EngineStats:
        """Requests handed to SGLang and not yet returned; it schedules them internally."""
        self._stats.running = self._in_flight
        self._stats.waiting = 0
        self._stats.sleeping = self._sleeping
        return self._stats

    async def close(self) -> None:
        """Kill SGLang's child processes; safe to call twice."""
        if self._engine is not None:
            self._engine.shutdown()
            self._engine = None
