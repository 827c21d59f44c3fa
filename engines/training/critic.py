"""The critic of `algorithm.advantage=gae`: a value model trained beside the actor.

It is a transformers causal LM (the policy's checkpoint, or `critic.model`) whose vocabulary head
is replaced by a one-output linear head that starts at zero, so V(s) is the head applied to the
hidden state that, in the policy, scores the next token: the value of a response token is the
value of the state just before the model emitted it, the same positions the actor's logprobs come
from. It runs on the actor's ranks with the torch actor's machinery (DDP or FSDP2 over the same
process group, micro-batches by rows or by token budget, its own AdamW and learning rate), so
everything `ActorBase` does for the policy (mini-batches, epochs, global loss denominators,
metric reductions, sharded checkpoints) holds for the critic too.

Values are recomputed by the trainer for every batch it learns from, whatever policy version
sampled it, so the critic works unchanged with bounded staleness.
"""

from __future__ import annotations

from typing import Any

import torch

from engines.training.batch import Batch, MicroBatch
from engines.training.config import ActorConfig, CriticConfig
from engines.training.hf_model import target_outputs
from engines.training.losses import value_loss
from engines.training.torch_actor import TorchActor


class Critic(TorchActor):
    fresh = ("lm_head.",)  # the value head is new: it starts at zero, not from the checkpoint

    def __init__(self, cfg: CriticConfig, actor_cfg: ActorConfig, model: str, dtype: str = "float32",
                 seed: int = 0, progress: bool = True, device: torch.device | None = None) -> None:
        self.critic_cfg = cfg
        super().__init__(cfg.optim(actor_cfg), model, dtype, 1.0, seed, progress, device)

    def _prepare(self, module: torch.nn.Module) -> None:
        head = getattr(module, "lm_head", None)
        if not isinstance(head, torch.nn.Linear):
            raise ValueError(f"the critic replaces a causal LM's `lm_head` with a value head and "
                             f"{type(module).__name__} has none; give critic.model a decoder-only causal LM")
        config = module.config.get_text_config() if hasattr(module.config, "get_text_config") else module.config
        value_head = torch.nn.Linear(head.in_features, 1, bias=True, device=head.weight.device)
        with torch.no_grad():
            value_head.weight.zero_()
            value_head.bias.zero_()
        module.lm_head = value_head
        for cfg in {id(c): c for c in (module.config, config)}.values():
            cfg.tie_word_embeddings = False  # the head is the critic's own, never the embedding
            if getattr(cfg, "final_logit_softcapping", None):
                cfg.final_logit_softcapping = None  # a value is unbounded, not a squashed logit
        super()._prepare(module)

    def _param_groups(self) -> list[dict[str, Any]]:
        """The value head apart when `critic.head_lr_scale` != 1: it starts at zero and is the only part
        that is new, while the body comes trained; one rate for both moves the head too slowly to follow."""
        scale = self.critic_cfg.head_lr_scale
        head = {id(p) for p in self.module.lm_head.parameters()}
        if scale == 1.0 or not head:
            return super()._param_groups()
        return [{"params": [p for p in self.params if id(p) not in head]},
                {"params": [p for p in self.params if id(p) in head], "lr_scale": scale, "lr": self.cfg.lr * scale}]

    def _score(self, model: torch.nn.Module, mb: MicroBatch, temperature: float,
               want_entropy: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """[b, k] values of the states before `mb.targets` (0 where `target_mask` is False)."""
        values = torch.where(mb.target_mask, target_outputs(model, mb)[..., 0].float(), 0.0)
        return values, (torch.zeros_like(values) if want_entropy else None)

    @torch.no_grad()
    def compute_values(self, batch: Batch) -> torch.Tensor:
        """[B, R] values of the batch's response tokens (0 past each response); every rank gets
        all rows (a shard: its own)."""
        return self.compute_logprobs(batch)[0]

    def update_values(self, batch: Batch, returns: torch.Tensor, old_values: torch.Tensor,
                      mask: torch.Tensor | None = None) -> dict[str, Any]:
        """`critic.ppo_epochs` epochs of the clipped value loss toward `returns` over the mask-1
        tokens of `mask` (default: the batch's loss mask); `old_values` are the values the returns
        were computed with."""
        mask = batch.loss_mask if mask is None else mask
        clip = self.critic_cfg.value_clip

        def loss_for(denom: float, tally: Any) -> Any:
            def loss_fn(mb: MicroBatch, values: torch.Tensor, _ent: torch.Tensor | None) -> torch.Tensor:
                k = values.shape[1]
                pick = lambda t: t[mb.rows, :k].to(self.device)  # noqa: E731
                msk = pick(mask)
                loss, met = value_loss(values.float(), pick(old_values).float(), pick(returns).float(), msk,
                                       clip, denom)
                tally.add(met, float(msk.sum()))
                return loss
            return loss_fn

        _, out = self._train_epochs(batch, "token-mean", False, loss_for, mask)
        out["value_loss"] = out.pop("loss", 0.0)
        out.pop("values_mean", None)  # the trainer reports the values the advantages used
        return out


def make_critic(cfg: CriticConfig, actor_cfg: ActorConfig, model: str, dtype: str = "float32", seed: int = 0,
                progress: bool = True) -> Critic:
    """The critic for the HF checkpoint directory `model`; the actor must be the torch one."""
    from engines.training.backends import actor_backend, with_feature

    if not actor_backend(actor_cfg.backend).critic:
        raise ValueError(f"algorithm.advantage=gae trains a critic beside the actor, which needs actor.backend="
                         f"{'|'.join(with_feature('critic'))} (got {actor_cfg.backend!r}); use an outcome estimator "
                         f"(grpo, rloo) with {actor_cfg.backend}")
    return Critic(cfg, actor_cfg, model, dtype, seed + 1, progress)
