"""Advantage estimators against per-group / per-sequence references written as plain loops."""

import math

import numpy as np
import pytest
import torch

from engines.training.advantages import ESTIMATORS, compute_advantages, group_ids, grpo, reinforce_pp, rloo


def random_mask(B: int, T: int, seed: int) -> torch.Tensor:
    """Multi-turn-like masks: model segments separated by tool tokens, then padding."""
    g = torch.Generator().manual_seed(seed)
    mask = (torch.rand(B, T, generator=g) > 0.3).long()
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    mask[torch.arange(T)[None, :] >= lengths[:, None]] = 0
    return mask


def shuffled_groups(sizes: list[int], seed: int) -> list[int]:
    labels = [g for g, n in enumerate(sizes) for _ in range(n)]
    np.random.default_rng(seed).shuffle(labels)
    return labels


def assert_broadcast(adv: torch.Tensor, per_seq: list[float], mask: torch.Tensor) -> None:
    for i in range(mask.shape[0]):
        for t in range(mask.shape[1]):
            want = per_seq[i] if mask[i, t] else 0.0
            assert adv[i, t].item() == pytest.approx(want, abs=1e-5), (i, t)


def test_grpo_matches_per_group_numpy_with_unbiased_std():
    sizes = [4, 1, 3, 5, 2]
    labels = shuffled_groups(sizes, 0)
    B = len(labels)
    rewards = torch.tensor(np.random.default_rng(1).normal(size=B))
    mask = random_mask(B, 7, 2)
    adv = grpo(rewards, torch.tensor(labels), mask)
    assert adv.dtype == torch.float32 and adv.shape == mask.shape

    r = rewards.numpy()
    want = []
    for i in range(B):
        members = np.array([r[j] for j in range(B) if labels[j] == labels[i]])
        if len(members) == 1:
            want.append(0.0)
        else:
            want.append((r[i] - members.mean()) / (members.std(ddof=1) + 1e-6))
    assert_broadcast(adv, want, mask)


def test_grpo_known_values_and_mean_only_mode():
    mask = torch.ones(4, 2)
    # group of two with rewards {0, 1}: unbiased std is 1/sqrt(2)
    adv = grpo(torch.tensor([0.0, 1.0, 5.0, 5.0]), [0, 0, 1, 1], mask)
    assert adv[:, 0].tolist() == pytest.approx([-1 / math.sqrt(2), 1 / math.sqrt(2), 0.0, 0.0], abs=1e-5)
    mean_only = grpo(torch.tensor([0.0, 1.0, 2.0, 9.0]), [0, 0, 1, 1], mask, norm_by_std=False)
    assert mean_only[:, 1].tolist() == pytest.approx([-0.5, 0.5, -3.5, 3.5])


def test_grpo_degenerate_groups_get_zero():
    mask = torch.ones(5, 3)
    adv = grpo(torch.tensor([1.0, 1.0, 1.0, 0.3, 7.0]), [0, 0, 0, 1, 2], mask)
    assert torch.equal(adv, torch.zeros(5, 3))  # all-equal group and two singletons


def test_group_index_is_one_integer_per_row_in_any_order_and_failed_rows_stand_alone():
    rewards = torch.tensor([0.1, 0.9, 0.5, 0.4, 0.2, 0.8])
    mask = random_mask(6, 5, 3)
    sparse = grpo(rewards, torch.tensor([7, 3, 7, 1000, 3, 1000]), mask)  # a shard's groups: not contiguous
    dense = grpo(rewards, [1, 0, 1, 2, 0, 2], mask)
    assert torch.equal(sparse, dense)
    ids, n = group_ids(torch.tensor([9, 4, 9]), 3)
    assert ids.tolist() == [1, 0, 1] and n == 2
    # a failed row (valid false) is a group of its own: advantage 0, and its siblings as if it were absent
    valid = torch.tensor([True, True, False, True, True, True])
    with_failed = grpo(rewards, [1, 0, 1, 2, 0, 2], mask, valid=valid)
    assert torch.equal(with_failed[2], torch.zeros(5))
    assert torch.equal(with_failed[0], torch.zeros(5))  # the only valid sample left of its group
    assert torch.equal(with_failed[[1, 3, 4, 5]], dense[[1, 3, 4, 5]])
    ids, n = group_ids([0, 0, 1, 1], 4, valid=torch.tensor([True, False, False, True]))
    assert n == 4 and len(set(ids.tolist())) == 4
    assert torch.equal(compute_advantages("rloo", rewards, mask, [1, 0, 1, 2, 0, 2], valid=valid),
                       rloo(rewards, [1, 0, 1, 2, 0, 2], mask, valid=valid))


def test_rloo_matches_leave_one_out_loop():
    sizes = [3, 1, 4, 2]
    labels = shuffled_groups(sizes, 4)
    B = len(labels)
    rewards = torch.tensor(np.random.default_rng(5).uniform(size=B))
    mask = random_mask(B, 6, 6)
    adv = rloo(rewards, labels, mask)
    want = []
    for i in range(B):
        others = [rewards[j].item() for j in range(B) if labels[j] == labels[i] and j != i]
        want.append(rewards[i].item() - sum(others) / len(others) if others else 0.0)
    assert_broadcast(adv, want, mask)
    # the identity RLOO = n/(n-1) * (r - mean), checked on one group
    n = 4
    r = torch.tensor([0.0, 1.0, 1.0, 0.5])
    got = rloo(r, [0] * n, torch.ones(n, 1))[:, 0]
    assert torch.allclose(got, (n / (n - 1) * (r - r.mean())).float())


