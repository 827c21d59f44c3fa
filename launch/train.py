"""switchyard's entry point: GRPO/PPO on agent rollouts.

    torchrun --nproc-per-node N launch/train.py [config.yaml] [key.sub=value ...]
    python launch/train.py                      # N = 1, launch/configs/cpu_demo.yaml
    python launch/train.py CONFIG --plan [--nodes N --gpus-per-node G]   # check a GPU plan here

One RL step: rollout (agent loops on the engines, over the bus; `rollout/plane.py`, whose feeder
runs synchronously at rollout.staleness=0 and ahead of the trainer above it) -> learn
(rewards, reference and old logprobs, advantages, update; `launch/algorithm.py`) -> weight sync
into the engines -> metrics -> checkpoint. Kill it at any point and run the same command again:
it continues from the last complete checkpoint in `trainer.output_dir`.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without install

from launch.config import Config, ConfigError, load_config  # noqa: E402

REWARD_KEY = "rollout/reward_mean"
VAL_KEY = "val/accuracy"
CONSOLE_KEYS = (REWARD_KEY, VAL_KEY, "rollout/invalid", "rollout/signal_fraction", "rollout/tool_calls_per_trajectory",
                "rollout/response_length_mean", "drift/mean",
                "actor/pg_loss", "critic/vf_explained_var", "time/rollout_s", "time/update_s", "time/step_s")


def train(cfg: Config) -> dict[str, Any]:
    """One run; its rank 0 holds the output directory's lock (launch/run_lock.py) from start to exit."""
    from launch.run_lock import RunLock

    if int(os.environ.get("RANK", "0")) != 0:
        return _train(cfg)
    with RunLock(Path(cfg.trainer.output_dir)):
        return _train(cfg)


