"""The RL objective over padded token batches: PPO-clip policy loss, KL, entropy, aggregation.

Everything works on [B, T] tensors aligned with `response_mask` (1 = a token the model
generated and we train on; 0 = prompt, tool output, template, padding). Masked positions may
hold garbage (padding logprobs can be -inf), so masking uses `torch.where`, never `x * mask`,
which would turn -inf * 0 into NaN; `policy_loss` and `compute_loss` zero masked inputs before
any arithmetic, so garbage there reaches neither the loss nor its gradient.

One loss is built from three terms, each aggregated the same way (`agg_loss`):
    loss = policy_loss + kl_coef * kl_penalty  (only when the KL is a loss)  - entropy_coef * entropy
When the KL belongs in the reward instead, the trainer takes the per-token `kl_penalty(...)`
and hands it to `engines.training.advantages.reinforce_pp(kl=..., kl_coef=...)` or subtracts it from the
rewards; `compute_loss` then leaves it out.

Three policies meet in an off-policy batch: the behaviour policy that sampled the tokens (the
engine's `rollout_logprobs`: older weights under bounded staleness, another numeric stack
always), the proximal policy (the actor before this update: `old_logprobs`) and the current one.
PPO's ratio and clip only relate current to proximal; `behaviour_weights` supplies the per-token
factor that corrects for behaviour != proximal (`LossConfig.off_policy`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

IGNORE_INDEX = -100  # label of tokens a cross entropy skips (PyTorch's default ignore_index)
AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean")
KL_KINDS = ("k1", "k2", "k3", "abs")
OFF_POLICY_MODES = ("none", "tis", "mis", "decoupled")
IS_LEVELS = ("token", "sequence")
_MAX_LOG_RATIO = 20.0  # exp(20) ~ 5e8: any real ratio is far inside; stops inf/NaN from a bad row
_K3_MAX = 10.0


def _check_like(mask: torch.Tensor, **tensors: torch.Tensor) -> None:
    for name, t in tensors.items():
        if t.shape != mask.shape:
            raise ValueError(f"{name} has shape {tuple(t.shape)} but response_mask is {tuple(mask.shape)}; "
                             "pass per-token [B, T] tensors aligned with the mask")


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of `x` over positions where `mask` is 1 (over all of them, or along `dim`).

    A slice with no mask-1 positions averages to 0, not NaN: a micro-batch made only of tool
    tokens must not poison the step.
    """
    keep = mask.bool()
    total = torch.where(keep, x, 0).sum() if dim is None else torch.where(keep, x, 0).sum(dim)
    count = keep.sum() if dim is None else keep.sum(dim)
    return total / count.clamp_min(1).to(total.dtype)


def agg_loss(loss_mat: torch.Tensor, mask: torch.Tensor, mode: str = "token-mean",
             denominator: float | None = None) -> torch.Tensor:
    """Reduce a per-token loss [B, T] to a scalar; the mode decides how much each token weighs.

    - "token-mean": sum over all mask-1 tokens of the batch / their number. Every token weighs
      the same, so long answers are not discounted (DAPO's token-level loss; verl's default).
    - "seq-mean-token-sum": each sequence's token sum, averaged over sequences. The normaliser
      does not depend on a sequence's length (Dr. GRPO, which divides by a constant; its extra
      constant "max tokens" factor only rescales the learning rate and is left out).
    - "seq-mean-token-mean": each sequence's token mean, averaged over sequences (the original
      GRPO objective; every sequence weighs the same whatever its length).
    Sequences without a mask-1 token are not counted in the seq-mean modes.

    `denominator`: with gradient accumulation or data parallelism, pass the number of mask-1
    tokens ("token-mean") or of sequences with a mask-1 token (the seq modes) in the whole
    mini-batch, over all micro-batches and ranks. The result is then sum / denominator, so the
    micro-batch losses add up to exactly the mini-batch loss instead of a mean of means.
    """
    if mode not in AGG_MODES:
        raise ValueError(f"unknown loss aggregation {mode!r}; choose one of {list(AGG_MODES)}")
    if denominator is not None and not denominator > 0:
        raise ValueError(f"denominator={denominator}; it must be > 0 (a count of tokens or sequences "
                         "across the mini-batch), or None to normalise by this batch alone")
    _check_like(mask, loss_mat=loss_mat)
    keep = mask.bool()
    masked = torch.where(keep, loss_mat, 0)
    if mode == "token-mean":
        total, count = masked.sum(), keep.sum()
    else:
        per_seq = masked.sum(dim=-1)
        if mode == "seq-mean-token-mean":
            per_seq = per_seq / keep.sum(dim=-1).clamp_min(1)
        total, count = per_seq.sum(), keep.any(dim=-1).sum()
    if denominator is not None:
        return total / denominator
    return total / count.clamp_min(1).to(total.dtype)


