"""The learning half of one RL step, top to bottom: rewards -> reference and old logprobs ->
(the critic's values) -> advantages -> the actor's update (-> the critic's update). `launch/train.py` calls `learn` once per step with the batch
rollout produced; everything here runs on every rank (each actor takes its share of rows).
"""

from __future__ import annotations

import time
from typing import Any

import torch

from engines.training.actor import drift_over_ranks, logprob_gap
from engines.training.batch import Batch
from engines.training.config import ActorConfig
from engines.training.losses import kl_penalty
from engines.training.advantages import ESTIMATORS, compute_advantages
from parallel.reduce import over_ranks


def drift(rollout_logprobs: torch.Tensor, actor_logprobs: torch.Tensor, mask: torch.Tensor,
          shard: bool = False) -> dict[str, float]:
    """The run's drift (`engines.training.actor.logprob_gap`) over trained tokens, of every rank when each
    holds a shard."""
    mean, top = drift_over_ranks(logprob_gap(rollout_logprobs, actor_logprobs, mask), shard)
    return {"drift/mean": mean, "drift/max": top}


def _masked_stats(mask: torch.Tensor, shard: bool, **tensors: torch.Tensor) -> dict[str, tuple[float, float]]:
    """(mean, variance) of each tensor over the mask-1 tokens (of every rank when `shard`)."""
    keep = mask.bool()
    sums = [float(keep.sum())]
    for t in tensors.values():
        x = t.double()[keep]
        sums += [float(x.sum()), float((x * x).sum())]
    sums, _ = over_ranks(sums, shard=shard)
    n = max(sums[0], 1.0)
    out = {}
    for i, name in enumerate(tensors):
        mean = sums[1 + 2 * i] / n
        out[name] = (mean, max(0.0, sums[2 + 2 * i] / n - mean * mean))
    return out


def _explained_at_ends(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor, group_index: torch.Tensor,
                       shard: bool) -> dict[str, float]:
    """Where the critic's explained variance comes from, per row: at its first model token (all a value
    can know there is the prompt: how likely this prompt is to succeed) and at its last (the whole
    reply read). `prompt_explained_var` is the share of the first-token returns' variance that each
    group's own mean return explains (in-sample, over the groups as each rank holds them): about the
    most a value that reads only the prompt could reach on this batch. Rows without a model token
    are left out."""
    keep = mask.sum(1) > 0
    if not bool(keep.any()) and not shard:
        return {}
    m, v, r = mask[keep], values[keep].double(), returns[keep].double()
    cols = torch.arange(m.shape[1], device=m.device)
    first = torch.where(m.bool(), cols, m.shape[1]).min(1).values
    last = torch.where(m.bool(), cols, -1).max(1).values
    rows = torch.arange(len(m), device=m.device)
    r0, r1 = r[rows, first], r[rows, last]
    _, group = group_index[keep].unique(return_inverse=True)
    group_mean = torch.zeros_like(r0).index_add_(0, group, r0) / torch.bincount(group, minlength=len(r0))
    # per row as one masked token each: _masked_stats' (mean, variance) over every rank; the
    # deviations from the group means average 0, so their variance is the within-group share
    st = _masked_stats(torch.ones(len(r0), 1, device=r0.device), shard, r0=r0[:, None], e0=(r0 - v[rows, first])[:, None],
                       r1=r1[:, None], e1=(r1 - v[rows, last])[:, None],
                       within=(r0 - group_mean[group])[:, None])

    def explained(err: str, total: str) -> float:
        return 1.0 - st[err][1] / st[total][1] if st[total][1] > 1e-12 else 0.0

    return {"critic/vf_explained_var_first": explained("e0", "r0"),
            "critic/vf_explained_var_last": explained("e1", "r1"),
            "critic/prompt_explained_var": explained("within", "r0")}