def _train(cfg: Config) -> dict[str, Any]:
    from engines.training.backends import ACTORS
    from launch.algorithm import learn
    from launch.guards import DriftGuard, InvalidGuard
    from launch.checkpoint import Checkpointer, load_run, save_run
    from launch.config import resolved
    from launch.metrics import MetricsLogger, summarize
    from launch.resume import choose, compare, flat_config, set_aside
    from launch.setup import setup
    from parallel.reduce import on_every_rank

    run = setup(cfg)
    actor, plane, stream, rank, barrier = run.actor, run.plane, run.stream, run.rank, run.barrier
    fleet, weights = plane.fleet, plane.weights
    out, start, rollout_state = Path(cfg.trainer.output_dir), 0, None
    sharded = cfg.actor.sharding in ACTORS[cfg.actor.backend].per_rank_checkpoint  # a checkpoint file per rank
    ckpt, config = Checkpointer(out), flat_config(cfg)  # the config as resolved (model.dtype made concrete)
    try:
        latest = choose(ckpt, cfg.trainer.resume, rank if sharded else None, on_every_rank, show=rank == 0)
        if cfg.trainer.resume == "fresh" and rank == 0:
            set_aside(out, show=True)  # an earlier run's checkpoints and metrics are kept, never overwritten
        barrier()
        if latest is not None:
            start, weights.version, rollout_state = load_run(
                ckpt, latest, actor, stream, rank, sharded, critic=run.critic,
                check=lambda saved: compare(saved, config, cfg.trainer.resume_changes, latest, show=rank == 0))
    except BaseException:
        plane.close()
        raise
    if latest is not None:
        print(f"resuming from {latest} (step {start}, data position {stream.position})", flush=True)
    overlap = cfg.rollout.staleness > 0  # asynchronous RL: rollout runs on through updates
    logger = MetricsLogger(out, cfg.trainer.loggers, resolved(cfg), start, cfg.trainer.wandb_project) if rank == 0 \
        else None
    validator = _validator(cfg, run) if rank == 0 and run.val_rows else None
    drift = DriftGuard(cfg.model.dtype, cfg.trainer.drift_warn, cfg.trainer.max_drift, cfg.rollout.top_p < 1,
                       show=rank == 0)
    invalids = InvalidGuard(cfg.trainer.max_invalid_fraction, show=rank == 0)
    try:
        beside = fleet.loads_beside_the_trainer  # engines loading since setup: the SFT warm-up runs meanwhile
        if not beside:
            plane.start_engines(out)
        if latest is None and cfg.sft.enabled:
            from launch.data.sft import warm_up

            turns = int(cfg.rollout.agent.get("tool_agent", {}).get("max_assistant_turns", 3))
            warm_up(actor, run.rows, run.tools, run.model_dir, cfg.sft, turns - 1, show=rank == 0)
            save_run(ckpt, 0, actor, stream, weights.version, rank, sharded, barrier, critic=run.critic,
                     config=config)
        if beside:  # an engine that failed to start fails the run here, its warm-up saved (a rerun resumes past it)
            plane.start_engines(out)
        plane.start_workers()
        barrier()  # no node runs ahead (e.g. a resumed run with no steps left) while rank 0 connects
        if latest is not None or cfg.sft.enabled:  # engines start from the base model; bring them to the actor
            # a resumed run's weights are the checkpoint's version (fresh engines are at 0): no gap
            weights.load(actor, max(weights.version, 1) if latest is not None else weights.version + 1)
        if validator is not None and logger is not None and cfg.trainer.val_before_train and start == 0 \
                and not logger.logged(0, VAL_KEY):  # once: not again after a kill during step 1
            logger.log(0, _validate(validator, plane, 0, weights.version), console=(VAL_KEY,))
        if start < cfg.trainer.steps:
            plane.start_rollout(stream, cfg.data.prompts_per_step, weights.version, rollout_state)
        for step in range(start + 1, cfg.trainer.steps + 1):
            t0 = time.perf_counter()
            revived = fleet.revive_reward_engines()  # a judge that died is started again before this rollout
            weights.catch_up(actor)  # attached engines that restarted: back to the current weights
            batch, metrics = plane.take_batch(weights.version)  # finished groups within the staleness bound
            t_rollout = time.perf_counter() - t0
            failed = invalids.check(step, batch, metrics)  # no valid trajectory: nothing to learn, nothing to push
            metrics.update({**fleet.engine_metrics(t_rollout), **revived})
            t_update, t_sync = time.time(), 0.0
            if not failed:
                metrics.update(fleet.sleep())
                plane.training(True)
                t_update, busy = time.time(), fleet.engine_busy_s()
                metrics.update(learn(batch, actor, run.ref, cfg.algorithm, cfg.actor, critic=run.critic))
                drift.check(step, metrics, weights.mismatched)  # warns, or (trainer.max_drift) stops the run
                plane.training(False)
                if rank == 0:  # how much the engines generated while the trainer updated (0: they idled)
                    metrics["time/engine_busy_in_update"] = (fleet.engine_busy_s() - busy) / max(
                        1e-9, (time.time() - t_update) * len(fleet.engines))
                fleet.wake()  # colocated engines come back; the push below is what they serve with
                # asynchronous: running generations stop for the push and go on with the new weights
                t_sync = weights.publish(actor, preempt=overlap)
            if overlap and step < cfg.trainer.steps:  # asynchronous: rollout runs on once the weights are in,
                plane.trained(weights.version)  # not after this step's logging, validation and checkpoint
            metrics.update({"weight_version": weights.version, "time/rollout_s": t_rollout, "time/sync_s": t_sync,
                            "time/step_s": time.perf_counter() - t0, "data/epoch": stream.position[0],
                            "data/index": stream.position[1], **weights.last_sync})
            if overlap:  # the benchmark's overlap figures
                metrics.update({"time/update_start_t": t_update, "time/update_end_t": time.time()})
            if validator is not None and validator.due(step, cfg.trainer.steps, cfg.trainer.val_every):
                metrics.update(_validate(validator, plane, step, weights.version))  # logged with the step: once per step
            if logger is not None:
                logger.log(step, metrics, console=CONSOLE_KEYS)
            if step % cfg.trainer.save_every == 0 or step == cfg.trainer.steps:
                save_run(ckpt, step, actor, stream, weights.version, rank, sharded, barrier,
                         rollout=plane.rollout_state() if rank == 0 else None, critic=run.critic, config=config)
            if not overlap and step < cfg.trainer.steps:  # the next rows start on the weights just pushed
                plane.trained(weights.version)
            barrier()
        invalids.finish()  # every step failed: the run trained nothing, and exits non-zero
        summary = summarize(logger, REWARD_KEY, VAL_KEY) if logger is not None else {}
        if cfg.trainer.export_hf:
            actor.save_hf(out / "hf")  # every rank: a sharded actor gathers to rank 0, which writes
            if logger is not None:
                summary["hf_export"] = str(out / "hf")
        barrier()  # every node keeps its engines until rank 0 is done with them
        return summary
    except BaseException:
        fleet.print_engine_logs()
        raise
    finally:
        plane.close()
        if logger is not None:
            logger.close()


