"""trainer.loggers with each package for real: wandb in offline mode (its run's files read back),
a TensorBoard event file read back by tensorboard's EventAccumulator, an MLflow sqlite store read back
by mlflow's client; each gets the step numbers and the resolved config. A logger whose package is not
installed fails at config time, before any model loads, naming its install line."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from launch.config import ConfigError, load_config, resolved
from launch.metrics import MetricsLogger

REPO = Path(__file__).resolve().parents[1]
STEPS = {1: {"rollout/reward_mean": 0.25, "time/step_s": 1.5}, 2: {"rollout/reward_mean": 0.75, "time/step_s": 1.0}}


def _run(out: Path, loggers: list[str], **kw) -> dict:
    cfg = resolved(load_config(None, [f"trainer.loggers=[{','.join(loggers)}]", "trainer.steps=2",
                                      f"trainer.output_dir={out}"]))
    logger = MetricsLogger(out, loggers, cfg, **kw)
    for step, metrics in STEPS.items():
        logger.log(step, {**metrics, "note": "text is not a number"}, console=("rollout/reward_mean",))
    logger.close()
    return cfg


def test_console_shows_step_of_total_with_the_time_left(tmp_path: Path, capsys: pytest.CaptureFixture):
    _run(tmp_path, ["console"])
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("step")]
    assert lines[0].split()[:4] == ["step", "1/2", "eta", "0m02s"] and "rollout/reward_mean=0.25" in lines[0]
    assert lines[1].split()[:4] == ["step", "2/2", "eta", "0m00s"]


def test_tensorboard_event_file_holds_the_metrics_and_config(tmp_path: Path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cfg = _run(tmp_path, ["tensorboard"])
    acc = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"tensors": 0, "scalars": 0})
    acc.Reload()
    scalars = acc.Scalars("rollout/reward_mean")
    assert [(e.step, e.value) for e in scalars] == [(1, 0.25), (2, 0.75)]
    text = acc.Tensors("config/text_summary")[0].tensor_proto.string_val[0].decode()
    assert yaml.safe_load(text.replace("\n    ", "\n").strip())["trainer"] == cfg["trainer"]


def test_mlflow_sqlite_store_holds_the_metrics_and_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    from mlflow import MlflowClient

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    _run(tmp_path, ["mlflow"], project="loggers-test")
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("loggers-test").experiment_id])
    history = client.get_metric_history(run.info.run_id, "rollout/reward_mean")
    assert [(m.step, m.value) for m in history] == [(1, 0.25), (2, 0.75)]
    assert run.data.params["trainer.steps"] == "2" and run.data.params["trainer.loggers"] == "['mlflow']"
    assert run.info.status == "FINISHED"


def _wandb_records(path: Path) -> list:
    """The records of an offline run's .wandb file: W&B's leveldb-style log (a 7-byte file header, then
    32 KiB blocks of chunks, each `crc32 u32, length u16, type u8` + bytes; types 1 full, 2-4 pieces),
    each record a protobuf `Record` of wandb's own."""
    import struct

    from wandb.proto import wandb_internal_pb2

    data, pos, piece, records = path.read_bytes(), 7, b"", []
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # a block's tail too short for a chunk header is padding
            pos += 32768 - pos % 32768
            continue
        _, n, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if n == 0 and kind == 0:
            break
        piece, pos = piece + data[pos + 7:pos + 7 + n], pos + 7 + n
        if kind in (1, 4):
            records.append(wandb_internal_pb2.Record.FromString(piece))
            piece = b""
    return records


def test_wandb_offline_run_holds_the_metrics_and_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    import json

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    cfg = _run(tmp_path, ["wandb"], project="loggers-test")
    (run_file,) = (tmp_path / "wandb").glob("offline-run-*/run-*.wandb")
    deadline = time.monotonic() + 30  # wandb's service process may still be writing the file after finish()
    records = _wandb_records(run_file)
    while "exit" not in [r.WhichOneof("record_type") for r in records]:
        assert time.monotonic() < deadline, f"{run_file} holds no exit record after 30 s"
        time.sleep(0.1)
        records = _wandb_records(run_file)
    (run,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    config = {u.key: json.loads(u.value_json) for u in run.config.update}
    assert run.project == "loggers-test" and config["trainer"] == cfg["trainer"] and config["model"] == cfg["model"]
    rows = [{"/".join(i.nested_key) or i.key: json.loads(i.value_json) for i in r.history.item}
            for r in records if r.WhichOneof("record_type") == "history"]
    assert [(row["_step"], row["rollout/reward_mean"]) for row in rows] == [(1, 0.25), (2, 0.75)]


# what an uninstalled package looks like to the import system: no spec, `import wandb` fails
BLOCK = """import sys
class _Gone:
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] == {name!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
sys.meta_path.insert(0, _Gone())
"""


@pytest.mark.parametrize("package,args", [("wandb", ["trainer.loggers=[console,wandb]"]),
                                          ("wandb", ["trainer.wandb_project=demo"]),
                                          ("tensorboard", ["trainer.loggers=[tensorboard]"])])
def test_a_logger_without_its_package_fails_at_config_time(tmp_path: Path, package: str, args: list[str]):
    (tmp_path / "sitecustomize.py").write_text(BLOCK.format(name=package))
    env = {"PYTHONPATH": f"{tmp_path}:{REPO}", "PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1"}
    run = subprocess.run([sys.executable, "launch/train.py", "model.path=tiny-llama", *args,
                          f"trainer.output_dir={tmp_path / 'run'}"], cwd=REPO, env=env, capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 2, run.stdout + run.stderr
    assert f"pip install {package}" in run.stderr and "trainer.loggers" in run.stderr, run.stderr
    assert "actor memory" not in run.stdout  # no model was built


def test_an_unknown_logger_names_the_choices():
    with pytest.raises(ConfigError, match="choose from .*'mlflow'.*'tensorboard'"):
        load_config(None, ["trainer.loggers=[console,neptune]"])