def value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, response_mask: torch.Tensor,
               clip: float = 0.0, denominator: float | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """The critic's loss: 0.5 * (V - R)^2 token-mean over mask-1 tokens. With `clip` > 0 a value
    may move at most `clip` from the value it had when the batch was scored (`old_values`), the
    larger of the clipped and unclipped errors counting (PPO's value clipping), so one batch cannot
    drag the critic far. `denominator` as in `agg_loss` (mask-1 tokens of the whole mini-batch)."""
    _check_like(response_mask, values=values, old_values=old_values, returns=returns)
    if clip < 0:
        raise ValueError(f"value clip={clip}; it must be >= 0 (0 = no clipping)")
    keep = response_mask.bool()
    err = (values - returns) ** 2
    clipped = torch.zeros((), dtype=torch.bool)
    if clip > 0:
        moved = old_values + (values - old_values).clamp(-clip, clip)
        err_clipped = (moved - returns) ** 2
        clipped = keep & (err_clipped > err)
        err = torch.maximum(err, err_clipped)
    loss = agg_loss(0.5 * err, response_mask, "token-mean", denominator)
    n = keep.sum().clamp_min(1)
    return loss, {"loss": float(loss.detach()), "vf_clipfrac": float(clipped.sum() / n),
                  "values_mean": float(torch.where(keep, values.detach(), 0).sum() / n)}


