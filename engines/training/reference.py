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
                 device: torch.device | None = None, shared_prefix: str = "off") -> None:
        from engines.training.prefix import pair_cost

        self.rank, self.world = dist_info()
        self.device = device or default_device()
        self.temperature = temperature
        self.micro_batch_size = micro_batch_size
        self.shared_prefix = shared_prefix  # as the actor's (actor.shared_prefix)
        self.pair = pair_cost(model) if shared_prefix == "auto" else 0.0
        self.module = load_causal_lm(model, compute_dtype(dtype), self.device).eval().requires_grad_(False)
        if shared_prefix != "off":  # packed micro-batches attended by runs, as the actor's by default
            from engines.training.tree_attention import install

            install(self.module)

    @torch.no_grad()
    def compute_logprobs(self, batch: Batch) -> torch.Tensor:
        from engines.training.prefix import by_group
        from engines.training.tree_attention import by_runs

        rows = torch.arange(len(batch))
        local = rows if batch.is_shard else torch.tensor_split(rows, self.world)[self.rank]
        order = by_group(batch, local) if self.shared_prefix != "off" else local  # a group's rows together
        out = [response_logprobs(self.module, batch, mb, self.temperature, self.device, self.shared_prefix, self.pair,
                                 by_runs(self.module)) for mb in order.split(self.micro_batch_size)]
        lp = torch.cat(out) if out else torch.zeros(0, batch.responses.shape[1])
        if self.shared_prefix != "off":  # back in the order of `local`
            at = torch.empty(len(batch), dtype=torch.long)
            at[order] = torch.arange(len(order))
            lp = lp[at[local]]
        return lp if batch.is_shard else gather_rows(lp, len(batch), self.world)


class AdapterOffReference:
    """The starting policy of a LoRA actor: its own frozen base, scored with the adapter off."""

    def __init__(self, actor: Any) -> None:
        self.actor = actor

    def compute_logprobs(self, batch: Batch) -> torch.Tensor:
        with self.actor.adapters_off():
            return self.actor.compute_logprobs(batch)[0]


def make_reference(backend: str, model: str, dtype: str = "float32", temperature: float = 1.0,
                   micro_batch_size: int = 8, shared_prefix: str = "off") -> Any:
    """`shared_prefix`: the torch reference packs as the actor does; the DeepSpeed one computes unpacked."""
    if backend == "torch":
        return TorchReference(model, dtype, temperature, micro_batch_size, shared_prefix=shared_prefix)
    if backend == "deepspeed":
        from engines.training.deepspeed_ref import DeepSpeedReference

        return DeepSpeedReference(model, dtype, temperature, micro_batch_size)
    raise ValueError(f"reference.backend={backend!r}; choose one of {list(REFERENCES)}")
