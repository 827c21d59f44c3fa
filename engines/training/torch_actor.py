"""The plain-torch actor: a transformers causal LM on CPU or one GPU per rank, data parallel with
DDP (gloo on CPU, NCCL on GPUs) when torchrun starts more than one rank.

The PPO loop, SFT step and metrics are `ActorBase`'s; this file only says how micro-batches go
forward and backward under DDP: gradients are synchronised on the last micro-batch of a
mini-batch only (`no_sync` before it), and each loss is multiplied by the world size so DDP's
gradient average becomes the sum the global-denominator losses need.
"""

from __future__ import annotations

import re
from contextlib import nullcontext
from pathlib import Path
from typing import Any, Iterator

import torch
from tqdm import tqdm

from engines.training.actor import ActorBase, LossFn, dist_info
from engines.training.batch import MicroBatch
from engines.training.config import ActorConfig
from engines.training.hf_model import default_device, load_causal_lm, micro_logprobs


class TorchActor(ActorBase):
    def __init__(self, cfg: ActorConfig, model: str, dtype: str = "float32", temperature: float = 1.0,
                 seed: int = 0, progress: bool = True, device: torch.device | None = None) -> None:
        if cfg.backend != "torch":
            raise ValueError(f"TorchActor got actor.backend={cfg.backend!r}; use MegatronActor for 'megatron'")
        super().__init__(cfg, model, dtype, temperature, seed, progress)
        self.rank, self.world = dist_info()
        self.dp_rank, self.dp_size = self.rank, self.world
        self.device = device or default_device()
        torch.manual_seed(seed)
        self.module = load_causal_lm(model, torch.float32, self.device)
        if cfg.gradient_checkpointing:
            self.module.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self.params = self._select_trainable(list(cfg.trainable))
        self.model: torch.nn.Module = self.module
        if self.world > 1:
            from torch.nn.parallel import DistributedDataParallel

            self.model = DistributedDataParallel(self.module, device_ids=[self.device] if self.device.type == "cuda"
                                                 else None)
        self.optimizer = torch.optim.AdamW(self.params, lr=cfg.lr, weight_decay=cfg.weight_decay)

    def _select_trainable(self, patterns: list[str]) -> list[torch.nn.Parameter]:
        named = list(self.module.named_parameters())
        if not patterns:
            return [p for _, p in named]
        regexes = [re.compile(p) for p in patterns]
        keep = []
        for name, p in named:
            p.requires_grad_(any(rx.search(name) for rx in regexes))
            if p.requires_grad:
                keep.append(p)
        if not keep:
            raise ValueError(f"actor.trainable={patterns} matches no parameter; names look like "
                             f"{[n for n, _ in named[:3]]}")
        return keep

    # ------------------------------------------------------------------ the backend hooks
    def _set_train(self, mode: bool) -> None:
        self.module.train(mode)

    def _forward_backward(self, micro: list[MicroBatch], want_entropy: bool, temperature: float, loss_fn: LossFn,
                          bar: tqdm) -> None:
        for j, mb in enumerate(micro):
            sync = j == len(micro) - 1 or self.world == 1
            with nullcontext() if sync else self.model.no_sync():
                with self._autocast():
                    lp, ent = micro_logprobs(self.model, mb.to(self.device), temperature, want_entropy)
                (loss_fn(mb, lp, ent) * self.world).backward()
            bar.update(1)

    def _forward_logprobs(self, micro: list[MicroBatch], bar: tqdm) -> list[tuple[torch.Tensor, torch.Tensor]]:
        out = []
        for mb in micro:
            with self._autocast():
                lp, ent = micro_logprobs(self.module, mb.to(self.device), self.temperature, True)
            assert ent is not None
            out.append((lp.float().cpu(), ent.float().cpu()))
            bar.update(1)
        return out

    def _step_optimizer(self) -> float:
        norm = torch.nn.utils.clip_grad_norm_(self.params, self.cfg.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(norm)

    # ------------------------------------------------------------------ weights and state
    def named_hf_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """HF checkpoint names, each storage once (a tied lm_head is its embedding), in the
        compute dtype. Only rank 0 yields anything: every rank holds the same replica."""
        if self.rank != 0:
            return
        seen: set[int] = set()
        for name, t in self.module.state_dict().items():
            ptr = t.untyped_storage().data_ptr()
            if ptr in seen:
                continue
            seen.add(ptr)
            yield name, t.detach().to(self.compute_dtype)

    def state_dict(self) -> dict[str, Any]:
        return {"model": self.module.state_dict(), **self._counters()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.module.load_state_dict(state["model"])
        self._load_counters(state)

    def save_hf(self, path: Path) -> None:
        """safetensors + config + tokenizer, in the compute dtype; rank 0 writes."""
        if self.rank != 0:
            return
        from transformers import AutoTokenizer

        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        self.module.to(self.compute_dtype).save_pretrained(path, safe_serialization=True)
        self.module.to(torch.float32)
        AutoTokenizer.from_pretrained(self.model_path).save_pretrained(path)