def policy_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                response_mask: torch.Tensor, clip_low: float = 0.2, clip_high: float = 0.2,
                dual_clip_c: float | None = None, agg: str = "token-mean",
                denominator: float | None = None,
                token_weights: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO clipped surrogate: per token max(-A r, -A clip(r, 1 - clip_low, 1 + clip_high)).

    r = exp(logprobs - old_logprobs). Asymmetric bounds are DAPO's "clip-higher": a larger
    `clip_high` lets low-probability tokens with positive advantage grow further, which keeps
    entropy from collapsing. Where the clip is active the loss is constant in `logprobs`, so
    those tokens get no gradient.

    `dual_clip_c` (> 1; Ye et al. 2020, "dual-clip PPO") caps the loss of negative-advantage
    tokens at -A * c: a token whose ratio has already exploded (stale data, off-policy engine)
    cannot dominate the step. It does not touch positive advantages.

    `token_weights` ([B, T], detached; from `behaviour_weights`) multiply each token's clipped
    (and dual-clipped) loss before aggregation: the off-policy correction. None leaves the
    arithmetic exactly as without it.

    Metrics (floats over mask-1 tokens): `clipfrac` (the clip bound was active),
    `clipfrac_high` / `clipfrac_low` (which side), `dual_clipfrac`, `approx_kl` (the k3
    estimate of KL(old || new), r - 1 - log r >= 0), `ratio_mean`, `ratio_max`; all 0 with no mask-1 tokens.
    """
    if not 0 <= clip_low < 1 or not clip_high >= 0:
        raise ValueError(f"clip_low={clip_low}, clip_high={clip_high}; need 0 <= clip_low < 1 and "
                         "clip_high >= 0 (the ratio is clipped to [1 - clip_low, 1 + clip_high])")
    if dual_clip_c is not None and not dual_clip_c > 1:
        raise ValueError(f"dual_clip_c={dual_clip_c}; it must be > 1 (3.0 is usual) or None to disable")
    _check_like(response_mask, logprobs=logprobs, old_logprobs=old_logprobs, advantages=advantages)
    keep = response_mask.bool()
    # zero the masked positions *before* any arithmetic: a -inf there would give NaN gradients
    adv = torch.where(keep, advantages.detach(), 0)
    log_ratio = torch.where(keep, logprobs - old_logprobs.detach(), 0).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    ratio = torch.exp(log_ratio)
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1 - clip_low, 1 + clip_high)
    loss_mat = torch.maximum(unclipped, clipped)
    dual = torch.zeros_like(keep)
    if dual_clip_c is not None:
        cap = -adv * dual_clip_c
        dual = (adv < 0) & (loss_mat > cap)
        loss_mat = torch.where(adv < 0, torch.minimum(loss_mat, cap), loss_mat)
    if token_weights is not None:
        _check_like(response_mask, token_weights=token_weights)
        loss_mat = loss_mat * torch.where(keep, token_weights.detach(), 0)
    loss = agg_loss(loss_mat, response_mask, agg, denominator)

    with torch.no_grad():
        r = ratio.detach()
        high = (adv > 0) & (r > 1 + clip_high)
        low = (adv < 0) & (r < 1 - clip_low)
        mean = lambda x: masked_mean(x.float(), keep).item()  # noqa: E731
        metrics = {
            "pg_loss": loss.item(),
            "clipfrac": mean(high | low),
            "clipfrac_high": mean(high),
            "clipfrac_low": mean(low),
            "dual_clipfrac": mean(dual),
            "approx_kl": mean(torch.expm1(log_ratio.detach()) - log_ratio.detach()),
            "ratio_mean": mean(r),
            "ratio_max": torch.where(keep, r, 0).max().item() if keep.numel() else 0.0,
        }
    return loss, metrics


def behaviour_weights(old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, response_mask: torch.Tensor,
                      mode: str = "none", level: str = "token", cap: float = 2.0,
                      band: tuple[float, float] = (0.5, 2.0)) -> tuple[torch.Tensor | None, dict[str, float]]:
    """Importance weights w = pi_old / mu of the proximal policy (`old_logprobs`) over the behaviour
    policy that sampled the tokens (`rollout_logprobs`), and the per-token factor `mode` turns
    them into for `policy_loss(token_weights=...)` (None for "none": nothing to correct).

    log w is clamped to +-20 like the PPO log ratio, so one broken row cannot make inf or NaN.
    `level="sequence"` uses one weight per row, exp(sum of the row's mask-1 log w), for all its
    tokens (a micro-batch always holds whole rows, so the sum is complete); it is unbiased for
    sequence-level objectives but its variance grows with length.
    - "tis": truncated IS, factor min(w, cap). Bounded variance, biased where w > cap.
    - "mis": masked IS, factor 1 where w is inside `band`, 0 outside: those tokens (or whole rows)
      leave the loss. They stay in the denominator of `agg_loss`, so the micro-batch losses still
      add up exactly to the mini-batch loss and a dropped token just contributes 0.
    - "decoupled" (decoupled PPO, Hilton et al. 2021; AReaL): factor w, untruncated: the PPO
      objective of the proximal policy, importance-weighted from behaviour samples, so the trust
      region stays around the proximal policy however stale the data. tis is the same product with
      w truncated at `cap`: bounded variance, paid for with bias where the gap is large.

    Metrics over mask-1 tokens, for every mode (0 with none): `is_weight_mean`, `is_weight_max`
    (of w at `level`, before truncation or masking: the off-policy gap itself), `is_masked_frac`
    (tokens "mis" dropped) and `rollout_kl`, the k3 estimate of KL(mu || pi_old) per token,
    w - 1 - log w >= 0 (the tokens are samples of mu).
    """
    if mode not in OFF_POLICY_MODES:
        raise ValueError(f"unknown off-policy correction {mode!r}; choose one of {list(OFF_POLICY_MODES)}")
    if level not in IS_LEVELS:
        raise ValueError(f"unknown importance-weight level {level!r}; choose one of {list(IS_LEVELS)}")
    _check_like(response_mask, old_logprobs=old_logprobs, rollout_logprobs=rollout_logprobs)
    keep = response_mask.bool()
    with torch.no_grad():
        log_w = torch.where(keep, old_logprobs.detach() - rollout_logprobs.detach(), 0)
        tok = log_w.clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
        if level == "sequence":
            log_w = log_w.sum(dim=-1, keepdim=True).expand_as(log_w)
        w = torch.exp(log_w.clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO))
        dropped = torch.zeros_like(keep)
        factor: torch.Tensor | None = None
        if mode == "tis":
            factor = w.clamp(max=cap)
        elif mode == "mis":
            dropped = keep & ((w < band[0]) | (w > band[1]))
            factor = (~dropped).to(w.dtype)
        elif mode == "decoupled":
            factor = w
        mean = lambda x: masked_mean(x.float(), keep).item()  # noqa: E731
        metrics = {
            "is_weight_mean": mean(w),
            "is_weight_max": torch.where(keep, w, 0).max().item() if keep.numel() else 0.0,
            "is_masked_frac": mean(dropped),
            "rollout_kl": mean(torch.expm1(tok) - tok),
        }
    return factor, metrics


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, kind: str = "k3") -> torch.Tensor:
    """Per-token estimate of KL(policy || reference) from tokens sampled by the policy.

    With d = logprobs - ref_logprobs (Schulman, "Approximating KL divergence", 2020):
    - "k1": d. Unbiased for the KL value, high variance, can be negative. The estimator for
      KL-in-reward; as a loss its expected gradient is zero, so it does nothing there.
    - "k2": d^2 / 2. Biased value, but as a loss its gradient is that of KL(policy || ref).
    - "k3": exp(-d) - 1 + d. Unbiased, never negative, low variance (the "low_var_kl" of GRPO).
      exp(-d) explodes when the policy drifts far below the reference, so d is clamped to
      [-20, 20] and the result to at most 10; clamped tokens get no gradient.
    - "abs": |d|.
    Returns [B, T]; aggregate it with `agg_loss` for a KL loss, or add `-kl_coef *` it to the
    token rewards for KL-in-reward.
    """
    if kind not in KL_KINDS:
        raise ValueError(f"unknown KL estimator {kind!r}; choose one of {list(KL_KINDS)}")
    if logprobs.shape != ref_logprobs.shape:
        raise ValueError(f"logprobs {tuple(logprobs.shape)} and ref_logprobs {tuple(ref_logprobs.shape)} "
                         "differ in shape; both must be per-token [B, T] for the same tokens")
    d = logprobs - ref_logprobs.detach()
    if kind == "k1":
        return d
    if kind == "k2":
        return 0.5 * d.square()
    if kind == "abs":
        return d.abs()
    d = d.clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    return (torch.expm1(-d) + d).clamp(min=0.0, max=_K3_MAX)


def _rows(t: torch.Tensor, chunk_rows: int) -> list[torch.Tensor]:
    if chunk_rows < 1:
        raise ValueError(f"chunk_rows={chunk_rows}; it must be >= 1 (rows of logits processed at once)")
    return list(t.split(chunk_rows, dim=0)) if t.shape[0] else [t]


def _upcast(x: torch.Tensor) -> torch.Tensor:
    """bf16/fp16 logsumexp loses the small logprobs the ratio depends on; work in fp32."""
    return x if x.dtype in (torch.float32, torch.float64) else x.float()


def logprobs_from_logits(logits: torch.Tensor, labels: torch.Tensor, chunk_rows: int = 1024) -> torch.Tensor:
    """log softmax(logits)[label] for every position: [..., V] logits, [...] labels -> [...].

    Computed as logits[label] - logsumexp(logits), chunk by chunk of `chunk_rows` positions, in fp32
    (bf16 logsumexp loses the small logprobs the ratio depends on). `log_softmax` + gather would
    write a full [N, V] output and keep it alive for backward; this keeps only the logits and [N]
    numbers, and its backward (`_TargetLogprob`) recomputes each chunk's softmax once and writes the
    logits' gradient in their own dtype, where autograd through logsumexp and gather would keep an fp32
    copy of the logits and make several [N, V] passes (1.14x faster bf16 CPU update, measured).
    """
    if logits.shape[:-1] != labels.shape:
        raise ValueError(f"labels have shape {tuple(labels.shape)} but logits are {tuple(logits.shape)}; "
                         "labels must match logits without the vocab dimension (shift them before calling)")
    flat, ids = logits.reshape(-1, logits.shape[-1]), labels.reshape(-1, 1).long()
    return _TargetLogprob.apply(flat, ids, chunk_rows).reshape(labels.shape)


class _TargetLogprob(torch.autograd.Function):
    """[N, V] logits, [N, 1] ids -> [N] log softmax(logits)[id]; d/dlogits = g * (onehot(id) - softmax)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, ids: torch.Tensor, chunk_rows: int) -> torch.Tensor:
        out, lses = [], []
        for xc, ic in zip(_rows(x, chunk_rows), _rows(ids, chunk_rows)):
            xc = _upcast(xc)
            lse = torch.logsumexp(xc, dim=-1)
            out.append(xc.gather(-1, ic).squeeze(-1) - lse)
            lses.append(lse)
        ctx.save_for_backward(x, ids, torch.cat(lses))
        ctx.chunk_rows = chunk_rows
        return torch.cat(out)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        x, ids, lse = ctx.saved_tensors
        grad = torch.empty_like(x)
        c = ctx.chunk_rows
        for at in range(0, x.shape[0], c):
            p = x[at:at + c].to(torch.float32 if x.dtype != torch.float64 else x.dtype, copy=True)
            p.sub_(lse[at:at + c, None]).exp_().mul_(-g[at:at + c, None])  # -g * softmax
            p.scatter_add_(-1, ids[at:at + c], g[at:at + c, None].to(p.dtype))  # + g at the label
            grad[at:at + c].copy_(p)
        return grad, None, None