def _with_critic(batch: Batch, rewards: torch.Tensor, mask: torch.Tensor, critic: Any, algorithm: Any,
                 kwargs: dict[str, Any], token_rewards: torch.Tensor | None) -> tuple[torch.Tensor, dict[str, Any]]:
    """GAE: the critic's values of this batch (recomputed now, whatever policy sampled it), the
    advantages (`algorithm.lam`) whitened over the batch's mask-1 tokens, and the critic's update
    toward the returns at `critic.lam`."""
    if critic is None:
        raise ValueError(f"algorithm.advantage={algorithm.advantage} needs a critic and the run has none")
    values = critic.compute_values(batch)
    estimate = ESTIMATORS[algorithm.advantage].fn
    adv, returns = estimate(rewards, mask, values=values, token_rewards=token_rewards, **kwargs)
    if "lam" in kwargs and critic.critic_cfg.lam != kwargs["lam"]:  # the critic's targets at a lambda of their own
        _, returns = estimate(rewards, mask, values=values, token_rewards=token_rewards,
                              **{**kwargs, "lam": critic.critic_cfg.lam})
    st = _masked_stats(mask, batch.is_shard, values=values, returns=returns, adv=adv, error=returns - values)
    mean, var = st["adv"]
    adv = torch.where(mask.bool(), (adv - mean) / ((var ** 0.5 + 1e-8) if algorithm.norm_by_std else 1.0), 0.0)
    metrics = {"critic/values_mean": st["values"][0], "critic/returns_mean": st["returns"][0],
               "critic/advantages_mean": mean, "critic/advantages_std": var ** 0.5,
               # 1 = the values explain the returns; 0 = no better than their mean; < 0 worse
               "critic/vf_explained_var": 1.0 - st["error"][1] / st["returns"][1] if st["returns"][1] > 0 else 0.0,
               **_explained_at_ends(values, returns, mask, batch.group_index, batch.is_shard)}
    upd = critic.update_values(batch, returns, values, mask)
    metrics.update({f"critic/{k}": v for k, v in upd.items()})
    return adv.float(), metrics


def learn(batch: Batch, actor: Any, ref: Any, algorithm: Any, actor_cfg: ActorConfig,
          critic: Any = None) -> dict[str, Any]:
    """One PPO/GRPO update from `batch`; `algorithm` is the run's `AlgorithmConfig`, `critic` the
    run's value model when the estimator takes values (gae). Returns the step's metrics (actor/*,
    critic/*, drift/*, kl_in_reward, time/update_s)."""
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
    estimator = ESTIMATORS[algorithm.advantage]
    token_rewards = None
    if kl_in_reward:  # KL to the reference as a reward penalty: per token with a critic, else per sequence
        kl_tok = kl_penalty(old_lp, ref_lp, "k1") * mask
        kl = kl_tok.sum(1)
        if estimator.values:
            token_rewards = -loss.kl_coef * kl_tok
        else:
            rewards = rewards - loss.kl_coef * kl
        (kl_sum, rows), _ = over_ranks([float(kl.sum()), float(len(kl))], shard=batch.is_shard)
        metrics["kl_in_reward"] = kl_sum / max(rows, 1.0)

    # 3. advantages; invalid rows are groups of their own (advantage 0, no effect on siblings)
    kwargs = {name: getattr(algorithm, name) for name in estimator.options}
    kwargs.update({name: getattr(batch, name) for name in estimator.batch_fields})
    t0 = time.perf_counter()
    if estimator.values:  # with a critic, which also learns here
        adv, critic_metrics = _with_critic(batch, rewards, mask, critic, algorithm, kwargs, token_rewards)
        metrics.update(critic_metrics)
        if critic.rl_steps <= critic.critic_cfg.value_warmup_steps:  # the critic's head start: no actor update
            metrics.update({"critic/warmup": 1.0, "time/update_s": time.perf_counter() - t0})
            return metrics
    else:
        adv = compute_advantages(algorithm.advantage, rewards, mask, group_index=batch.group_index,
                                 valid=batch.valid, **kwargs)

    # the rows whose advantage is not 0 somewhere: the only ones the reward teaches (every group's rewards
    # alike, as with a model that never solves its task, leaves none; KL and entropy terms still act)
    taught = ((adv != 0) & (mask > 0)).any(1) & batch.valid.bool()
    (n_taught, n_valid), _ = over_ranks([float(taught.sum()), float(batch.valid.sum())], shard=batch.is_shard)
    metrics["rollout/signal_fraction"] = n_taught / n_valid if n_valid else 0.0

    # 4. the update
    upd = actor.update(batch, adv, old_lp, ref_lp, loss)
    metrics["time/update_s"] = time.perf_counter() - t0
    if on_policy:
        metrics.update({"drift/mean": upd.pop("drift_mean"), "drift/max": upd.pop("drift_max")})
    metrics.update({f"actor/{k}": v for k, v in upd.items()})
    return metrics
