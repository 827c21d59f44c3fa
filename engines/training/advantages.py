"""Advantages: GRPO, RLOO and REINFORCE++ from outcome rewards, turn-level GRPO from rewards
attached to turns, and GAE with a critic's values.

Every estimator takes the padded batch the rollout manager builds from finished trajectories:
`rewards` [B] (one scalar per trajectory) and `response_mask` [B, T] (1 = a token the model
generated and we train on, 0 = tool output, template or padding), and returns advantages [B, T]
that are zero wherever the mask is 0, so a loss over the mask never sees tool tokens.

GRPO and RLOO compare each trajectory with the other samples of the same prompt; `group_index`
[B] says which prompt a sample belongs to: the integer the rollout manager assigned the prompt
once (`Batch.group_index`), the one identity of a group from rollout to advantage. The samples
of a group need not be adjacent, and the indices need not be contiguous (a rank's shard of a
batch holds some groups only).

Statistics are computed in float64 (rewards are few, and a group's std can be tiny) and the
result is returned as float32, the dtype the loss works in.

GAE takes the critic's values (`engines/training/critic.py`) besides the rewards and returns the
returns the critic learns from with the advantages. A new estimator is one function here plus its
`ESTIMATORS` entry (which names the `algorithm` options and the batch fields, such as
`turn_rewards`, it takes).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

GroupIndex = torch.Tensor | Sequence[int]


def _as_batch(rewards: torch.Tensor, response_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Check shapes once so every estimator fails with the same clear message."""
    rewards = torch.as_tensor(rewards)
    response_mask = torch.as_tensor(response_mask)
    if response_mask.dim() != 2:
        raise ValueError(f"response_mask has shape {tuple(response_mask.shape)}; it must be [B, T] "
                         "(one row of 0/1 per trajectory, as the manager pads it)")
    if rewards.dim() != 1 or rewards.shape[0] != response_mask.shape[0]:
        raise ValueError(f"rewards has shape {tuple(rewards.shape)} but response_mask is "
                         f"{tuple(response_mask.shape)}; pass one scalar reward per trajectory, shape "
                         f"[{response_mask.shape[0]}]")
    if not torch.isfinite(rewards.double()).all():
        raise ValueError(f"rewards contain non-finite values {rewards.tolist()}; fix the reward "
                         "function (a failed trajectory should get a finite reward such as 0)")
    return rewards.to(device=response_mask.device, dtype=torch.float64), response_mask.bool()


def group_ids(group_index: GroupIndex, batch_size: int, valid: torch.Tensor | None = None
              ) -> tuple[torch.Tensor, int]:
    """Compact group indices 0..G-1 (long tensor [B]) and G. `group_index` holds one integer per
    trajectory, the prompt's group as the rollout manager assigned it; rows where `valid` is false
    (failed trajectories) become groups of their own, so they get advantage 0 and do not move their
    siblings' baseline."""
    index = torch.as_tensor(group_index)
    if index.dim() != 1 or index.is_floating_point() or index.dtype == torch.bool:
        raise ValueError(f"group_index must be one integer per trajectory (the prompt's group), got "
                         f"{index.dtype} of shape {tuple(index.shape)}")
    if len(index) != batch_size:
        raise ValueError(f"group_index has {len(index)} entries but the batch has {batch_size} trajectories; "
                         "pass one group index per trajectory")
    ids = torch.unique(index, return_inverse=True)[1]
    if valid is not None:
        invalid = ~torch.as_tensor(valid, dtype=torch.bool)
        alone = int(ids.max()) + 1 + torch.cumsum(invalid.long(), 0) - 1 if len(ids) else ids
        ids = torch.unique(torch.where(invalid, alone, ids), return_inverse=True)[1]
    return ids, int(ids.max()) + 1 if len(ids) else 0


def _group_sums(values: torch.Tensor, ids: torch.Tensor, num_groups: int) -> torch.Tensor:
    return torch.zeros(num_groups, dtype=values.dtype, device=values.device).index_add_(0, ids, values)


