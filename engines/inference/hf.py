"""A transformers engine with continuous batching: the CPU default and the tests' real model.

It exists so that everything above the Engine protocol (server, router, agent loops, the RL
step) runs end to end on a laptop with a real model, real tokens and real logprobs. It is
not fast; it is exact: logprobs are computed in float32 the way the actor recomputes them.

How it runs: every generate() call queues a request; one scheduler coroutine loops while
there is work, and each iteration does one compute step in a single worker thread (so the
asyncio loop keeps answering health and load messages): one decode token for every running
row, plus a prefill for newly admitted requests, which then join the running batch. All rows
share one left-padded DynamicCache; rows are merged into it on admission and cut out of it
when they finish, so a long generation never holds up new requests. Sampling (logit_bias, penalties,
which distribution the logprobs and top_logprobs are of) is engines/inference/sampling.py's.

Sleep gives a colocated trainer the memory back: level 1 parks CUDA weights in host RAM, level 2
frees every parameter's storage (and trims the heap, so the RSS really falls).
"""

from __future__ import annotations

import asyncio
import collections
import ctypes
from dataclasses import dataclass, field
from typing import Any, Callable, Collection, Iterable

import torch
import torch.nn.functional as F

from engines.inference.base import GenerateOutput, SamplingParams, check_sleep_level, id_list
from engines.inference.queued import QueuedEngine
from engines.inference.grammar import Grammars
from engines.inference.sampling import check_vocab, sample
from engines.lora import HookedAdapter
from engines.models import image_token_layout, is_vision_language, load_pretrained, load_tokenizer, resolve_model

PREFIX_BLOCK = 16  # tokens per block of the modelled prefix cache (vLLM's default block size)
PREFIX_LRU_ENTRIES = 100_000


@dataclass(eq=False)
class _Request:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    future: asyncio.Future
    generator: torch.Generator | None
    cached_prompt_tokens: int
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top: list[tuple[list[int], list[float]]] = field(default_factory=list)  # per token, with top_logprobs
    finish_reason: str | None = None
    pixel_values: torch.Tensor | None = None  # [n, C, H, W]: the images behind the prompt's image tokens
    aborted: bool = False  # set on the loop thread, read by the worker between steps
    matcher: Any = None  # the grammar matcher of a `json_schema` request (engines/inference/grammar.py)

    def output(self) -> GenerateOutput:
        k = self.params.top_logprobs
        return GenerateOutput(list(self.token_ids), list(self.logprobs), self.finish_reason or "abort",
                              self.cached_prompt_tokens, top_ids=[t[0] for t in self.top] if k else None,
                              top_logprobs=[t[1] for t in self.top] if k else None)


@dataclass
class _Batch:
    """Running rows and their shared KV cache, right-aligned: column -1 is every row's newest token.

    `last` is each row's most recent sampled token, not yet in the cache; `positions` is the
    position it will be fed at. Only the worker thread touches a batch.
    """

    rows: list[_Request]
    cache: Any  # transformers DynamicCache
    mask: torch.Tensor  # [B, T] 1 = real token, 0 = left padding
    positions: torch.Tensor  # [B]
    last: torch.Tensor  # [B]


