"""The step line on stdout: `step N/total`, the configured keys, and the time left at the pace so far."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any


class ConsoleLogger:
    def __init__(self, output_dir: Path, run_name: str, config: dict[str, Any], resume_step: int = 0,
                 project: str | None = None) -> None:
        self.total = int(config.get("trainer", {}).get("steps", 0)) or None
        self._since: tuple[int, float] | None = None  # (step, time) of the first step line: the pace's start
        self._first = resume_step

    def log(self, step: int, metrics: dict[str, Any], shown: tuple[str, ...] = ()) -> None:
        """One line: `step N/total`, the time left at the pace of the steps so far, the `shown` metrics."""
        now = time.monotonic()
        if self._since is None and step > self._first:
            self._since = (self._first, now - float(metrics.get("time/step_s", 0.0)))
        done, start = (step - self._since[0], self._since[1]) if self._since else (0, now)
        values = " ".join(f"{k}={_fmt(metrics[k])}" for k in shown if k in metrics)
        total = f"/{self.total}" if self.total else ""
        eta = ""
        if self.total and done > 0 and step <= self.total:
            eta = f" eta {_duration((now - start) / done * (self.total - step))}"
        print(f"step {step:>4}{total}{eta} {values}", flush=True)

    def close(self) -> None:
        pass


def _fmt(v: Any) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def _duration(seconds: float) -> str:
    s = int(round(seconds))
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"
