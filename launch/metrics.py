"""Where a run's numbers go: a JSONL file (always), the loggers `trainer.loggers` names (launch/loggers:
console, wandb, tensorboard, mlflow), and a reward-curve PNG at the end. The JSONL file is appended to,
so a resumed run continues it; steps it does again move their earlier lines to metrics.redone.jsonl."""

from __future__ import annotations

import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

REWARD_KEY = "rollout/reward_mean"
VAL_KEY = "val/accuracy"
CONSOLE_KEYS = (REWARD_KEY, VAL_KEY, "rollout/invalid", "rollout/signal_fraction", "rollout/tool_calls_per_trajectory",
                "rollout/response_length_mean", "drift/mean",
                "actor/pg_loss", "critic/vf_explained_var", "time/rollout_s", "time/update_s", "time/step_s")


class MetricsLogger:
    """Every step's numbers to output_dir/metrics.jsonl and to each of `loggers` (launch/loggers: the
    console's step line, wandb, TensorBoard, MLflow), which get the resolved `config` once at the start."""

    def __init__(self, output_dir: Path, loggers: list[str] | tuple[str, ...] = ("console",),
                 config: dict[str, Any] | None = None, resume_step: int = 0, project: str | None = None) -> None:
        from launch.loggers import make_logger

        self.path = output_dir / "metrics.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._drop_after(resume_step)
        self.sinks: dict[str, Any] = {}
        try:
            for name in dict.fromkeys(loggers):
                self.sinks[name] = make_logger(name, output_dir=output_dir, run_name=output_dir.resolve().name,
                                               config=config or {}, resume_step=resume_step, project=project)
        except BaseException:
            self.close()
            raise

    def _drop_after(self, step: int) -> None:
        """A run killed after logging step k but before its checkpoint redoes step k: keep one line per
        step in metrics.jsonl; the lines of steps done again go to metrics.redone.jsonl, never lost."""
        if not self.path.exists():
            return
        lines = [ln for ln in self.path.read_text().splitlines() if ln.strip()]
        keep = [ln for ln in lines if json.loads(ln).get("step", 0) <= step]
        if len(keep) == len(lines):
            return
        with (self.path.parent / "metrics.redone.jsonl").open("a") as f:
            f.write("".join(ln + "\n" for ln in lines if json.loads(ln).get("step", 0) > step))
        tmp = self.path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(ln + "\n" for ln in keep))
        os.replace(tmp, self.path)

    def log(self, step: int, metrics: dict[str, Any], console: tuple[str, ...] = ()) -> None:
        """One line of the JSONL file per step; the numbers among `metrics` to every logger (`console`:
        the keys the console's step line shows)."""
        record = {"step": step, "time": round(time.time(), 3),
                  **{k: _plain(v) for k, v in sorted(metrics.items())}}
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        numbers = {k: v for k, v in record.items() if isinstance(v, (int, float)) and not isinstance(v, bool)
                   and k not in ("step", "time")}
        for sink in self.sinks.values():
            sink.log(step, numbers, console)

    def history(self) -> list[dict[str, Any]]:
        if not self.path.exists():
            return []
        return [json.loads(ln) for ln in self.path.read_text().splitlines() if ln.strip()]

    def logged(self, step: int, key: str) -> bool:
        """Whether a line of `step` with `key` is in the file already (a resumed run skips it)."""
        return any(h.get("step") == step and h.get(key) is not None for h in self.history())

    def close(self) -> None:
        for sink in self.sinks.values():
            sink.close()
        self.sinks = {}


def run_logger(cfg: Any, start: int, rank: int) -> MetricsLogger | None:
    """Rank 0's logger of a training run that goes on after step `start` (None on the other ranks);
    its loggers get the config as resolved (`launch.config.resolved`)."""
    if rank != 0:
        return None
    from launch.config import resolved

    return MetricsLogger(Path(cfg.trainer.output_dir), cfg.trainer.loggers, resolved(cfg), start,
                         cfg.trainer.wandb_project)


