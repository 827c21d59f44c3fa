"""TensorBoard: event files under output_dir/tensorboard, one scalar per metric and the run's config
as a text summary (YAML) at step 0."""

from __future__ import annotations

from pathlib import Path
from typing import Any


class TensorBoardLogger:
    def __init__(self, output_dir: Path, run_name: str, config: dict[str, Any], resume_step: int = 0,
                 project: str | None = None) -> None:
        import yaml
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(output_dir / "tensorboard"), purge_step=resume_step + 1 if resume_step else None)
        text = yaml.safe_dump(config, sort_keys=False)
        self.writer.add_text("config", "    " + text.replace("\n", "\n    "), 0)  # indented: markdown code

    def log(self, step: int, metrics: dict[str, Any], shown: tuple[str, ...] = ()) -> None:
        for key, value in metrics.items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()