def _broadcast(per_sequence: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Every trained token of a trajectory gets the trajectory's advantage; others get 0."""
    return torch.where(mask, per_sequence[:, None], 0.0).float()


def grpo(rewards: torch.Tensor, group_index: GroupIndex, response_mask: torch.Tensor,
         norm_by_std: bool = True, eps: float = 1e-6, valid: torch.Tensor | None = None) -> torch.Tensor:
    """GRPO advantage: (reward - group mean) / (group std + eps), on every mask-1 token.

    The std is the unbiased (Bessel-corrected, n - 1) sample std of the group's rewards. That is
    what the common GRPO implementations use (a `tensor.std()` over the group), so advantage
    scales and learning rates carry over from their recipes; with the biased std a group of 2
    with rewards {0, 1} would get +-1 instead of +-0.71.

    `norm_by_std=False` keeps only the mean baseline (Dr. GRPO argues the std division
    over-weights prompts that are nearly always or nearly never solved).
    A group of one sample, or one where every sample got the same reward, carries no relative
    signal and gets advantage 0.
    """
    r, mask = _as_batch(rewards, response_mask)
    ids, num_groups = group_ids(group_index, r.shape[0], valid)
    ids = ids.to(r.device)
    counts = _group_sums(torch.ones_like(r), ids, num_groups)
    mean = _group_sums(r, ids, num_groups) / counts
    centered = r - mean[ids]  # exactly 0 for a group of one or of equal rewards, so stays 0 below
    if norm_by_std:
        sq = _group_sums(centered * centered, ids, num_groups)
        std = torch.sqrt(sq / (counts - 1).clamp_min(1))
        centered = centered / (std[ids] + eps)
    return _broadcast(centered, mask)


def rloo(rewards: torch.Tensor, group_index: GroupIndex, response_mask: torch.Tensor,
         valid: torch.Tensor | None = None) -> torch.Tensor:
    """RLOO advantage: reward minus the mean reward of the *other* samples of the same prompt.

    Leaving the sample out keeps the baseline independent of the sample's own action, so the
    gradient estimate stays unbiased (Kool et al. 2019; Ahmadian et al. 2024). It equals
    n/(n-1) * (reward - group mean). A group of one sample has no other samples and gets 0.
    """
    r, mask = _as_batch(rewards, response_mask)
    ids, num_groups = group_ids(group_index, r.shape[0], valid)
    ids = ids.to(r.device)
    counts = _group_sums(torch.ones_like(r), ids, num_groups)[ids]
    others = (_group_sums(r, ids, num_groups)[ids] - r) / (counts - 1).clamp_min(1)
    adv = torch.where(counts > 1, r - others, 0.0)
    return _broadcast(adv, mask)


def reinforce_pp(rewards: torch.Tensor, response_mask: torch.Tensor, kl: torch.Tensor | None = None,
                 kl_coef: float = 0.0, gamma: float = 1.0, eps: float = 1e-8) -> torch.Tensor:
    """REINFORCE++ advantage: per-token discounted returns, whitened over the whole batch.

    Token rewards are the trajectory's outcome reward on its last mask-1 token, minus
    `kl_coef * kl` on every mask-1 token (the KL-in-reward form; `kl` is a per-token penalty
    such as `engines.training.losses.kl_penalty(logprobs, ref_logprobs, "k1")`). The return of a
    token is the discounted sum of token rewards from it to the end. Discounting counts only
    model tokens: tool and template tokens (mask 0) are not actions of the policy, so a long
    tool observation does not shrink the reward of the turn before it.

    Returns are then whitened over all mask-1 tokens of the batch (mean 0, unbiased std 1).
    The batch-wide baseline, not a per-prompt one, is what distinguishes REINFORCE++ from GRPO
    (Hu 2025). A trajectory with no mask-1 tokens has nothing to train and gets 0 everywhere.
    """
    r, mask = _as_batch(rewards, response_mask)
    if gamma <= 0 or gamma > 1:
        raise ValueError(f"gamma={gamma}; the discount must be in (0, 1] (1.0 = no discounting)")
    if kl_coef < 0:
        raise ValueError(f"kl_coef={kl_coef}; a KL penalty coefficient must be >= 0")
    B, T = mask.shape
    token_rewards = torch.zeros(B, T, dtype=torch.float64, device=mask.device)
    has_tokens = mask.any(dim=1)
    # last mask-1 position of each row: the largest index whose mask is 1
    positions = torch.arange(T, device=mask.device).expand(B, T)
    last = torch.where(mask, positions, -1).max(dim=1).values.clamp_min(0)
    token_rewards[torch.arange(B, device=mask.device), last] = torch.where(has_tokens, r, 0.0)
    if kl is not None:
        kl = torch.as_tensor(kl)
        if kl.shape != mask.shape:
            raise ValueError(f"kl has shape {tuple(kl.shape)}; it must match response_mask "
                             f"{tuple(mask.shape)} (one penalty per token)")
        token_rewards = token_rewards - kl_coef * kl.detach().to(token_rewards)
    token_rewards = torch.where(mask, token_rewards, 0.0)

    if gamma == 1.0:  # undiscounted: a reverse cumulative sum, no Python loop over T
        returns = token_rewards.flip(1).cumsum(1).flip(1)
    else:
        returns = torch.zeros_like(token_rewards)
        running = torch.zeros(B, dtype=torch.float64, device=mask.device)
        for t in range(T - 1, -1, -1):
            running = torch.where(mask[:, t], token_rewards[:, t] + gamma * running, running)
            returns[:, t] = running

    n = mask.sum()
    if n == 0:
        return torch.zeros(B, T, dtype=torch.float32, device=mask.device)
    mean = returns[mask].mean()
    centered = returns - mean
    if n > 1:
        var = (centered[mask] ** 2).sum() / (n - 1)
        centered = centered / (var.sqrt() + eps)
    return torch.where(mask, centered, 0.0).float()


def turn_grpo(rewards: torch.Tensor, group_index: GroupIndex, response_mask: torch.Tensor,
              turn_rewards: torch.Tensor | None = None, norm_by_std: bool = False, eps: float = 1e-6,
              valid: torch.Tensor | None = None) -> torch.Tensor:
    """Turn-level GRPO: each turn is credited with the reward still to come, against a baseline of
    the other samples of its prompt at the same turn.

    `rewards` [B] is each trajectory's total reward; `turn_rewards` [B, T] holds, at the last token
    of the turn that earned it, the part of that total a turn earned on its own (a tool's step
    reward, an interaction's turn score); it is already included in `rewards`. A turn is a run of
    mask-1 tokens (one generation). A token's return is what the trajectory earns from that token
    on: G_t = reward - (turn rewards at positions before t), so the outcome reaches every turn and
    a turn reward only the turns before it.

    The baseline of turn k of sample i is the mean of G at the first token of turn k over the
    *other* valid samples of the group that reached turn k; when none did, the mean of the others'
    returns at their latest turn before k. Either way it is computed from samples drawn
    independently of sample i's actions and depends on sample i only through its state (the turn
    index it reached), so by the baseline theorem (Williams 1992; Sutton & Barto 2018, sec. 13.4)
    the gradient estimate stays unbiased whatever the number of turns of each sample; leaving the
    sample out is the construction of Kool et al. 2019 (as in `rloo`). With every turn reward 0 and
    one turn per sample this is exactly RLOO. `norm_by_std` divides by the std of the group's
    total rewards (a positive per-group scale, as in `grpo`). A sample alone in its group, and an
    invalid one, get 0.
    """
    r, mask = _as_batch(rewards, response_mask)
    B, T = mask.shape
    tr = torch.zeros(B, T, dtype=torch.float64, device=mask.device) if turn_rewards is None else \
        torch.as_tensor(turn_rewards).to(device=mask.device, dtype=torch.float64)
    if tr.shape != mask.shape:
        raise ValueError(f"turn_rewards has shape {tuple(tr.shape)}; it must match response_mask {tuple(mask.shape)}")
    if not torch.isfinite(tr).all():
        raise ValueError("turn_rewards contain non-finite values; every turn reward must be a finite number")
    ids, num_groups = group_ids(group_index, B, valid)
    ids = ids.to(mask.device)
    if B == 0 or T == 0:
        return torch.zeros(B, T, dtype=torch.float32, device=mask.device)
    returns = r[:, None] - (tr.cumsum(1) - tr)  # G_t: the reward still to come at token t
    starts = mask & ~torch.cat([torch.zeros(B, 1, dtype=torch.bool, device=mask.device), mask[:, :-1]], 1)
    turn = starts.long().cumsum(1) - 1  # the turn each token belongs to (meaningful where mask is 1)
    n_turns = starts.sum(1)
    K = int(n_turns.max())
    if K == 0:
        return torch.zeros(B, T, dtype=torch.float32, device=mask.device)
    per_turn = torch.zeros(B, K, dtype=torch.float64, device=mask.device)  # G at each turn's first token
    rows, cols = starts.nonzero(as_tuple=True)
    per_turn[rows, turn[rows, cols]] = returns[rows, cols]
    ks = torch.arange(K, device=mask.device)
    reached = ks[None, :] < n_turns[:, None]
    latest = per_turn.gather(1, torch.minimum(ks[None, :], (n_turns - 1).clamp_min(0)[:, None]).expand(B, K))

    def others_mean(values: torch.Tensor, present: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        values = torch.where(present, values, 0.0)
        sums = torch.zeros(num_groups, K, dtype=torch.float64, device=mask.device).index_add_(0, ids, values)
        counts = torch.zeros(num_groups, K, dtype=torch.float64, device=mask.device).index_add_(0, ids, present.double())
        n = counts[ids] - present.double()
        return (sums[ids] - values) / n.clamp_min(1), n

    same, n_same = others_mean(per_turn, reached)
    earlier, n_earlier = others_mean(latest, (n_turns > 0)[:, None].expand(B, K))
    baseline = torch.where(n_same > 0, same, earlier)  # [B, K]
    alone = n_earlier == 0  # no other sample with a turn: no baseline, no signal
    adv = returns - baseline.gather(1, turn.clamp(0, K - 1))
    adv = torch.where(alone.gather(1, turn.clamp(0, K - 1)), 0.0, adv)
    if norm_by_std:
        counts = _group_sums(torch.ones_like(r), ids, num_groups)
        mean = _group_sums(r, ids, num_groups) / counts
        sq = _group_sums((r - mean[ids]) ** 2, ids, num_groups)
        std = torch.sqrt(sq / (counts - 1).clamp_min(1))
        adv = adv / (std[ids][:, None] + eps)
    return torch.where(mask, adv, 0.0).float()


def gae(rewards: torch.Tensor, response_mask: torch.Tensor, values: torch.Tensor, gamma: float = 1.0,
        lam: float = 1.0, turn_rewards: torch.Tensor | None = None,
        token_rewards: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalized advantage estimation (Schulman et al. 2016) over the model's own tokens:
    (advantages, returns), both [B, T] and 0 where the mask is 0. Not whitened (the trainer does).

    The time steps are the mask-1 tokens only: a tool's output or template tokens between two turns
    are not actions of the policy, carry no value target, and neither discount nor break the chain;
    the next state of a turn's last token is the next turn's first token. With V_t the critic's
    value of the state before token t and r_t the token's reward,
    delta_t = r_t + gamma * V_next - V_t,  A_t = delta_t + gamma * lam * A_next,  R_t = A_t + V_t,
    and V_next = 0, A_next = 0 after the last model token (the episode ends).

    Rewards: `token_rewards` [B, T] per token (a KL penalty, say); `turn_rewards` [B, T] at the
    positions a turn earned them (already part of `rewards`, as `turn_grpo` reads them); the rest of
    the trajectory's total `rewards` [B] at its last token. A reward at a mask-0 position goes to the
    model token before it.
    """
    r, mask = _as_batch(rewards, response_mask)
    B, T = mask.shape
    dev = mask.device

    def per_token(t: torch.Tensor | None, name: str) -> torch.Tensor:
        if t is None:
            return torch.zeros(B, T, dtype=torch.float64, device=dev)
        t = torch.as_tensor(t).to(device=dev, dtype=torch.float64)
        if t.shape != mask.shape:
            raise ValueError(f"{name} has shape {tuple(t.shape)}; it must match response_mask {tuple(mask.shape)}")
        if not torch.isfinite(t).all():
            raise ValueError(f"{name} contain non-finite values; every one must be a finite number")
        return t

    v = per_token(values, "values")
    if not 0 < gamma <= 1 or not 0 <= lam <= 1:
        raise ValueError(f"gamma={gamma}, lam={lam}; GAE needs 0 < gamma <= 1 and 0 <= lam <= 1")
    turns = per_token(turn_rewards, "turn_rewards")
    reward = per_token(token_rewards, "token_rewards") + turns
    if T:
        reward[:, -1] += r - turns.sum(1)  # the outcome (net of turn rewards) at the end ...
    adv = torch.zeros(B, T, dtype=torch.float64, device=dev)
    zero = torch.zeros(B, dtype=torch.float64, device=dev)
    pending, next_value, next_adv = zero, zero, zero
    for t in range(T - 1, -1, -1):  # ... and every reward at a mask-0 position moves to the token before it
        m = mask[:, t]
        pending = pending + reward[:, t]
        delta = pending + gamma * next_value - v[:, t]
        a = delta + gamma * lam * next_adv
        adv[:, t] = torch.where(m, a, 0.0)
        next_adv = torch.where(m, a, next_adv)
        next_value = torch.where(m, v[:, t], next_value)
        pending = torch.where(m, 0.0, pending)
    returns = torch.where(mask, adv + v, 0.0)
    return adv.float(), returns.float()


@dataclass(frozen=True)
class Estimator:
    """One advantage estimator: `fn`, whether it compares the samples of one prompt (then it takes
    `group_index` after the rewards), the `algorithm` config fields it reads as keywords, and the
    training batch's fields it reads as keywords (`Batch.turn_rewards`), and whether it needs a critic."""

    fn: Callable[..., Any]
    grouped: bool
    options: tuple[str, ...] = ()
    batch_fields: tuple[str, ...] = ()
    values: bool = False  # takes the critic's `values` and returns (advantages, returns), not whitened


# the registry `algorithm.advantage` names; config validation and `launch/algorithm.learn` read it
ESTIMATORS: dict[str, Estimator] = {
    "grpo": Estimator(grpo, grouped=True, options=("norm_by_std",)),
    "rloo": Estimator(rloo, grouped=True),
    "reinforce_pp": Estimator(reinforce_pp, grouped=False),
    "turn_grpo": Estimator(turn_grpo, grouped=True, options=("norm_by_std",), batch_fields=("turn_rewards",)),
    "gae": Estimator(gae, grouped=False, options=("gamma", "lam"), batch_fields=("turn_rewards",), values=True),
}


def compute_advantages(name: str, rewards: torch.Tensor, response_mask: torch.Tensor,
                       group_index: GroupIndex | None = None, valid: torch.Tensor | None = None,
                       **kwargs: Any) -> torch.Tensor:
    """Pick an estimator by its config name, so the trainer's config stays a plain string.

    `group_index` (the prompt's group per trajectory) and `valid` (false: a failed trajectory, a group
    of its own) are read by the group estimators (grpo, rloo) and ignored by the others;
    extra keyword arguments go to the estimator (e.g. `norm_by_std`, `kl`, `kl_coef`, `gamma`).
    """
    est = ESTIMATORS.get(name)
    if est is None:
        raise ValueError(f"unknown advantage estimator {name!r}; choose one of {list(ESTIMATORS)}")
    if est.values:
        raise ValueError(f"advantage estimator {name!r} needs a critic's values; call it directly with values= "
                         "(the trainer does, with the run's critic)")
    if not est.grouped:
        return est.fn(rewards, response_mask, **kwargs)
    if group_index is None:
        raise ValueError(f"advantage estimator {name!r} compares samples of the same prompt and needs "
                         "group_index (one prompt label per trajectory); pass it, or use 'reinforce_pp'")
    return est.fn(rewards, group_index, response_mask, valid=valid, **kwargs)