def _validator(cfg: Config, run: Any) -> Any:
    from engines.models import load_tokenizer
    from launch.validation import Validator

    return Validator(run.val_rows, cfg.val, cfg.rollout.max_tokens, Path(cfg.trainer.output_dir),
                     load_tokenizer(run.model_dir))


def _validate(validator: Any, plane: Any, step: int, version: int) -> dict[str, Any]:
    """Rank 0: validate the weights of `version` after `step` steps; its records go to val/step_N.jsonl."""
    from launch.validation import describe

    metrics = validator.run(plane, f"step_{step}", version)
    print(describe(metrics, f"validation after step {step}"), flush=True)
    return metrics


def _exit_with_launcher(every_s: float = 1.0) -> None:
    """Under torchrun each rank runs in its own session, so a launcher killed with -9 (a node
    lost, a job cancelled) would leave its ranks and their engines running on; a rank whose
    launcher is gone exits, and its engines follow it (they watch their parent)."""
    from parallel.lifetime import watch_parent

    def gone() -> None:
        print("the launcher is gone; this rank exits", file=sys.stderr, flush=True)
        os._exit(1)

    watch_parent(gone, every_s=every_s, name="launcher-watch")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("-h", "--help"):  # every section and key with its default and meaning, or one section
        from launch.config_help import describe

        try:
            section = argv[1] if argv[1:] else None
            text = describe(Config(), section)  # first: a section that is not there says so, alone
            print(text if section else __doc__ + "\nThe config, `key=default  meaning` (launch/config.py; with no "
                  "config file the demo's launch/configs/cpu_demo.yaml sets some of them; `--help SECTION` "
                  "shows one section):\n\n" + text)
        except KeyError as e:
            print(f"config error: {e.args[0]}", file=sys.stderr)
            return 2
        return 0
    path = argv.pop(0) if argv and "=" not in argv[0] and not argv[0].startswith("--") else None
    if "--plan" in argv:  # what the config would start where, checked without a model or a GPU
        from launch.plan import plan_main

        return plan_main(path, argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if "TORCHELASTIC_RUN_ID" in os.environ:
        _exit_with_launcher()
    from engines.models import ModelUnavailableError
    from launch.checkpoint import CheckpointWriteError, ResumeError
    from launch.guards import DriftError, InvalidError
    from launch.run_lock import RunLockError
    from rollout.bus.auth import AuthError

    try:
        summary = train(load_config(path, argv))
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    except ModelUnavailableError as e:  # a user error like a bad config value: one line, exit 2
        print(f"config error: model.path: {e}", file=sys.stderr)
        return 2
    except AuthError as e:  # engines refused this run's keys (rollout.engines with another deployment's keys)
        print(f"error: {e}", file=sys.stderr)
        return 2
    # the run did not do what it was asked (a drift or invalid batches stopped it, the earlier run in its
    # output_dir cannot be continued as configured, another trainer holds it, a checkpoint did not fit): said, exit 1
    except (DriftError, InvalidError, ResumeError, RunLockError, CheckpointWriteError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    finally:
        from parallel.mesh import close_process_group

        close_process_group()  # in the launcher's own exit path, whatever ended the run
    if summary:
        print("SUMMARY " + " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in summary.items()))
        if summary.get("no_signal_steps") and summary["no_signal_steps"] == summary.get("steps"):
            print(f"warning: no step of this run had a learning signal: in every group all trajectories scored "
                  f"alike (reward {summary.get('reward_last5', 0):.3g}), so every advantage was 0 and the reward "
                  f"taught the policy nothing; check the reward (reward.*), make the task reachable for this model "
                  f"(an SFT warm-up, sft.*), or raise rollout.n", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
