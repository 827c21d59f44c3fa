"""The `rollout:` section of the run config: engines, sampling, agent loops and the weight
path into the engines. It lives with the code that reads it (`rollout/plane.py`); the run's config
tree (`launch/config.py`) puts it under `rollout`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

from agent.traces import TraceConfig
from engines.config_checks import choice, positive
from engines.inference import ENGINES, ROLLOUT_ENGINES, check_options  # the engine registry: one entry per backend
from rollout.bus.router import POLICIES  # the router owns the policy names

WEIGHT_PATHS = ("auto", "bus")
START_METHODS = ("spawn", "forkserver")  # agent worker processes; fork is unsafe in a trainer
PLACEMENTS = ("auto", "cpu", "colocated", "split")  # see parallel/mesh.py; auto = colocated on GPUs, else cpu


@dataclass
class RolloutConfig:
    engine: str = "vllm"  # the inference backend: vllm | sglang | hf (ENGINES, engines/inference)
    num_engines: int = 1  # placement cpu: engine processes per node, each on its own slice of the node's cores
    placement: str = "auto"  # where engines run: auto | colocated (they sleep during updates) | split | cpu
    bind_host: str | None = None  # tcp host engines bind for other nodes; default: $SWITCHYARD_HOST or the
    #                               address this node uses to reach the rendezvous host
    # colocated: 1 = engines keep their weights while asleep, 2 = free them (resent each step); None = 2, or 1
    # with a LoRA actor (the engines keep the base, and each push is the adapter alone)
    sleep_level: int | None = None
    request_log: bool = False  # every engine appends one JSON line per reply to output_dir/engines/<id>.jsonl
    engine_options: dict[str, Any] = field(default_factory=dict)  # passed to the engine backend
    policy: str = "sticky_group"  # how requests pick an engine (rollout/bus/router.py)
    n: int = 4  # samples per prompt: one GRPO group
    temperature: float = 1.0  # sampling temperature of the rollout
    top_p: float = 1.0  # nucleus sampling of the rollout
    max_tokens: int = 128  # per generation; tool_agent's max_turn_tokens caps it too
    num_workers: int = 0  # agent worker processes; 0 = in the trainer's process
    agent: dict[str, Any] = field(default_factory=dict)  # {agent_name: {loop options}}
    agent_loops: dict[str, str] = field(default_factory=dict)  # {agent_name: package.module.LoopClass}
    tools_config: str | None = "launch/configs/tools_calculator.yaml"  # the tools agent loops may call (tools.yaml)
    interaction_config: str | None = None  # interactions that answer the model between turns (agent/interactions)
    startup_timeout_s: float = 900.0  # the longest engines may take to start and load
    step_timeout_s: float = 3600.0  # the longest one step's rollout may take before the run fails naming it
    weight_bucket_mb: int = 64  # a weight push travels in buckets of at most this many MiB
    # how weights reach the engines: auto = through shared memory on the sender's node, by collective
    # broadcast to the other nodes' leaders (rollout.plane.route); bus = as frames over the sockets
    weight_path: str = "auto"
    # after each push every engine reports a digest of each tensor it serves, compared with what was
    # sent; a tensor whose copy differs is named in a warning (rollout/weights/verify.py)
    verify_weights: bool = True
    # N > 1: a push checks a rotating 1/N of the tensors instead of all (each one at least every N pushes;
    # a run's first push, a resume's and a push to restarted engines check all): the trainer's and the
    # engines' digests of the others stay off the pause
    verify_weights_every: int = 1
    # serve the (one, hf) engine from the trainer's own process: weights then load by reference, no
    # bytes in between (rollout/inproc.py); one node only
    in_process: bool = False
    # asynchronous RL: 0 = rollout -> update -> sync, strictly in turn; k >= 1 = rollout runs on
    # during updates, at most k batches ahead, and no trained token is older than version - k
    staleness: int = 0
    # placement cpu: the cores of each node the engines run on (default: all, shared with the
    # trainer); the trainer ranks then keep to the others, so rollout and updates do not compete
    engine_cores: list[int] = field(default_factory=list)
    # DAPO's filters: drop GRPO groups whose rewards are all equal (no signal) and keep generating
    # until the batch is full; keep trajectories cut by a token limit out of the loss
    dynamic_sampling: bool = False
    overlong_filter: bool = False
    # MLflow traces of finished trajectories (agent/traces.py): enabled, tracking_uri (default: the
    # run's own sqlite store, output_dir/mlflow.db), experiment, sample_rate (fraction of GRPO groups)
    tracing: TraceConfig = field(default_factory=TraceConfig)
    # engines as a service (rollout/service.py): addresses of engine servers started on their own; the
    # run attaches to them (weights over the bus), never starts, sleeps or stops them
    engines: list[str] = field(default_factory=list)
    engine_keys: str | None = None  # their CURVE keys file (python -m rollout.service keys PATH); tcp needs it

    @property
    def asynchronous(self) -> bool:
        """Whether rollout runs on through the updates (`staleness` >= 1), and with it what that
        implies, decided here: engines must generate during the update, so they never sleep
        (placement colocated is refused; `auto` picks split or cpu: `rollout.fleet.resolve_placement`);
        a push preempts running generations; the next rows start as soon as the weights are in,
        not after the step's checkpoint (`RolloutPlane.after_update`, `after_checkpoint`)."""
        return self.staleness > 0

    def sleep_level_for(self, adapter_rank: int) -> int:
        """How deep colocated engines sleep: `sleep_level`, or by default 2 (free the weights, the push
        resends them) and 1 with a LoRA actor of `adapter_rank` (the base stays; each push is the adapter)."""
        return self.sleep_level or (1 if adapter_rank > 0 else 2)

    @property
    def assistant_turns(self) -> int:
        """How many assistant turns a trajectory may take (the tool agent's `max_assistant_turns`; 3 unset)."""
        return int(self.agent.get("tool_agent", {}).get("max_assistant_turns", 3))

    def __post_init__(self) -> None:
        choice("rollout", "engine", self.engine, ROLLOUT_ENGINES)
        check_options(self.engine, self.engine_options)
        choice("rollout", "policy", self.policy, POLICIES)
        choice("rollout", "placement", self.placement, PLACEMENTS)
        choice("rollout", "weight_path", self.weight_path, WEIGHT_PATHS)
        if self.sleep_level not in (None, 1, 2):
            raise ValueError(f"rollout.sleep_level={self.sleep_level!r} must be 1 (keep weights), 2 (free them) or "
                             "null (2, or 1 with actor.lora)")
        positive("rollout", self, "num_engines", "n", "max_tokens", "weight_bucket_mb", "verify_weights_every")
        if self.num_workers < 0:
            raise ValueError(f"rollout.num_workers={self.num_workers} must be >= 0 (0 = run in the trainer process)")
        if self.temperature <= 0:
            raise ValueError(f"rollout.temperature={self.temperature} must be > 0 for RL (sampling, not greedy)")
        if isinstance(self.staleness, bool) or not isinstance(self.staleness, int) or self.staleness < 0:
            raise ValueError(f"rollout.staleness={self.staleness!r} must be an integer >= 0 (0 = synchronous)")
        if self.asynchronous and self.placement == "colocated":
            raise ValueError(f"rollout.staleness={self.staleness} needs engines that generate during the update, but "
                             "colocated engines sleep through it; set rollout.placement=split (or cpu), or staleness=0")
        if any(isinstance(c, bool) or not isinstance(c, int) or c < 0 for c in self.engine_cores):
            raise ValueError(f"rollout.engine_cores={self.engine_cores!r} must list core numbers (integers >= 0)")
        if self.in_process and (ENGINES[self.engine].in_process is None or self.num_engines != 1
                                or self.weight_path == "bus"):
            able = [k for k, v in ENGINES.items() if v.rollout and v.in_process]
            raise ValueError(f"rollout.in_process=true serves one engine of {able} from the trainer's process (got "
                             f"engine {self.engine!r}, num_engines={self.num_engines}, weight_path={self.weight_path!r}); "
                             "the others (SGLang) run their schedulers in processes of their own and take shared memory")
        if self.engines:
            from rollout.service import check_service

            check_service(self)
        if not self.step_timeout_s > 0:
            raise ValueError(f"rollout.step_timeout_s={self.step_timeout_s} must be > 0 (seconds)")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"rollout.top_p={self.top_p} must be in (0, 1]")


