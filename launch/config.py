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

from agent.rewards.function import RewardConfig
from engines.config_checks import choice, positive
from engines.inference import ENGINES
from engines.training.advantages import ESTIMATORS
from engines.training.config import DTYPES, ActorConfig, CriticConfig
from launch.data.curriculum import CurriculumConfig
from engines.training.losses import LossConfig
from engines.training.reference import REFERENCES
from rollout.config import RolloutConfig

REPO = Path(__file__).resolve().parents[1]
DEFAULT_CONFIG = REPO / "launch" / "configs" / "cpu_demo.yaml"
TASKS = ("arithmetic", "gsm8k", "rows")
RESUME_MODES = ("auto", "fresh")


class ConfigError(ValueError):
    """A config value that cannot work; the message names the key."""


@dataclass
class ModelConfig:
    path: str = "smollm2-135m-instruct"  # built-in name, local HF directory or hub id
    # the actor's compute dtype (autocast over fp32 weights) and the engines': auto = bfloat16 where the
    # trainer's device multiplies it natively, else float32 (engines/training/config.py resolve_dtype)
    dtype: str = "auto"

    def __post_init__(self) -> None:
        choice("model", "dtype", self.dtype, ("auto", *DTYPES), error=ConfigError)


@dataclass
class DataConfig:
    task: str = "arithmetic"  # arithmetic (procedural, no download) | gsm8k (jsonl/hub) | rows (verl rows file)
    train_path: str | None = None  # task=gsm8k: GSM8K jsonl; task=rows: jsonl/json/parquet rows
    # held-out rows for validation (launch/validation.py): "test" = the task's own test split (arithmetic:
    # generated, disjoint from training by expression; gsm8k from the hub id), or a file of verl rows
    # or raw GSM8K records (jsonl/json/parquet); None = no validation
    val_path: str | None = None
    prompts_per_step: int = 8  # rows (prompts) per step; each gets rollout.n samples
    seed: int = 0  # the order rows are drawn in
    agent_name: str = "tool_agent"  # for generated rows (arithmetic, gsm8k); rows files carry their own
    max_operand: int = 50  # arithmetic difficulty
    num_ops: int = 2  # arithmetic: operators per expression
    curriculum: CurriculumConfig = field(default_factory=CurriculumConfig)  # launch/data/curriculum.py
    # rows whose prompt holds more tokens are left out before the run, each named (None: the model's
    # context, max_position_embeddings); the engines would refuse them anyway, one failed trajectory each
    max_prompt_tokens: int | None = None

    def __post_init__(self) -> None:
        choice("data", "task", self.task, TASKS, error=ConfigError)
        positive("data", self, "prompts_per_step", "max_operand", "num_ops", error=ConfigError)
        if self.max_prompt_tokens is not None and (isinstance(self.max_prompt_tokens, bool)
                                                   or not isinstance(self.max_prompt_tokens, int)
                                                   or self.max_prompt_tokens < 1):
            raise ConfigError(f"data.max_prompt_tokens={self.max_prompt_tokens!r} must be a positive integer (or null: "
                              "the model's context)")
        if self.task == "rows" and not self.train_path:
            raise ConfigError("data.train_path is required when data.task=rows (a jsonl/json/parquet file of rows)")
        if self.val_path == "test" and self.task == "rows":
            raise ConfigError("data.val_path=test means the task's own test split, and data.task=rows has none; give "
                              "a file of held-out rows (data.val_path=path/to/val.jsonl), or data.val_path=null to "
                              "train without validation")
        if self.val_path == "test" and self.task == "gsm8k" and self.train_path != "openai/gsm8k":
            raise ConfigError(f"data.val_path=test with data.task=gsm8k reads the hub's test split only when "
                              f"data.train_path=openai/gsm8k (got {self.train_path!r}); give the GSM8K test file "
                              "instead (data.val_path=path/to/gsm8k/test.jsonl), or data.val_path=null to train "
                              "without validation")