def entropy_from_logits(logits: torch.Tensor, chunk_rows: int = 1024) -> torch.Tensor:
    """Entropy of softmax(logits) at every position: [..., V] -> [...], differentiable.

    H = logsumexp(z) - sum(softmax(z) * z). No log of a probability is taken, so tiny
    probabilities cannot underflow to log(0); -inf logits (masked vocabulary) count as
    probability 0. Works chunk by chunk in fp32, like `logprobs_from_logits`.
    """
    flat = logits.reshape(-1, logits.shape[-1])
    out = []
    for x in _rows(flat, chunk_rows):
        x = _upcast(x)
        x = x.clamp_min(torch.finfo(x.dtype).min)  # -inf -> finite, so 0 * z stays 0
        lse = torch.logsumexp(x, dim=-1)
        p = torch.exp(x - lse[:, None])
        out.append(lse - (p * x).sum(-1))
    return torch.cat(out).reshape(logits.shape[:-1])


@dataclass
class LossConfig:
    """The loss knobs of the trainer config; validated on construction so a bad YAML value fails
    before any model loads."""

    clip_low: float = 0.2  # PPO's ratio clip below 1: 1 - clip_low
    clip_high: float = 0.2  # and above 1: 1 + clip_high (DAPO's clip-higher when larger)
    dual_clip_c: float | None = None  # dual-clip PPO: caps the loss of negative-advantage tokens (> 1, e.g. 3); None = off
    agg: str = "token-mean"  # how token losses are averaged: token-mean | seq-mean-token-sum | seq-mean-token-mean
    kl_coef: float = 0.0  # the KL penalty to the reference model; 0 = no reference model
    kl_kind: str = "k3"  # the KL estimator: k1 | k2 | k3 | abs
    use_kl_loss: bool = False  # True: kl_coef * KL is a loss term; False: the KL goes in the reward
    entropy_coef: float = 0.0  # an entropy bonus in the loss
    off_policy: str = "none"  # behaviour != proximal correction: none | tis | mis | decoupled (`behaviour_weights`)
    is_level: str = "token"  # token | sequence: one importance weight per token or per row
    is_cap: float = 2.0  # tis: the weight is truncated at this
    is_band: tuple[float, float] = (0.5, 2.0)  # mis: tokens (rows) with a weight outside [low, high] are dropped

    def __post_init__(self) -> None:
        def bad(field: str, value: object, allowed: str) -> ValueError:
            return ValueError(f"loss.{field}={value!r} is invalid; allowed: {allowed}")

        for field in ("clip_low", "clip_high", "kl_coef", "entropy_coef", "is_cap"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise bad(field, value, "a finite number")
        if not 0 <= self.clip_low < 1:
            raise bad("clip_low", self.clip_low, "0 <= clip_low < 1 (lower ratio bound is 1 - clip_low)")
        if self.clip_high < 0:
            raise bad("clip_high", self.clip_high, "clip_high >= 0 (upper ratio bound is 1 + clip_high)")
        if self.dual_clip_c is not None and (isinstance(self.dual_clip_c, bool)
                                             or not isinstance(self.dual_clip_c, (int, float))
                                             or not self.dual_clip_c > 1):
            raise bad("dual_clip_c", self.dual_clip_c, "a number > 1 (3.0 is usual), or null to disable")
        if self.agg not in AGG_MODES:
            raise bad("agg", self.agg, ", ".join(AGG_MODES))
        if self.kl_kind not in KL_KINDS:
            raise bad("kl_kind", self.kl_kind, ", ".join(KL_KINDS))
        if self.kl_coef < 0:
            raise bad("kl_coef", self.kl_coef, "kl_coef >= 0")
        if not isinstance(self.use_kl_loss, bool):
            raise bad("use_kl_loss", self.use_kl_loss, "true or false")
        if self.entropy_coef < 0:
            raise bad("entropy_coef", self.entropy_coef, "entropy_coef >= 0 (it is a bonus subtracted from the loss)")
        if self.off_policy not in OFF_POLICY_MODES:
            raise bad("off_policy", self.off_policy, ", ".join(OFF_POLICY_MODES))
        if self.is_level not in IS_LEVELS:
            raise bad("is_level", self.is_level, ", ".join(IS_LEVELS))
        if self.is_cap < 1:
            raise bad("is_cap", self.is_cap, "is_cap >= 1 (a cap below 1 would shrink on-policy tokens too)")
        band = self.is_band
        if (not isinstance(band, (list, tuple)) or len(band) != 2
                or any(isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x) for x in band)
                or not 0 <= band[0] <= 1 <= band[1]):
            raise bad("is_band", band, "[low, high] with 0 <= low <= 1 <= high (weights outside it are dropped)")
        self.is_band = (float(band[0]), float(band[1]))


