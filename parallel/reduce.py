"""Numbers every rank holds, summed and maximised over the ranks: the one way per-rank metrics (a
shard's token counts, logprob gaps, invalid trajectories) become the run's."""

from __future__ import annotations

from typing import Any, Sequence


def over_ranks(sums: Sequence[float], maxima: Sequence[float] = (), group: Any = None,
               shard: bool = True) -> tuple[list[float], list[float]]:
    """`sums` summed and `maxima` maximised over the ranks of `group` (every rank by default), in
    float64; as given when torch.distributed does not run or runs one rank, or when each rank holds
    the whole batch, not a `shard` of it (its figures are the run's already). Every rank of the
    group must call it with lists of the same lengths. Where each rank holds a shard and replicas of
    one shard count alike in numerator and denominator, means taken of the sums are unaffected."""
    import torch
    import torch.distributed as dist

    if not shard or not dist.is_available() or not dist.is_initialized() or dist.get_world_size(group) == 1:
        return [float(x) for x in sums], [float(x) for x in maxima]
    total = torch.tensor([float(x) for x in sums], dtype=torch.float64)
    top = torch.tensor([float(x) for x in maxima], dtype=torch.float64)
    if len(total):
        dist.all_reduce(total, group=group)
    if len(top):
        dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
    return total.tolist(), top.tolist()


def on_every_rank(ok: bool, group: Any = None) -> bool:
    """True when every rank of `group` (every rank by default) passed True (each calls it): a
    decision all ranks take alike."""
    failed, _ = over_ranks([0.0 if ok else 1.0], group=group)
    return failed[0] == 0


def most_over_ranks(n: int) -> int:
    """The largest `n` any rank has: how many passes every rank must make when the passes hold
    collectives (FSDP's gathers, ZeRO-3's), whatever its own share of rows."""
    _, (most,) = over_ranks([], [float(n)])
    return int(most)
