"""Loss pieces against hand-written per-token / per-sequence loops and torch references."""

import math

import pytest
import torch
from torch.distributions import Categorical

from engines.training.losses import (AGG_MODES, KL_KINDS, OFF_POLICY_MODES, LossConfig, agg_loss, behaviour_weights,
                                     compute_loss, entropy_from_logits, kl_penalty, logprobs_from_logits, masked_mean,
                                     policy_loss)


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def batch(B: int = 5, T: int = 8, seed: int = 0) -> tuple[torch.Tensor, ...]:
    g = gen(seed)
    mask = (torch.rand(B, T, generator=g) > 0.35).long()
    mask[1] = 0  # a row with nothing to train
    old = -torch.rand(B, T, generator=g) * 3
    new = old + 0.4 * torch.randn(B, T, generator=g)  # ratios spread across both clip bounds
    adv = torch.randn(B, T, generator=g)
    return new, old, adv, mask


def ref_agg(values: list[list[float]], mask: torch.Tensor, mode: str) -> float:
    rows = [[v for v, m in zip(vals, mrow) if m] for vals, mrow in zip(values, mask.tolist())]
    if mode == "token-mean":
        flat = [v for r in rows for v in r]
        return sum(flat) / len(flat) if flat else 0.0
    rows = [r for r in rows if r]
    per = [sum(r) if mode == "seq-mean-token-sum" else sum(r) / len(r) for r in rows]
    return sum(per) / len(per) if per else 0.0


def test_masked_mean_ignores_masked_garbage_and_empty_masks():
    x = torch.tensor([[1.0, float("-inf"), 3.0], [float("nan"), 2.0, 4.0]])
    mask = torch.tensor([[1, 0, 1], [0, 1, 1]])
    assert masked_mean(x, mask).item() == pytest.approx(10 / 4)
    assert masked_mean(x, mask, dim=1).tolist() == pytest.approx([2.0, 3.0])
    assert masked_mean(x, mask.bool(), dim=0).tolist() == pytest.approx([1.0, 2.0, 3.5])
    assert masked_mean(x, torch.zeros_like(mask)).item() == 0.0


@pytest.mark.parametrize("mode", AGG_MODES)
def test_agg_loss_modes_match_loops(mode):
    g = gen(1)
    loss_mat = torch.randn(6, 7, generator=g)
    mask = (torch.rand(6, 7, generator=g) > 0.5).long()
    mask[2] = 0
    mask[4] = torch.tensor([1, 0, 0, 0, 0, 0, 0])  # lengths differ a lot: the modes disagree
    got = agg_loss(loss_mat, mask, mode).item()
    assert got == pytest.approx(ref_agg(loss_mat.tolist(), mask, mode), abs=1e-6)
    assert agg_loss(loss_mat, torch.zeros(6, 7), mode).item() == 0.0


def test_agg_modes_weigh_tokens_differently():
    loss_mat = torch.tensor([[1.0, 1.0, 1.0, 1.0], [4.0, 0.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 0, 0, 0]])
    assert agg_loss(loss_mat, mask, "token-mean").item() == pytest.approx(8 / 5)
    assert agg_loss(loss_mat, mask, "seq-mean-token-sum").item() == pytest.approx((4 + 4) / 2)
    assert agg_loss(loss_mat, mask, "seq-mean-token-mean").item() == pytest.approx((1 + 4) / 2)


@pytest.mark.parametrize("mode", AGG_MODES)
def test_denominator_makes_micro_batches_add_up(mode):
    new, old, adv, mask = batch(6, 8, seed=2)
    full_in = new.clone().requires_grad_(True)
    full, _ = policy_loss(full_in, old, adv, mask, agg=mode)
    full.backward()

    keep = mask.bool()
    denom = float(keep.sum() if mode == "token-mean" else keep.any(1).sum())
    micro_in = new.clone().requires_grad_(True)
    total = sum(policy_loss(micro_in[s], old[s], adv[s], mask[s], agg=mode, denominator=denom)[0]
                for s in (slice(0, 2), slice(2, 6)))
    total.backward()
    assert total.item() == pytest.approx(full.item(), abs=1e-6)
    assert torch.allclose(micro_in.grad, full_in.grad, atol=1e-7)
    with pytest.raises(ValueError, match="denominator=0"):
        agg_loss(new, mask, mode, denominator=0)


