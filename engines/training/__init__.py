"""Training backends (actor, reference) and the RL loss; one module per backend, no orchestration.

`make_actor` builds the actor backend `actor.backend` names in `backends.ACTORS`;
`reference.make_reference` the reference.
"""

from __future__ import annotations

import importlib
from typing import Any

from engines.training.backends import actor_backend
from engines.training.config import ActorConfig


def make_actor(cfg: ActorConfig, model: str, dtype: str = "float32", temperature: float = 1.0, seed: int = 0,
               progress: bool = True) -> Any:
    """The actor of `cfg.backend` for the HF checkpoint directory `model`."""
    module, name = actor_backend(cfg.backend).target.split(":")
    return getattr(importlib.import_module(module), name)(cfg, model, dtype, temperature, seed, progress)
