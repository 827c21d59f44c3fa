"""Evaluate a model on held-out rows: the numbers `launch/train.py` logs as `val/...`, for a model
before training (a baseline), a finished run's export, or one of its checkpoints.

    python launch/evaluate.py [config.yaml] [key.sub=value ...] [--checkpoint DIR] [--out DIR]

    python launch/evaluate.py model.path=runs/cpu_demo/hf         # the CPU demo's export, its 200 test problems
    python launch/evaluate.py                                     # the demo's base model: the baseline
    python launch/evaluate.py --checkpoint runs/cpu_demo/checkpoints/step_000020
    python launch/evaluate.py data.task=gsm8k data.val_path=gsm8k/test.jsonl val.max_rows=100

The config is a training config (default launch/configs/cpu_demo.yaml): the model (`model.path`: a
built-in name, an HF directory or a run's `hf/` export), the held-out rows (`data.val_path`, "test"
for the task's own test split), the engine, agent loops, tools, interactions and reward
(`rollout...`) and the sampling (`val...`: greedy, one sample by default; `val.n` with
`val.temperature` for pass@k). `--checkpoint` loads a run's checkpoint (one process, unsharded
actor) onto `model.path`, the run's base model, and pushes its weights into the engines. Every sample
goes to OUT/val/eval.jsonl, the metrics to OUT/eval_metrics.json (OUT: `--out`, default runs/eval).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without install

from launch.config import Config, ConfigError, load_config, resolve_model_dtype, resolve_path  # noqa: E402


def evaluate(cfg: Config, out: Path, checkpoint: Path | None = None) -> dict[str, Any]:
    """Start the engines and agent workers of `cfg.rollout` for `cfg.model.path`, run the held-out
    rows of `cfg.data.val_path` and return the metrics (records and metrics files in `out`)."""
    from agent.interactions import load_interactions
    from agent.loop import AgentLoopRegistry
    from agent.tools import load_tools
    from engines.models import load_tokenizer, resolve_model
    from launch.data import validation_rows
    from launch.validation import Validator, describe
    from rollout.plane import RolloutPlane

    r = cfg.rollout
    if not cfg.data.val_path:
        raise ConfigError("data.val_path is not set: name the held-out rows (\"test\" for the task's own test "
                          "split, or a jsonl/parquet file of rows)")
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise ConfigError("launch/evaluate.py runs as one process; start it with python, not torchrun")
    tools_path, inter_path = resolve_path(r.tools_config), resolve_path(r.interaction_config)
    try:
        tools = load_tools(tools_path) if tools_path else {}
        inter = load_interactions(inter_path) if inter_path else {}
        rows = validation_rows(cfg.data, cfg.val.max_rows, AgentLoopRegistry(r.agent_loops).names, list(tools),
                               list(inter))
    except (OSError, ValueError) as e:
        raise ConfigError(f"data.val_path={cfg.data.val_path!r}: {e}") from None
    if checkpoint is not None and not (checkpoint / "state.pt").exists():
        raise ConfigError(f"--checkpoint {checkpoint} has no state.pt; give a directory such as "
                          "runs/NAME/checkpoints/step_000020")
    model_dir = str(resolve_model(cfg.model.path))
    resolve_model_dtype(cfg, show=True)
    plane = RolloutPlane(r, model_dir, cfg.model.dtype, 0, 1, tools_path, inter_path)
    validator = Validator(rows, cfg.val, r.max_tokens, out, load_tokenizer(model_dir))
    try:
        plane.start_engines(out)
        plane.start_workers()
        version = 0
        if checkpoint is not None:
            version = _push_checkpoint(cfg, plane, model_dir, checkpoint)
        metrics = validator.run(plane, "eval", version)
    except BaseException:
        plane.print_engine_logs()
        raise
    finally:
        plane.close()
    print(describe(metrics, f"evaluation of {checkpoint or cfg.model.path}"), flush=True)
    (out / "eval_metrics.json").write_text(json.dumps(metrics, indent=1, sort_keys=True) + "\n")
    return metrics


def _push_checkpoint(cfg: Config, plane: Any, model_dir: str, checkpoint: Path) -> int:
    """Load a run's checkpoint into an actor for `model_dir` and push its weights; its version."""
    import torch

    from engines.training import make_actor

    state = torch.load(checkpoint / "state.pt", map_location="cpu", weights_only=False)
    if "actor" not in state:
        raise ConfigError(f"{checkpoint} is a sharded checkpoint (one file per rank: FSDP or Megatron); evaluate the "
                          "run's hf/ export instead (model.path=runs/NAME/hf)")
    actor = make_actor(cfg.actor, model_dir, cfg.model.dtype, cfg.rollout.temperature, cfg.trainer.seed)
    try:
        actor.load_state_dict(state["actor"])
    except (RuntimeError, ValueError, KeyError) as e:
        raise ConfigError(f"{checkpoint} does not fit model.path={cfg.model.path!r} with this config's actor "
                          f"section ({type(e).__name__}: {str(e).splitlines()[0][:300]}); pass the run's own config "
                          "and base model") from None
    version = max(1, int(state.get("version", 1)))
    plane.load(actor, version)  # the whole weights: an evaluation's plane takes no adapters
    del actor
    return version


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0
    flags: dict[str, str] = {}
    rest: list[str] = []
    it = iter(argv)
    for a in it:
        if a in ("--checkpoint", "--out"):
            value = next(it, None)
            if value is None:
                print(f"config error: {a} needs a value", file=sys.stderr)
                return 2
            flags[a] = value
        elif a.startswith("--"):
            print(f"config error: unknown option {a!r}; options: --checkpoint DIR, --out DIR (and key=value)",
                  file=sys.stderr)
            return 2
        else:
            rest.append(a)
    path = rest.pop(0) if rest and "=" not in rest[0] else None
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from engines.models import ModelUnavailableError

    try:
        cfg = load_config(path, rest)
        ckpt = Path(flags["--checkpoint"]) if "--checkpoint" in flags else None
        metrics = evaluate(cfg, Path(flags.get("--out", "runs/eval")), ckpt)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    except ModelUnavailableError as e:
        print(f"config error: model.path: {e}", file=sys.stderr)
        return 2
    from launch.validation import table

    print(table(metrics), flush=True)
    keys = ("val/accuracy", "val/reward_mean", "val/rows", "val/samples", "val/tool_calls_per_trajectory",
            "val/time_s")
    shown = {k[len("val/"):]: metrics[k] for k in keys if k in metrics}
    shown.update({k[len("val/"):]: metrics[k] for k in sorted(metrics) if k.startswith("val/pass@")})
    print("EVAL " + " ".join(f"{k}={v:.4g}" for k, v in shown.items()), flush=True)
    return 0


if __name__ == "__main__":
    from parallel.lifetime import exit_now

    exit_now(main())
