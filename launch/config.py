"""The one config tree of a run: dataclasses, filled from a YAML file and dotted CLI overrides.

    python launch/train.py launch/configs/cpu_demo.yaml trainer.steps=5 rollout.n=8

Everything is checked before any model loads: types by OmegaConf against the dataclasses, values
by each section's `__post_init__`, and cross-references (agent names, tool classes, interaction
classes, engine backends) by `validate`. Every error names the key, the bad value and what is
allowed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engines.training.losses import LossConfig

REPO = Path(__file__).resolve().parents[1]
DEFAULT_CONFIG = REPO / "launch" / "configs" / "cpu_demo.yaml"
ENGINES = ("vllm", "hf", "sglang")
TASKS = ("arithmetic", "gsm8k", "rows")
ADVANTAGES = ("grpo", "rloo", "reinforce_pp")
POLICIES = ("sticky_group", "sticky", "least_loaded", "round_robin")


class ConfigError(ValueError):
    """A config value that cannot work; the message names the key."""


def _positive(section: str, obj: Any, *names: str) -> None:
    for name in names:
        value = getattr(obj, name)
        if value is None or value < 1:
            raise ConfigError(f"{section}.{name}={value!r} must be a positive integer")


def _choice(section: str, name: str, value: Any, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ConfigError(f"{section}.{name}={value!r} is not allowed; choose one of {list(allowed)}")


@dataclass
class ModelConfig:
    path: str = "smollm2-135m-instruct"  # built-in name, local HF directory or hub id
    dtype: str = "float32"

    def __post_init__(self) -> None:
        _choice("model", "dtype", self.dtype, ("float32", "bfloat16", "float16"))


@dataclass
class DataConfig:
    task: str = "arithmetic"  # arithmetic (procedural, no download) | gsm8k (jsonl/hub) | rows (verl rows file)
    train_path: str | None = None  # task=gsm8k: GSM8K jsonl; task=rows: jsonl/json/parquet rows
    prompts_per_step: int = 8
    seed: int = 0
    agent_name: str = "tool_agent"  # for generated rows (arithmetic, gsm8k); rows files carry their own
    max_operand: int = 50  # arithmetic difficulty
    num_ops: int = 2

    def __post_init__(self) -> None:
        _choice("data", "task", self.task, TASKS)
        _positive("data", self, "prompts_per_step", "max_operand", "num_ops")
        if self.task == "rows" and not self.train_path:
            raise ConfigError("data.train_path is required when data.task=rows (a jsonl/json/parquet file of rows)")


@dataclass
class RolloutConfig:
    engine: str = "vllm"
    num_engines: int = 1
    engine_options: dict[str, Any] = field(default_factory=dict)  # passed to the engine backend
    policy: str = "sticky_group"
    n: int = 4  # samples per prompt: one GRPO group
    temperature: float = 1.0
    top_p: float = 1.0
    max_tokens: int = 128  # per generation; tool_agent's max_turn_tokens caps it too
    num_workers: int = 0  # agent worker processes; 0 = in the trainer's process
    agent: dict[str, Any] = field(default_factory=dict)  # {agent_name: {loop options}}
    agent_loops: dict[str, str] = field(default_factory=dict)  # {agent_name: package.module.LoopClass}
    tools_config: str | None = "launch/configs/tools_calculator.yaml"
    interaction_config: str | None = None
    startup_timeout_s: float = 900.0
    weight_bucket_mb: int = 64

    def __post_init__(self) -> None:
        _choice("rollout", "engine", self.engine, ENGINES)
        _choice("rollout", "policy", self.policy, POLICIES)
        _positive("rollout", self, "num_engines", "n", "max_tokens", "weight_bucket_mb")
        if self.num_workers < 0:
            raise ConfigError(f"rollout.num_workers={self.num_workers} must be >= 0 (0 = run in the trainer process)")
        if self.temperature <= 0:
            raise ConfigError(f"rollout.temperature={self.temperature} must be > 0 for RL (sampling, not greedy)")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"rollout.top_p={self.top_p} must be in (0, 1]")


@dataclass
class ActorConfig:
    backend: str = "torch"
    lr: float = 1e-5
    weight_decay: float = 0.0
    warmup_steps: int = 0
    grad_clip: float = 1.0
    micro_batch_size: int = 8
    ppo_mini_batch_size: int = 0  # 0 = the whole batch is one mini-batch (one optimizer step per RL step)
    ppo_epochs: int = 1
    gradient_checkpointing: bool = False
    trainable: list[str] = field(default_factory=list)  # parameter-name regexes to train; empty = all
    tp: int = 1  # megatron: tensor parallel size
    pp: int = 1  # megatron: pipeline parallel size

    def __post_init__(self) -> None:
        _choice("actor", "backend", self.backend, ("torch", "megatron"))
        _positive("actor", self, "micro_batch_size", "ppo_epochs", "tp", "pp")
        if self.backend == "torch" and (self.tp, self.pp) != (1, 1):
            raise ConfigError(f"actor.tp={self.tp}, actor.pp={self.pp} need actor.backend=megatron (the torch actor "
                              "is data parallel only)")
        if self.backend == "megatron" and (self.trainable or self.gradient_checkpointing):
            raise ConfigError(f"actor.trainable={list(self.trainable)} / actor.gradient_checkpointing="
                              f"{self.gradient_checkpointing} are torch-actor options; the megatron actor trains every "
                              "parameter without recomputation: set actor.trainable=[] actor.gradient_checkpointing=false")
        if self.lr <= 0:
            raise ConfigError(f"actor.lr={self.lr} must be > 0")
        if self.ppo_mini_batch_size < 0:
            raise ConfigError(f"actor.ppo_mini_batch_size={self.ppo_mini_batch_size} must be >= 0")


@dataclass
class ReferenceConfig:
    backend: str = "torch"  # torch | deepspeed (ZeRO-3; CUDA)

    def __post_init__(self) -> None:
        _choice("reference", "backend", self.backend, ("torch", "deepspeed"))


@dataclass
class AlgorithmConfig:
    advantage: str = "grpo"
    norm_by_std: bool = True
    loss: LossConfig = field(default_factory=LossConfig)

    def __post_init__(self) -> None:
        _choice("algorithm", "advantage", self.advantage, ADVANTAGES)


@dataclass
class SFTConfig:
    enabled: bool = True
    steps: int = 30
    batch_size: int = 8
    lr: float = 5e-5
    examples: int = 512

    def __post_init__(self) -> None:
        if self.enabled:
            _positive("sft", self, "steps", "batch_size", "examples")


@dataclass
class TrainerConfig:
    steps: int = 20
    output_dir: str = "runs/cpu_demo"
    save_every: int = 1
    resume: bool = True  # continue from output_dir's last checkpoint when there is one
    seed: int = 0
    wandb_project: str | None = None  # metrics go to wandb too when set
    export_hf: bool = True  # write output_dir/hf (safetensors) at the end

    def __post_init__(self) -> None:
        _positive("trainer", self, "steps", "save_every")


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    reference: ReferenceConfig = field(default_factory=ReferenceConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    sft: SFTConfig = field(default_factory=SFTConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """Defaults <- YAML file <- `key.sub=value` overrides, type-checked and validated."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    path = Path(path) if path else DEFAULT_CONFIG
    if not path.exists():
        raise ConfigError(f"config file {str(path)!r} does not exist; pass a YAML file such as {DEFAULT_CONFIG}")
    bad = [o for o in overrides or [] if "=" not in o]
    if bad:
        raise ConfigError(f"override {bad[0]!r} is not key=value (e.g. trainer.steps=5)")
    try:
        tree = OmegaConf.merge(OmegaConf.structured(Config), OmegaConf.load(path),
                               OmegaConf.from_dotlist(list(overrides or [])))
        cfg = OmegaConf.to_object(tree)
    except OmegaConfBaseException as e:
        key = getattr(e, "full_key", None)
        raise ConfigError(f"{path}: bad config{f' at {key}' if key else ''}: {str(e).splitlines()[0]}") from None
    except ValueError as e:  # a section's __post_init__
        raise ConfigError(f"{path}: {e}") from None
    assert isinstance(cfg, Config)
    validate(cfg)
    return cfg


