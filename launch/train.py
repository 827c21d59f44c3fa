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
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without install

from launch.config import Config, load_config  # noqa: E402


def train(cfg: Config) -> dict[str, Any]:
    """One run; its rank 0 holds the output directory's lock (launch/run_lock.py) from start to exit."""
    from launch.run_lock import run_lock

    with run_lock(Path(cfg.trainer.output_dir)):
        return _train(cfg)


def _train(cfg: Config) -> dict[str, Any]:
    from engines.training.backends import ACTORS
    from launch.checkpoint import Checkpointer
    from launch.data.sft import warm_up_run
    from launch.metrics import REWARD_KEY, VAL_KEY, run_logger, summarize
    from launch.resume import flat_config, resume
    from launch.setup import setup
    from launch.validation import validate_before_training, validator_for
    from parallel.reduce import on_every_rank

    run = setup(cfg)
    actor, plane, stream, rank, barrier = run.actor, run.plane, run.stream, run.rank, run.barrier
    out = Path(cfg.trainer.output_dir)
    sharded = cfg.actor.sharding in ACTORS[cfg.actor.backend].per_rank_checkpoint  # a checkpoint file per rank
    ckpt, config = Checkpointer(out), flat_config(cfg)  # the config as resolved (model.dtype made concrete)
    try:
        latest, start, version, rollout_state = resume(cfg, run, ckpt, sharded, config, on_every_rank)
    except BaseException:
        plane.close()
        raise
    logger = run_logger(cfg, start, rank)
    validator = validator_for(cfg, run) if rank == 0 and run.val_rows else None
    try:
        plane.begin(out, actor, run.dp_rank, version, None if latest is not None or not cfg.sft.enabled else
                    lambda: warm_up_run(cfg, run, ckpt, sharded, config))
        validate_before_training(validator, logger, plane, cfg, start)
        if start < cfg.trainer.steps:
            plane.start_rollout(stream, cfg.data.prompts_per_step, plane.version, rollout_state)
        _steps(cfg, run, start, ckpt, sharded, logger, validator, config)
        summary = summarize(logger, REWARD_KEY, VAL_KEY) if logger is not None else {}
        if cfg.trainer.export_hf:
            actor.save_hf(out / "hf")  # every rank: a sharded actor gathers to rank 0, which writes
            if logger is not None:
                summary["hf_export"] = str(out / "hf")
        barrier()  # every node keeps its engines until rank 0 is done with them
        return summary
    except BaseException:
        plane.print_engine_logs()
        raise
    finally:
        plane.close()
        if logger is not None:
            logger.close()


def _steps(cfg: Config, run: Any, start: int, ckpt: Any, sharded: bool, logger: Any, validator: Any,
           config: dict[str, Any]) -> None:
    """The RL steps after `start`: rollout -> learn -> weight sync -> metrics -> checkpoint."""
    from launch.algorithm import learn
    from launch.checkpoint import save_run
    from launch.guards import DriftGuard, InvalidGuard
    from launch.metrics import CONSOLE_KEYS
    from launch.validation import validate_step

    actor, plane, rank, last = run.actor, run.plane, run.rank, cfg.trainer.steps
    drift = DriftGuard(cfg.model.dtype, cfg.trainer.drift_warn, cfg.trainer.max_drift, cfg.rollout.top_p < 1,
                       show=rank == 0)
    invalids = InvalidGuard(cfg.trainer.max_invalid_fraction, show=rank == 0)
    for step in range(start + 1, last + 1):
        batch, metrics = plane.next_batch(actor)  # finished groups within the staleness bound
        if not invalids.check(step, batch, metrics):  # no valid trajectory: nothing to learn, nothing to push
            with plane.updating(metrics):
                metrics.update(learn(batch, actor, run.ref, cfg.algorithm, cfg.actor, critic=run.critic))
                drift.check(step, metrics, plane.mismatched)  # warns, or (trainer.max_drift) stops the run
            plane.publish(actor)
        metrics.update(plane.after_update(last=step == last))
        if validator is not None and validator.due(step, last, cfg.trainer.val_every):
            metrics.update(validate_step(validator, plane, step, plane.version))  # logged with the step: once per step
        if logger is not None:
            logger.log(step, metrics, console=CONSOLE_KEYS)
        if step % cfg.trainer.save_every == 0 or step == last:
            save_run(ckpt, step, actor, run.stream, plane.version, rank, sharded, run.barrier,
                     rollout=plane.rollout_state() if rank == 0 else None, critic=run.critic, config=config)
        plane.after_checkpoint(last=step == last)
        run.barrier()
    invalids.finish()  # every step failed: the run trained nothing, and exits non-zero


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("-h", "--help"):  # every section and key with its default and meaning, or one section
        from launch.config_help import help_main

        return help_main(Config(), argv[1:], __doc__ or "")
    path = argv.pop(0) if argv and "=" not in argv[0] and not argv[0].startswith("--") else None
    if "--plan" in argv:  # what the config would start where, checked without a model or a GPU
        from launch.plan import plan_main

        return plan_main(path, argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if "TORCHELASTIC_RUN_ID" in os.environ:
        from parallel.lifetime import exit_with_launcher

        exit_with_launcher()
    from launch.exits import exit_status
    from launch.metrics import print_summary
    from parallel.mesh import close_process_group

    try:
        summary = train(load_config(path, argv))
    except Exception as e:  # the user's to act on: one line and a status; anything else keeps its traceback
        status = exit_status(e)
        if status is None:
            raise
        return status
    finally:
        close_process_group()  # in the launcher's own exit path, whatever ended the run
    print_summary(summary)
    return 0


if __name__ == "__main__":
    from parallel.lifetime import exit_now

    exit_now(main())  # what it wrote is closed; the interpreter's teardown would add ~2 s
