"""A scalar reward model served on the bus: transformers' AutoModelForSequenceClassification.

generate() scores its whole prompt (the conversation to judge, already tokenized) and answers
with no tokens, finish_reason "stop" and the model's score (`GenerateOutput.score`, `Result.score`
on the wire). It is not a policy: never a rollout engine and never weight-synced.

How it runs: every generate() call queues a request; one scheduler coroutine takes whatever is
waiting (up to max_batch_size rows and max_batch_tokens padded tokens) and scores it in one
forward on a worker thread, so the asyncio loop keeps answering health and load meanwhile;
requests that arrive during a forward make up the next batch.

Padding: rows are right-padded with the model's pad_token_id under an attention mask. transformers
pools each row at its rightmost token that is not pad_token_id, so right padding reads each row at
its last real token, positions need no correction (each row starts at 0) and causal attention never
lets a real token see the padding: a row scores exactly as the same prompt alone, unpadded. (A
prompt that itself ends in pad_token_id is pooled at its last other token, as transformers does for
it alone.) A model whose config has no pad_token_id cannot be pooled in a batch by transformers, so
it is scored one request per forward.
"""

from __future__ import annotations

import asyncio
import logging
import math
from dataclasses import dataclass
from typing import Any, Iterable

import torch

from engines.inference.base import GenerateOutput, SamplingParams, check_sleep_level, id_list
from engines.inference.queued import QueuedEngine
from engines.models import resolve_model

log = logging.getLogger("switchyard.hf_reward")
NO_WEIGHT_UPDATES = ("HFRewardEngine serves a reward model, which takes no weight updates: it scores with the "
                     "checkpoint it was started on. Do not route weight sync to it (a new reward model is a new "
                     "engine started on the new checkpoint)")


@dataclass(eq=False)
class _Request:
    request_id: str
    prompt_ids: list[int]
    future: asyncio.Future
    aborted: bool = False  # set on the loop thread; the row's score is dropped when its forward ends


