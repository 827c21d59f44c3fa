"""The plain-torch actor and reference: a transformers causal LM on CPU or one GPU per rank,
data parallel with DDP (gloo on CPU, NCCL on GPUs) when torchrun starts more than one rank.

Every rank receives the whole rollout batch (it is small next to the model) and takes a
contiguous share of its rows. So the loss denominators of a mini-batch (tokens or sequences
over all ranks and micro-batches) are known locally without a collective, each micro-batch loss
is sum / global denominator, and DDP's gradient average times the world size is exactly the
gradient of the mini-batch loss, whatever the micro-batch size or the number of ranks.

Forward passes trim each micro-batch to its own widest prompt and response (batches are padded
to the widest trajectory of the whole step) and ask the model only for the logits of response
positions, which is most of the cost saved on CPU.
"""

from __future__ import annotations

import math
import re
from collections import defaultdict
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

import torch
import torch.distributed as dist
from tqdm import tqdm

from engines.training.losses import IGNORE_INDEX, LossConfig, compute_loss, entropy_from_logits, logprobs_from_logits

if TYPE_CHECKING:
    from rollout.manager import Batch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_ADDITIVE = ("pg_loss", "kl", "entropy", "loss")  # per-micro-batch shares of the mini-batch value


def dist_info() -> tuple[int, int]:
    """(rank, world size); (0, 1) without an initialized process group."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def default_device() -> torch.device:
    if torch.cuda.is_available():
        import os

        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def response_logprobs(model: torch.nn.Module, prompts: torch.Tensor, responses: torch.Tensor,
                      attention_mask: torch.Tensor, position_ids: torch.Tensor, temperature: float,
                      want_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Logprobs (and entropy) of the response tokens of a few padded rows, [b, R] each.

    The rows are cut to their own widest prompt and response first; the model returns logits
    only for the positions that predict response tokens (`logits_to_keep`), from the last
    prompt token on. Positions past a row's response are 0.
    """
    b, p = prompts.shape
    r = responses.shape[1]
    plen, rlen = attention_mask[:, :p].sum(1), attention_mask[:, p:].sum(1)
    end = int(rlen.max()) if b else 0
    if end == 0:
        zeros = torch.zeros(b, r, dtype=torch.float32, device=prompts.device)
        return zeros, (zeros.clone() if want_entropy else None)
    if int(plen.min()) < 1:
        raise ValueError("a trajectory has an empty prompt; every row needs at least one prompt token")
    start = p - int(plen.max())
    ids = torch.cat([prompts[:, start:], responses[:, :end]], dim=1)
    logits = model(input_ids=ids, attention_mask=attention_mask[:, start:p + end],
                   position_ids=position_ids[:, start:p + end], logits_to_keep=end + 1, use_cache=False).logits
    logits = logits[:, :-1]
    if temperature != 1.0:
        logits = logits.float() / temperature
    real = attention_mask[:, p:p + end].bool()  # a shorter row's padding inside this width
    lp = torch.where(real, logprobs_from_logits(logits, responses[:, :end]), 0)
    lp = torch.nn.functional.pad(lp, (0, r - end))
    ent = None
    if want_entropy:
        ent = torch.nn.functional.pad(torch.where(real, entropy_from_logits(logits), 0), (0, r - end))
    return lp, ent


def _gather_rows(local: torch.Tensor, total: int, world: int) -> torch.Tensor:
    """Undo `torch.tensor_split(rows, world)`: every rank gets the [total, ...] tensor."""
    if world == 1:
        return local
    per = math.ceil(total / world)
    padded = local.new_zeros((per, *local.shape[1:]))
    padded[:local.shape[0]] = local
    parts = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(parts, padded)
    sizes = [len(s) for s in torch.tensor_split(torch.arange(total), world)]
    return torch.cat([part[:n] for part, n in zip(parts, sizes)])


