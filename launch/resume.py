"""Whether and how a run continues the one before it in `trainer.output_dir`.

`trainer.resume=auto` continues from the newest checkpoint whose files verify (launch/checkpoint.py);
when checkpoints are there and none loads, the run stops, naming each and why: a restart from step 0
would quietly discard the earlier run. `trainer.resume=fresh` starts at step 0, the earlier run's
checkpoints and metrics moved aside into `output_dir/earlier/<that run's id>/`, never overwritten.
(Steps a resumed run does again, logged after its checkpoint by a run that was killed, keep their
first lines in `metrics.redone.jsonl`: launch/metrics.py.)

A resumed run compares its config with the one its checkpoint was saved with and prints every
change. A change that alters what the run means (the model, its dtype, the learning rate, the
estimator or loss, rollout.n, data.prompts_per_step, the data...) is refused unless
`trainer.resume_changes` names its key (or says `all`); harmless ones (logging, cadence, total
steps, validation, timeouts, where things run) are allowed. A data stream that no longer matches
its saved position (another dataset behind the same path) is refused here too (`ResumeError`).
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import time
from pathlib import Path
from typing import Any, Callable

from launch.checkpoint import Checkpointer, ResumeError

# keys (or sections) whose change on resume leaves the run's meaning as it was
HARMLESS = (
    "trainer.steps", "trainer.output_dir", "trainer.save_every", "trainer.resume", "trainer.resume_changes",
    "trainer.wandb_project", "trainer.export_hf", "trainer.collective_timeout_s", "trainer.val_every",
    "trainer.val_before_train", "trainer.drift_warn", "trainer.max_drift", "trainer.max_invalid_fraction",
    "val", "data.val_path", "sft",  # sft: a resumed run does not warm up again
    "rollout.num_engines", "rollout.placement", "rollout.bind_host", "rollout.request_log", "rollout.engine_options",
    "rollout.policy", "rollout.num_workers", "rollout.startup_timeout_s", "rollout.step_timeout_s",
    "rollout.weight_bucket_mb", "rollout.weight_path", "rollout.verify_weights", "rollout.verify_weights_every",
    "rollout.in_process",
    "rollout.engine_cores", "rollout.tracing", "rollout.engines", "rollout.engine_keys",
    "actor.micro_batch_size", "actor.max_tokens_per_micro_batch", "actor.gradient_checkpointing",
    "actor.retain_freed_memory", "actor.attn_implementation", "actor.shared_prefix", "actor.packed_attention",
    "reward.timeout_s", "reward.processes", "reward.batch_size", "reward.batch_wait_s",
)
# what an earlier run leaves in its output directory that a run from step 0 would overwrite
EARLIER_RUN = ("checkpoints", "metrics.jsonl", "metrics.redone.jsonl", "val", "reward_curve.png", "hf")


def flat_config(cfg: Any) -> dict[str, Any]:
    """The config as {dotted key: value}, JSON-plain (what a checkpoint records and a resume compares)."""
    out: dict[str, Any] = {}

    def walk(node: Any, key: str) -> None:
        if isinstance(node, dict) and node:
            for k, v in node.items():
                walk(v, f"{key}.{k}" if key else str(k))
        else:
            out[key] = node

    walk(json.loads(json.dumps(dataclasses.asdict(cfg), default=str)), "")
    return out


def _under(key: str, names: tuple[str, ...] | list[str]) -> bool:
    return any(key == n or key.startswith(n + ".") for n in names)


def compare(saved: dict[str, Any] | None, now: dict[str, Any], accepted: list[str], where: Path,
            show: bool = True) -> list[str]:
    """Every difference between the checkpoint's config and this run's, printed (when `show`); raises
    ResumeError naming the changes that alter the run's meaning and are not in `accepted`."""
    if saved is None:
        if show:
            print(f"WARNING: {where} records no config (saved by an earlier version): the resumed config is not "
                  "checked against it", flush=True)
        return []
    lines, refused = [], []
    unknown = [a for a in accepted if a != "all" and not any(_under(k, [a]) for k in set(saved) | set(now))]
    if unknown and show:
        print(f"WARNING: trainer.resume_changes names {unknown}, which are no config keys; it confirms nothing "
              "for them", flush=True)
    for key in sorted(set(saved) | set(now)):
        before, after = saved.get(key, "<unset>"), now.get(key, "<unset>")
        if before == after:
            continue
        if _under(key, HARMLESS):
            kind = "allowed"
        elif "all" in accepted or _under(key, accepted):
            kind = "accepted by trainer.resume_changes"
        else:
            kind = "alters the run"
            refused.append(key)
        lines.append(f"  {key}: {before!r} -> {after!r} ({kind})")
    if lines and show:
        print(f"config changed since {where} was saved:\n" + "\n".join(lines), flush=True)
    if refused:
        raise ResumeError(
            f"resuming from {where} with a config that alters the run: {', '.join(refused)} changed (each above). "
            f"Resume with the saved values, or confirm the change with trainer.resume_changes=[{','.join(refused)}], "
            "or start over with trainer.resume=fresh (the earlier run is moved aside), or set another "
            "trainer.output_dir")
    return lines


