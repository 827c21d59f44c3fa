"""Building a training process from the config, in the order that fails cheapest first: batch
geometry, then rows and tools (no model yet), then the process group, the rollout plane (whose
engines, where it is safe, start loading at once), the actor and the reference. `launch/train.py`
runs what this builds."""

from __future__ import annotations

import os
import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from launch.config import Config, ConfigError, check_world_size, resolve_model_dtype, resolve_path


@dataclass
class Run:
    """What one training process holds."""

    rank: int
    barrier: Callable[[], None]
    rows: list[dict[str, Any]]
    val_rows: list[dict[str, Any]]  # held-out rows (data.val_path), [] without validation
    stream: Any
    tools: dict[str, Any]
    model_dir: str
    actor: Any
    ref: Any
    plane: Any
    critic: Any = None  # the value model of algorithm.advantage=gae
    dp_rank: int = 0  # this rank's data-parallel replica (whose rows of each batch it trains on)


def setup(cfg: Config) -> Run:
    """Everything a training process holds; a bad config or row raises ConfigError before any model loads."""
    import torch

    from agent.interactions import load_interactions
    from agent.loop import AgentLoopRegistry
    from agent.tools import load_tools
    from engines.models import resolve_model
    from launch.data import training_rows, validation_rows
    from engines.inference import ENGINES
    from launch.data.rows import has_images
    from parallel.mesh import init_distributed
    from rollout.plane import RolloutPlane

    r = cfg.rollout
    check_world_size(cfg, int(os.environ.get("WORLD_SIZE", "1")))
    tools_path, inter_path = resolve_path(r.tools_config), resolve_path(r.interaction_config)
    try:  # a bad row, a missing file, a bad generator knob
        tools = load_tools(tools_path) if tools_path else {}
        inter = load_interactions(inter_path) if inter_path else {}
        names = AgentLoopRegistry(r.agent_loops).names
        rows = training_rows(cfg.data, names, list(tools), list(inter))
    except (OSError, ValueError) as e:
        raise ConfigError(f"data: {e}") from None
    if not ENGINES[r.engine].images and any(has_images(row) for row in rows):
        raise ConfigError(f"the training rows hold images and rollout.engine={r.engine} does not take them; use an "
                          f"engine that does ({[n for n, s in ENGINES.items() if s.images and s.rollout]})")
    reward = dataclasses.asdict(cfg.reward)
    if cfg.reward.function:  # loaded once here, so a bad path or an import error stops the run before models load
        from agent.rewards.function import load_function

        where, _, name = cfg.reward.function.rpartition(":")
        if where.endswith(".py") or "/" in where:
            reward["function"] = f"{Path(where).expanduser().resolve()}:{name}"  # workers may run elsewhere
        try:
            load_function(reward["function"])
        except ValueError as e:
            raise ConfigError(str(e)) from None
    try:
        val_rows = (validation_rows(cfg.data, cfg.val.max_rows, names, list(tools), list(inter))
                    if cfg.data.val_path else [])
    except (OSError, ValueError) as e:
        raise ConfigError(f"data.val_path={cfg.data.val_path!r}: {e}; data.val_path=null trains without "
                          "validation") from None
    if r.placement == "split" and not torch.cuda.is_available():
        raise ConfigError("rollout.placement='split' puts engines on GPUs of their own and this machine has none; "
                          "use rollout.placement=cpu (engines on core slices) or colocated (they also sleep)")
    rank, world = init_distributed(cfg.trainer.collective_timeout_s)
    barrier = torch.distributed.barrier if world > 1 else (lambda: None)
    if rank == 0:
        resolve_model(cfg.model.path)  # fetch/convert once, before other ranks read it
    barrier()
    model_dir = str(resolve_model(cfg.model.path))
    resolve_model_dtype(cfg, show=rank == 0)
    plane = RolloutPlane(r, model_dir, cfg.model.dtype, rank, world, tools_path, inter_path, reward=reward,
                         adapter_rank=cfg.actor.lora.rank if cfg.actor.lora is not None else 0)
    plane.launch_engines(Path(cfg.trainer.output_dir))  # they load while the rows are measured and the actor built
    try:
        rows, val_rows = _fitting(cfg, model_dir, rows, val_rows, show=rank == 0)
        return _build(cfg, rank, world, barrier, rows, val_rows, tools, model_dir, plane)
    except BaseException:
        plane.close()
        raise


