"""Training backends (actor, reference) and the RL loss; one module per backend, no orchestration.

`make_actor` picks the actor backend by `actor.backend`; `reference.make_reference` the reference.
"""

from __future__ import annotations

from typing import Any

from engines.training.config import ActorConfig


def make_actor(cfg: ActorConfig, model: str, dtype: str = "float32", temperature: float = 1.0, seed: int = 0,
               progress: bool = True) -> Any:
    """The actor of `cfg.backend` for the HF checkpoint directory `model`."""
    if cfg.backend == "megatron":
        from engines.training.megatron_actor import MegatronActor

        return MegatronActor(cfg, model, dtype, temperature, seed, progress)
    from engines.training.torch_actor import TorchActor

    return TorchActor(cfg, model, dtype, temperature, seed, progress)