class HFEngine(QueuedEngine):
    """Engine protocol on a transformers causal LM (any model AutoModelForCausalLM loads).

    stats().cached_prompt_tokens models what a prefix cache would hit, it does not skip any
    compute: an LRU of hashes of every 16-token block prefix of the prompts seen so far, and a
    prompt counts its leading blocks found there. The router's affinity benchmarks read it.

    `weights_valid` is False from a level-2 sleep until the next finish_weight_update(); until
    then the parameters hold undefined values and generate() refuses to run on them.
    """

    def __init__(self, model: str, device: str = "cpu", dtype: str = "float32", max_batch_size: int = 64,
                 seed: int = 0) -> None:
        super().__init__(model, device, dtype, max_batch_size, seed, "hf-engine")
        self.model: Any = None
        self.weights_valid = True
        self._weights_freed = False  # parameters are meta tensors (level-2 sleep, not woken yet)
        self.eos_ids: set[int] = set()
        self.max_model_len = 0
        self.takes_images = False  # a vision-language model (LLaVA-style): generate() takes pixel_values
        self._image_token: int | None = None
        self._tokens_per_image = 0
        self.adapter: HookedAdapter | None = None  # a LoRA adapter pushed as weights (engines/lora.py)
        self._prefix_lru: collections.OrderedDict[int, None] = collections.OrderedDict()
        self._batch: _Batch | None = None
        self._generator = torch.Generator(device=self.device).manual_seed(seed)
        self._runnable = asyncio.Event()  # awake and weights valid: the scheduler may step
        self._runnable.set()

    # ------------------------------------------------------------------ protocol

    async def generate(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                       pixel_values: Any = None) -> GenerateOutput:
        """Queue one request and wait for its row to finish; bad prompts fail here, not mid-batch.
        `pixel_values` ([n, C, H, W]) are the images of a vision-language model's image tokens."""
        if not self._admit(request_id):
            return GenerateOutput([], [], "abort")
        if not self.weights_valid:
            raise RuntimeError(f"HFEngine({self.model_name!r}) discarded its weights in sleep(level=2) and no "
                               f"weight update was committed since; wake(), send every tensor with "
                               f"update_weights() and call finish_weight_update() before generating")
        prompt_ids = id_list(prompt_ids)
        self._check_prompt(prompt_ids)
        check_vocab(params, self.model.config.get_text_config().vocab_size)
        pixels = self._check_images(prompt_ids, pixel_values)
        matcher = None
        if params.json_schema:  # compiled off the event loop (the first time a schema comes, ~1 s)
            matcher = await asyncio.get_running_loop().run_in_executor(None, self._grammars.matcher,
                                                                       params.json_schema, params.json_suffix,
                                                                       params.json_calls)
        gen = None
        if params.seed is not None and params.temperature > 0:
            gen = torch.Generator(device=self.device).manual_seed(params.seed)
        req = _Request(request_id, list(prompt_ids), params, asyncio.get_running_loop().create_future(), gen,
                       self._count_cached_prefix(prompt_ids), pixel_values=pixels, matcher=matcher)
        self._stats.prompt_tokens += len(prompt_ids)
        self._stats.cached_prompt_tokens += req.cached_prompt_tokens
        return await self._queued(req, self._resolve_pending)  # a caller gone: its row freed at the next step

    async def abort(self, request_id: str) -> None:
        req = self._abort_target(request_id)
        if req is None:  # not arrived yet (or already done): its generate() returns at once
            return
        req.aborted = True
        self._resolve_pending(req)

    async def update_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy a bucket in between two decode steps (the worker thread runs one thing at a time)."""
        items = list(weights)
        await asyncio.get_running_loop().run_in_executor(self._pool, self._load_weights, items)

    async def finish_weight_update(self) -> None:
        """Buckets are applied as they arrive (a LoRA adapter's tensors at the commit, replacing the
        adapter served before; engines/lora.py); committing then marks the weights valid again.

        Which names arrived is not tracked: after a level-2 sleep the sender must send the whole
        model (the trainer always does), or the tensors it skipped keep undefined values.
        """
        if self._weights_freed:
            raise RuntimeError(_FREED_MESSAGE)
        await asyncio.get_running_loop().run_in_executor(self._pool, self.adapter.commit)
        self.weights_valid = True
        self._set_runnable()

    async def weight_digest(self, names: Collection[str] | None = None) -> dict[str, tuple[float, float]] | None:
        """{HF name: digest} of the weights served (engines/weight_digest.py), of `names` only when given;
        None while they are freed."""
        from engines.weight_digest import digests

        if self._weights_freed:
            return None
        wanted = None if names is None else set(names)
        return await asyncio.get_running_loop().run_in_executor(self._pool, lambda: digests(
            (n, t) for n, t in self.model.state_dict().items() if wanted is None or n in wanted))

    async def sleep(self, level: int = 1) -> None:
        """Pause scheduling and give memory back; `level` as in the Engine protocol.

        Level 1: on CUDA the weights move to host memory, on CPU they stay; rows still running
        keep their KV cache and resume on wake() (the server drains them first anyway). Level 2:
        the parameters' storage is freed on any device; running rows end now with finish_reason
        'abort' and the tokens they have, since continuing them needs the discarded weights.
        Queued requests wait and run once a new version is committed.
        """
        check_sleep_level(level)
        self._stats.sleeping = True
        if level == 2:
            self.weights_valid = False
        self._set_runnable()
        ended = await asyncio.get_running_loop().run_in_executor(self._pool, self._release, level)
        self._running = len(self._batch.rows) if self._batch else 0
        for req in ended:
            self._finish(req)

    async def wake(self) -> None:
        """Take the memory back; after level 2 the parameters exist again but hold garbage."""
        await asyncio.get_running_loop().run_in_executor(self._pool, self._restore)
        self._stats.sleeping = False
        self._set_runnable()

    # ------------------------------------------------------------------ loop side

    def _check_prompt(self, prompt_ids: list[int]) -> None:
        if not prompt_ids:
            raise ValueError("prompt_ids is empty; a prompt needs at least one token")
        if len(prompt_ids) >= self.max_model_len:
            raise ValueError(f"prompt of {len(prompt_ids)} tokens does not fit the model's context of "
                             f"{self.max_model_len}; shorten it")
        vocab = self.model.config.get_text_config().vocab_size
        bad = [t for t in prompt_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {vocab})")

    def _check_images(self, prompt_ids: list[int], pixel_values: Any) -> torch.Tensor | None:
        """The request's pixel values as a tensor, after checking they match its image tokens (a
        mismatch would fail the whole batched prefill, so it fails this request here)."""
        n_tokens = prompt_ids.count(self._image_token) if self._image_token is not None else 0
        n_images = 0 if pixel_values is None else len(pixel_values)
        if pixel_values is not None and not self.takes_images:
            raise ValueError(f"{self.model_name} is a text-only model; it takes no pixel_values")
        if n_tokens != n_images * self._tokens_per_image:
            raise ValueError(f"the prompt holds {n_tokens} image tokens but {n_images} images came with it; a "
                             f"{self.model_name} image takes {self._tokens_per_image} tokens (expand each image "
                             "token, e.g. with agent.vision.Vision.expand)")
        return None if pixel_values is None else torch.as_tensor(pixel_values, dtype=self.dtype)

    def _count_cached_prefix(self, prompt_ids: list[int]) -> int:
        """Leading prompt tokens in 16-token blocks whose whole prefix was seen before (LRU)."""
        lru, h, hit, missed = self._prefix_lru, 0, 0, False
        for start in range(0, len(prompt_ids) - PREFIX_BLOCK + 1, PREFIX_BLOCK):
            h = hash((h, tuple(prompt_ids[start:start + PREFIX_BLOCK])))
            if h in lru:
                lru.move_to_end(h)
                hit += 0 if missed else PREFIX_BLOCK
            else:
                missed = True
                lru[h] = None
                if len(lru) > PREFIX_LRU_ENTRIES:
                    lru.popitem(last=False)
        return hit

    def _resolve_pending(self, req: _Request) -> None:
        """An aborted request that never reached a row returns now, with no tokens."""
        if req in self._pending:
            self._pending.remove(req)
            self._finish(req)

    def _finish(self, req: _Request) -> None:
        self._live.pop(req.request_id, None)
        if not req.future.done():
            req.future.set_result(req.output())

    def _set_runnable(self) -> None:
        if self._stats.sleeping or not self.weights_valid:
            self._runnable.clear()
        else:
            self._runnable.set()

    async def _schedule(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await self._runnable.wait()
            if not self._pending and self._batch is None:
                self._has_work.clear()
                await self._has_work.wait()
                continue
            admitted = []
            while self._pending and self._running + len(admitted) < self.max_batch_size:
                admitted.append(self._pending.popleft())
            in_flight = admitted + (self._batch.rows if self._batch else [])
            try:
                finished = await loop.run_in_executor(self._pool, self._step, admitted)
            except Exception as e:  # a failed step fails its requests, never the engine
                self._batch = None
                finished = []
                for req in in_flight:
                    self._live.pop(req.request_id, None)
                    if not req.future.done():
                        req.future.set_exception(e)
            self._running = len(self._batch.rows) if self._batch else 0
            for req in finished:
                self._finish(req)

    # ------------------------------------------------------------------ worker thread

    def _load(self) -> None:
        path = resolve_model(self.model_name)
        self.model = load_pretrained(path, self.dtype).to(self.device).eval()
        self.adapter = HookedAdapter(self.model)
        tokenizer = load_tokenizer(path)
        if is_vision_language(self.model.config):
            self.takes_images = True
            self._image_token, self._tokens_per_image = image_token_layout(self.model.config, path)
        eos = [tokenizer.eos_token_id, getattr(self.model.generation_config, "eos_token_id", None)]
        for e in eos:
            self.eos_ids.update(e if isinstance(e, list) else [] if e is None else [e])
        text_config = self.model.config.get_text_config()
        self.max_model_len = int(getattr(text_config, "max_position_embeddings", 1 << 30))
        self._grammars = Grammars(tokenizer, text_config.vocab_size, self.eos_ids)

    @torch.inference_mode()
    def _step(self, admitted: list[_Request]) -> list[_Request]:
        """One decode token for every running row, then prefill the admitted ones into the batch."""
        finished: list[_Request] = []
        b = self._batch
        if b is not None:
            live = [i for i, r in enumerate(b.rows) if not r.aborted]
            finished += [r for r in b.rows if r.aborted]
            b = _select(b, live)
            if b is not None:
                mask = torch.cat([b.mask, b.mask.new_ones(len(b.rows), 1)], dim=1)
                out = self.model(input_ids=b.last[:, None], attention_mask=mask, position_ids=b.positions[:, None],
                                 past_key_values=b.cache, use_cache=True)
                b.mask, b.positions = mask, b.positions + 1
                b = self._advance(b, out.logits[:, -1], finished)
        finished += [r for r in admitted if r.aborted]
        admitted = [r for r in admitted if not r.aborted]
        if admitted:
            new = self._advance(*self._prefill(admitted), finished)
            b = new if b is None else (b if new is None else _merge(b, new))
        self._batch = b
        return finished

    def _prefill(self, reqs: list[_Request]) -> tuple[_Batch, torch.Tensor]:
        from transformers import DynamicCache

        lengths = [len(r.prompt_ids) for r in reqs]
        width = max(lengths)
        ids = torch.zeros(len(reqs), width, dtype=torch.long)
        mask = torch.zeros(len(reqs), width, dtype=torch.long)
        for i, r in enumerate(reqs):
            ids[i, width - lengths[i]:] = torch.tensor(r.prompt_ids)
            mask[i, width - lengths[i]:] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        positions = (mask.cumsum(1) - 1).clamp(min=0)
        cache = DynamicCache(config=self.model.config)
        pixels = [r.pixel_values for r in reqs if r.pixel_values is not None]  # in row order, as the model fills them
        images = {"pixel_values": torch.cat(pixels).to(self.device)} if pixels else {}
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=positions, past_key_values=cache,
                         use_cache=True, logits_to_keep=1, **images)
        if any(getattr(layer, "is_sliding", False) for layer in cache.layers):
            raise NotImplementedError(f"{self.model_name} uses sliding-window attention, which HFEngine's "
                                      f"shared cache does not support; use the vllm backend")
        return _Batch(reqs, cache, mask, torch.tensor(lengths, device=self.device), ids[:, -1]), out.logits[:, -1]

    def _advance(self, b: _Batch, logits: torch.Tensor, finished: list[_Request]) -> _Batch | None:
        """Sample one token per row, record it, and cut the rows that are done out of the batch."""
        matchers = [r.matcher for r in b.rows]
        tokens, logprobs, tops = sample(logits.float(), [r.params for r in b.rows],
                                        [r.generator or self._generator for r in b.rows], [r.token_ids for r in b.rows],
                                        matchers if any(m is not None for m in matchers) else None)
        keep, self._stats.generated_tokens = [], self._stats.generated_tokens + len(b.rows)
        for i, (r, t, lp) in enumerate(zip(b.rows, tokens.tolist(), logprobs.tolist())):
            r.token_ids.append(t)
            r.logprobs.append(lp)
            r.top += [tops[i]] if tops[i] else []
            p = r.params
            done = r.matcher is not None and (not r.matcher.accept_token(t) or r.matcher.is_terminated())
            if (t in self.eos_ids and not p.ignore_eos) or t in p.stop_token_ids or done:
                r.finish_reason = "stop"
            elif len(r.token_ids) >= p.max_tokens or len(r.prompt_ids) + len(r.token_ids) >= self.max_model_len:
                r.finish_reason = "length"
            if r.finish_reason:
                finished.append(r)
            else:
                keep.append(i)
        b.last = tokens.to(self.device)
        return _select(b, keep)

    def _load_weights(self, items: list[tuple[str, torch.Tensor]]) -> None:
        """Check the whole bucket before copying any of it, so a bad bucket leaves the model intact."""
        if self._weights_freed:  # copy_ into a meta tensor would silently do nothing
            raise RuntimeError(_FREED_MESSAGE)
        items = self.adapter.stage(items)  # a LoRA adapter's tensors wait for the commit
        params = self.model.state_dict(keep_vars=True)
        for name, tensor in items:
            if name not in params:
                close = [n for n in params if n.split(".")[-1] == name.split(".")[-1]][:3]
                raise ValueError(f"unknown weight {name!r} for {type(self.model).__name__}; names are HF "
                                 f"state_dict names, e.g. {close or list(params)[:3]}")
            want = params[name]
            if tuple(tensor.shape) != tuple(want.shape):
                raise ValueError(f"weight {name!r} has shape {tuple(tensor.shape)}, the model expects "
                                 f"{tuple(want.shape)}; reshard it to the HF layout before sending")
            if tensor.dtype != want.dtype:
                sent, held = (str(t.dtype).removeprefix("torch.") for t in (tensor, want))
                raise ValueError(f"weight {name!r} has dtype {sent}, this engine holds {held}: the trainer sends its "
                                 f"model.dtype; set model.dtype={held} for the run, or start the engine with dtype {sent}")
        with torch.no_grad():
            for name, tensor in items:  # tied lm_head.weight is the embedding: copying either updates both
                params[name].copy_(tensor)

    def _release(self, level: int) -> list[_Request]:
        """Free what `level` gives up; returns the running rows a level-2 sleep ended.

        Only parameters are freed: non-persistent buffers (rotary inv_freq) are small and no
        weight update would bring them back."""
        ended: list[_Request] = []
        if level == 2:
            ended, self._batch = (self._batch.rows if self._batch else []), None
            if not self._weights_freed:
                _swap_parameters(self.model, lambda p: torch.empty_like(p, device="meta"))
                self._weights_freed = True
        elif self.device.type == "cuda":
            self.model.to("cpu")
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        _trim_host_heap()
        return ended

    def _restore(self) -> None:
        if self._weights_freed:
            _swap_parameters(self.model, lambda p: torch.empty_like(p, device=self.device))
            self._weights_freed = False
        self.model.to(self.device)  # level 1 on CUDA parked everything, buffers included, on the host


_FREED_MESSAGE = ("the weights were discarded by sleep(level=2) and the engine has not been woken; call "
                  "wake() first so the parameters have memory again, then send the whole model")


def _swap_parameters(model: torch.nn.Module, make: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """Replace every parameter by `make(old)`, once per distinct tensor.

    Module.to("meta") and to_empty() untie shared parameters (lm_head and the embedding); the
    memo keeps aliases one tensor, and holds the old ones so no id is reused mid-walk."""
    memo: dict[int, tuple[torch.nn.Parameter, torch.nn.Parameter]] = {}
    for module in model.modules():
        for name, old in list(module.named_parameters(recurse=False, remove_duplicate=False)):
            if id(old) not in memo:
                memo[id(old)] = (old, torch.nn.Parameter(make(old), requires_grad=old.requires_grad))
            setattr(module, name, memo[id(old)][1])


def _trim_host_heap() -> None:
    """Ask glibc to return freed heap pages to the OS; without it freed tensors can keep the RSS up."""
    try:
        trim = getattr(ctypes.CDLL(None), "malloc_trim", None)
    except OSError:
        return
    if trim is not None:  # glibc only; musl and macOS have no malloc_trim
        trim(0)


def _select(b: _Batch, keep: list[int]) -> _Batch | None:
    """Keep rows `keep` of a batch and drop the left columns no remaining row uses."""
    if not keep:
        return None
    if len(keep) == len(b.rows):
        return b
    idx = torch.tensor(keep, device=b.mask.device)
    mask = b.mask[idx]
    start = int(mask.any(dim=0).int().argmax())
    for layer in b.cache.layers:
        layer.keys, layer.values = layer.keys[idx, :, start:], layer.values[idx, :, start:]
    return _Batch([b.rows[i] for i in keep], b.cache, mask[:, start:], b.positions[idx], b.last[idx])


def _merge(a: _Batch, b: _Batch) -> _Batch:
    """Stack two batches, left-padding the shorter cache so newest tokens stay aligned."""
    width = max(a.mask.shape[1], b.mask.shape[1])
    pa, pb = width - a.mask.shape[1], width - b.mask.shape[1]
    for la, lb in zip(a.cache.layers, b.cache.layers):
        la.keys = torch.cat([F.pad(la.keys, (0, 0, pa, 0)), F.pad(lb.keys, (0, 0, pb, 0))])
        la.values = torch.cat([F.pad(la.values, (0, 0, pa, 0)), F.pad(lb.values, (0, 0, pb, 0))])
    mask = torch.cat([F.pad(a.mask, (pa, 0)), F.pad(b.mask, (pb, 0))])
    return _Batch(a.rows + b.rows, a.cache, mask, torch.cat([a.positions, b.positions]), torch.cat([a.last, b.last]))
