"""The learning half of one RL step, top to bottom: rewards -> reference and old logprobs ->
advantages -> the actor's update. `launch/train.py` calls `learn` once per step with the batch
rollout produced; everything here runs on every rank (each actor takes its share of rows).
"""

from __future__ import annotations

import time
from typing import Any

import torch

from engines.training.batch import Batch
from engines.training.config import ActorConfig
from engines.training.losses import kl_penalty
from engines.training.advantages import ESTIMATORS, compute_advantages


def _over_ranks(sums: list[float], top: float, shard: bool) -> tuple[list[float], float]:
    """Sums and a maximum over every rank when each holds a shard of the batch (replicas of one
    shard count alike in numerator and denominator, so means are unaffected)."""
    if not shard or not torch.distributed.is_initialized():
        return sums, top
    t, m = torch.tensor(sums, dtype=torch.float64), torch.tensor([top], dtype=torch.float64)
    torch.distributed.all_reduce(t)
    torch.distributed.all_reduce(m, op=torch.distributed.ReduceOp.MAX)
    return t.tolist(), float(m[0])


def drift(rollout_logprobs: torch.Tensor, actor_logprobs: torch.Tensor, mask: torch.Tensor,
          shard: bool = False) -> dict[str, float]:
    """|rollout - actor| logprob gap over trained tokens: how far the engine and the trainer
    disagree about the policy (dtype, a missed weight sync, top-p)."""
    diff = (rollout_logprobs - actor_logprobs).abs() * mask
    (total, count), top = _over_ranks([float(diff.sum()), float(mask.sum())],
                                      float(diff.max()) if diff.numel() else 0.0, shard)
    return {"drift/mean": total / max(count, 1.0), "drift/max": top}


def learn(batch: Batch, actor: Any, ref: Any, algorithm: Any, actor_cfg: ActorConfig) -> dict[str, Any]:
    """One PPO/GRPO update from `batch`; `algorithm` is the run's `AlgorithmConfig`. Returns the
    step's metrics (actor/*, drift/*, kl_in_reward, time/update_s)."""
    loss = algorithm.loss
    mask = batch.loss_mask.float()

    # 1. rewards: a failed trajectory (loop or engine error, not model behaviour) scores 0
    rewards = batch.rewards.clone() * batch.valid

    # 2. reference and old logprobs. On-policy (one epoch over one mini-batch, no KL in the
    #    reward) the update's own forward gives the old logprobs, saving a whole pass
    ref_lp = ref.compute_logprobs(batch) if ref is not None else None
    kl_in_reward = ref_lp is not None and not loss.use_kl_loss
    on_policy = actor_cfg.on_policy(batch.total_rows) and not kl_in_reward
    old_lp = None if on_policy else actor.compute_logprobs(batch)[0]
    metrics: dict[str, Any] = {"kl_in_reward": 0.0}
    if old_lp is not None:
        metrics.update(drift(batch.rollout_logprobs, old_lp, mask, batch.is_shard))
    if kl_in_reward:  # KL to the reference as a per-sequence reward penalty
        kl = (kl_penalty(old_lp, ref_lp, "k1") * mask).sum(1)
        rewards = rewards - loss.kl_coef * kl
        (kl_sum, rows), _ = _over_ranks([float(kl.sum()), float(len(kl))], 0.0, batch.is_shard)
        metrics["kl_in_reward"] = kl_sum / max(rows, 1.0)

    # 3. advantages; invalid rows are groups of their own (advantage 0, no effect on siblings)
    estimator = ESTIMATORS[algorithm.advantage]
    kwargs = {name: getattr(algorithm, name) for name in estimator.options}
    kwargs.update({name: getattr(batch, name) for name in estimator.batch_fields})
    adv = compute_advantages(algorithm.advantage, rewards, mask, group_index=batch.group_index,
                             valid=batch.valid, **kwargs)

    # 4. the update
    t0 = time.perf_counter()
    upd = actor.update(batch, adv, old_lp, ref_lp, loss)
    metrics["time/update_s"] = time.perf_counter() - t0
    if on_policy:
        metrics.update({"drift/mean": upd.pop("drift_mean"), "drift/max": upd.pop("drift_max")})
    metrics.update({f"actor/{k}": v for k, v in upd.items()})
    return metrics