def _plain(v: Any) -> Any:
    if hasattr(v, "item"):
        v = v.item()
    if isinstance(v, float) and not math.isfinite(v):
        return None
    return v


def plot_rewards(history: list[dict[str, Any]], path: Path, key: str = "reward/mean",
                 val_key: str | None = None) -> Path | None:
    """The reward curve of a run as a PNG, with the held-out accuracy (`val_key`) as points where
    it was validated; None when matplotlib is missing or nothing was logged."""
    points = [(r["step"], r[key]) for r in history if r.get(key) is not None]
    val = [(r["step"], r[val_key]) for r in history if val_key and r.get(val_key) is not None]
    if not points:
        return None
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed; skipping the reward plot (pip install matplotlib)")
        return None
    steps, values = zip(*points)
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(steps, values, marker="o", label=key)
    if len(values) >= 5:
        avg = [sum(values[max(0, i - 4):i + 1]) / len(values[max(0, i - 4):i + 1]) for i in range(len(values))]
        ax.plot(steps, avg, label="5-step mean")
    if val:
        ax.plot(*zip(*val), marker="s", linestyle="--", color="tab:green", label=f"{val_key} (held out)")
    ax.set_xlabel("RL step")
    ax.set_ylabel("reward")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def summarize(logger: MetricsLogger, key: str, val_key: str | None = None) -> dict[str, Any]:
    """The run's closing numbers: mean `key` over the first and last five steps, `val_key` before
    the first step (val_before) and at the last validation (val_after), the plot, the file."""
    hist = [h for h in logger.history() if h.get(key) is not None]
    summary: dict[str, Any] = {}
    if hist:
        first, last = hist[:5], hist[-5:]
        summary = {"steps": len(hist), "reward_first5": sum(h[key] for h in first) / len(first),
                   "reward_last5": sum(h[key] for h in last) / len(last)}
    steps = [h for h in logger.history() if h.get("step", 0) > 0]
    summary["trajectories"] = int(sum(h.get("rollout/trajectories") or 0 for h in steps))
    summary["invalid"] = int(sum(h.get("rollout/invalid") or 0 for h in steps))
    summary["failed_steps"] = sum(1 for h in steps if h.get("step/failed"))
    summary["no_signal_steps"] = sum(1 for h in steps if h.get("rollout/signal_fraction") == 0)
    reasons: dict[str, float] = {}
    for h in steps:
        for k, v in h.items():
            if k.startswith("rollout/invalid_reason/") and v:
                reasons[k.rsplit("/", 1)[1]] = reasons.get(k.rsplit("/", 1)[1], 0) + v
    if reasons:
        summary["invalid_reasons"] = ",".join(f"{k}:{int(v)}" for k, v in sorted(reasons.items(), key=lambda kv: -kv[1]))
    val = [h for h in logger.history() if val_key and h.get(val_key) is not None]
    if val and val[0]["step"] == 0:
        summary["val_before"] = val[0][val_key]
    if val and val[-1]["step"] > 0:
        summary["val_after"] = val[-1][val_key]
    png = plot_rewards(logger.history(), logger.path.parent / "reward_curve.png", key=key, val_key=val_key)
    summary["plot"] = str(png) if png else None
    summary["metrics"] = str(logger.path)
    return summary


def print_summary(summary: dict[str, Any]) -> None:
    """The run's closing line (`summarize`), and a warning when no step had a learning signal."""
    if not summary:
        return
    print("SUMMARY " + " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in summary.items()))
    if summary.get("no_signal_steps") and summary["no_signal_steps"] == summary.get("steps"):
        print(f"warning: no step of this run had a learning signal: in every group all trajectories scored "
              f"alike (reward {summary.get('reward_last5', 0):.3g}), so every advantage was 0 and the reward "
              f"taught the policy nothing; check the reward (reward.*), make the task reachable for this model "
              f"(an SFT warm-up, sft.*), or raise rollout.n", file=sys.stderr)
