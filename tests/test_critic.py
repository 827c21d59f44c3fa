"""PPO with a critic: GAE against a hand computation (multi-turn masks included), the clipped value
loss, the critic on a tiny model (values at zero, learning toward returns, state round trip, the
same values in row or token-budget micro-batches), and `launch/train.py` with
`algorithm.advantage=gae` killed with -9 and resumed with the critic's state."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from batches import make_batch
from waiting import wait_for_unlocked
from engines.training.advantages import compute_advantages, gae
from engines.training.losses import value_loss

REPO = Path(__file__).resolve().parents[1]


def _by_hand(rewards: list[float], values: list[float], gamma: float, lam: float) -> tuple[list[float], list[float]]:
    """A_t = sum_l (gamma lam)^l delta_{t+l}, delta_t = r_t + gamma V_{t+1} - V_t, V_T = 0."""
    T = len(rewards)
    v = values + [0.0]
    deltas = [rewards[t] + gamma * v[t + 1] - v[t] for t in range(T)]
    adv = [sum((gamma * lam) ** k * deltas[t + k] for k in range(T - t)) for t in range(T)]
    return adv, [a + values[t] for t, a in enumerate(adv)]


def test_gae_equals_the_hand_computation_on_one_turn():
    values = [0.5, -0.2, 0.1, 0.3]
    adv, ret = gae(torch.tensor([2.0]), torch.ones(1, 4), torch.tensor([values]), gamma=0.9, lam=0.8)
    want_adv, want_ret = _by_hand([0.0, 0.0, 0.0, 2.0], values, 0.9, 0.8)
    assert torch.allclose(adv[0], torch.tensor(want_adv), atol=1e-6), (adv, want_adv)
    assert torch.allclose(ret[0], torch.tensor(want_ret), atol=1e-6)


def test_gae_skips_tool_tokens_and_moves_their_rewards_to_the_turn_before():
    """Two turns with a tool output between them and padding after: the time steps are the four
    model tokens; a turn reward at the tool's position belongs to the first turn's last token."""
    mask = torch.tensor([[1, 1, 0, 0, 1, 1, 0]])
    values = torch.tensor([[0.4, 0.1, 9.0, 9.0, -0.3, 0.2, 9.0]])  # 9.0: never read (mask 0)
    turns = torch.zeros(1, 7)
    turns[0, 3] = 0.5  # earned by the first turn (e.g. a tool's step reward), part of the total 1.5
    adv, ret = gae(torch.tensor([1.5]), mask, values, gamma=0.95, lam=0.7, turn_rewards=turns)
    want_adv, want_ret = _by_hand([0.0, 0.5, 0.0, 1.0], [0.4, 0.1, -0.3, 0.2], 0.95, 0.7)
    at = mask[0].bool()
    assert torch.allclose(adv[0, at], torch.tensor(want_adv), atol=1e-6), (adv, want_adv)
    assert torch.allclose(ret[0, at], torch.tensor(want_ret), atol=1e-6)
    assert (adv[0, ~at] == 0).all() and (ret[0, ~at] == 0).all()


def test_gae_with_lambda_one_and_zero_values_is_the_reward_to_go_and_rows_do_not_mix():
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])
    penalty = torch.tensor([[-0.1, -0.1, -0.1, 0.0], [-0.2, -0.2, 0.0, 0.0]])  # a per-token KL term
    adv, ret = gae(torch.tensor([1.0, 3.0]), mask, torch.zeros(2, 4), gamma=1.0, lam=1.0, token_rewards=penalty)
    assert torch.allclose(adv, torch.tensor([[0.7, 0.8, 0.9, 0.0], [2.6, 2.8, 0.0, 0.0]]), atol=1e-6), adv
    assert torch.equal(adv, ret)


def test_gae_refuses_bad_inputs_by_name():
    with pytest.raises(ValueError, match="values has shape"):
        gae(torch.tensor([1.0]), torch.ones(1, 3), torch.zeros(1, 4))
    with pytest.raises(ValueError, match="gamma=0"):
        gae(torch.tensor([1.0]), torch.ones(1, 3), torch.zeros(1, 3), gamma=0.0)
    with pytest.raises(ValueError, match="needs a critic's values"):
        compute_advantages("gae", torch.tensor([1.0]), torch.ones(1, 3))


def test_value_loss_clips_around_the_scored_values():
    old = torch.tensor([[1.0, 1.0]])
    new = torch.tensor([[2.0, 1.1]])
    ret = torch.tensor([[3.0, 0.0]])
    mask = torch.ones(1, 2)
    plain, _ = value_loss(new, old, ret, mask, clip=0.0)
    assert plain.item() == pytest.approx(0.5 * ((2 - 3) ** 2 + 1.1 ** 2) / 2)
    clipped, met = value_loss(new, old, ret, mask, clip=0.5)
    # token 0 moved 1.0 toward its return: the clipped value 1.5 is further from 3 and counts; token 1 is within the clip
    assert clipped.item() == pytest.approx(0.5 * ((1.5 - 3) ** 2 + 1.1 ** 2) / 2)
    assert met["vf_clipfrac"] == pytest.approx(0.5)


def test_the_critic_starts_at_zero_learns_toward_returns_and_round_trips(tiny_llama: str):
    from engines.training.config import ActorConfig, CriticConfig
    from engines.training.critic import make_critic

    torch.manual_seed(0)
    batch = make_batch(1000, n=6)
    critic = make_critic(CriticConfig(lr=1e-2, micro_batch_size=2, value_clip=0.0), ActorConfig(), tiny_llama,
                         progress=False)
    values = critic.compute_values(batch)
    assert values.shape == batch.responses.shape and torch.count_nonzero(values) == 0  # the head starts at zero
    returns = torch.where(batch.loss_mask.bool(), 1.0 + batch.rewards[:, None].expand_as(values), 0.0)
    losses = [critic.update_values(batch, returns, critic.compute_values(batch))["value_loss"] for _ in range(8)]
    assert losses[-1] < 0.5 * losses[0], losses
    after = critic.compute_values(batch)
    assert float((after - returns).abs()[batch.loss_mask.bool()].mean()) < 0.5
    budget = make_critic(CriticConfig(max_tokens_per_micro_batch=24), ActorConfig(), tiny_llama, progress=False)
    budget.load_state_dict(critic.state_dict())  # the head and the optimizer state come back
    assert torch.allclose(budget.compute_values(batch), after, atol=1e-5)  # row order kept under a token budget
    part = make_critic(CriticConfig(trainable=[r"model\.norm\."]), ActorConfig(), tiny_llama, progress=False)
    assert {n for n, p in part.module.named_parameters() if p.requires_grad} == {
        "model.norm.weight", "lm_head.weight", "lm_head.bias"}  # the value head trains whatever the regexes say


def test_the_value_heads_own_learning_rate_survives_every_lr_update(tiny_llama: str):
    """`critic.head_lr_scale`: the head's group keeps its multiple through the schedule's `set_lr` on
    each update (which once set one rate on every group, so a head rate of its own never applied)."""
    from engines.training.config import ActorConfig, CriticConfig
    from engines.training.critic import make_critic

    batch = make_batch(1000, n=4)
    critic = make_critic(CriticConfig(lr=1e-3, head_lr_scale=50.0, micro_batch_size=4, value_clip=0.0), ActorConfig(),
                         tiny_llama, progress=False)
    head = {id(p) for p in critic.module.lm_head.parameters()}
    groups = critic.optimizer.param_groups
    assert [{id(p) for p in g["params"]} == head for g in groups] == [False, True]
    returns = torch.where(batch.loss_mask.bool(), 1.0, 0.0)
    critic.update_values(batch, returns, critic.compute_values(batch))
    critic.set_lr(2e-4)
    assert [g["lr"] for g in groups] == pytest.approx([2e-4, 1e-2])
    plain = make_critic(CriticConfig(), ActorConfig(), tiny_llama, progress=False)
    assert len(plain.optimizer.param_groups) == 1  # checkpoints of one group still load
    with pytest.raises(ValueError, match=r"critic.head_lr_scale=0"):
        CriticConfig(head_lr_scale=0)


def test_the_critic_learns_which_row_returns_what_not_only_the_mean(tiny_llama: str):
    """Explained variance (as `critic/vf_explained_var` computes it) on a batch whose rows have
    targets of their own: a critic that only learned the mean return would stay at 0."""
    from engines.training.config import ActorConfig, CriticConfig
    from engines.training.critic import make_critic

    torch.manual_seed(0)
    batch = make_batch(1000, n=8)
    critic = make_critic(CriticConfig(lr=1e-3, micro_batch_size=4, value_clip=0.0), ActorConfig(), tiny_llama,
                         progress=False)
    keep = batch.loss_mask.bool()
    returns = torch.where(keep, torch.rand(8)[:, None].expand(keep.shape), 0.0)
    for _ in range(40):
        critic.update_values(batch, returns, critic.compute_values(batch))
    error = (returns - critic.compute_values(batch))[keep]
    assert 1 - error.var(unbiased=False) / returns[keep].var(unbiased=False) > 0.9


def test_the_critics_targets_take_critic_lam_and_the_advantages_algorithm_lam(tiny_llama: str):
    """Decoupled GAE: the value targets are the returns at `critic.lam` (1: the reward itself at
    every token), the policy's advantages GAE at `algorithm.lam`, from the same values."""
    from engines.training.config import ActorConfig, CriticConfig
    from engines.training.critic import make_critic
    from launch.algorithm import _with_critic
    from launch.config import AlgorithmConfig

    batch = make_batch(1000, n=4)
    batch.rewards = torch.tensor([1.0, 0.0, 2.0, 0.5])
    mask = batch.loss_mask.float()
    for critic_lam in (1.0, 0.5):
        critic = make_critic(CriticConfig(lam=critic_lam), ActorConfig(), tiny_llama, progress=False)
        seen = {}
        critic.update_values = lambda b, returns, values, m: seen.update(returns=returns) or {}
        algorithm = AlgorithmConfig(advantage="gae", lam=0.5)
        adv, _ = _with_critic(batch, batch.rewards, mask, critic, algorithm, {"gamma": 1.0, "lam": 0.5}, None)
        zero = torch.zeros_like(mask)  # the head starts at zero: the values the estimates came from
        want_adv, half = gae(batch.rewards, mask, zero, gamma=1.0, lam=0.5)
        keep = mask.bool()
        want_adv = (want_adv - want_adv[keep].mean()) / want_adv[keep].std(unbiased=False)
        assert torch.allclose(adv[keep], want_adv[keep].float(), atol=1e-5)
        want = batch.rewards[:, None].expand_as(mask) * mask if critic_lam == 1.0 else half
        assert torch.allclose(seen["returns"].float(), want.float(), atol=1e-6), critic_lam


