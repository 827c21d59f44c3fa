"""The frozen reference policy by config name: "torch" (a replica per rank) or "deepspeed"
(ZeRO-3, partitioned over the ranks: `engines/training/deepspeed_ref.py`). Either scores each
rank's share of rows and gathers them, so every rank gets [B, R] reference logprobs. With a LoRA
actor the reference is the actor itself with its adapter switched off (`AdapterOffReference`):
the frozen base it trains on is the starting policy, so no second copy is loaded."""

from __future__ import annotations

from typing import Any

import torch

from engines.training.actor import dist_info, gather_rows
from engines.training.batch import Batch
from engines.training.config import compute_dtype
from engines.training.hf_model import default_device, load_causal_lm, response_logprobs

REFERENCES = ("torch", "deepspeed")


class TorchReference:
    """The frozen starting policy, one replica per rank, each computing its share of rows."""

    def __init__(self, model: str, dtype: str = "float32", temperature: float = 1.0, micro_batch_size: int = 8,
                 device: torch.device | None = None) -> None:
        self.rank, self.world = dist_info()
        self.device = device or default_device()
        self.temperature = temperature
        self.micro_batch_size = micro_batch_size
        self.module = load_causal_lm(model, compute_dtype(dtype), self.device).eval().requires_grad_(False)

    @torch.no_grad()
    def compute_logprobs(self, batch: Batch) -> torch.Tensor:
        rows = torch.arange(len(batch))
        local = rows if batch.is_shard else torch.tensor_split(rows, self.world)[self.rank]
        out = [response_logprobs(self.module, batch, mb, self.temperature, self.device)
               for mb in local.split(self.micro_batch_size)]
        lp = torch.cat(out) if out else torch.zeros(0, batch.responses.shape[1])
        return lp if batch.is_shard else gather_rows(lp, len(batch), self.world)


class AdapterOffReference:
    """The starting policy of a LoRA actor: its own frozen base, scored with the adapter off."""

    def __init__(self, actor: Any) -> None:
        self.actor = actor

    def compute_logprobs(self, batch: Batch) -> torch.Tensor:
        with self.actor.adapters_off():
            return self.actor.compute_logprobs(batch)[0]


def make_reference(backend: str, model: str, dtype: str = "float32", temperature: float = 1.0,
                   micro_batch_size: int = 8) -> Any:
    if backend == "torch":
        return TorchReference(model, dtype, temperature, micro_batch_size)
    if backend == "deepspeed":
        from engines.training.deepspeed_ref import DeepSpeedReference

        return DeepSpeedReference(model, dtype, temperature, micro_batch_size)
    raise ValueError(f"reference.backend={backend!r}; choose one of {list(REFERENCES)}")