def resolve_path(p: str | None) -> Path | None:
    """Config paths are relative to the working directory, else to the repository."""
    if not p:
        return None
    path = Path(p)
    return path if path.is_absolute() or path.exists() else REPO / path


def validate(cfg: Config) -> None:
    """Cross-section checks that import classes but load no model."""
    from agent.loop import AgentLoopRegistry

    try:
        registry = AgentLoopRegistry(cfg.rollout.agent_loops)
    except ValueError as e:
        raise ConfigError(f"rollout.{e}") from None
    for name in [cfg.data.agent_name, *cfg.rollout.agent]:
        try:
            registry.get(name)
        except KeyError as e:
            key = "data.agent_name" if name == cfg.data.agent_name else f"rollout.agent.{name}"
            raise ConfigError(f"{key}: {e.args[0]}") from None
    if "tool_agent" in cfg.rollout.agent:
        from agent.tool_agent import ToolAgentConfig

        try:
            ToolAgentConfig.from_mapping(cfg.rollout.agent["tool_agent"])
        except ValueError as e:
            raise ConfigError(f"rollout.agent.tool_agent: {e}") from None
    if "langgraph_agent" in cfg.rollout.agent:
        try:
            from agent.langgraph import LangGraphAgentConfig, import_graph_factory
        except ImportError as e:
            raise ConfigError(f"rollout.agent.langgraph_agent needs langgraph ({e}); pip install langgraph") from None
        try:
            lg = LangGraphAgentConfig.from_mapping(cfg.rollout.agent["langgraph_agent"])
            import_graph_factory(lg.graph_factory)
        except ValueError as e:
            raise ConfigError(f"rollout.agent.langgraph_agent: {e}") from None
    if cfg.rollout.tools_config:
        from agent.tools import ToolConfigError, load_tools

        path = resolve_path(cfg.rollout.tools_config)
        try:
            load_tools(path)
        except ToolConfigError as e:
            raise ConfigError(f"rollout.tools_config: {e}") from None
    if cfg.rollout.interaction_config:
        from agent.interactions import InteractionConfigError, load_interactions

        try:
            load_interactions(resolve_path(cfg.rollout.interaction_config))
        except InteractionConfigError as e:
            raise ConfigError(f"rollout.interaction_config: {e}") from None
    mini = cfg.actor.ppo_mini_batch_size
    total = cfg.data.prompts_per_step * cfg.rollout.n
    if mini and total % mini:
        raise ConfigError(f"actor.ppo_mini_batch_size={mini} must divide the batch of data.prompts_per_step x "
                          f"rollout.n = {total} trajectories")