def _ends_case() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Two groups of two (returns 1, 0 and 1, 1) and a row with no model token (values, returns, mask,
    groups): values equal to their group's mean at each row's first model token and to the return at
    its last, 99 everywhere else (a wrong position would show)."""
    mask = torch.tensor([[0, 1, 1, 0, 1, 0], [1, 1, 0, 0, 0, 0], [0, 0, 1, 0, 0, 0], [1, 0, 1, 1, 1, 1],
                         [0, 0, 0, 0, 0, 0]], dtype=torch.float32)
    ret = torch.tensor([1.0, 0.0, 1.0, 1.0, 5.0])[:, None].expand(5, 6).clone()
    values = torch.full((5, 6), 99.0)
    for row, (first, last, v0) in enumerate([(1, 4, 0.5), (0, 1, 0.5), (2, 2, 1.0), (0, 5, 1.0)]):
        values[row, first], values[row, last] = v0, ret[row, last]
    values[2, 2] = 1.0  # one model token: first and last alike
    return values, ret, mask, torch.tensor([0, 0, 1, 1, 2])


ENDS = {"critic/vf_explained_var_first": 1 / 3, "critic/vf_explained_var_last": 1.0,
        "critic/prompt_explained_var": 1 / 3}  # the groups' means: 0.125 of the 0.1875 variance


def test_the_explained_variance_at_each_rows_first_and_last_model_token_and_the_prompts_share():
    from launch.algorithm import _explained_at_ends

    assert _explained_at_ends(*_ends_case(), shard=False) == pytest.approx(ENDS)


def _ends_on_rank(rank: int, init: str, out: str) -> None:
    import torch.distributed as dist

    from launch.algorithm import _explained_at_ends

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    rows = [0, 1] if rank == 0 else [2, 3, 4]  # each rank its shard: one group, the other and the empty row
    got = _explained_at_ends(*(t[rows] for t in _ends_case()), shard=True)
    if rank == 0:
        Path(out).write_text(json.dumps(got))
    dist.destroy_process_group()


def test_the_explained_variance_at_the_ends_over_two_gloo_ranks_equals_one_process(tmp_path: Path):
    import torch.multiprocessing as mp

    mp.spawn(_ends_on_rank, args=(f"file://{tmp_path / 'init'}", str(tmp_path / "got.json")), nprocs=2)
    assert json.loads((tmp_path / "got.json").read_text()) == pytest.approx(ENDS)


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> str:
    from engines.models import resolve_model

    return str(resolve_model("tiny-llama"))


TINY = ["model.path=tiny-llama", "data.val_path=null", "rollout.engine=hf", "rollout.in_process=true",
        "data.prompts_per_step=2", "rollout.n=2",
        "rollout.max_tokens=24", "sft.steps=2", "sft.batch_size=4", "algorithm.advantage=gae", "algorithm.gamma=0.99",
        "algorithm.lam=0.95", "critic.lr=1e-4", "critic.ppo_epochs=2", "algorithm.loss.kl_coef=0.01"]


def test_ppo_with_a_critic_resumes_after_kill_9_with_the_critic_restored(tmp_path: Path):
    import json

    out = tmp_path / "run"
    args = [*TINY, "trainer.steps=3", f"trainer.output_dir={out}"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    log = (tmp_path / "first.log").open("w")
    proc = subprocess.Popen([sys.executable, "launch/train.py", *args], cwd=REPO, env=env, stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True)
    step2 = out / "checkpoints" / "step_000002" / "state.pt"
    try:
        import time

        deadline = time.monotonic() + 400
        while not step2.exists():
            assert proc.poll() is None, (tmp_path / "first.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "no checkpoint of step 2"
            time.sleep(0.1)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    wait_for_unlocked(out)
    saved = torch.load(step2, map_location="cpu", weights_only=False)["critic"]
    head = saved["model"]["lm_head.weight"]
    assert head.shape[0] == 1 and torch.count_nonzero(head) > 0  # the value head has learned, and is saved
    again = subprocess.run([sys.executable, "launch/train.py", *args], cwd=REPO, env=env, capture_output=True,
                           text=True, timeout=600)
    assert again.returncode == 0, again.stderr[-4000:]
    assert "resuming from" in again.stdout and "(step 2," in again.stdout, again.stdout[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    last = rows[-1]
    assert last["step"] == 3
    for key in ("critic/value_loss", "critic/vf_explained_var", "critic/values_mean", "critic/returns_mean",
                "critic/advantages_std", "critic/grad_norm", "actor/pg_loss"):
        assert key in last and last[key] == last[key], (key, last)  # present and not NaN
    # the resumed critic continued from step 2's state: its first values are not the zero-initialised head's
    assert last["critic/values_mean"] != 0.0
    assert last["critic/optimizer_steps"] == 2.0  # critic.ppo_epochs=2 over one mini-batch


def test_gae_is_refused_with_the_megatron_actor_by_name(tmp_path: Path):
    proc = subprocess.run([sys.executable, "launch/train.py", "algorithm.advantage=gae", "actor.backend=megatron", "actor.trainable=[]",
                           f"trainer.output_dir={tmp_path}"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "needs actor.backend=torch" in proc.stderr, proc.stderr[-2000:]
