"""The rollout side of a run: batches for every rank, from agent workers on rank 0 that run over
the engine fleet (`rollout/fleet.py`), whose weights `rollout/weights/sync.py` keeps current.

Agent workers run on global rank 0 and route over every node's engines (sticky GRPO groups,
least-loaded placement, failover across nodes: `rollout.bus.router`). Each step's rows go out
synchronously (`generate`) or from a rollout that runs on through the updates (`start_async`,
`take_batch`); either way the finished trajectories are padded into a `Batch` and every rank gets
its data-parallel replica's rows (`rollout/handoff.py`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from engines.training.batch import Batch
from rollout.config import RolloutConfig
from rollout.fleet import EngineFleet
from rollout.weights.sync import WeightSync

MAX_SAMPLING_ROUNDS = 10  # dynamic sampling: rollout rounds a synchronous step may take to fill its batch


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
        self.feeder: Any = None  # rank 0 under rollout.staleness >= 1: the AsyncRollout
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
    def generate(self, rows: list[dict[str, Any]], weight_version: int,
                 more_rows: Callable[[int], list[dict[str, Any]]] | None = None,
                 record: Callable[[dict[str, Any], list[float]], None] | None = None) -> tuple[Batch, dict[str, float]]:
        """Roll out `rows` with weights no older than `weight_version`. Every rank gets its data-
        parallel replica's rows (`rollout.handoff`); the metrics of the whole batch and of the
        handoff come back on rank 0 ({} elsewhere). With `rollout.dynamic_sampling`, groups with
        equal rewards are dropped and rank 0 asks `more_rows(k)` for rows to fill their places. `record(row,
        rewards)` hears every group's rewards on rank 0, dropped ones included (an adaptive curriculum)."""
        batch, metrics = None, {}
        if self.rank == 0:
            from engines.training.batch import equal_rewards

            n, want, kept, kept_rows, dropped = self.cfg.n, len(rows), [], [], 0
            for attempt in range(MAX_SAMPLING_ROUNDS):
                outs = self.manager.generate_outputs(rows, weight_version, timeout_s=self.cfg.step_timeout_s)
                for i in range(len(rows)):
                    group = outs[i * n:(i + 1) * n]
                    if record is not None:
                        record(rows[i], [float(o.reward) for o in group])
                    if self.cfg.dynamic_sampling and equal_rewards(group):
                        dropped += 1
                    else:
                        kept.append(group)
                        kept_rows.append(rows[i])
                if len(kept) >= want or more_rows is None or not self.cfg.dynamic_sampling:
                    break
                rows = more_rows(want - len(kept))
            if not kept:
                raise RuntimeError(f"every GRPO group of {MAX_SAMPLING_ROUNDS} rounds had equal rewards, so "
                                   "rollout.dynamic_sampling left nothing to train on; the task is too easy or too hard "
                                   "for the model, or the reward is constant: check it, or turn dynamic_sampling off")
            metrics = {"data/row_uids": [r.get("uid") for r in kept_rows]}
            if self.cfg.dynamic_sampling:
                metrics.update({"rollout/filtered_groups": float(dropped), "rollout/sampling_rounds": attempt + 1.0})
            batch, metrics = self._padded([o for g in kept for o in g], [i for i, g in enumerate(kept) for _ in g],
                                          metrics)
        return self._hand_out(batch, metrics)

    def validate(self, rows: list[dict[str, Any]], sampling: dict[str, Any], n: int, weight_version: int,
                 timeout_s: float) -> list[Any]:
        """Rank 0: `n` samples of every held-out row on the training engines and workers, returned
        to the caller only (beside a running asynchronous rollout too: `AsyncRollout.run_aside`)."""
        if self.feeder is not None:
            return self.feeder.run_aside(rows, sampling, n, weight_version, timeout_s)
        return self.manager.generate_outputs(rows, weight_version, sampling, n, timeout_s, desc="validation")

    # ------------------------------------------------------------------ asynchronous RL
    def start_async(self, stream: Any, prompts_per_step: int, state: dict[str, Any] | None = None) -> None:
        """Rank 0: keep rollout running from `stream` (`rollout.async_rollout`), continuing from a
        checkpoint's `state`; other ranks have nothing to start."""
        if self.fleet.sleeps:
            raise ValueError(f"rollout.staleness={self.cfg.staleness} with placement {self.fleet.placement}: colocated engines "
                             "sleep through the update, so rollout cannot run on; set rollout.placement=split or cpu")
        if self.rank != 0:
            return
        from rollout.async_rollout import AsyncRollout

        self.feeder = AsyncRollout(self.manager, stream, prompts_per_step, self.cfg.n, self.cfg.staleness,
                                   dynamic_sampling=self.cfg.dynamic_sampling)
        if state is not None:
            self.feeder.load_state_dict(state)
        self.weights.pushed.append(self.feeder.weights_pushed)
        self.feeder.start()

    def take_batch(self, weight_version: int) -> tuple[Batch, dict[str, Any]]:
        """Asynchronous RL: the next batch from the running rollout, within the staleness bound
        of `weight_version`, handed out like `generate`'s."""
        batch, metrics = None, {}
        if self.rank == 0:
            taken = self.feeder.take(weight_version, timeout_s=self.cfg.step_timeout_s)
            batch, metrics = self._padded(taken.outputs, taken.group_index, taken.metrics)
        return self._hand_out(batch, metrics)

    def _padded(self, outputs: list[Any], group_index: list[int], metrics: dict[str, Any]
                ) -> tuple[Batch, dict[str, Any]]:
        """Rank 0: finished trajectories padded into the step's batch (synchronous or not), with its
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
        """Rank 0 under asynchronous RL: what a checkpoint must keep of the running rollout."""
        return self.feeder.state_dict() if self.feeder is not None else None

    def _hand_out(self, batch: Batch | None, metrics: dict[str, Any]) -> tuple[Batch, dict[str, Any]]:
        if self.world == 1:
            assert batch is not None
            return batch, metrics
        from rollout.handoff import hand_out

        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None
        shard, cost = hand_out(batch, self.fleet.replica_of, self.rank, device)
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
