"""MLflow: one run per output_dir in the experiment `trainer.wandb_project` names (else "switchyard"),
the resolved config as its params (dotted keys), every step's numbers as metrics. The store is
MLFLOW_TRACKING_URI, else a sqlite file output_dir/mlflow.db; a resumed run continues its MLflow run."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any


class MlflowLogger:
    def __init__(self, output_dir: Path, run_name: str, config: dict[str, Any], resume_step: int = 0,
                 project: str | None = None) -> None:
        from mlflow import MlflowClient
        from mlflow.entities import Param

        uri = os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{output_dir.resolve() / 'mlflow.db'}"
        self.client = MlflowClient(tracking_uri=uri)
        name = project or "switchyard"
        found = self.client.get_experiment_by_name(name)
        experiment = found.experiment_id if found is not None else self.client.create_experiment(
            name, artifact_location=(output_dir.resolve() / "mlruns").as_uri())
        tag = "switchyard.output_dir"
        runs = self.client.search_runs([experiment], f"tags.`{tag}` = '{output_dir.resolve()}'", max_results=1)
        if runs:  # a resumed run: the same MLflow run, its params already there
            self.run_id = runs[0].info.run_id
            self.client.update_run(self.run_id, "RUNNING")
            return
        self.run_id = self.client.create_run(experiment, run_name=run_name,
                                             tags={tag: str(output_dir.resolve())}).info.run_id
        params = [Param(k, str(v)[:6000]) for k, v in _flat(config).items()]
        for i in range(0, len(params), 100):  # MLflow takes at most 100 params per batch
            self.client.log_batch(self.run_id, params=params[i:i + 100])

    def log(self, step: int, metrics: dict[str, Any], shown: tuple[str, ...] = ()) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        values = [Metric(k.replace("@", "_at_"), float(v), now, step) for k, v in metrics.items()]
        for i in range(0, len(values), 1000):
            self.client.log_batch(self.run_id, metrics=values[i:i + 1000])

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


def _flat(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in tree.items():
        if isinstance(v, dict) and v:
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out
