"""Optimizer state sharded over the data-parallel ranks (ZeRO stage 1, the idea of Megatron's
distributed optimizer), for backends whose optimizer megatron-core cannot build on CPU.

Every parameter is cut into DP equal contiguous ranges of its flattened elements; each rank keeps
AdamW's two fp32 moments for its range only, steps that range from the matching range of the
(already DP-summed) gradient and all-gathers the ranges back into the whole parameter. So the
moments' 8 bytes per parameter fall to 8/DP on every rank, exactly balanced whatever the tensor
sizes, and the result equals replicated AdamW. fp32 parameters are their own master weights (the
range is stepped in place); a lower-precision parameter gets an fp32 master copy of its range
(4/DP bytes more).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist

from engines.training.actor import adamw


class ShardedAdamW:
    """`optimizer` is a plain AdamW over this rank's master ranges (its state_dict is this rank's
    shard); `step()` replaces `optimizer.step()` for the whole model."""

    def __init__(self, params: list[torch.nn.Parameter], dp_rank: int, dp_size: int, group: Any, lr: float,
                 weight_decay: float) -> None:
        self.params, self.dp_rank, self.dp_size, self.group = params, dp_rank, dp_size, group
        self.ranges: list[tuple[int, int, int]] = []  # (start, end, elements per rank) of each parameter
        masters = []
        for p in params:
            n = p.numel()
            per = math.ceil(n / dp_size)
            start, end = min(n, dp_rank * per), min(n, (dp_rank + 1) * per)
            self.ranges.append((start, end, per))
            flat = p.detach().reshape(-1)
            # fp32 parameters are their own master: step a view of this rank's range in place;
            # lower-precision ones get an fp32 master copy of the range
            exact = p.dtype == torch.float32 and p.is_contiguous()
            masters.append(torch.nn.Parameter(flat[start:end] if exact else flat[start:end].float().clone()))
        self.masters = masters
        self.optimizer = adamw(masters, lr, weight_decay)

    def refresh(self) -> None:
        """Re-take the master ranges from the parameters (after loading a checkpoint's weights)."""
        with torch.no_grad():
            for p, m, (start, end, _) in zip(self.params, self.masters, self.ranges):
                m.copy_(p.detach().reshape(-1)[start:end])

    def _copies(self) -> list[int]:
        """Indices of the masters that are fp32 copies rather than views of their parameter."""
        return [i for i, (m, p) in enumerate(zip(self.masters, self.params))
                if m.untyped_storage().data_ptr() != p.untyped_storage().data_ptr()]

    def master_state(self) -> dict[int, torch.Tensor]:
        """This rank's fp32 master ranges that are copies (of lower-precision parameters), for a
        checkpoint: rounding them to the parameters' dtype would lose what the updates added."""
        return {i: self.masters[i].detach().clone() for i in self._copies()}

    def load_master_state(self, masters: dict[int, torch.Tensor]) -> None:
        if sorted(masters) != self._copies():
            raise ValueError("checkpoint's fp32 main weights do not match this actor's parameters; resume with the same "
                             "actor.param_dtype, actor.sharding and number of processes")
        with torch.no_grad():
            for i, saved in masters.items():
                self.masters[i].copy_(saved)

    @torch.no_grad()
    def step(self, grads: list[torch.Tensor] | None = None) -> None:
        """Step from `grads` (one per parameter, already summed over DP; default: `p.grad`)."""
        for p, m, g, (start, end, _) in zip(self.params, self.masters, grads or [p.grad for p in self.params],
                                            self.ranges):
            m.grad = g.reshape(-1)[start:end].float()
        self.optimizer.step()
        for p, m, (start, end, per) in zip(self.params, self.masters, self.ranges):
            if self.dp_size == 1:  # the whole parameter is this rank's range
                p.copy_(m.detach().view_as(p))
                m.grad = None
                continue
            mine = torch.zeros(per, dtype=p.dtype, device=p.device)
            mine[:end - start] = m.detach()
            parts = [torch.empty_like(mine) for _ in range(self.dp_size)]
            dist.all_gather(parts, mine, group=self.group)
            p.copy_(torch.cat(parts)[:p.numel()].view_as(p))
            m.grad = None

    def state_bytes(self) -> int:
        """Bytes this rank holds beyond the model's own parameters: moments and master copies."""
        own = sum(self.masters[i].numel() * self.masters[i].element_size() for i in self._copies())
        return own + sum(t.numel() * t.element_size() for s in self.optimizer.state.values() for t in s.values()
                         if isinstance(t, torch.Tensor))