def ref_token_loss(lp: float, old: float, a: float, lo: float, hi: float, c: float | None) -> float:
    """PPO written as the objective it maximises: min(r A, clip(r) A), dual-capped from below."""
    r = math.exp(lp - old)
    objective = min(r * a, min(max(r, 1 - lo), 1 + hi) * a)
    if c is not None and a < 0:
        objective = max(objective, c * a)
    return -objective


@pytest.mark.parametrize("mode", AGG_MODES)
@pytest.mark.parametrize("lo,hi,c", [(0.2, 0.2, None), (0.2, 0.28, None), (0.1, 0.3, 3.0)])
def test_policy_loss_matches_per_token_reference(mode, lo, hi, c):
    new, old, adv, mask = batch(seed=3)
    loss, metrics = policy_loss(new, old, adv, mask, clip_low=lo, clip_high=hi, dual_clip_c=c, agg=mode)
    per_token = [[ref_token_loss(*v, lo, hi, c) for v in zip(*rows)]
                 for rows in zip(new.tolist(), old.tolist(), adv.tolist())]
    assert loss.item() == pytest.approx(ref_agg(per_token, mask, mode), abs=1e-5)
    ratios = [math.exp(n - o) for rn, ro, rm in zip(new.tolist(), old.tolist(), mask.tolist())
              for n, o, m in zip(rn, ro, rm) if m]
    assert metrics["ratio_mean"] == pytest.approx(sum(ratios) / len(ratios), rel=1e-5)
    assert metrics["ratio_max"] == pytest.approx(max(ratios), rel=1e-5)
    assert metrics["approx_kl"] == pytest.approx(sum(r - 1 - math.log(r) for r in ratios) / len(ratios), rel=1e-4)


def test_clip_boundaries_and_dual_clip_gradients():
    # clip_low 0.2 -> lower bound 0.8; clip_high 0.28 -> upper bound 1.28; dual cap c = 3
    cases = [  # (advantage, ratio, token gets gradient?)
        (+1.0, 1.30, False),  # above 1 + clip_high with A > 0: clipped
        (+1.0, 1.25, True),   # just inside the (higher) upper bound
        (+1.0, 0.50, True),   # A > 0 and ratio low: the pessimistic term is the unclipped one
        (-1.0, 0.70, False),  # below 1 - clip_low with A < 0: clipped
        (-1.0, 0.85, True),
        (-1.0, 1.50, True),   # A < 0 and ratio high: unclipped ...
        (-1.0, 5.00, False),  # ... until the dual clip caps it at 3 * |A|
        (-1.0, 2.00, True),
        (+1.0, 5.00, False),  # dual clip leaves positive advantages alone
    ]
    adv = torch.tensor([[a for a, _, _ in cases] + [1.0]])
    old = torch.full_like(adv, -1.0)
    new = old + torch.log(torch.tensor([[r for _, r, _ in cases] + [1.0]]))
    mask = torch.tensor([[1] * len(cases) + [0]])
    new[0, -1] = old[0, -1] = float("-inf")  # padding garbage: -inf - -inf is NaN
    adv[0, -1] = float("nan")
    new.requires_grad_(True)
    loss, metrics = policy_loss(new, old, adv, mask, clip_low=0.2, clip_high=0.28, dual_clip_c=3.0)
    loss.backward()
    n = len(cases)
    for k, (a, r, live) in enumerate(cases):
        want = -a * r / n if live else 0.0
        assert new.grad[0, k].item() == pytest.approx(want, abs=1e-6), cases[k]
    assert new.grad[0, -1].item() == 0.0 and torch.isfinite(loss)
    assert metrics["clipfrac"] == pytest.approx(3 / n)
    assert metrics["clipfrac_high"] == pytest.approx(2 / n)
    assert metrics["clipfrac_low"] == pytest.approx(1 / n)
    assert metrics["dual_clipfrac"] == pytest.approx(1 / n)
    assert metrics["ratio_max"] == pytest.approx(5.0, rel=1e-5)