@dataclass
class ReferenceConfig:
    backend: str = "torch"  # torch | deepspeed (ZeRO-3; CUDA)

    def __post_init__(self) -> None:
        choice("reference", "backend", self.backend, REFERENCES, error=ConfigError)


@dataclass
class AlgorithmConfig:
    advantage: str = "grpo"  # grpo | rloo | reinforce_pp | turn_grpo | gae (with the `critic:` section)
    norm_by_std: bool = True  # grpo/turn_grpo: divide by the group's std; gae: by the batch's (whitening)
    gamma: float = 1.0  # gae: the discount per model token
    lam: float = 1.0  # gae: lambda, the bias/variance trade-off of the advantage (1 = Monte Carlo returns)
    loss: LossConfig = field(default_factory=LossConfig)

    def __post_init__(self) -> None:
        choice("algorithm", "advantage", self.advantage, tuple(ESTIMATORS), error=ConfigError)
        if not 0 < self.gamma <= 1:
            raise ConfigError(f"algorithm.gamma={self.gamma} must be in (0, 1] (1 = no discounting)")
        if not 0 <= self.lam <= 1:
            raise ConfigError(f"algorithm.lam={self.lam} must be in [0, 1] (GAE's lambda)")


@dataclass
class SFTConfig:
    enabled: bool = True  # a supervised warm-up on solved examples before the first RL step (launch/data/sft.py)
    steps: int = 30  # warm-up optimizer steps
    batch_size: int = 8  # examples per warm-up step
    lr: float = 5e-5  # the warm-up's learning rate
    examples: int = 512  # solved examples made for the warm-up

    def __post_init__(self) -> None:
        if self.enabled:
            positive("sft", self, "steps", "batch_size", "examples", error=ConfigError)


@dataclass
class ValConfig:
    """How validation samples (launch/validation.py): greedy with one sample by default; `n` samples
    at a temperature > 0 give pass@k and mean@k. A sample passes when its reward >= pass_threshold."""

    n: int = 1  # samples per validation row (pass@n, mean@n)
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0  # nucleus sampling of validation samples
    max_rows: int | None = None  # at most this many rows (the arithmetic test split makes 200 by default)
    pass_threshold: float = 1.0  # a sample passes when its reward >= this
    records: bool = True  # write every sample to output_dir/val/step_N.jsonl
    timeout_s: float = 3600.0  # longest a validation may take before the run fails naming it

    def __post_init__(self) -> None:
        positive("val", self, "n", error=ConfigError)
        if self.max_rows is not None:
            positive("val", self, "max_rows", error=ConfigError)
        if not (self.temperature == 0 or 0.01 <= self.temperature <= 100):
            raise ConfigError(f"val.temperature={self.temperature} must be 0 (greedy) or in [0.01, 100]")
        if self.n > 1 and self.temperature == 0:
            raise ConfigError(f"val.n={self.n} greedy samples would all be the same; set val.temperature > 0 "
                              "(e.g. 1.0) for pass@k, or val.n=1")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"val.top_p={self.top_p} must be in (0, 1]")
        if not self.timeout_s > 0:
            raise ConfigError(f"val.timeout_s={self.timeout_s} must be > 0 (seconds)")


