"""What the trainer needs from an actor and a reference, whatever runs them (plain torch,
DeepSpeed, Megatron). The trainer only talks to these two protocols; `engines/training/actor.py`'s `ActorBase`
implements the shared part of `Actor` once for every backend.

A `batch` is `engines.training.batch.Batch`: left-padded prompts, right-padded responses, their masks,
and position ids. Logprobs are per response token, [B, R], computed as
log_softmax(logits / temperature)[token], the same quantity the engines report.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator, Protocol

if TYPE_CHECKING:
    import torch

    from engines.training.batch import Batch
    from engines.training.losses import LossConfig


class Reference(Protocol):
    def compute_logprobs(self, batch: "Batch") -> "torch.Tensor":
        """[B, R] logprobs of the response tokens under the frozen reference (0 where masked)."""


class Actor(Protocol):
    def compute_logprobs(self, batch: "Batch") -> tuple["torch.Tensor", "torch.Tensor"]:
        """([B, R] logprobs, [B, R] entropy) under the current policy, no gradient."""

    def update(self, batch: "Batch", advantages: "torch.Tensor", old_logprobs: "torch.Tensor",
               ref_logprobs: "torch.Tensor | None", loss: "LossConfig") -> dict[str, float]:
        """PPO/GRPO epochs over the batch; returns metrics averaged over the step."""

    def sft_step(self, input_ids: "torch.Tensor", labels: "torch.Tensor",
                 attention_mask: "torch.Tensor") -> dict[str, float]:
        """One optimizer step of token-mean cross entropy on labels != -100."""

    def set_lr(self, lr: float) -> None: ...

    def named_hf_weights(self) -> Iterator[tuple[str, "torch.Tensor"]]:
        """The policy's weights as HF checkpoint names and layouts (each tensor once)."""

    def named_sync_weights(self, adapter: bool) -> Iterator[tuple[str, "torch.Tensor"]]:
        """What a weight sync sends: `named_hf_weights()`, or with a LoRA actor and `adapter` (the
        engines apply adapters) the adapter alone (engines/lora.py)."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...

    def save_hf(self, path: Path) -> None:
        """A directory transformers and vLLM load (safetensors, config, tokenizer)."""