def test_on_policy_step_is_plain_policy_gradient():
    new, _, adv, mask = batch(seed=4)
    new.requires_grad_(True)
    loss, metrics = policy_loss(new, new.detach(), adv, mask)
    loss.backward()
    n = mask.sum()
    assert loss.item() == pytest.approx(-(adv * mask).sum().item() / n.item(), abs=1e-6)
    assert torch.allclose(new.grad, -adv * mask / n)
    assert metrics["clipfrac"] == 0.0 and metrics["approx_kl"] == 0.0 and metrics["ratio_max"] == 1.0


def test_policy_loss_rejects_bad_arguments():
    new, old, adv, mask = batch()
    with pytest.raises(ValueError, match="clip_low=1.0"):
        policy_loss(new, old, adv, mask, clip_low=1.0)
    with pytest.raises(ValueError, match="dual_clip_c=0.5"):
        policy_loss(new, old, adv, mask, dual_clip_c=0.5)
    with pytest.raises(ValueError, match=r"advantages has shape \(5,\)"):
        policy_loss(new, old, adv[:, 0], mask)
    with pytest.raises(ValueError, match=r"'sum'.*token-mean"):
        policy_loss(new, old, adv, mask, agg="sum")


def test_kl_kinds_formulas_signs_and_zero_at_equality():
    g = gen(5)
    lp, ref = -3 * torch.rand(4, 6, generator=g), -3 * torch.rand(4, 6, generator=g)
    for kind in KL_KINDS:
        assert torch.equal(kl_penalty(lp, lp.clone(), kind), torch.zeros(4, 6)), kind
    for (a, b), k1, k2, k3, ab in zip(zip(lp.flatten().tolist(), ref.flatten().tolist()),
                                      *(kl_penalty(lp, ref, k).flatten().tolist() for k in ("k1", "k2", "k3", "abs"))):
        assert k1 == pytest.approx(a - b, abs=1e-6)
        assert k2 == pytest.approx((a - b) ** 2 / 2, abs=1e-6)
        assert k3 == pytest.approx(math.exp(b - a) - (b - a) - 1, abs=1e-5)
        assert ab == pytest.approx(abs(a - b), abs=1e-6)
    wide = 8 * torch.randn(1000, generator=g)
    k3 = kl_penalty(wide, torch.zeros(1000), "k3")
    assert (k3 >= 0).all() and (k3 <= 10).all() and torch.isfinite(k3).all()
    assert kl_penalty(torch.tensor([-200.0]), torch.tensor([0.0]), "k3").item() == 10.0
    with pytest.raises(ValueError, match=r"'k4'.*'k1', 'k2', 'k3', 'abs'"):
        kl_penalty(lp, ref, "k4")


def test_kl_estimators_on_samples_from_the_policy():
    """k1 and k3 estimate KL(policy || ref); k2 as a loss has the gradient of that KL."""
    g = gen(6)
    theta = torch.randn(5, generator=g, dtype=torch.float64).requires_grad_(True)
    ref = torch.log_softmax(torch.randn(5, generator=g, dtype=torch.float64), 0)
    logp = torch.log_softmax(theta, 0)
    exact = (logp.exp() * (logp - ref)).sum()
    (exact_grad,) = torch.autograd.grad(exact, theta, retain_graph=True)

    x = torch.multinomial(logp.detach().exp(), 400_000, replacement=True, generator=g)
    for kind in ("k1", "k3"):
        assert kl_penalty(logp[x], ref[x], kind).mean().item() == pytest.approx(exact.item(), abs=0.01)
    (k2_grad,) = torch.autograd.grad(kl_penalty(logp[x], ref[x], "k2").mean(), theta)
    assert torch.allclose(k2_grad, exact_grad, atol=0.01)