def _fitting(cfg: Config, model_dir: str, rows: list[dict[str, Any]], val_rows: list[dict[str, Any]],
             show: bool) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The rows whose prompts fit `data.max_prompt_tokens` (default: the model's context); the others
    are left out before the run, each named by its row id (a 10 MB prompt would otherwise be one
    failed trajectory per epoch). Every rank filters alike."""
    from engines.models import load_tokenizer, model_positions
    from launch.data.rows import row_uid, too_long

    limit = cfg.data.max_prompt_tokens or model_positions(model_dir)
    if not limit:
        return rows, val_rows
    tokenizer = load_tokenizer(model_dir)
    kept = []
    for name, given in (("training", rows), ("validation", val_rows)):
        bad = set(too_long(given, tokenizer, limit))
        if bad and show:
            ids = [row_uid(given[i]) for i in sorted(bad)]
            print(f"WARNING: data: left out {len(bad)} {name} row(s) whose prompt holds more than "
                  f"data.max_prompt_tokens={limit} tokens (row ids {ids[:10]}{' ...' if len(ids) > 10 else ''}); "
                  "shorten them or raise data.max_prompt_tokens", flush=True)
        if bad and len(bad) == len(given) and name == "training":
            raise ConfigError(f"data: every training row's prompt holds more than data.max_prompt_tokens={limit} "
                              "tokens; shorten them or raise the limit")
        kept.append([row for i, row in enumerate(given) if i not in bad])
    return kept[0], kept[1]


def _build(cfg: Config, rank: int, world: int, barrier: Any, rows: list[dict[str, Any]],
           val_rows: list[dict[str, Any]], tools: dict[str, Any], model_dir: str, plane: Any) -> Run:
    """The actor, its critic and reference, and the row stream."""
    from engines.models import resolve_model
    from engines.training import make_actor
    from engines.training.reference import make_reference
    from launch.data.rows import RowStream

    r = cfg.rollout
    actor = make_actor(cfg.actor, model_dir, cfg.model.dtype, r.temperature, cfg.trainer.seed)
    if rank == 0 and hasattr(actor, "mesh"):
        print(actor.mesh.describe(), flush=True)
    if rank == 0:
        m = actor.memory_report()
        how = f"{cfg.actor.backend} actor, sharding {cfg.actor.sharding}" + (
            f", LoRA rank {cfg.actor.lora.rank}" if cfg.actor.lora is not None else "")
        print(f"actor memory on rank 0 ({world} rank(s), {how}): "
              f"weights {m['weights_gb']:.3g} GB + gradients {m['grads_gb']:.3g} GB + AdamW {m['optimizer_gb']:.3g} GB"
              + (f" + fp32 main weights {m['main_weights_gb']:.3g} GB" if m["main_weights_gb"] else "") + " = "
              f"{m['total_gb']:.3g} GB for {m['parameters'] / 1e6:.0f}M parameters ({m['bytes_per_parameter']:.1f} bytes "
              "each), plus activations", flush=True)
        trains = "every parameter" if m["trainable_fraction"] >= 1 else (
            f"{m['trainable_fraction']:.3%} of the parameters (actor.trainable={list(cfg.actor.trainable)}"
            + (f", LoRA rank {cfg.actor.lora.rank}" if cfg.actor.lora is not None else "") + ")")
        print(f"training {trains}; {_layers_trained(actor)}", flush=True)
    critic = None
    from engines.training.advantages import ESTIMATORS

    if ESTIMATORS[cfg.algorithm.advantage].values:
        from engines.training.critic import make_critic

        critic_dir = model_dir
        if cfg.critic.model:
            if rank == 0:
                resolve_model(cfg.critic.model)
            barrier()
            critic_dir = str(resolve_model(cfg.critic.model))
        critic = make_critic(cfg.critic, cfg.actor, critic_dir, cfg.model.dtype, cfg.trainer.seed)
    ref = None
    if cfg.algorithm.loss.kl_coef > 0 and cfg.actor.lora is not None:  # the actor's base, adapter off: no copy
        from engines.training.reference import AdapterOffReference

        ref = AdapterOffReference(actor)
    elif cfg.algorithm.loss.kl_coef > 0:
        ref = make_reference(cfg.reference.backend, model_dir, dtype=cfg.model.dtype, temperature=r.temperature,
                             micro_batch_size=cfg.actor.micro_batch_size, shared_prefix=cfg.actor.shared_prefix)
    if cfg.data.curriculum.mode != "off":
        from launch.data.curriculum import CurriculumStream

        stream: Any = CurriculumStream(rows, cfg.data.curriculum, seed=cfg.data.seed)
    else:
        stream = RowStream(rows, seed=cfg.data.seed)
    return Run(rank, barrier, rows, val_rows, stream, tools, model_dir, actor, ref, plane, critic,
               int(getattr(actor, "dp_rank", rank)))


def _layers_trained(actor: Any) -> str:
    """How many of the model's decoder layers have a parameter that trains (from parameter names)."""
    import re

    module = actor.module if hasattr(actor, "module") else actor.model
    layers, trained = set(), set()
    for name, p in module.named_parameters():
        hit = re.search(r"layers\.(\d+)\.", name)
        if hit:
            layers.add(hit.group(1))
            if p.requires_grad:
                trained.add(hit.group(1))
    return f"{len(trained)} of {len(layers)} decoder layers"
