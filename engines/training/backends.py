"""The actor backends by name (`actor.backend`). Adding one is its module plus one entry here: the
config checks (`engines/training/config.py`), `make_actor`, the critic, the checkpointing of
`launch/train.py` and the memory plan of `launch/plan.py` all read it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping


@dataclass(frozen=True)
class ActorBackend:
    """One actor backend: where its class lives and what a run may ask of it."""

    target: str  # "module:Class", imported only when the backend is asked for
    shardings: Mapping[str, str]  # actor.sharding values it takes -> what each shards over the DP ranks
    # the per-parameter bytes of the actor's training state on one GPU (weights, gradients, AdamW
    # moments and master copy), given its sharding and the DP and model-parallel (TP x PP) sizes
    state_bytes: Callable[[str, int, int], float]
    per_rank_checkpoint: tuple[str, ...] = ()  # the shardings whose checkpoint is a file per rank
    model_parallel: bool = False  # takes actor.tp and actor.pp
    hf_options: bool = False  # takes the HF model's options: trainable, gradient_checkpointing, attn_implementation
    lora: bool = False  # trains a LoRA adapter (actor.lora)
    critic: bool = False  # a critic (algorithm.advantage=gae) trains beside it
    shared_prefix: bool = False  # packs rows by shared prefix (actor.shared_prefix; engines/training/prefix.py)


def _torch_bytes(sharding: str, dp: int, mp: int) -> float:
    return 16 / (dp if sharding == "fsdp" else 1)  # fp32 weights, gradients, two moments


def _megatron_bytes(sharding: str, dp: int, mp: int) -> float:
    # a distributed optimizer (ZeRO-1) keeps bf16 weights and gradients per rank, the fp32 master copy
    # and moments sharded over DP; both sharded over TP x PP
    return ((6 + 12 / dp) if sharding == "optimizer" else 16) / mp


ACTORS: dict[str, ActorBackend] = {
    "torch": ActorBackend("engines.training.torch_actor:TorchActor",
                          {"none": "DDP replicas", "fsdp": "FSDP2 shards of weights, gradients and optimizer"},
                          _torch_bytes, per_rank_checkpoint=("fsdp",), hf_options=True, lora=True, critic=True,
                          shared_prefix=True),
    "megatron": ActorBackend("engines.training.megatron_actor:MegatronActor",
                             {"none": "replicas", "optimizer": "AdamW state (ZeRO-1, a distributed optimizer)"},
                             _megatron_bytes, per_rank_checkpoint=("none", "optimizer"), model_parallel=True),
}


def actor_backend(name: str) -> ActorBackend:
    """The backend `name`, or a ValueError that lists the choices."""
    if name not in ACTORS:
        raise ValueError(f"actor.backend={name!r} is not allowed; choose one of {list(ACTORS)}")
    return ACTORS[name]


def with_feature(feature: str) -> list[str]:
    """The backends that have `feature` (a flag of ActorBackend), for errors that name the fix."""
    return [name for name, spec in ACTORS.items() if getattr(spec, feature)]