@pytest.mark.parametrize("scale", [1.0, 300.0])
def test_entropy_matches_categorical_values_and_gradients(scale):
    logits = (scale * torch.randn(3, 4, 50, generator=gen(7), dtype=torch.float64)).requires_grad_(True)
    got = entropy_from_logits(logits, chunk_rows=5)
    want = Categorical(logits=logits).entropy()
    assert got.shape == (3, 4) and torch.allclose(got, want, atol=1e-10)
    w = torch.randn(3, 4, generator=gen(8), dtype=torch.float64)
    (g1,) = torch.autograd.grad((got * w).sum(), logits)
    (g2,) = torch.autograd.grad((want * w).sum(), logits)
    assert torch.allclose(g1, g2, atol=1e-10)


def test_entropy_with_masked_vocab_and_half_precision():
    logits = torch.randn(6, 40, generator=gen(9))
    logits[:, 30:] = float("-inf")
    logits[0, 1:] = float("-inf")  # one certain token: entropy 0
    got = entropy_from_logits(logits)
    assert torch.isfinite(got).all() and got[0].item() == 0.0
    assert torch.allclose(got, Categorical(logits=logits[:, :30]).entropy(), atol=1e-5)
    bf = torch.randn(4, 1000, generator=gen(10)).to(torch.bfloat16)
    out = entropy_from_logits(bf)
    assert out.dtype == torch.float32
    assert torch.allclose(out, Categorical(logits=bf.float()).entropy(), atol=1e-5)


def test_logprobs_match_log_softmax_gather():
    g = gen(11)
    logits = (10 * torch.randn(3, 7, 33, generator=g, dtype=torch.float64)).requires_grad_(True)
    labels = torch.randint(0, 33, (3, 7), generator=g)
    got = logprobs_from_logits(logits, labels, chunk_rows=4)
    want = torch.log_softmax(logits, -1).gather(-1, labels[..., None]).squeeze(-1)
    assert got.shape == (3, 7) and torch.allclose(got, want, atol=1e-12)
    w = torch.randn(3, 7, generator=g, dtype=torch.float64)
    (g1,) = torch.autograd.grad((got * w).sum(), logits)
    (g2,) = torch.autograd.grad((want * w).sum(), logits)
    assert torch.allclose(g1, g2, atol=1e-12)

    bf = torch.randn(5, 2000, generator=g).to(torch.bfloat16) * 4
    idx = torch.randint(0, 2000, (5,), generator=g)
    out = logprobs_from_logits(bf, idx)
    assert out.dtype == torch.float32
    assert torch.allclose(out, torch.log_softmax(bf.float(), -1)[torch.arange(5), idx], atol=1e-5)
    assert logprobs_from_logits(torch.zeros(0, 9), torch.zeros(0, dtype=torch.long)).shape == (0,)

    # the backward of bf16 and fp32 logits: the reference's gradient, in the logits' dtype, logits untouched
    for dtype in (torch.bfloat16, torch.float32):
        z = (torch.randn(6, 300, generator=g) * 4).to(dtype).requires_grad_(True)
        before = z.detach().clone()
        lab = torch.randint(0, 300, (6,), generator=g)
        w6 = torch.randn(6, generator=g)
        (gz,) = torch.autograd.grad((logprobs_from_logits(z, lab, chunk_rows=4) * w6).sum(), z)
        zf = z.detach().float().requires_grad_(True)
        (gref,) = torch.autograd.grad((torch.log_softmax(zf, -1)[torch.arange(6), lab] * w6).sum(), zf)
        assert gz.dtype == dtype and torch.equal(z.detach(), before)
        assert torch.allclose(gz.float(), gref, atol=1e-2 if dtype == torch.bfloat16 else 1e-6)
    with pytest.raises(ValueError, match=r"labels have shape \(3, 6\)"):
        logprobs_from_logits(logits, labels[:, :6])


