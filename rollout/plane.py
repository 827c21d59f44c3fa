"""The rollout side of a run: batches for every rank, from agent workers on rank 0 that run over
the engine fleet (`rollout/fleet.py`), whose weights `rollout/weights/sync.py` keeps current.

Agent workers run on global rank 0 and route over every node's engines (sticky GRPO groups,
least-loaded placement, failover across nodes: `rollout.bus.router`). Rows go out through one
path, the feeder (`start_rollout`, `take_batch`, `trained`; `rollout/feeder.py`), synchronous at
`rollout.staleness=0` and running on through the updates above it; the finished trajectories are
padded into a `Batch` and every rank gets its data-parallel replica's rows (`rollout/handoff.py`).
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Any


from engines.training.batch import Batch
from rollout.config import RolloutConfig
from rollout.fleet import EngineFleet
from rollout.weights.sync import WeightSync


class RolloutPlane:
    """`fleet`: the engines; `weights`: their weights and the run's weight version; batches here."""

    def __init__(self, cfg: RolloutConfig, model_dir: str, dtype: str, rank: int, world: int,
                 tools_config: Path | None = None, interaction_config: Path | None = None, dp_rank: int = 0,
                 reward: dict[str, Any] | None = None, adapter_rank: int = 0) -> None:
        """`dp_rank`: this rank's data-parallel replica, whose rows of each batch it receives.
        `adapter_rank`: the actor trains a LoRA adapter of that rank (0: none; see `WeightSync.takes_adapters`)."""
        self.cfg, self.model_dir, self.dtype, self.rank, self.world = cfg, model_dir, dtype, rank, world
        self.tools_config, self.interaction_config = tools_config, interaction_config
        self.reward = dict(reward or {})  # the `reward:` section, for the agent workers
        self.fleet = EngineFleet(cfg, model_dir, dtype, rank, world, dp_rank, adapter_rank)
        self.weights = WeightSync(cfg, self.fleet, dtype, model_dir)  # the adapter's rank: the fleet's
        self.manager: Any = None
        self.feeder: Any = None  # rank 0: the RolloutFeeder (start_rollout)
        self.run_dir = Path(".")  # the run's output directory (start_engines)

    # ------------------------------------------------------------------ start-up
    def launch_engines(self, run_dir: Path) -> None:
        """Where it is safe (`EngineFleet.launch`), this node's engines start loading now, beside the actor."""
        self.fleet.launch(run_dir, self.weights.adapter_options(), self.weights.check_room)

    def start_engines(self, run_dir: Path) -> None:
        """Every node's engines started (or attached to) and known to every rank; the weight route set up."""
        self.run_dir = run_dir
        self.fleet.start(run_dir, self.weights.adapter_options(), self.weights.check_room)
        self.weights.connect()

    def start_workers(self) -> None:
        """Rank 0: the trainer's control client and the agent workers, connected to every engine (a
        reward model's engines started first). Other nodes' leaders, on the collective weight route:
        a control client to their own engines."""
        from rollout.bus.auth import WORKER

        self.fleet.connect()
        self.weights.connect_clients()
        if self.rank != 0:
            return
        from rollout.manager import AgentLoopManager, ManagerConfig

        r, fleet = self.cfg, self.fleet
        addresses = fleet.addresses()
        reward = dict(self.reward)
        if (reward.get("model") or {}).get("path"):  # a reward model or judge: its own engines, started first
            reward["model"] = {**reward["model"], "addresses": fleet.start_reward_engines(reward["model"])}
        worker_keys = asdict(fleet.keys.for_role(WORKER)) if fleet.keys is not None else None
        self.manager = AgentLoopManager(ManagerConfig(
            addresses=addresses, tokenizer=self.model_dir, num_workers=r.num_workers, n=r.n,
            sampling={"temperature": r.temperature, "top_p": r.top_p, "max_tokens": r.max_tokens},
            agent_configs={k: dict(v) for k, v in r.agent.items()}, agent_loops=dict(r.agent_loops),
            tools_config=str(self.tools_config) if self.tools_config else None,
            interaction_config=str(self.interaction_config) if self.interaction_config else None,
            policy=r.policy, ready_timeout_s=r.startup_timeout_s, bus_keys=worker_keys, reward=reward,
            tracing=self._tracing())).start()

    def _tracing(self) -> Any:
        """The run's trace settings; enabled without a tracking_uri, the traces go to the run's own
        sqlite store, and the command that opens them is printed."""
        from dataclasses import replace

        t = self.cfg.tracing
        if t.enabled and not t.tracking_uri:
            t = replace(t, tracking_uri=f"sqlite:///{(Path(self.run_dir) / 'mlflow.db').resolve()}")
        if t.enabled:
            print(f"tracing {t.sample_rate:.0%} of GRPO groups to MLflow experiment {t.experiment!r}; view them with: "
                  f"mlflow ui --backend-store-uri {t.tracking_uri}", flush=True)
        return t

    # ------------------------------------------------------------------ every step
    def validate(self, rows: list[dict[str, Any]], sampling: dict[str, Any], n: int, weight_version: int,
                 timeout_s: float) -> list[Any]:
        """Rank 0: `n` samples of every held-out row on the training engines and workers, returned
        to the caller only (beside the running rollout: `RolloutFeeder.run_aside`)."""
        if self.feeder is not None:
            return self.feeder.run_aside(rows, sampling, n, weight_version, timeout_s)
        return self.manager.generate_outputs(rows, weight_version, sampling, n, timeout_s, desc="validation")

    # ------------------------------------------------------------------ the rollout
    def start_rollout(self, stream: Any, prompts_per_step: int, version: int,
                      state: dict[str, Any] | None = None) -> None:
        """Rank 0: rollout from `stream` (`rollout.feeder`) on engines serving `version`, continuing
        from a checkpoint's `state`; other ranks have nothing to start."""
        if self.cfg.staleness > 0 and self.fleet.sleeps:
            raise ValueError(f"rollout.staleness={self.cfg.staleness} with placement {self.fleet.placement}: colocated engines "
                             "sleep through the update, so rollout cannot run on; set rollout.placement=split or cpu")
        if self.rank != 0:
            return
        from rollout.feeder import RolloutFeeder

        self.feeder = RolloutFeeder(self.manager, stream, prompts_per_step, self.cfg.n, self.cfg.staleness,
                                    dynamic_sampling=self.cfg.dynamic_sampling, version=version)
        if state is not None:
            self.feeder.load_state_dict(state)
        self.feeder.start()

    def take_batch(self, weight_version: int) -> tuple[Batch, dict[str, Any]]:
        """The next batch from the rollout, within the staleness bound of `weight_version`; every
        rank gets its replica's rows, rank 0 the metrics (a curriculum's too)."""
        batch, metrics = None, {}
        if self.rank == 0:
            taken = self.feeder.take(weight_version, timeout_s=self.cfg.step_timeout_s)
            stream = self.feeder.stream
            if hasattr(stream, "stats"):  # the curriculum's difficulty, pool and retired rows
                taken.metrics.update(stream.stats(taken.rows))
            batch, metrics = self._padded(taken.outputs, taken.group_index, taken.metrics)
        return self._hand_out(batch, metrics)

    def trained(self, version: int) -> None:
        """The trainer is done with the batch it took; the engines serve `version` (the next rows
        may start: at staleness 0, they waited for these weights)."""
        if self.feeder is not None:
            self.feeder.trained(version)

    def _padded(self, outputs: list[Any], group_index: list[int], metrics: dict[str, Any]
                ) -> tuple[Batch, dict[str, Any]]:
        """Rank 0: finished trajectories padded into the step's batch, with its
        rollout metrics and, with `rollout.overlong_filter`, truncated rows masked out."""
        from engines.training.batch import filter_overlong, pad_outputs

        batch = pad_outputs(outputs, self.manager.pad_id, group_index)
        metrics = {**batch.metrics(), **metrics}
        if self.cfg.overlong_filter:
            metrics.update(filter_overlong(batch))
        return batch, metrics

    def training(self, on: bool) -> None:
        """The trainer is (not) in its update: rollout counts the groups it finishes meanwhile."""
        if self.feeder is not None:
            self.feeder.training = on

    def rollout_state(self) -> dict[str, Any] | None:
        """Rank 0: what a checkpoint must keep of the running rollout."""
        return self.feeder.state_dict() if self.feeder is not None else None

    def _hand_out(self, batch: Batch | None, metrics: dict[str, Any]) -> tuple[Batch, dict[str, Any]]:
        if self.world == 1:
            assert batch is not None
            return batch, metrics
        from parallel.mesh import transfer_device
        from rollout.handoff import hand_out

        shard, cost = hand_out(batch, self.fleet.replica_of, self.rank, transfer_device())
        return shard, {**metrics, **cost}

    def close(self) -> None:
        if self.feeder is not None:
            self.feeder.close()
            self.feeder = None
        if self.manager is not None:
            self.manager.close()
            self.manager = None
        self.weights.close()
        self.fleet.close()