class HFRewardEngine(QueuedEngine):
    """Engine protocol on a transformers sequence-classification model with one output (num_labels=1).

    `params` (sampling) are accepted and ignored: scoring samples nothing. stats() counts prompt
    tokens scored; generated_tokens stays 0 and kv_cache_usage is the fraction of batch rows in use.
    """

    takes_images = False

    def __init__(self, model: str, device: str = "cpu", dtype: str = "float32", max_batch_size: int = 64,
                 max_batch_tokens: int = 65536, seed: int = 0) -> None:
        super().__init__(model, device, dtype, max_batch_size, seed, "hf-reward")  # the seed: unused (scoring is exact)
        if max_batch_tokens < 1:
            raise ValueError(f"max_batch_tokens={max_batch_tokens} must be >= 1")
        self.max_batch_tokens = max_batch_tokens
        self.model: Any = None
        self.pad_token_id: int | None = None
        self.vocab_size = 0
        self.max_model_len = 0
        self._awake = asyncio.Event()
        self._awake.set()

    # ------------------------------------------------------------------ protocol

    async def generate(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> GenerateOutput:
        """Score the whole prompt; the answer has no tokens and the score in `score`."""
        if not self._admit(request_id):
            return GenerateOutput([], [], "abort")
        prompt_ids = id_list(prompt_ids)
        self._check_prompt(prompt_ids)
        req = _Request(request_id, prompt_ids, asyncio.get_running_loop().create_future())
        self._stats.prompt_tokens += len(prompt_ids)
        return await self._queued(req, self._drop_pending)

    async def abort(self, request_id: str) -> None:
        req = self._abort_target(request_id)
        if req is None:  # not arrived yet (or already done): its generate() returns at once
            return
        req.aborted = True
        if self._drop_pending(req) and not req.future.done():
            req.future.set_result(GenerateOutput([], [], "abort"))

    async def update_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        raise RuntimeError(NO_WEIGHT_UPDATES)

    async def finish_weight_update(self) -> None:
        """Nothing is ever staged, so there is nothing to apply: the weights stay the checkpoint's."""

    async def sleep(self, level: int = 1) -> None:
        """Level 1: stop scoring; on CUDA the weights move to host memory. Level 2 is refused: it
        discards the weights until the next weight update, and a reward model never gets one."""
        check_sleep_level(level)
        if level == 2:
            raise ValueError("sleep level 2 discards the weights until the next weight update, and a reward model "
                             "takes none (it would never score again); use level 1")
        self._stats.sleeping = True
        self._awake.clear()
        if self.device.type == "cuda":
            await asyncio.get_running_loop().run_in_executor(self._pool, self._park)

    async def wake(self) -> None:
        if self.device.type == "cuda" and self.model is not None:
            await asyncio.get_running_loop().run_in_executor(self._pool, self.model.to, self.device)
        self._stats.sleeping = False
        self._awake.set()

    # ------------------------------------------------------------------ loop side

    def _check_prompt(self, prompt_ids: list[int]) -> None:
        """Bad prompts fail here, alone, instead of failing the batch they would join."""
        if not prompt_ids:
            raise ValueError("prompt_ids is empty; a conversation to score needs at least one token")
        if len(prompt_ids) > self.max_model_len:
            raise ValueError(f"prompt of {len(prompt_ids)} tokens does not fit the reward model's context of "
                             f"{self.max_model_len}; shorten it")
        if len(prompt_ids) > self.max_batch_tokens:
            raise ValueError(f"prompt of {len(prompt_ids)} tokens exceeds max_batch_tokens={self.max_batch_tokens}; "
                             "raise that option or shorten the prompt")
        bad = [t for t in prompt_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {self.vocab_size})")

    def _drop_pending(self, req: _Request) -> bool:
        """Forget a request that has not reached a forward yet; False if it is in one (or done)."""
        if req in self._pending:
            self._pending.remove(req)
            self._live.pop(req.request_id, None)
            return True
        return False

    def _take_batch(self) -> list[_Request]:
        """The oldest waiting requests that fit max_batch_size rows and max_batch_tokens padded tokens."""
        rows = 1 if self.pad_token_id is None else self.max_batch_size
        batch: list[_Request] = []
        width = 0
        while self._pending and len(batch) < rows:
            w = max(width, len(self._pending[0].prompt_ids))
            if batch and w * (len(batch) + 1) > self.max_batch_tokens:
                break
            batch.append(self._pending.popleft())
            width = w
        return batch

    async def _schedule(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await self._awake.wait()
            if not self._pending:
                self._has_work.clear()
                await self._has_work.wait()
                continue
            batch = self._take_batch()
            self._running = len(batch)
            try:
                scores = await loop.run_in_executor(self._pool, self._score, [r.prompt_ids for r in batch])
            except Exception as e:  # a failed forward fails its requests, never the engine
                log.warning("scoring a batch of %d failed: %s", len(batch), e)
                scores = [e] * len(batch)
            finally:
                self._running = 0
            for req, score in zip(batch, scores):
                self._live.pop(req.request_id, None)
                if req.future.done():
                    continue
                if req.aborted:
                    req.future.set_result(GenerateOutput([], [], "abort"))
                elif isinstance(score, Exception):
                    req.future.set_exception(score)
                elif not math.isfinite(score):
                    req.future.set_exception(ValueError(f"the reward model scored {req.request_id!r} as {score}; its "
                                                        f"weights or dtype ({self.dtype}) are broken for this input"))
                else:
                    req.future.set_result(GenerateOutput([], [], "stop", score=score))

    # ------------------------------------------------------------------ worker thread

    def _load(self) -> None:
        from transformers import AutoModelForSequenceClassification

        path = resolve_model(self.model_name)
        model, info = AutoModelForSequenceClassification.from_pretrained(path, dtype=self.dtype,
                                                                         output_loading_info=True)
        if info.get("missing_keys"):  # e.g. a causal LM checkpoint: the score head would be random
            raise ValueError(f"{path} is not a reward model checkpoint: {sorted(info['missing_keys'])[:5]} were not "
                             f"in it (a sequence-classification head trained with num_labels=1 is needed)")
        if model.config.num_labels != 1:
            raise ValueError(f"{path} classifies into {model.config.num_labels} labels; a reward model has one "
                             f"output (num_labels=1)")
        self.model = model.to(self.device).eval()
        text = model.config.get_text_config()
        self.pad_token_id = text.pad_token_id
        self.vocab_size = int(text.vocab_size)
        self.max_model_len = int(getattr(text, "max_position_embeddings", 1 << 30))
        if self.pad_token_id is None:
            log.warning("%s has no pad_token_id in its config; scoring one request per forward", path)

    @torch.inference_mode()
    def _score(self, prompts: list[list[int]]) -> list[float]:
        """One forward over the right-padded prompts; the model pools each row at its last real token."""
        width = max(len(p) for p in prompts)
        fill = 0 if self.pad_token_id is None else self.pad_token_id  # no pad: one row, nothing is padded
        ids = torch.full((len(prompts), width), fill, dtype=torch.long)
        mask = torch.zeros(len(prompts), width, dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, :len(p)] = torch.tensor(p)
            mask[i, :len(p)] = 1
        out = self.model(input_ids=ids.to(self.device), attention_mask=mask.to(self.device), use_cache=False)
        return out.logits[:, 0].float().tolist()

    def _park(self) -> None:
        self.model.to("cpu")
        torch.cuda.empty_cache()