@pytest.mark.parametrize("field,value,allowed", [
    ("clip_low", 1.0, "0 <= clip_low < 1"),
    ("clip_low", -0.1, "0 <= clip_low < 1"),
    ("clip_high", -0.2, "clip_high >= 0"),
    ("clip_high", "0.2", "a finite number"),
    ("clip_high", float("nan"), "a finite number"),
    ("dual_clip_c", 1.0, "> 1"),
    ("agg", "mean", "token-mean, seq-mean-token-sum, seq-mean-token-mean"),
    ("kl_kind", "low_var", "k1, k2, k3, abs"),
    ("kl_coef", -0.01, "kl_coef >= 0"),
    ("use_kl_loss", "yes", "true or false"),
    ("entropy_coef", -1e-3, "entropy_coef >= 0"),
    ("off_policy", "ppo", "none, tis, mis, decoupled"),
    ("is_level", "row", "token, sequence"),
    ("is_cap", 0.5, "is_cap >= 1"),
    ("is_cap", float("inf"), "a finite number"),
    ("is_band", (0.5,), "[low, high] with 0 <= low <= 1 <= high"),
    ("is_band", (1.5, 3.0), "[low, high] with 0 <= low <= 1 <= high"),
    ("is_band", (-0.1, 2.0), "[low, high] with 0 <= low <= 1 <= high"),
])
def test_loss_config_rejects_bad_values_naming_the_field(field, value, allowed):
    with pytest.raises(ValueError) as err:
        LossConfig(**{field: value})
    assert f"loss.{field}={value!r}" in str(err.value) and allowed in str(err.value)


def test_compute_loss_combines_terms():
    new, old, adv, mask = batch(seed=12)
    ref = old + 0.1 * torch.randn(old.shape, generator=gen(13))
    ent = torch.rand(old.shape, generator=gen(14))
    cfg = LossConfig(clip_high=0.28, agg="seq-mean-token-mean", kl_coef=0.05, kl_kind="k3", use_kl_loss=True,
                     entropy_coef=0.01)
    inp = new.clone().requires_grad_(True)
    loss, metrics = compute_loss(cfg, inp, old, adv, mask, ref_logprobs=ref, entropy=ent)
    pg, _ = policy_loss(new, old, adv, mask, clip_high=0.28, agg=cfg.agg)
    kl = agg_loss(kl_penalty(new, ref, "k3"), mask, cfg.agg)
    h = agg_loss(ent, mask, cfg.agg)
    assert loss.item() == pytest.approx((pg + 0.05 * kl - 0.01 * h).item(), abs=1e-6)
    assert metrics["kl"] == pytest.approx(kl.item()) and metrics["entropy"] == pytest.approx(h.item())
    assert metrics["pg_loss"] == pytest.approx(pg.item()) and metrics["loss"] == pytest.approx(loss.item())
    loss.backward()
    assert torch.isfinite(inp.grad).all() and inp.grad[~mask.bool()].abs().sum() == 0

    # KL in the reward: reported, not added to the loss
    loss2, m2 = compute_loss(LossConfig(kl_coef=0.05, use_kl_loss=False), new, old, adv, mask, ref_logprobs=ref)
    assert loss2.item() == pytest.approx(policy_loss(new, old, adv, mask)[0].item()) and "kl" in m2

    # padding garbage in the reference does not reach the gradient (k2 squares an inf)
    padded_ref = torch.where(mask.bool(), ref, float("-inf"))
    inp = new.clone().requires_grad_(True)
    loss3, _ = compute_loss(LossConfig(kl_coef=0.05, kl_kind="k2", use_kl_loss=True), inp, old, adv, mask,
                            ref_logprobs=padded_ref)
    loss3.backward()
    assert torch.isfinite(loss3) and torch.isfinite(inp.grad).all()


