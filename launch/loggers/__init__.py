"""Where a run's metrics and resolved config go besides `output_dir/metrics.jsonl` (always written,
launch/metrics.py): `trainer.loggers`, each name one entry of `LOGGERS` and one file here. An entry
names the package its logger needs and the line that installs it, so a run naming a logger whose
package is missing fails at config time, before any model loads.

A logger is a class built as `Logger(output_dir, run_name, config, resume_step, project)` with
`log(step, metrics, shown)` (numbers only; `shown`: the keys a console line shows) and `close()`; `config` is the run's resolved config as a nested
dict, given once at the start."""

from __future__ import annotations

import importlib
import importlib.util
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class LoggerSpec:
    target: str  # module:Class
    package: str | None = None  # the import it needs (None: nothing beyond the project)
    install: str = ""  # the line that installs it


LOGGERS: dict[str, LoggerSpec] = {
    "console": LoggerSpec("launch.loggers.console:ConsoleLogger"),
    "wandb": LoggerSpec("launch.loggers.wandb_logger:WandbLogger", "wandb", "pip install wandb"),
    "tensorboard": LoggerSpec("launch.loggers.tensorboard_logger:TensorBoardLogger", "tensorboard",
                              "pip install tensorboard"),
    "mlflow": LoggerSpec("launch.loggers.mlflow_logger:MlflowLogger", "mlflow", "pip install mlflow-skinny"),
}


def missing(name: str) -> str | None:
    """What is wrong with logger `name` before the run starts (unknown, or its package absent), with
    the fix; None when it can be built."""
    spec = LOGGERS.get(name)
    if spec is None:
        return f"trainer.loggers names {name!r}, which is not a logger; choose from {sorted(LOGGERS)}"
    try:
        found = importlib.util.find_spec(spec.package) if spec.package else True
    except ImportError:
        found = None
    if found is None:
        return (f"trainer.loggers names {name!r}, whose package {spec.package} is not installed; install it "
                f"({spec.install}) or drop {name!r} from trainer.loggers")
    return None


def make_logger(name: str, **kwargs: Any) -> Any:
    module, _, cls = LOGGERS[name].target.partition(":")
    return getattr(importlib.import_module(module), cls)(**kwargs)
