"""The rollout side of a run: batches for every rank, from agent workers on rank 0 that run over
the engine fleet (`rollout/fleet.py`), whose weights `rollout/weights/sync.py` keeps current.

Agent workers run on global rank 0 and route over every node's engines (sticky GRPO groups,
least-loaded placement, failover across nodes: `rollout.bus.router`). Rows go out through one
path, the feeder (`start_rollout`, `take_batch`, `trained`; `rollout/feeder.py`), synchronous at
`rollout.staleness=0` and running on through the updates above it; the finished trajectories are
padded into a `Batch` and every rank gets its data-parallel replica's rows (`rollout/handoff.py`).

The plane orders the rollout side of every step, so the entry point only calls: `begin` (engines,
workers and first weights, around the warm-up), `next_batch`, `updating` (around the trainer's
update), `publish`, `after_update` and `after_checkpoint` (when the next rows start). The fleet and
the weights meet through the fleet's `Topology` and what the plane hands each, never each other.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from engines.training.batch import Batch
from rollout.config import RolloutConfig
from rollout.fleet import EngineFleet
from rollout.weights.sync import WeightSync


class RolloutPlane:
    """`fleet`: the engines; `weights`: their weights and the run's weight version; batches here."""

    def __init__(self, cfg: RolloutConfig, model_dir: str, dtype: str, rank: int, world: int,
                 tools_config: Path | None = None, interaction_config: Path | None = None,
                 reward: dict[str, Any] | None = None, adapter_rank: int = 0) -> None:
        """`adapter_rank`: the actor trains a LoRA adapter of that rank (0: none; see `WeightSync.takes_adapters`)."""
        self.cfg, self.model_dir, self.dtype, self.rank, self.world = cfg, model_dir, dtype, rank, world
        self.tools_config, self.interaction_config = tools_config, interaction_config
        self.reward = dict(reward or {})  # the `reward:` section, for the agent workers
        self.fleet = EngineFleet(cfg, model_dir, dtype, rank, world, cfg.sleep_level_for(adapter_rank))
        self.weights = WeightSync(cfg, dtype, model_dir, adapter_rank,
                                  frees_weights=self.fleet.sleeps and self.fleet.sleep_level == 2)
        self.manager: Any = None
        self.feeder: Any = None  # rank 0: the RolloutFeeder (start_rollout)
        self.run_dir = Path(".")  # the run's output directory (start_engines)
        self.stream: Any = None  # the rows the rollout draws from (start_rollout)
        self._clock: dict[str, float] = {}  # the running step's times (next_batch, updating, publish)

    # ------------------------------------------------------------------ start-up
    def launch_engines(self, run_dir: Path) -> None:
        """Where it is safe (`EngineFleet.launch`), this node's engines start loading now, beside the actor."""
        self.fleet.launch(run_dir, self._engine_options(launching=True))

    def start_engines(self, run_dir: Path, dp_rank: int | None = None) -> None:
        """Every node's engines started (or attached to) and known to every rank; the weight route set up.
        `dp_rank`: this rank's data-parallel replica, whose rows of each batch it receives (default: its rank)."""
        self.run_dir = run_dir
        topology = self.fleet.start(run_dir, self._engine_options(launching=False),
                                    self.rank if dp_rank is None else dp_rank)
        self.weights.connect(topology)

    def _engine_options(self, launching: bool) -> dict[str, Any]:
        """Before this node's engines are spawned (`EngineFleet.spawns`): shared memory checked for the
        weight route; the engine options that ready them for the actor's adapters."""
        fleet = self.fleet
        if fleet.spawns(launching):
            self.weights.check_room(fleet.node, fleet.nodes, fleet.local_rank)
        return self.weights.adapter_options()

    def start_workers(self) -> None:
        """Rank 0: the trainer's control client and the agent workers, connected to every engine (a
        reward model's engines started first). Other nodes' leaders, on the collective weight route:
        a control client to their own engines."""
        from rollout.bus.auth import WORKER

        self.fleet.connect()
        self.weights.connect_clients(self.fleet.control)
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

    def begin(self, run_dir: Path, actor: Any, dp_rank: int, resumed_version: int | None = None,
              warm_up: Callable[[], None] | None = None) -> None:
        """Every rank: engines, workers and weights ready for the first step (`dp_rank`: this rank's
        data-parallel replica, see `start_engines`). Engines that load beside the trainer
        (`EngineFleet.loads_beside_the_trainer`) are waited for after `warm_up` (an SFT warm-up that
        saves itself: an engine that failed to start fails the run with it saved, and a rerun
        resumes past it); the others start first. Then the engines, started from the base model,
        are brought to the actor: a resumed run's as the checkpoint's `resumed_version` (fresh
        engines are at 0: no gap), a warmed-up one's as the next version."""
        if resumed_version is not None:
            self.weights.version = resumed_version
        beside = self.fleet.loads_beside_the_trainer
        if not beside:
            self.start_engines(run_dir, dp_rank)
        if warm_up is not None:
            warm_up()
        if beside:
            self.start_engines(run_dir, dp_rank)
        self.start_workers()
        if self.world > 1:  # no node runs ahead (e.g. a resumed run with no steps left) while rank 0 connects
            torch.distributed.barrier()
        if resumed_version is not None:
            self.load(actor, max(self.weights.version, 1))
        elif warm_up is not None:
            self.load(actor, self.weights.version + 1)

    def load(self, actor: Any, version: int) -> None:
        """The engines (started from the base model) brought to `actor`'s weights as `version`."""
        self.weights.load(actor, version)

    @property
    def version(self) -> int:
        """The run's weight version: the one the engines serve (`WeightSync.version`)."""
        return self.weights.version

    @property
    def mismatched(self) -> dict[int, list[tuple[str, float]]]:
        """The last push's tensors that an engine serves differently from what was sent, per engine."""
        return self.weights.mismatched

    # ------------------------------------------------------------------ every step
    def next_batch(self, actor: Any) -> tuple[Batch, dict[str, Any]]:
        """The step's batch: judges that died started again, attached engines that restarted brought
        back to the actor's weights, then the finished groups within the staleness bound
        (`take_batch`), with the engines' metrics."""
        self._clock = {"start": time.perf_counter()}
        revived = self.fleet.revive_reward_engines()  # a judge that died is started again before this rollout
        self.weights.catch_up(actor)  # attached engines that restarted: back to the current weights
        batch, metrics = self.take_batch(self.weights.version)
        self._clock["rollout_s"] = time.perf_counter() - self._clock["start"]
        metrics.update({**self.fleet.engine_metrics(self._clock["rollout_s"]), **revived})
        self._clock.update(update_t=time.time(), sync_s=0.0)
        return batch, metrics

    @contextmanager
    def updating(self, metrics: dict[str, Any]) -> Iterator[None]:
        """Around the trainer's update: colocated engines asleep, the rollout counting the groups it
        finishes meanwhile, and into `metrics` how much the engines generated during it."""
        metrics.update(self.fleet.sleep())
        self.training(True)
        self._clock["update_t"], busy = time.time(), self.fleet.engine_busy_s()
        yield
        self.training(False)
        if self.rank == 0:  # how much the engines generated while the trainer updated (0: they idled)
            metrics["time/engine_busy_in_update"] = (self.fleet.engine_busy_s() - busy) / max(
                1e-9, (time.time() - self._clock["update_t"]) * len(self.fleet.engines))
        self.fleet.wake()  # colocated engines come back; the push that follows is what they serve with

    def publish(self, actor: Any) -> None:
        """The actor's weights into every engine as the next version; asynchronous, running
        generations stop for the push and go on with the new weights."""
        self._clock["sync_s"] = self.weights.publish(actor, preempt=self.cfg.asynchronous)

    def after_update(self, last: bool) -> dict[str, Any]:
        """The step's update is done (or skipped): asynchronous, the rollout runs on with the weights
        just pushed now, not after the step's logging, validation and checkpoint. The step's version,
        times, data position and sync figures."""
        asynchronous = self.cfg.asynchronous
        if asynchronous and not last:
            self.trained(self.weights.version)
        clock = self._clock
        metrics = {"weight_version": self.weights.version, "time/rollout_s": clock["rollout_s"],
                   "time/sync_s": clock["sync_s"], "time/step_s": time.perf_counter() - clock["start"],
                   "data/epoch": self.stream.position[0], "data/index": self.stream.position[1],
                   **self.weights.last_sync}
        if asynchronous:  # the benchmark's overlap figures
            metrics.update({"time/update_start_t": clock["update_t"], "time/update_end_t": time.time()})
        return metrics

    def after_checkpoint(self, last: bool) -> None:
        """The step is logged and saved: synchronous, the next rows start on the weights just pushed."""
        if not self.cfg.asynchronous and not last:
            self.trained(self.weights.version)

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
        self.stream = stream
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

    def print_engine_logs(self) -> None:
        """The last lines of this node's engine logs, on stderr: what a failed run needs."""
        self.fleet.print_engine_logs()

    def close(self) -> None:
        if self.feeder is not None:
            self.feeder.close()
            self.feeder = None
        if self.manager is not None:
            self.manager.close()
            self.manager = None
        self.weights.close()
        self.fleet.close()