def test_compute_loss_missing_inputs_say_how_to_fix():
    new, old, adv, mask = batch()
    with pytest.raises(ValueError, match="no ref_logprobs.*use_kl_loss=false"):
        compute_loss(LossConfig(kl_coef=0.1, use_kl_loss=True), new, old, adv, mask)
    with pytest.raises(ValueError, match="entropy_coef=0.01 but no entropy"):
        compute_loss(LossConfig(entropy_coef=0.01), new, old, adv, mask)
    loss, metrics = compute_loss(LossConfig(), new, old, adv, mask)  # plain PPO needs neither
    assert "kl" not in metrics and "entropy" not in metrics


# ------------------------------------------------------------------ off-policy correction
# One row, three trained tokens and one padding token. r = current / proximal = [1.1, 0.7, 1.0];
# w = proximal / behaviour = [0.5, 1.5, 4.0]. PPO per token (clip 0.2): A=1, r=1.1 -> -1.1;
# A=-2, r=0.7 clipped to 0.8 -> 1.6; A=3, r=1 -> -3.
HAND_PPO = [-1.1, 1.6, -3.0]
HAND_W = [0.5, 1.5, 4.0]


def hand_case() -> tuple[torch.Tensor, ...]:
    old = torch.tensor([[-1.0, -2.0, -0.5, float("-inf")]])
    new = old + torch.log(torch.tensor([[1.1, 0.7, 1.0, 1.0]]))
    rollout = old - torch.log(torch.tensor([[0.5, 1.5, 4.0, 1.0]]))
    rollout[0, -1] = float("nan")  # padding garbage in the behaviour logprobs must not matter
    adv = torch.tensor([[1.0, -2.0, 3.0, 0.0]])
    mask = torch.tensor([[1, 1, 1, 0]])
    return new, old, adv, mask, rollout


def test_off_policy_none_keeps_the_plain_arithmetic_and_reports_the_gap():
    new, old, adv, mask = batch(seed=20)
    rollout = old + 0.3 * torch.randn(old.shape, generator=gen(21))
    a_in, b_in = new.clone().requires_grad_(True), new.clone().requires_grad_(True)
    plain, m_plain = compute_loss(LossConfig(), a_in, old, adv, mask)
    none, m_none = compute_loss(LossConfig(off_policy="none"), b_in, old, adv, mask, rollout_logprobs=rollout)
    plain.backward()
    none.backward()
    assert torch.equal(plain, none) and torch.equal(a_in.grad, b_in.grad)
    assert torch.equal(plain, policy_loss(new, old, adv, mask)[0])
    assert "is_weight_mean" not in m_plain  # nothing to measure without behaviour logprobs
    assert m_none["is_weight_mean"] > 0 and m_none["rollout_kl"] > 0 and m_none["is_masked_frac"] == 0.0


@pytest.mark.parametrize("mode", OFF_POLICY_MODES)
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_behaviour_equal_to_proximal_gives_exactly_the_plain_loss(mode, level):
    new, old, adv, mask = batch(seed=22)
    plain, _ = compute_loss(LossConfig(), new, old, adv, mask)
    loss, m = compute_loss(LossConfig(off_policy=mode, is_level=level), new, old, adv, mask,
                           rollout_logprobs=old.clone())
    assert torch.equal(loss, plain)  # w = exp(0) = 1 exactly, so every factor is exactly 1
    assert m["is_weight_mean"] == m["is_weight_max"] == 1.0
    assert m["is_masked_frac"] == 0.0 and m["rollout_kl"] == 0.0