@dataclass
class TrainerConfig:
    steps: int = 20  # RL steps of the run
    output_dir: str = "runs/cpu_demo"  # metrics, checkpoints, the hf export; a rerun resumes from it
    save_every: int = 1  # a checkpoint every N steps (and after the last)
    # auto: continue from output_dir's newest checkpoint that loads; when checkpoints are there and none
    # loads, the run stops naming each and why. fresh: start at step 0; an earlier run's checkpoints and
    # metrics are moved aside into output_dir/earlier/<its run id>/ (launch/resume.py)
    resume: str = "auto"
    # keys whose change on resume alters the run's meaning (actor.lr, model.dtype, rollout.n, ...) and
    # that this resume accepts all the same, e.g. [actor.lr]; ["all"] accepts every change (launch/resume.py)
    resume_changes: list[str] = field(default_factory=list)
    seed: int = 0  # the actor's and sampling's seed
    # where each step's numbers and the resolved config go besides output_dir/metrics.jsonl (always):
    # console (the step line), wandb, tensorboard, mlflow (launch/loggers)
    loggers: list[str] = field(default_factory=lambda: ["console"])
    wandb_project: str | None = None  # the wandb project and MLflow experiment; setting it adds wandb to loggers
    export_hf: bool = True  # write output_dir/hf (safetensors) at the end
    collective_timeout_s: float = 3600.0  # longest wait of a rank in a collective: cover the longest rollout
    # validation on data.val_path: every val_every steps (0 = only after the last step), and before the
    # first step when val_before_train; the last step is always validated
    val_every: int = 0
    val_before_train: bool = True
    # the engines' logprobs against the actor's (launch/guards.py): drift/mean above drift_warn
    # (None: the model dtype's limit, DRIFT_LIMITS) warns naming the tensors that differ; above
    # max_drift (None: never) the run stops with a non-zero exit
    drift_warn: float | None = None
    max_drift: float | None = None
    # a run whose batches lose more than this fraction to failed trajectories, 3 steps in a row, stops
    # (launch/guards.py); a step with no valid trajectory fails on its own, and a run of only those exits 1
    max_invalid_fraction: float = 0.5

    def __post_init__(self) -> None:
        positive("trainer", self, "steps", "save_every", error=ConfigError)
        if self.resume not in RESUME_MODES:
            raise ConfigError(f"trainer.resume={self.resume!r} is not allowed; choose one of {list(RESUME_MODES)} "
                              "(auto: continue from the newest checkpoint that loads; fresh: start at step 0, the "
                              "earlier run moved aside)")
        if not 0 < self.max_invalid_fraction <= 1:
            raise ConfigError(f"trainer.max_invalid_fraction={self.max_invalid_fraction} must be in (0, 1] (1: never "
                              "stop for failed trajectories)")
        for key in ("drift_warn", "max_drift"):
            value = getattr(self, key)
            if value is not None and not value > 0:
                raise ConfigError(f"trainer.{key}={value} must be > 0 (a mean |logprob| gap), or null")
        if self.val_every < 0:
            raise ConfigError(f"trainer.val_every={self.val_every} must be >= 0 (0 = validate after the last step only)")
        if not self.collective_timeout_s > 0:
            raise ValueError(f"trainer.collective_timeout_s={self.collective_timeout_s} must be > 0 (seconds)")


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)  # algorithm.advantage=gae only
    reference: ReferenceConfig = field(default_factory=ReferenceConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    sft: SFTConfig = field(default_factory=SFTConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    val: ValConfig = field(default_factory=ValConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)  # agent/rewards/function.py


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """Defaults <- YAML file <- `key.sub=value` overrides, type-checked and validated."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    overrides = _demo_defaults(path, list(overrides or []))
    path = Path(path) if path else DEFAULT_CONFIG
    if not path.exists():
        raise ConfigError(f"config file {str(path)!r} does not exist; pass a YAML file such as {DEFAULT_CONFIG}")
    bad = [o for o in overrides or [] if "=" not in o]
    if bad:
        raise ConfigError(f"override {bad[0]!r} is not key=value (e.g. trainer.steps=5)")
    for o in overrides or []:  # a value YAML cannot read is the override's fault, not the file's
        try:
            OmegaConf.from_dotlist([o])
        except Exception as e:
            raise ConfigError(f"override {o!r:.200} does not parse ({str(e).splitlines()[0]}); quote the value, "
                              "e.g. key='text: with colons' or key=\"...\" (JSON string syntax)") from None
    try:
        tree = OmegaConf.merge(OmegaConf.structured(Config), OmegaConf.load(path),
                               OmegaConf.from_dotlist(list(overrides or [])))
        for o in overrides or []:  # `key={}` empties a free-form mapping such as rollout.engine_options (a
            key, _, value = o.partition("=")  # merge would keep the file's entries); a section keeps its defaults
            node = OmegaConf.select(tree, key.strip()) if value.strip() == "{}" else None
            if node is not None and OmegaConf.get_type(node) is dict:
                OmegaConf.update(tree, key.strip(), {}, merge=False)
        cfg = OmegaConf.to_object(tree)
    except OmegaConfBaseException as e:
        key = getattr(e, "full_key", None)
        if type(e).__name__ == "ConfigKeyError" and key:  # a key the tree does not have: name the closest
            from launch.config_help import unknown

            raise ConfigError(unknown(Config(), key)) from None
        raise ConfigError(f"{path}: bad config{f' at {key}' if key else ''}: {str(e).splitlines()[0]}") from None
    except ValueError as e:  # a section's __post_init__
        raise ConfigError(f"{path}: {e}") from None
    except Exception as e:  # the YAML itself does not parse
        if type(e).__module__.split(".")[0] != "yaml":
            raise
        raise ConfigError(f"{path} is not valid YAML: {str(e).splitlines()[0]}; fix the file") from None
    assert isinstance(cfg, Config)
    _check_finite(cfg, "")
    validate(cfg)
    return cfg


# the demo's settings that only fit its model (cpu_demo.yaml trains SmolLM2's top 10 layers): a run
# naming another model gets the defaults
DEMO_MODEL_ONLY = {"actor.trainable": "[]"}  # key: its default


def _demo_defaults(path: str | Path | None, overrides: list[str]) -> list[str]:
    """With no config file the demo's config is the base; a run that names another model (or a LoRA
    adapter) gets model-independent defaults for what only fits the demo's model: every parameter
    trains unless the overrides say otherwise."""
    keys = {o.split("=", 1)[0].strip() for o in overrides if "=" in o}
    given = {o.split("=", 1)[0].strip(): o.split("=", 1)[1].strip() for o in overrides if "=" in o}
    other_model = "model.path" in keys
    lora = any(k == "actor.lora" or k.startswith("actor.lora.") for k in keys)
    if path:
        return overrides
    # the demo validates on its task's own test split (data.val_path=test); another task has one only
    # from the hub's GSM8K, so a run naming another task validates when it names its held-out rows
    no_split = given.get("data.task", "arithmetic") != "arithmetic" and not (
        given.get("data.task") == "gsm8k" and given.get("data.train_path") == "openai/gsm8k")
    demo = [f"{k}={v}" for k, v in DEMO_MODEL_ONLY.items() if k not in keys] if other_model or lora else []
    return demo + (["data.val_path=null"] if no_split and "data.val_path" not in keys else []) + overrides


def _check_finite(node: Any, key: str) -> None:
    """No number anywhere in the tree is NaN or infinite (`actor.lr=nan` would otherwise pass
    every `x <= 0` check and fail only after the model loaded)."""
    import dataclasses
    import math

    if isinstance(node, float) and not math.isfinite(node):
        raise ConfigError(f"{key}={node} must be a finite number")
    if dataclasses.is_dataclass(node):
        for f in dataclasses.fields(node):
            _check_finite(getattr(node, f.name), f"{key}.{f.name}" if key else f.name)
    elif isinstance(node, dict):
        for k, v in node.items():
            _check_finite(v, f"{key}.{k}")
    elif isinstance(node, (list, tuple)):
        for i, v in enumerate(node):
            _check_finite(v, f"{key}[{i}]")


def resolved(cfg: Config) -> dict[str, Any]:
    """The run's config as the loggers record it: every section and key, defaults filled in."""
    import dataclasses

    return dataclasses.asdict(cfg)


def resolve_path(p: str | None) -> Path | None:
    """Config paths are relative to the working directory, else to the repository."""
    if not p:
        return None
    path = Path(p)
    return path if path.is_absolute() or path.exists() else REPO / path


def resolve_model_dtype(cfg: Config, show: bool) -> None:
    """`model.dtype=auto` made concrete for the trainer's device on this machine (the line that says
    which, printed when `show`), before any engine or actor is built from it."""
    import torch

    from engines.training.config import resolve_dtype

    cfg.model.dtype, why = resolve_dtype(cfg.model.dtype, "cuda" if torch.cuda.is_available() else "cpu")
    if show and why != "as configured":
        print(why, flush=True)


def validate(cfg: Config) -> None:
    """Cross-section checks that import classes but load no model."""
    from agent.loop import AgentLoopRegistry

    from engines.training.backends import ACTORS, with_feature

    from launch.loggers import missing

    if cfg.trainer.wandb_project and "wandb" not in cfg.trainer.loggers:
        cfg.trainer.loggers.append("wandb")
    for name in cfg.trainer.loggers:
        if missing(name):
            raise ConfigError(missing(name))
    if ESTIMATORS[cfg.algorithm.advantage].values and not ACTORS[cfg.actor.backend].critic:
        raise ConfigError(f"algorithm.advantage={cfg.algorithm.advantage} trains a critic beside the actor and needs "
                          f"actor.backend={'|'.join(with_feature('critic'))} (got {cfg.actor.backend!r}); use grpo or "
                          f"rloo with {cfg.actor.backend}")

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
    if "gym_agent" in cfg.rollout.agent or cfg.data.agent_name == "gym_agent":
        from agent.gym_loop import GymAgentConfig, load_env

        try:
            load_env(GymAgentConfig.from_mapping(cfg.rollout.agent.get("gym_agent") or {}).env)
        except ValueError as e:
            raise ConfigError(f"rollout.agent.gym_agent: {e}") from None
    if "openai_agent" in cfg.rollout.agent or cfg.data.agent_name == "openai_agent":
        from agent.openai_agent import OpenAIAgentConfig

        try:
            OpenAIAgentConfig.from_mapping(cfg.rollout.agent.get("openai_agent") or {})
        except ValueError as e:
            raise ConfigError(f"rollout.agent.openai_agent: {e}") from None
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
    if cfg.actor.lora is not None:
        import importlib.util

        from engines.training.lora import INSTALL

        if importlib.util.find_spec("peft") is None:
            raise ConfigError(f"actor.lora needs the peft package, which is not installed; install it with {INSTALL}")
    if cfg.actor.lora is not None and cfg.reference.backend != "torch":
        raise ConfigError(f"reference.backend={cfg.reference.backend!r} with actor.lora: the reference of a LoRA actor "
                          "is its own frozen base with the adapter off (no second model); set reference.backend=torch")
    mini = cfg.actor.ppo_mini_batch_size
    total = cfg.data.prompts_per_step * cfg.rollout.n
    if mini and total % mini:
        raise ConfigError(f"actor.ppo_mini_batch_size={mini} must divide the batch of data.prompts_per_step x "
                          f"rollout.n = {total} trajectories")


def check_world_size(cfg: Config, world: int) -> None:
    """Batch shapes that cannot be split over the ranks fail before any model loads."""
    a = cfg.actor
    mini = a.mini_batch(cfg.data.prompts_per_step * cfg.rollout.n)
    if world % (a.tp * a.pp):
        raise ConfigError(f"actor.tp={a.tp} x actor.pp={a.pp} does not divide the {world} ranks; start "
                          f"torchrun with a multiple of {a.tp * a.pp} processes")
    if cfg.rollout.in_process and ENGINES[cfg.rollout.engine].in_process_one_rank and world > 1:
        raise ConfigError(f"rollout.in_process=true with rollout.engine={cfg.rollout.engine} needs a trainer of one "
                          f"process (this run has {world}): the engine would take the ranks' torch.distributed world "
                          "as its own; set rollout.in_process=false (the engine then runs in a process of its own) "
                          "or start one process")
    dp = world // (a.tp * a.pp)
    if mini < dp:
        raise ConfigError(f"actor.ppo_mini_batch_size (or data.prompts_per_step x rollout.n) = {mini} "
                          f"trajectories cannot be split over {dp} data-parallel ranks; raise it to >= {dp}")
