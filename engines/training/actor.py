"""What every actor backend shares: the PPO epochs and mini-batches, the SFT step, metrics and
logprob drift, learning-rate warm-up and autocast. A backend (torch, Megatron) supplies only how
a list of micro-batches goes forward and backward on its ranks, how it steps its optimizer, and
which of its ranks own the numbers.

Rows are split over the data-parallel replicas; every loss is a micro-batch's sum divided by the
mini-batch's global denominator (tokens or sequences over all replicas), known locally because
every rank sees the whole batch. So summing gradients over the replicas gives exactly the
mini-batch gradient, whatever the micro-batch size or the number of ranks.
"""

from __future__ import annotations

import math
from collections import defaultdict
from contextlib import nullcontext
from typing import Any, Callable

import torch
import torch.distributed as dist
from tqdm import tqdm

from engines.training.batch import Batch, MicroBatch
from engines.training.config import ActorConfig, compute_dtype
from engines.training.losses import IGNORE_INDEX, LossConfig, compute_loss
from parallel.reduce import over_ranks

_ADDITIVE = ("pg_loss", "kl", "entropy", "loss")  # per-micro-batch shares of the mini-batch value
# keys ending in "_max" (ratio_max, is_weight_max) are maxima over micro-batches and ranks, not means
LossFn = Callable[[MicroBatch, torch.Tensor, "torch.Tensor | None"], torch.Tensor]


