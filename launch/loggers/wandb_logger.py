"""Weights & Biases: the run's config at init, every step's numbers (WANDB_MODE=offline keeps the run
under output_dir/wandb for `wandb sync`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any


class WandbLogger:
    def __init__(self, output_dir: Path, run_name: str, config: dict[str, Any], resume_step: int = 0,
                 project: str | None = None) -> None:
        import wandb

        self.run = wandb.init(project=project or "switchyard", name=run_name, config=config, dir=str(output_dir),
                              resume="allow")

    def log(self, step: int, metrics: dict[str, Any], shown: tuple[str, ...] = ()) -> None:
        self.run.log(metrics, step=step)

    def close(self) -> None:
        self.run.finish()