def _denominator(mask: torch.Tensor, agg: str) -> float:
    """What `agg_loss` divides a mini-batch by: its mask-1 tokens, or its sequences with one."""
    keep = mask.bool()
    return float(keep.sum()) if agg == "token-mean" else float(keep.any(dim=-1).sum())


def load_causal_lm(path: str, dtype: torch.dtype, device: torch.device) -> torch.nn.Module:
    """The HF model, with `padding_idx` taken off its embeddings: chat models often pad with
    their end-of-turn token, which is a real input in every multi-turn trajectory, and HF's
    padding_idx would silently freeze that row's input embedding. Padding positions get no
    gradient anyway (attention and loss masks keep them out)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device)
    for m in model.modules():
        if isinstance(m, torch.nn.Embedding):
            m.padding_idx = None
    return model


@dataclass
class ActorConfig:
    """What every actor backend takes. `dtype` is the compute dtype: weights are kept in float32
    (the optimizer's master copy) and bfloat16/float16 run under autocast. Engines are sent
    `dtype` weights."""

    model: str
    dtype: str = "float32"
    lr: float = 1e-5
    weight_decay: float = 0.0
    warmup_steps: int = 0
    grad_clip: float = 1.0
    micro_batch_size: int = 8
    ppo_mini_batch_size: int | None = None  # trajectories per optimizer step; None = the whole batch
    ppo_epochs: int = 1
    temperature: float = 1.0
    seed: int = 0
    progress: bool = True  # tqdm bars for the logprob and update passes (rank 0)

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"actor dtype={self.dtype!r}; choose one of {list(DTYPES)}")


@dataclass
class TorchActorConfig(ActorConfig):
    gradient_checkpointing: bool = False
    trainable: list[str] | None = None  # parameter-name regexes; None = every parameter


class TorchActor:
    def __init__(self, cfg: TorchActorConfig, device: torch.device | None = None) -> None:
        self.cfg = cfg
        self.rank, self.world = dist_info()
        self.device = device or default_device()
        self.compute_dtype = DTYPES[cfg.dtype]
        torch.manual_seed(cfg.seed)
        self.module = load_causal_lm(cfg.model, torch.float32, self.device)
        if cfg.gradient_checkpointing:
            self.module.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self.params = self._select_trainable(cfg.trainable)
        self.model: torch.nn.Module = self.module
        if self.world > 1:
            from torch.nn.parallel import DistributedDataParallel

            self.model = DistributedDataParallel(self.module, device_ids=[self.device] if self.device.type == "cuda"
                                                 else None)
        self.optimizer = torch.optim.AdamW(self.params, lr=cfg.lr, weight_decay=cfg.weight_decay)
        self.rl_steps = 0
        self.sft_steps = 0
        self._lr = cfg.lr

    def _select_trainable(self, patterns: list[str] | None) -> list[torch.nn.Parameter]:
        named = list(self.module.named_parameters())
        if not patterns:
            return [p for _, p in named]
        regexes = [re.compile(p) for p in patterns]
        keep = []
        for name, p in named:
            p.requires_grad_(any(rx.search(name) for rx in regexes))
            if p.requires_grad:
                keep.append(p)
        if not keep:
            raise ValueError(f"actor.trainable={patterns} matches no parameter; names look like "
                             f"{[n for n, _ in named[:3]]}")
        return keep

    # ------------------------------------------------------------------ helpers
    def _autocast(self) -> Any:
        if self.compute_dtype == torch.float32:
            return nullcontext()
        return torch.autocast(self.device.type, dtype=self.compute_dtype)

    def _rows(self, batch: "Batch", idx: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(t[idx].to(self.device) for t in (batch.prompts, batch.responses, batch.attention_mask,
                                                       batch.position_ids))

    def _micro(self, idx: torch.Tensor) -> list[torch.Tensor]:
        return list(idx.split(self.cfg.micro_batch_size)) if len(idx) else []

    def _bar(self, desc: str, total: int) -> tqdm:
        return tqdm(total=total, desc=desc, unit="micro-batch", leave=False,
                    disable=not self.cfg.progress or self.rank != 0)

    def set_lr(self, lr: float) -> None:
        self._lr = float(lr)
        for g in self.optimizer.param_groups:
            g["lr"] = self._lr

    def _rl_lr(self) -> float:
        warm = self.cfg.warmup_steps
        return self.cfg.lr * (min(1.0, self.rl_steps / warm) if warm > 0 else 1.0)

    def _step_optimizer(self) -> float:
        norm = torch.nn.utils.clip_grad_norm_(self.params, self.cfg.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(norm)

    # ------------------------------------------------------------------ logprobs
    @torch.no_grad()
    def compute_logprobs(self, batch: "Batch") -> tuple[torch.Tensor, torch.Tensor]:
        """Per-token logprobs and entropy of the batch's responses; every rank gets all rows."""
        self.module.eval()
        local = torch.tensor_split(torch.arange(len(batch)), self.world)[self.rank]
        lps, ents = [], []
        micro = self._micro(local)
        with self._bar("logprobs", len(micro)) as bar:
            for mb in micro:
                with self._autocast():
                    lp, ent = response_logprobs(self.module, *self._rows(batch, mb), self.cfg.temperature, True)
                lps.append(lp.float().cpu())
                ents.append(ent.float().cpu())
                bar.update(1)
        r = batch.responses.shape[1]
        lp = torch.cat(lps) if lps else torch.zeros(0, r)
        ent = torch.cat(ents) if ents else torch.zeros(0, r)
        return _gather_rows(lp, len(batch), self.world), _gather_rows(ent, len(batch), self.world)

    # ------------------------------------------------------------------ RL update
    def update(self, batch: "Batch", advantages: torch.Tensor, old_logprobs: torch.Tensor | None,
               ref_logprobs: torch.Tensor | None, loss: LossConfig) -> dict[str, float]:
        """PPO epochs over mini-batches of the batch.

        `old_logprobs=None` is the on-policy case (one epoch, one mini-batch): the policy that
        sampled is the one being updated, so the old logprobs are this forward's own, detached,
        and no separate pass is needed. The metrics then carry `drift_mean`/`drift_max`, the
        |rollout - actor| logprob gap over mask-1 tokens, measured on that same forward.
        """
        mask = batch.loss_mask
        n = len(batch)
        mini = self.cfg.ppo_mini_batch_size or n
        if old_logprobs is None and (mini < n or self.cfg.ppo_epochs > 1):
            raise ValueError("update(old_logprobs=None) is only valid for one epoch over one mini-batch; compute "
                             "old logprobs with compute_logprobs() first")
        if min(mini, n) < self.world:
            raise ValueError(f"a mini-batch of {min(mini, n)} trajectories cannot be split over {self.world} ranks; "
                             "raise actor.ppo_mini_batch_size or data.prompts_per_step x rollout.n")
        self.rl_steps += 1
        self.set_lr(self._rl_lr())
        self.module.train()
        gen = torch.Generator().manual_seed(self.cfg.seed * 1_000_003 + self.rl_steps)
        want_entropy = loss.entropy_coef > 0
        sums: dict[str, float] = defaultdict(float)
        weights: dict[str, float] = defaultdict(float)
        norms: list[float] = []
        drift = torch.zeros(3, dtype=torch.float64)  # sum, count, max of |rollout - old| over mask-1 tokens
        per_rank = math.ceil(min(mini, n) / self.world)
        bar = self._bar("update", self.cfg.ppo_epochs * math.ceil(n / mini) * math.ceil(per_rank / self.cfg.micro_batch_size))
        for _ in range(self.cfg.ppo_epochs):
            order = torch.randperm(n, generator=gen) if (mini < n or self.cfg.ppo_epochs > 1) else torch.arange(n)
            for s in range(0, n, mini):
                idx = order[s:s + mini]
                denom = _denominator(mask[idx], loss.agg)
                if denom == 0:  # nothing to learn from (all rows invalid or empty); every rank skips alike
                    continue
                micro = self._micro(torch.tensor_split(idx, self.world)[self.rank])
                for j, mb in enumerate(micro):
                    sync = j == len(micro) - 1 or self.world == 1
                    with nullcontext() if sync else self.model.no_sync():
                        with self._autocast():
                            lp, ent = response_logprobs(self.model, *self._rows(batch, mb), self.cfg.temperature,
                                                        want_entropy)
                        dev = lambda t: None if t is None else t[mb].to(self.device)  # noqa: E731
                        old = dev(old_logprobs)
                        if old is None:
                            old = lp.detach().float()
                            keep = dev(mask).bool()
                            gap = (dev(batch.rollout_logprobs) - old).abs().double()[keep]
                            if gap.numel():
                                drift[0] += float(gap.sum())
                                drift[1] += gap.numel()
                                drift[2] = max(float(drift[2]), float(gap.max()))
                        value, m = compute_loss(loss, lp.float(), old, dev(advantages), dev(mask),
                                                dev(ref_logprobs), None if ent is None else ent.float(), denom)
                        (value * self.world).backward()
                    bar.update(1)
                    tokens = float(mask[mb].sum())
                    for k, v in m.items():
                        sums[k] += v if k in _ADDITIVE else v * tokens
                        weights[k] += 0.0 if k in _ADDITIVE else tokens
                norms.append(self._step_optimizer())
        bar.close()
        out = self._reduce_metrics(sums, weights, len(norms))
        if old_logprobs is None:
            if self.world > 1:
                total = drift[:2].clone()
                dist.all_reduce(total)
                top = drift[2:].clone()
                dist.all_reduce(top, op=dist.ReduceOp.MAX)
                drift = torch.cat([total, top])
            out["drift_mean"] = float(drift[0] / drift[1]) if drift[1] > 0 else 0.0
            out["drift_max"] = float(drift[2])
        out.update({"grad_norm": sum(norms) / max(1, len(norms)), "lr": self._lr, "optimizer_steps": float(len(norms))})
        return out

    def _reduce_metrics(self, sums: dict[str, float], weights: dict[str, float], steps: int) -> dict[str, float]:
        """Additive shares summed over micro-batches and ranks make one value per optimizer
        step, averaged over the steps; the other metrics are token-weighted means."""
        keys = sorted(sums)
        if not keys:
            return {}
        t = torch.tensor([[sums[k] for k in keys], [weights[k] for k in keys]], dtype=torch.float64)
        if self.world > 1:
            dist.all_reduce(t)
        out = {}
        for i, k in enumerate(keys):
            den = float(steps) if k in _ADDITIVE else float(t[1, i])
            out[k] = float(t[0, i] / den) if den > 0 else 0.0
        return out

    # ------------------------------------------------------------------ SFT
    def sft_step(self, input_ids: torch.Tensor, labels: torch.Tensor, attention_mask: torch.Tensor) -> dict[str, float]:
        """One step of token-mean cross entropy over labels != -100 (labels aligned with ids;
        the shift happens here). Every rank passes the same batch and takes its share of rows."""
        self.module.train()
        self.sft_steps += 1
        target = labels[:, 1:]
        denom = float((target != IGNORE_INDEX).sum())
        if denom == 0:
            raise ValueError("an SFT batch has no labelled token (all labels are -100); check the traces")
        local = torch.tensor_split(torch.arange(len(input_ids)), self.world)[self.rank]
        micro = self._micro(local)
        total = 0.0
        for j, mb in enumerate(micro):
            sync = j == len(micro) - 1 or self.world == 1
            ids, lab, attn = (t[mb].to(self.device) for t in (input_ids, labels, attention_mask))
            width = int(attn.sum(1).max())
            ids, lab, attn = ids[:, :width], lab[:, :width], attn[:, :width]
            # logits only from the first labelled position on: prompts carry no labels, and the
            # vocabulary projection of every prompt position is a large share of a small model's cost
            labelled = (lab[:, 1:] != IGNORE_INDEX).any(0).nonzero()
            first = int(labelled[0]) if len(labelled) else width - 2
            with nullcontext() if sync else self.model.no_sync():
                with self._autocast():
                    logits = self.model(input_ids=ids, attention_mask=attn, use_cache=False,
                                        logits_to_keep=width - first).logits[:, :-1]
                tgt = lab[:, first + 1:]
                keep = tgt != IGNORE_INDEX
                lp = logprobs_from_logits(logits, tgt.clamp(min=0))
                value = -torch.where(keep, lp, 0).sum() / denom
                (value * self.world).backward()
            total += float(value.detach())
        norm = self._step_optimizer()
        t = torch.tensor([total], dtype=torch.float64)
        if self.world > 1:
            dist.all_reduce(t)
        return {"loss": float(t[0]), "grad_norm": norm}

    # ------------------------------------------------------------------ weights and state
    def named_hf_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """HF checkpoint names, each storage once (a tied lm_head is its embedding), in the
        compute dtype. Only rank 0 yields anything: every rank holds the same replica."""
        if self.rank != 0:
            return
        seen: set[int] = set()
        for name, t in self.module.state_dict().items():
            ptr = t.untyped_storage().data_ptr()
            if ptr in seen:
                continue
            seen.add(ptr)
            yield name, t.detach().to(self.compute_dtype)

    def state_dict(self) -> dict[str, Any]:
        return {"model": self.module.state_dict(), "optimizer": self.optimizer.state_dict(),
                "rl_steps": self.rl_steps, "sft_steps": self.sft_steps, "lr": self._lr}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.module.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.rl_steps, self.sft_steps = int(state["rl_steps"]), int(state["sft_steps"])
        self.set_lr(float(state["lr"]))

    def save_hf(self, path: Path) -> None:
        """safetensors + config + tokenizer, in the compute dtype; rank 0 writes."""
        if self.rank != 0:
            return
        from transformers import AutoTokenizer

        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        self.module.to(self.compute_dtype).save_pretrained(path, safe_serialization=True)
        self.module.to(torch.float32)
        AutoTokenizer.from_pretrained(self.cfg.model).save_pretrained(path)


class TorchReference:
    """The frozen starting policy, one replica per rank, each computing its share of rows."""

    def __init__(self, model: str, dtype: str = "float32", temperature: float = 1.0, micro_batch_size: int = 8,
                 device: torch.device | None = None) -> None:
        self.rank, self.world = dist_info()
        self.device = device or default_device()
        self.temperature = temperature
        self.micro_batch_size = micro_batch_size
        self.module = load_causal_lm(model, DTYPES[dtype], self.device).eval().requires_grad_(False)

    @torch.no_grad()
    def compute_logprobs(self, batch: "Batch") -> torch.Tensor:
        local = torch.tensor_split(torch.arange(len(batch)), self.world)[self.rank]
        out = []
        for mb in local.split(self.micro_batch_size):
            rows = tuple(t[mb].to(self.device) for t in (batch.prompts, batch.responses, batch.attention_mask,
                                                          batch.position_ids))
            out.append(response_logprobs(self.module, *rows, self.temperature)[0].float().cpu())
        lp = torch.cat(out) if out else torch.zeros(0, batch.responses.shape[1])
        return _gather_rows(lp, len(batch), self.world)


def make_reference(backend: str, model: str, dtype: str = "float32", temperature: float = 1.0,
                   micro_batch_size: int = 8) -> Any:
    """The reference policy by config name: "torch" (a replica per rank) or "deepspeed" (ZeRO-3
    partitioned over the ranks; engines/training/deepspeed_ref.py)."""
    if backend == "torch":
        return TorchReference(model, dtype, temperature, micro_batch_size)
    if backend == "deepspeed":
        from engines.training.deepspeed_ref import DeepSpeedReference

        return DeepSpeedReference(model, dtype, temperature, micro_batch_size)
    raise ValueError(f"reference.backend={backend!r}; choose 'torch' or 'deepspeed'")