@dataclass
class ManagerConfig:
    """addresses: EngineServer addresses. tokenizer: model name or directory whose tokenizer the
    loops use (`engines.models.resolve_model`). num_workers: agent processes; 0 runs the loops on
    an event loop thread inside this process (tests, debugging). agent_configs: per agent_name,
    the mapping a loop gets as `AgentContext.config`. agent_loops: extra {name: "pkg.mod.Class"}.
    max_concurrent: trajectories in flight per worker."""

    addresses: list[str]
    tokenizer: str
    num_workers: int = 2
    n: int = 1
    sampling: dict[str, Any] = field(default_factory=lambda: {"temperature": 1.0, "max_tokens": 256})
    agent_configs: dict[str, dict[str, Any]] = field(default_factory=dict)
    agent_loops: dict[str, str] = field(default_factory=dict)
    tools_config: str | None = None
    interaction_config: str | None = None
    policy: str = "sticky_group"
    tracing: TraceConfig = field(default_factory=TraceConfig)
    max_concurrent: int = 128
    start_method: str = "spawn"
    ready_timeout_s: float = 300.0
    progress: bool = True
    bus_keys: dict[str, str] | None = None  # rollout.bus.auth.ClientKeys fields, for engines on tcp addresses
    reward: dict[str, Any] = field(default_factory=dict)  # the run's `reward:` section (agent/rewards/function.py)

    def __post_init__(self) -> None:
        if isinstance(self.tracing, Mapping):
            self.tracing = TraceConfig(**self.tracing)
        if not self.addresses:
            raise ValueError("rollout.addresses is empty; give the EngineServer addresses, e.g. ['ipc:///tmp/e0.sock']")
        for name, value, low in (("num_workers", self.num_workers, 0), ("n", self.n, 1),
                                 ("max_concurrent", self.max_concurrent, 1)):
            if int(value) < low:
                raise ValueError(f"rollout.{name}={value} must be >= {low}")
        if self.policy not in POLICIES:
            raise ValueError(f"rollout.policy={self.policy!r}; choose one of {list(POLICIES)}")
        if self.start_method not in START_METHODS:
            raise ValueError(f"rollout.start_method={self.start_method!r}; choose one of {list(START_METHODS)} "
                             "(fork is unsafe: the trainer holds threads and sockets)")