def test_tis_truncates_the_weight_and_keeps_the_proximal_ratio():
    new, old, adv, mask, rollout = hand_case()
    new.requires_grad_(True)
    loss, m = compute_loss(LossConfig(off_policy="tis", is_cap=2.0), new, old, adv, mask, rollout_logprobs=rollout)
    loss.backward()
    factor = [0.5, 1.5, 2.0]  # 4.0 truncated at the cap
    assert loss.item() == pytest.approx(sum(p * f for p, f in zip(HAND_PPO, factor)) / 3, abs=1e-6)
    # d/d logprob of -A r f is -A r f / n where the clip is inactive; the clipped token gets none
    assert new.grad[0].tolist() == pytest.approx([-1.1 * 0.5 / 3, 0.0, -3.0 * 2.0 / 3, 0.0], abs=1e-6)
    assert m["pg_loss"] == pytest.approx(loss.item())


def test_decoupled_uses_the_untruncated_weight():
    new, old, adv, mask, rollout = hand_case()
    loss, _ = compute_loss(LossConfig(off_policy="decoupled"), new, old, adv, mask, rollout_logprobs=rollout)
    assert loss.item() == pytest.approx(sum(p * w for p, w in zip(HAND_PPO, HAND_W)) / 3, abs=1e-6)
    wide, _ = compute_loss(LossConfig(off_policy="tis", is_cap=10.0), new, old, adv, mask, rollout_logprobs=rollout)
    assert loss.item() == pytest.approx(wide.item(), abs=1e-7)  # tis with a cap above every w is decoupled


def test_off_policy_metrics_on_a_hand_made_example():
    new, old, adv, mask, rollout = hand_case()
    for mode in OFF_POLICY_MODES:  # the gap is reported whatever the correction
        _, m = compute_loss(LossConfig(off_policy=mode), new, old, adv, mask, rollout_logprobs=rollout)
        assert m["is_weight_mean"] == pytest.approx(2.0, rel=1e-6)
        assert m["is_weight_max"] == pytest.approx(4.0, rel=1e-6)
        assert m["rollout_kl"] == pytest.approx(sum(w - 1 - math.log(w) for w in HAND_W) / 3, rel=1e-5)
        assert m["is_masked_frac"] == pytest.approx(1 / 3 if mode == "mis" else 0.0)  # 4.0 is outside [0.5, 2]
    _, m = compute_loss(LossConfig(), new, old, adv, torch.zeros_like(mask), rollout_logprobs=rollout)
    assert m["is_weight_mean"] == m["is_weight_max"] == m["is_masked_frac"] == m["rollout_kl"] == 0.0


def test_mis_token_level_drops_tokens_outside_the_band_but_keeps_the_denominator():
    new, old, adv, mask = batch(seed=23)
    log_w = torch.log(torch.tensor([0.3, 0.9, 1.2, 2.5, 1.0, 0.6, 1.9, 3.0])).expand_as(old)
    rollout = old - log_w
    new.requires_grad_(True)
    loss, m = compute_loss(LossConfig(off_policy="mis", is_band=(0.5, 2.0)), new, old, adv, mask,
                           rollout_logprobs=rollout)
    loss.backward()
    inside = ((log_w.exp() >= 0.5) & (log_w.exp() <= 2.0)).float()
    per_token = [[ref_token_loss(n, o, a, 0.2, 0.2, None) * k for n, o, a, k in zip(*rows)]
                 for rows in zip(new.tolist(), old.tolist(), adv.tolist(), inside.tolist())]
    assert loss.item() == pytest.approx(ref_agg(per_token, mask, "token-mean"), abs=1e-6)
    keep = mask.bool()
    assert (new.grad[keep & (inside == 0)] == 0).all() and (new.grad[keep & (inside == 1)] != 0).any()
    assert m["is_masked_frac"] == pytest.approx(float((inside == 0)[keep].float().mean()))