def compute_loss(cfg: LossConfig, logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                 response_mask: torch.Tensor, ref_logprobs: torch.Tensor | None = None,
                 entropy: torch.Tensor | None = None, denominator: float | None = None,
                 rollout_logprobs: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """The scalar the actor backpropagates: policy loss (+ KL loss) (- entropy bonus).

    `ref_logprobs` is needed when `cfg.use_kl_loss` and `cfg.kl_coef > 0`; `entropy` (per token,
    from `entropy_from_logits`) when `cfg.entropy_coef > 0`; `rollout_logprobs` (the behaviour
    policy's, as the engine reported them) when `cfg.off_policy != "none"`. Given but unused, they
    are still reported as metrics (`kl`, `entropy`, the `is_*` and `rollout_kl` of
    `behaviour_weights`). `denominator` as in `agg_loss`, applied to every term.
    """
    if cfg.off_policy != "none" and rollout_logprobs is None:
        raise ValueError(f"loss.off_policy={cfg.off_policy!r} needs the behaviour policy's logprobs but no "
                         "rollout_logprobs were given; pass the batch's rollout_logprobs, or set off_policy=none")
    weights: torch.Tensor | None = None
    is_metrics: dict[str, float] = {}
    if rollout_logprobs is not None:
        weights, is_metrics = behaviour_weights(old_logprobs, rollout_logprobs, response_mask, cfg.off_policy,
                                                cfg.is_level, cfg.is_cap, cfg.is_band)
    loss, metrics = policy_loss(logprobs, old_logprobs, advantages, response_mask, cfg.clip_low, cfg.clip_high,
                                cfg.dual_clip_c, cfg.agg, denominator, weights)
    metrics.update(is_metrics)
    kl_as_loss = cfg.use_kl_loss and cfg.kl_coef > 0
    if kl_as_loss and ref_logprobs is None:
        raise ValueError(f"loss.use_kl_loss is true with kl_coef={cfg.kl_coef} but no ref_logprobs were "
                         "given; compute reference logprobs, or set use_kl_loss=false / kl_coef=0")
    if ref_logprobs is not None:
        _check_like(response_mask, ref_logprobs=ref_logprobs)
        keep = response_mask.bool()  # as in policy_loss: padding values must not reach the gradient
        per_token = kl_penalty(torch.where(keep, logprobs, 0), torch.where(keep, ref_logprobs, 0), cfg.kl_kind)
        kl = agg_loss(per_token, response_mask, cfg.agg, denominator)
        metrics["kl"] = kl.item()
        if kl_as_loss:
            loss = loss + cfg.kl_coef * kl
    if cfg.entropy_coef > 0 and entropy is None:
        raise ValueError(f"loss.entropy_coef={cfg.entropy_coef} but no entropy was given; pass "
                         "entropy_from_logits(logits) per token, or set entropy_coef=0")
    if entropy is not None:
        _check_like(response_mask, entropy=entropy)
        ent = agg_loss(entropy, response_mask, cfg.agg, denominator)
        metrics["entropy"] = ent.item()
        if cfg.entropy_coef > 0:
            loss = loss - cfg.entropy_coef * ent
    metrics["loss"] = loss.item()
    return loss, metrics