def reference_returns(rewards: torch.Tensor, mask: torch.Tensor, kl: torch.Tensor | None, kl_coef: float,
                      gamma: float) -> list[dict[int, float]]:
    """Per sequence: list the model-token positions, walk them backwards accumulating the return."""
    out = []
    for i in range(mask.shape[0]):
        pos = [t for t in range(mask.shape[1]) if mask[i, t]]
        step_reward = {t: (-kl_coef * kl[i, t].item() if kl is not None else 0.0) for t in pos}
        if pos:
            step_reward[pos[-1]] += rewards[i].item()
        ret, g = {}, 0.0
        for t in reversed(pos):
            g = step_reward[t] + gamma * g
            ret[t] = g
        out.append(ret)
    return out


@pytest.mark.parametrize("gamma,kl_coef", [(1.0, 0.0), (1.0, 0.1), (0.9, 0.05)])
def test_reinforce_pp_returns_then_batch_whitening(gamma, kl_coef):
    B, T = 6, 9
    mask = random_mask(B, T, 7)
    mask[2] = 0  # a trajectory with no model tokens
    mask[3] = torch.tensor([1, 1, 0, 0, 0, 1, 1, 0, 0])  # two turns around a tool observation
    rewards = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 0.5])
    kl = torch.randn(B, T, generator=torch.Generator().manual_seed(8)) if kl_coef else None
    adv = reinforce_pp(rewards, mask, kl=kl, kl_coef=kl_coef, gamma=gamma)

    returns = reference_returns(rewards, mask, kl, kl_coef, gamma)
    flat = np.array([v for r in returns for v in r.values()])
    mean, std = flat.mean(), flat.std(ddof=1)
    for i in range(B):
        for t in range(T):
            want = (returns[i][t] - mean) / (std + 1e-8) if mask[i, t] else 0.0
            assert adv[i, t].item() == pytest.approx(want, abs=1e-5), (i, t)
    trained = adv[mask.bool()].double()
    assert trained.mean().item() == pytest.approx(0.0, abs=1e-6)
    assert trained.std().item() == pytest.approx(1.0, abs=1e-5)


def test_reinforce_pp_discounts_model_tokens_only():
    # two model tokens around a 3-token tool observation, and a plain 2-token row as contrast
    mask = torch.tensor([[1, 0, 0, 0, 1], [1, 1, 0, 0, 0]])
    adv = reinforce_pp(torch.tensor([1.0, 1.0]), mask, gamma=0.5)
    # returns are 0.5 (one model step before the reward) and 1.0 in both rows, not 0.5**4
    assert adv[0, 0] == adv[1, 0] and adv[0, 4] == adv[1, 1] and adv[0, 0] < adv[0, 4]


def test_reinforce_pp_edge_cases():
    assert torch.equal(reinforce_pp(torch.tensor([1.0, 2.0]), torch.zeros(2, 3)), torch.zeros(2, 3))
    one = reinforce_pp(torch.tensor([3.0]), torch.tensor([[0, 1, 0]]))
    assert one.tolist() == [[0.0, 0.0, 0.0]]  # one token: centred, nothing to scale
    with pytest.raises(ValueError, match="gamma=0"):
        reinforce_pp(torch.tensor([1.0]), torch.ones(1, 2), gamma=0)
    with pytest.raises(ValueError, match=r"kl has shape \(1, 3\)"):
        reinforce_pp(torch.tensor([1.0]), torch.ones(1, 2), kl=torch.zeros(1, 3), kl_coef=0.1)


def test_compute_advantages_dispatch_and_errors():
    rewards, mask, groups = torch.tensor([0.0, 1.0, 1.0, 1.0]), torch.ones(4, 3), [0, 0, 1, 1]
    assert torch.equal(compute_advantages("grpo", rewards, mask, groups), grpo(rewards, groups, mask))
    assert torch.equal(compute_advantages("grpo", rewards, mask, groups, norm_by_std=False),
                       grpo(rewards, groups, mask, norm_by_std=False))
    assert torch.equal(compute_advantages("rloo", rewards, mask, groups), rloo(rewards, groups, mask))
    assert torch.equal(compute_advantages("reinforce_pp", rewards, mask), reinforce_pp(rewards, mask))
    assert set(ESTIMATORS) == {"grpo", "rloo", "reinforce_pp", "turn_grpo", "gae"}
    with pytest.raises(ValueError, match=r"'vtrace'.*\['grpo', 'rloo', 'reinforce_pp', 'turn_grpo', 'gae'\]"):
        compute_advantages("vtrace", rewards, mask, groups)
    with pytest.raises(ValueError, match="needs group_index"):
        compute_advantages("rloo", rewards, mask)


def test_shape_and_value_errors_name_the_problem():
    with pytest.raises(ValueError, match=r"rewards has shape \(3,\)"):
        grpo(torch.zeros(3), [0, 0, 0, 0], torch.ones(4, 2))
    with pytest.raises(ValueError, match="group_index has 3 entries but the batch has 4"):
        grpo(torch.zeros(4), [0, 0, 1], torch.ones(4, 2))
    with pytest.raises(ValueError, match=r"response_mask has shape \(4,\)"):
        rloo(torch.zeros(4), [0, 0, 1, 1], torch.ones(4))
    with pytest.raises(ValueError, match="non-finite"):
        grpo(torch.tensor([0.0, float("nan")]), [0, 0], torch.ones(2, 2))
    with pytest.raises(ValueError, match="one integer per trajectory"):
        grpo(torch.zeros(2), [[0], [0]], torch.ones(2, 2))
    with pytest.raises(ValueError, match="one integer per trajectory"):
        grpo(torch.zeros(2), torch.tensor([0.5, 0.5]), torch.ones(2, 2))