def dist_info() -> tuple[int, int]:
    """(rank, world size); (0, 1) without an initialized process group."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def gather_rows(local: torch.Tensor, total: int, parts: int, group: Any = None,
                device: torch.device | None = None) -> torch.Tensor:
    """Undo `torch.tensor_split(rows, parts)` over the `parts` ranks of `group`: every rank gets
    the [total, ...] tensor, on `local`'s device. The collective runs on `device` when given
    (the device the group's backend serves)."""
    if parts == 1:
        return local
    per = math.ceil(total / parts)
    padded = local.new_zeros((per, *local.shape[1:]))
    padded[:local.shape[0]] = local
    if device is not None:
        padded = padded.to(device)
    chunks = [torch.empty_like(padded) for _ in range(parts)]
    dist.all_gather(chunks, padded, group=group)
    sizes = [len(s) for s in torch.tensor_split(torch.arange(total), parts)]
    return torch.cat([c[:n].to(local.device) for c, n in zip(chunks, sizes)])


def logprob_gap(rollout: torch.Tensor, actor: torch.Tensor, mask: torch.Tensor) -> list[float]:
    """[sum, tokens, max] of the |rollout - actor| logprob gap over the mask-1 tokens: how far the
    engines and the trainer disagree about the policy (dtype, a missed weight sync, top-p). Drift is
    measured with it on both paths: the update's own forward (on-policy) and the old logprobs' pass
    (`launch/algorithm.py`); `drift_over_ranks` makes the run's figures."""
    gap = (rollout - actor).abs().double()[mask.bool()]
    return [float(gap.sum()), float(gap.numel()), float(gap.max()) if gap.numel() else 0.0]


def drift_over_ranks(gap: list[float], shard: bool = True) -> tuple[float, float]:
    """(mean, max) of `logprob_gap` figures, over every rank when each holds a `shard` of the batch."""
    (total, tokens), (top,) = over_ranks(gap[:2], gap[2:], shard=shard)
    return (total / tokens if tokens > 0 else 0.0), top


def adamw(params: Any, lr: float, weight_decay: float) -> torch.optim.AdamW:
    """Every trainer's AdamW: torch's fused kernel (one pass over each tensor's memory where the default
    makes about ten; 4x faster on a CPU for a 135M model, equal within float rounding) where the
    parameters' device has it, the default loop elsewhere."""
    groups = list(params)
    tensors = [p for g in groups for p in (g["params"] if isinstance(g, dict) else [g])]
    fused = bool(tensors) and all(p.device.type in ("cpu", "cuda") and p.dtype in (torch.float32, torch.bfloat16,
                                  torch.float16) for p in tensors)
    return torch.optim.AdamW(groups, lr=lr, weight_decay=weight_decay, fused=fused or None)


def _denominator(mask: torch.Tensor, agg: str) -> float:
    """What `agg_loss` divides a mini-batch by: its mask-1 tokens, or its sequences with one."""
    keep = mask.bool()
    return float(keep.sum()) if agg == "token-mean" else float(keep.any(dim=-1).sum())


class _Tally:
    """Metric sums of one update or SFT step, on the ranks that own them."""

    def __init__(self) -> None:
        self.sums: dict[str, float] = defaultdict(float)
        self.weights: dict[str, float] = defaultdict(float)
        self.maxes: dict[str, float] = {}
        self.drift = [0.0, 0.0, 0.0]  # sum, count, max of |rollout - old| over mask-1 tokens

    def add(self, metrics: dict[str, float], tokens: float) -> None:
        for k, v in metrics.items():
            if k.endswith("_max"):
                self.maxes[k] = max(self.maxes.get(k, v), v)
                continue
            self.sums[k] += v if k in _ADDITIVE else v * tokens
            self.weights[k] += 0.0 if k in _ADDITIVE else tokens

    def add_drift(self, rollout: torch.Tensor, old: torch.Tensor, mask: torch.Tensor) -> None:
        total, tokens, top = logprob_gap(rollout, old, mask)
        self.drift = [self.drift[0] + total, self.drift[1] + tokens, max(self.drift[2], top)]


class ActorBase:
    """Subclasses set `params`, `optimizer`, `device`, `rank`, `world`, `dp_rank`, `dp_size`,
    `dp_group`, then implement `_forward_backward`, `_forward_logprobs`, `_step_optimizer` and
    the weights/state methods of `engines.training.base.Actor`."""

    params: list[torch.nn.Parameter]
    optimizer: torch.optim.Optimizer
    device: torch.device
    rank: int
    world: int
    dp_rank: int
    dp_size: int
    dp_group: Any = None
    by_runs: bool = False  # a packed micro-batch is attended by runs (engines/training/tree_attention.py)

    def __init__(self, cfg: ActorConfig, model: str, dtype: str = "float32", temperature: float = 1.0,
                 seed: int = 0, progress: bool = True) -> None:
        self.cfg, self.model_path, self.dtype = cfg, model, dtype
        self.compute_dtype = compute_dtype(dtype)
        self.temperature, self.seed, self.progress = temperature, seed, progress
        self.rl_steps = self.sft_steps = 0
        self._lr = cfg.lr
        # a CPU update's buffers are reused from one micro-batch to the next, and handed back when it ends
        self._retaining = cfg.retain_freed_memory and not torch.cuda.is_available()
        if self._retaining:
            from parallel.host import retain_freed_memory

            retain_freed_memory()

    # ------------------------------------------------------------------ what a backend supplies
    def _forward_backward(self, micro: list[MicroBatch], want_entropy: bool, temperature: float, loss_fn: LossFn,
                          bar: tqdm) -> None:
        """Run every micro-batch forward, call `loss_fn(mb, logprobs [b, k], entropy)` where the
        logprobs live, and backpropagate its value; tick `bar` once per micro-batch."""
        raise NotImplementedError

    def _forward_logprobs(self, micro: list[MicroBatch], bar: tqdm) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """No-grad (logprobs, entropy) [b, k] per micro-batch, on the CPU, on every rank of this replica."""
        raise NotImplementedError

    def _step_optimizer(self) -> float:
        """Reduce gradients as the backend needs, clip to `grad_clip`, step; the pre-clip norm."""
        raise NotImplementedError

    def _owns_metrics(self) -> bool:
        """Whether this rank's tallies count (a rank that computes the loss, once per replica)."""
        return True

    def _set_train(self, mode: bool) -> None:
        raise NotImplementedError

    # ------------------------------------------------------------------ memory
    def memory_report(self) -> dict[str, float]:
        """Bytes this rank holds for the actor, per kind, before the first step: weights as held
        (a shard under FSDP/TP/PP), fp32 gradients and AdamW's two fp32 moments for the trainable
        ones, and fp32 main weights for those held below fp32. Activations come on top; they scale with micro_batch_size x sequence length."""
        local = lambda p: p.to_local() if hasattr(p, "to_local") else p  # noqa: E731
        module = self.module if hasattr(self, "module") else self.model  # type: ignore[attr-defined]
        held = [local(p) for p in module.parameters()]
        trainable = sum(local(p).numel() for p in self.params)
        gb = 2.0**30
        out = {"parameters": float(sum(p.numel() for p in module.parameters())),
               "trainable_fraction": trainable / max(1, sum(p.numel() for p in held)),
               "weights_gb": sum(p.numel() * p.element_size() for p in held) / gb,
               "grads_gb": 4 * trainable / gb, "optimizer_gb": 8 * trainable * self._optimizer_share() / gb}
        # parameters held below fp32 get fp32 main weights in the optimizer, sharded like its moments
        low = sum(local(p).numel() for p in self.params if local(p).element_size() < 4)
        out["main_weights_gb"] = 4 * low * self._optimizer_share() / gb
        out["total_gb"] = out["weights_gb"] + out["grads_gb"] + out["optimizer_gb"] + out["main_weights_gb"]
        out["bytes_per_parameter"] = out["total_gb"] * gb / max(1.0, out["parameters"])
        return out

    def _optimizer_share(self) -> float:
        """The fraction of its parameters' optimizer state this rank holds (1/DP when sharded)."""
        return 1.0

    def named_sync_weights(self, adapter: bool) -> Any:
        """What the weight sync sends the engines: the HF weights (`named_hf_weights`); a LoRA
        actor sends only its adapter when `adapter` (the engines apply one; TorchActor)."""
        return self.named_hf_weights()  # type: ignore[attr-defined]

    # ------------------------------------------------------------------ shared helpers
    @property
    def lr(self) -> float:
        return self._lr

    def set_lr(self, lr: float) -> None:
        """The learning rate of every parameter group, each times its own `lr_scale` (a critic's value head)."""
        self._lr = float(lr)
        for g in self.optimizer.param_groups:
            g["lr"] = self._lr * g.get("lr_scale", 1.0)

    def _autocast(self) -> Any:
        if self.compute_dtype == torch.float32:
            return nullcontext()
        return torch.autocast(self.device.type, dtype=self.compute_dtype)

    def _bar(self, desc: str, total: int | None) -> tqdm:
        return tqdm(total=total, desc=desc, unit="micro-batch", leave=False,
                    disable=not self.progress or self.rank != 0)

    def _local_rows(self, rows: torch.Tensor) -> torch.Tensor:
        return torch.tensor_split(rows, self.dp_size)[self.dp_rank]

    def _rows_of(self, batch: Batch) -> torch.Tensor:
        """This replica's rows: all of a shard (the handoff sent only those), else its share."""
        rows = torch.arange(len(batch))
        return rows if batch.is_shard else self._local_rows(rows)

    def _global_denominator(self, mask: torch.Tensor, agg: str) -> float:
        """A shard's mini-batch denominator summed over the data-parallel replicas."""
        if self.dp_size == 1:
            return _denominator(mask, agg)
        (total,), _ = over_ranks([_denominator(mask, agg)], group=self.dp_group)
        return total

    def _mini_batches(self, batch: Batch, mini: int, gen: torch.Generator, shuffle: bool) -> list[torch.Tensor]:
        """One epoch's mini-batches, as this replica's row indices into `batch`. A whole batch is
        split into global mini-batches of `mini` rows, each shared out over the replicas; a shard
        is shuffled locally and cut into as many mini-batches as every other replica cuts its own
        into (the optimizer steps are collective, so their number must agree)."""
        if not batch.is_shard:
            n = len(batch)
            order = torch.randperm(n, generator=gen) if shuffle else torch.arange(n)
            return [order[s:s + mini] for s in range(0, n, mini)]
        steps = math.ceil(batch.total_rows / mini)
        local = torch.Generator().manual_seed(int(gen.initial_seed()) * 7919 + self.dp_rank)
        order = torch.randperm(len(batch), generator=local) if shuffle else torch.arange(len(batch))
        return list(torch.tensor_split(order, steps))

    def _micro_rows(self, rows: torch.Tensor) -> list[torch.Tensor]:
        return list(rows.split(self.cfg.micro_batch_size)) if len(rows) else []

    def _micro_batches(self, batch: Batch, rows: torch.Tensor) -> list[MicroBatch]:
        """`rows` of `batch` as micro-batches: `actor.micro_batch_size` rows each, or with
        `actor.max_tokens_per_micro_batch` by padded token count (`token_budget_rows`). With
        `actor.shared_prefix`, a group's rows go together and a micro-batch is packed as a prefix
        tree (on; auto: where `packing_pays`), the budget counting the tokens it computes."""
        from engines.training import prefix

        mode, budget = getattr(self.cfg, "shared_prefix", "off"), self.cfg.max_tokens_per_micro_batch
        if mode == "off" or prefix.has_images(batch, rows):
            parts = (token_budget_rows(rows, batch.prompt_lengths, batch.response_lengths, budget) if budget
                     else self._micro_rows(rows))
            return [batch.micro_batch(mb) for mb in parts]
        rows = prefix.by_group(batch, rows)
        parts = prefix.budget_rows(batch, rows, budget) if budget else self._micro_rows(rows)
        return [prefix.micro_batch(batch, mb, mode, self._pair_cost, self.device, self.by_runs) for mb in parts]

    @property
    def _pair_cost(self) -> float:
        """An attention pair's FLOPs over a token's, for `packing_pays` (the policy's config)."""
        if not hasattr(self, "_pair_cost_value"):
            from engines.training.prefix import pair_cost

            self._pair_cost_value = pair_cost(self.model_path)
        return self._pair_cost_value

    # ------------------------------------------------------------------ logprobs
    @torch.no_grad()
    def compute_logprobs(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-token logprobs and entropy of the batch's responses; every rank gets all rows."""
        self._set_train(False)
        local = self._rows_of(batch)
        micro = self._micro_batches(batch, local)
        r = batch.responses.shape[1]
        with self._bar("logprobs", len(micro)) as bar:
            res = self._forward_logprobs(micro, bar)
        pad = lambda t: torch.nn.functional.pad(t.float().cpu(), (0, r - t.shape[1]))  # noqa: E731
        # back in row order: token-budget micro-batches hold rows sorted by length
        at = torch.empty(len(batch), dtype=torch.long)
        at[local] = torch.arange(len(local))
        order = at[torch.cat([mb.rows for mb in micro])] if micro else torch.zeros(0, dtype=torch.long)
        lp, ent = torch.zeros(len(local), r), torch.zeros(len(local), r)
        if res:
            lp[order] = torch.cat([pad(x[0]) for x in res])
            ent[order] = torch.cat([pad(x[1]) for x in res])
        n, real = len(batch), batch.real_responses
        if not batch.is_shard:  # every rank gets all rows; a shard keeps its own
            lp, ent = (gather_rows(t, n, self.dp_size, self.dp_group, self.device) for t in (lp, ent))
        return torch.where(real, lp, 0.0), torch.where(real, ent, 0.0)

    # ------------------------------------------------------------------ RL update
    def update(self, batch: Batch, advantages: torch.Tensor, old_logprobs: torch.Tensor | None,
               ref_logprobs: torch.Tensor | None, loss: LossConfig) -> dict[str, float]:
        """PPO epochs over mini-batches of the batch.

        `old_logprobs=None` is the on-policy case (one epoch, one mini-batch): the policy that
        sampled is the one being updated, so the old logprobs are this forward's own, detached,
        and no separate pass is needed. The metrics then carry `drift_mean`/`drift_max`, the
        |rollout - actor| logprob gap over mask-1 tokens, measured on that same forward.
        """
        mask = batch.loss_mask
        if old_logprobs is None and not self.cfg.on_policy(batch.total_rows):
            raise ValueError("update(old_logprobs=None) is only valid for one epoch over one mini-batch; compute "
                             "old logprobs with compute_logprobs() first")

        def loss_for(denom: float, tally: _Tally) -> LossFn:
            def loss_fn(mb: MicroBatch, lp: torch.Tensor, ent: torch.Tensor | None) -> torch.Tensor:
                k = lp.shape[1]
                pick = lambda t: None if t is None else t[mb.rows, :k].to(self.device)  # noqa: E731
                msk, old = pick(mask), pick(old_logprobs)
                if old is None:
                    old = lp.detach().float()
                    tally.add_drift(pick(batch.rollout_logprobs), old, msk)
                value, met = compute_loss(loss, lp.float(), old, pick(advantages), msk, pick(ref_logprobs),
                                          None if ent is None else ent.float(), denom,
                                          rollout_logprobs=pick(batch.rollout_logprobs))
                tally.add(met, float(msk.sum()))
                return value
            return loss_fn

        tally, out = self._train_epochs(batch, loss.agg, loss.entropy_coef > 0, loss_for)
        if old_logprobs is None:
            out.update(self._reduce_drift(tally))
        return out

    def _train_epochs(self, batch: Batch, agg: str, want_entropy: bool,
                      loss_for: Callable[[float, "_Tally"], LossFn],
                      mask: torch.Tensor | None = None) -> tuple["_Tally", dict[str, float]]:
        """`actor.ppo_epochs` epochs over the batch's mini-batches, one optimizer step each;
        `loss_for(denominator, tally)` gives a mini-batch's loss function (the policy's, or the
        critic's), the denominator counted over `mask` (default: the batch's loss mask). Returns
        the tally and the reduced metrics with grad_norm, lr, optimizer_steps and tokens_computed
        (the token positions the update's forwards computed over every rank and epoch, each shared
        prefix once when packed: what its FLOPs are proportional to)."""
        mask = batch.loss_mask if mask is None else mask
        n = batch.total_rows
        mini = self.cfg.mini_batch(n)
        if min(mini, n) < self.dp_size:
            raise ValueError(f"a mini-batch of {min(mini, n)} trajectories cannot be split over {self.dp_size} "
                             "data-parallel ranks; raise actor.ppo_mini_batch_size or data.prompts_per_step x rollout.n")
        self.rl_steps += 1
        warm = self.cfg.warmup_steps
        self.set_lr(self.cfg.lr * (min(1.0, self.rl_steps / warm) if warm > 0 else 1.0))
        self._set_train(True)
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + self.rl_steps)
        shuffle = mini < n or self.cfg.ppo_epochs > 1
        tally = _Tally()
        norms: list[float] = []
        tokens = 0
        per_rank = math.ceil(min(mini, n) / self.dp_size)
        bar = self._bar("update", None if self.cfg.max_tokens_per_micro_batch else  # token budget: not known ahead
                        self.cfg.ppo_epochs * math.ceil(n / mini) * math.ceil(per_rank / self.cfg.micro_batch_size))
        for _ in range(self.cfg.ppo_epochs):
            for idx in self._mini_batches(batch, mini, gen, shuffle):
                if batch.is_shard:
                    denom = self._global_denominator(mask[idx], agg)
                else:
                    denom = _denominator(mask[idx], agg)
                if denom == 0:  # nothing to learn from (all rows invalid or empty); every rank skips alike
                    continue
                mine = idx if batch.is_shard else self._local_rows(idx)
                micro = self._micro_batches(batch, mine)
                tokens += sum(mb.tokens for mb in micro)
                self._forward_backward(micro, want_entropy, self.temperature, loss_for(denom, tally), bar)
                norms.append(self._step_optimizer())
        bar.close()
        if self._retaining:  # between steps the process holds what it uses, not its highest update's peak
            from parallel.host import release_freed_memory

            release_freed_memory()
        out = self._reduce(tally, len(norms))
        (computed,), _ = over_ranks([float(tokens) if self._owns_metrics() else 0.0])
        out.update({"grad_norm": sum(norms) / max(1, len(norms)), "lr": self._lr, "optimizer_steps": float(len(norms)),
                    "tokens_computed": computed})
        return tally, out

    # ------------------------------------------------------------------ SFT
    def sft_step(self, input_ids: torch.Tensor, labels: torch.Tensor, attention_mask: torch.Tensor) -> dict[str, float]:
        """One step of token-mean cross entropy over labels != -100 (labels aligned with ids; the
        shift happens here). Every rank passes the same batch and takes its share of rows."""
        self._set_train(True)
        self.sft_steps += 1
        denom = float((labels[:, 1:] != IGNORE_INDEX).sum())
        if denom == 0:
            raise ValueError("an SFT batch has no labelled token (all labels are -100); check the traces")
        micro = [_sft_micro(input_ids, labels, attention_mask, mb)
                 for mb in self._micro_rows(self._local_rows(torch.arange(len(input_ids))))]
        tally = _Tally()

        def loss_fn(mb: MicroBatch, lp: torch.Tensor, _ent: torch.Tensor | None) -> torch.Tensor:
            value = -torch.where(mb.target_mask, lp, 0.0).sum() / denom
            tally.add({"loss": float(value.detach())}, 0.0)
            return value

        self._forward_backward(micro, False, 1.0, loss_fn, tqdm(disable=True))
        norm = self._step_optimizer()
        return {"loss": self._reduce(tally, 1).get("loss", 0.0), "grad_norm": norm}

    # ------------------------------------------------------------------ state
    def _counters(self) -> dict[str, Any]:
        """What every backend's checkpoint holds besides its weights."""
        return {"optimizer": self.optimizer.state_dict(), "rl_steps": self.rl_steps, "sft_steps": self.sft_steps,
                "lr": self._lr}

    def _load_counters(self, state: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        self.rl_steps, self.sft_steps = int(state["rl_steps"]), int(state["sft_steps"])
        self.set_lr(float(state["lr"]))

    # ------------------------------------------------------------------ reductions
    def _reduce(self, tally: _Tally, steps: int) -> dict[str, float]:
        """Additive shares summed over micro-batches and ranks make one value per optimizer step,
        averaged over the steps; "_max" keys are the largest value seen; the other metrics are
        token-weighted means. Only the ranks that own metrics contribute, so a value replicated over
        tensor or pipeline ranks counts once."""
        keys = sorted({*tally.sums, *tally.maxes})
        if self.world > 1:
            every: list[Any] = [None] * self.world
            dist.all_gather_object(every, keys)
            keys = sorted({k for ks in every for k in ks})
        if not keys:
            return {}
        own = self._owns_metrics()
        summed, top = over_ranks([tally.sums.get(k, 0.0) if own else 0.0 for k in keys]
                                 + [tally.weights.get(k, 0.0) if own else 0.0 for k in keys],
                                 [tally.maxes.get(k, -math.inf) if own else -math.inf for k in keys])
        sums, weights = summed[:len(keys)], summed[len(keys):]
        out = {}
        for i, k in enumerate(keys):
            if k.endswith("_max"):
                out[k] = top[i] if math.isfinite(top[i]) else 0.0
                continue
            den = float(steps) if k in _ADDITIVE else weights[i]
            out[k] = sums[i] / den if den > 0 else 0.0
        return out

    def _reduce_drift(self, tally: _Tally) -> dict[str, float]:
        mean, top = drift_over_ranks(tally.drift if self._owns_metrics() else [0.0, 0.0, 0.0])
        return {"drift_mean": mean, "drift_max": top}


def _sft_micro(input_ids: torch.Tensor, labels: torch.Tensor, attention_mask: torch.Tensor,
               rows: torch.Tensor) -> MicroBatch:
    """Right-padded SFT rows cut to their widest; logits are asked for only from the first
    labelled position on (prompts carry no labels, and the vocabulary projection of every
    prompt position is a large share of a small model's cost)."""
    width = int(attention_mask[rows].sum(1).max())
    ids, lab, attn = input_ids[rows, :width], labels[rows, :width], attention_mask[rows, :width]
    labelled = (lab[:, 1:] != IGNORE_INDEX).any(0).nonzero()
    first = int(labelled[0]) if len(labelled) else width - 2
    target = lab[:, first + 1:]
    return MicroBatch(rows=rows, input_ids=ids, attention_mask=attn, position_ids=None, first=first,
                      targets=target, target_mask=target != IGNORE_INDEX)


def token_budget_rows(rows: torch.Tensor, prompt_lengths: torch.Tensor, response_lengths: torch.Tensor,
                      budget: int) -> list[torch.Tensor]:
    """`rows` packed into micro-batches of at most `budget` padded tokens: a micro-batch is cut to
    its widest prompt and widest response, so it costs rows x (widest prompt + widest response).
    Rows go longest first, each into the current micro-batch while the cost stays within the budget
    (a row over the budget alone goes alone). The loss is normalised by the mini-batch's own
    denominator, so how rows are grouped changes nothing but the summation order."""
    if not len(rows):
        return []
    plen, rlen = prompt_lengths[rows], response_lengths[rows]
    order = torch.argsort(plen + rlen, descending=True, stable=True)
    out: list[list[int]] = []
    current: list[int] = []
    wide_p = wide_r = 0
    for i in order.tolist():
        p, r = int(plen[i]), int(rlen[i])
        cost = (len(current) + 1) * (max(wide_p, p) + max(wide_r, r))
        if current and cost > budget:
            out.append(current)
            current, wide_p, wide_r = [], 0, 0
        current.append(i)
        wide_p, wide_r = max(wide_p, p), max(wide_r, r)
    out.append(current)
    return [rows[torch.tensor(idx)] for idx in out]