def rows_case() -> tuple[torch.Tensor, ...]:
    """Three rows whose token weights are [3, 0.5], [1.5, 1.5] and [0.25]: inside the band
    [0.5, 2] as sequences (product 1.5), outside as a sequence though every token is inside
    (2.25), outside either way (0.25). The third row's padding holds garbage."""
    old = torch.tensor([[-1.0, -2.0, -1.5], [-0.5, -1.0, -2.0], [-3.0, 0.0, 0.0]])
    w = torch.tensor([[3.0, 0.5, 1.0], [1.5, 1.5, 1.0], [0.25, 1.0, 1.0]])
    rollout = old - torch.log(w)
    rollout[2, 1:] = float("-inf")
    mask = torch.tensor([[1, 1, 0], [1, 1, 0], [1, 0, 0]])
    new = old + 0.05 * torch.randn(old.shape, generator=gen(24))
    adv = torch.tensor([[1.0, -1.0, 0.0], [2.0, 2.0, 0.0], [-1.0, 0.0, 0.0]])
    return new, old, adv, mask, rollout


def test_sequence_level_weight_is_one_per_row():
    _, old, _, mask, rollout = rows_case()
    factor, m = behaviour_weights(old, rollout, mask, "decoupled", "sequence")
    for row, want in enumerate([1.5, 2.25, 0.25]):
        n = int(mask[row].sum())
        assert factor[row, :n].tolist() == pytest.approx([want] * n, rel=1e-6)
    assert m["is_weight_max"] == pytest.approx(2.25, rel=1e-6)
    assert m["is_weight_mean"] == pytest.approx((2 * 1.5 + 2 * 2.25 + 0.25) / 5, rel=1e-6)
    tis, _ = behaviour_weights(old, rollout, mask, "tis", "sequence", cap=2.0)
    assert tis[1, :2].tolist() == pytest.approx([2.0, 2.0]) and tis[0, :2].tolist() == pytest.approx([1.5, 1.5])


@pytest.mark.parametrize("level,kept", [("token", [[0, 1], [1, 1], [0]]), ("sequence", [[1, 1], [0, 0], [0]])])
def test_mis_drops_tokens_or_whole_rows(level, kept):
    new, old, adv, mask, rollout = rows_case()
    cfg = LossConfig(off_policy="mis", is_level=level, agg="seq-mean-token-mean")
    loss, m = compute_loss(cfg, new, old, adv, mask, rollout_logprobs=rollout)
    per_token = [[ref_token_loss(n, o, a, 0.2, 0.2, None) * (k[i] if i < len(k) else 0)
                  for i, (n, o, a) in enumerate(zip(*rows))]
                 for rows, k in zip(zip(new.tolist(), old.tolist(), adv.tolist()), kept)]
    # a dropped token still counts in its row's length and a dropped row in the number of rows
    assert loss.item() == pytest.approx(ref_agg(per_token, mask, "seq-mean-token-mean"), abs=1e-6)
    assert m["is_masked_frac"] == pytest.approx(sum(len(k) - sum(k) for k in kept) / 5)
    # so micro-batches with the mini-batch denominator still add up to the whole
    parts = [compute_loss(cfg, new[s], old[s], adv[s], mask[s], denominator=3.0, rollout_logprobs=rollout[s])[0]
             for s in (slice(0, 1), slice(1, 3))]
    assert sum(parts).item() == pytest.approx(loss.item(), abs=1e-6)


def test_off_policy_needs_rollout_logprobs_and_known_names():
    new, old, adv, mask = batch()
    with pytest.raises(ValueError, match="off_policy='tis'.*no rollout_logprobs.*off_policy=none"):
        compute_loss(LossConfig(off_policy="tis"), new, old, adv, mask)
    with pytest.raises(ValueError, match=r"'is'.*'none', 'tis', 'mis', 'decoupled'"):
        behaviour_weights(old, old, mask, mode="is")
    with pytest.raises(ValueError, match=r"'row'.*'token', 'sequence'"):
        behaviour_weights(old, old, mask, level="row")
    with pytest.raises(ValueError, match=r"rollout_logprobs has shape \(5, 7\)"):
        behaviour_weights(old, old[:, :7], mask)