def choose(ckpt: Checkpointer, mode: str, rank: int | None, agree: Callable[[bool], bool],
           show: bool) -> Path | None:
    """The checkpoint this run continues from, or None to start at step 0. Checkpoints that are there
    and none of which loads stop the run (auto) rather than restart it."""
    if mode == "fresh":
        return None
    path, skipped = ckpt.resumable(rank, agree, show=show)
    if path is None and skipped:
        named = "\n".join(f"  {p}: {why}" for p, why in skipped)
        raise ResumeError(f"no checkpoint in {ckpt.dir} loads, and a restart from step 0 would discard the run "
                          f"they hold:\n{named}\nrepair or restore one of them, or start over with "
                          "trainer.resume=fresh (the earlier run is moved aside into "
                          f"{ckpt.dir.parent / 'earlier'}), or set another trainer.output_dir")
    return path


def set_aside(output_dir: Path, show: bool) -> Path | None:
    """An earlier run's checkpoints and metrics (a run starting at step 0 would overwrite them) moved
    into output_dir/earlier/<its run id>/, the id being when it last wrote; None when there are none."""
    found = [output_dir / n for n in EARLIER_RUN if (output_dir / n).exists()]
    if not found:
        return None
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime(max(p.stat().st_mtime for p in found)))
    dest = output_dir / "earlier" / stamp
    n = 1
    while dest.exists():
        n += 1
        dest = output_dir / "earlier" / f"{stamp}-{n}"
    dest.mkdir(parents=True)
    for p in found:
        shutil.move(str(p), str(dest / p.name))
    if show:
        print(f"this run starts at step 0: the earlier run's {', '.join(p.name for p in found)} moved into {dest}",
              flush=True)
    return dest


def resume(cfg: Any, run: Any, ckpt: Checkpointer, sharded: bool, config: dict[str, Any],
           agree: Callable[[bool], bool]) -> tuple[Path | None, int, int | None, dict[str, Any] | None]:
    """Where this run starts: (the checkpoint it continues from or None, its step, its weight version,
    the feeder's saved state), every rank agreeing; a fresh start sets the earlier run aside first."""
    from launch.checkpoint import load_run

    show = run.rank == 0
    latest = choose(ckpt, cfg.trainer.resume, run.rank if sharded else None, agree, show=show)
    if cfg.trainer.resume == "fresh" and show:
        set_aside(ckpt.dir.parent, show=True)  # an earlier run's checkpoints and metrics are kept, never overwritten
    run.barrier()
    if latest is None:
        return None, 0, None, None
    start, version, rollout_state = load_run(
        ckpt, latest, run.actor, run.stream, run.rank, sharded, critic=run.critic,
        check=lambda saved: compare(saved, config, cfg.trainer.resume_changes, latest, show=show))
    if show:
        print(f"resuming from {latest} (step {start}, data position {run.stream.position})", flush=True)
    return latest, start, version, rollout_state
