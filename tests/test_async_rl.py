"""Asynchronous RL through `launch/train.py` on tiny-llama with a real hf engine: with
`rollout.staleness=1` rollout runs on while the trainer updates, every trained token comes from
weights at most one version old, generations preempted by a weight push continue on the new
weights (two versions in one trajectory), and a run killed with -9 resumes losing and repeating
no row; with staleness 0 the loop is the synchronous one."""

from __future__ import annotations

import os
import signal
import shutil
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_train import REPO, TINY, _env, _wait_for, metrics, train  # noqa: E402
from procs import pythonpath  # noqa: E402

ASYNC = [*TINY, "rollout.max_tokens=64", "rollout.staleness=1"]


def test_staleness_1_overlaps_rollout_with_updates_within_the_bound(tmp_path: Path):
    out = tmp_path / "run"
    proc = train([*ASYNC, "trainer.steps=5", f"trainer.output_dir={out}"])
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = metrics(out)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    versions_seen: set[int] = set()
    for r in rows:
        trained_on = r["weight_version"] - 1  # the version the step's update started from
        produced = {int(v): n for v, n in r["async/token_versions"].items()}
        assert produced and min(produced) >= trained_on - 1, r  # no token older than version - k
        assert r["async/staleness_max"] <= 1 and len(r["data/rows"]) == 2
        versions_seen |= set(produced)
    # a weight push preempted running generations, which went on with the next version's weights
    assert sum(v for r in rows for k, v in r.items() if k.endswith("/preemptions")) > 0
    # (counted as they finish: whether such a trajectory is then trained or dropped as too old for the
    # bound depends on when the push fell, so the trained count may be 0 in a short run)
    assert sum(r.get("async/mixed_version_done", 0) for r in rows) > 0
    assert any(len(r["async/token_versions"]) > 1 for r in rows)
    # the engines generated through the updates (the synchronous loop leaves them idle then)
    busy = [r["time/engine_busy_in_update"] for r in rows[1:]]
    assert sum(busy) / len(busy) > 0.2, busy
    assert len(versions_seen) >= 3
    trained = [row for r in rows for row in r["data/rows"]]
    assert len(trained) == len(set(trained)) == 10


def test_staleness_0_is_the_synchronous_loop(tmp_path: Path):
    import tempfile

    out, tmp = tmp_path / "run", Path(tempfile.mkdtemp(prefix="sy-", dir="/tmp"))  # short: ipc paths stay inside it
    try:
        proc = subprocess.run([sys.executable, "launch/train.py", *TINY, "rollout.max_tokens=64", "rollout.staleness=0",
                               "trainer.steps=2", f"trainer.output_dir={out}"], cwd=REPO, capture_output=True,
                              text=True, timeout=600, env={**_env(), "TMPDIR": str(tmp)})
        assert proc.returncode == 0, proc.stderr[-4000:]
        assert not list(tmp.glob("switchyard-*"))  # the engines' socket/key/log directory is removed
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    rows = metrics(out)
    for r in rows:  # the one rollout path at staleness 0: every token from the weights of the step
        assert r["async/staleness_max"] == 0 and r["async/mixed_version_trajectories"] == 0, r
        assert list(r["async/token_versions"]) == [str(r["weight_version"] - 1)], r
    assert [r["data/index"] for r in rows] == [2, 4] and [r["weight_version"] for r in rows] == [2, 3]
    assert all(r["time/engine_busy_in_update"] < 0.05 for r in rows)  # rollout waits for the update


@pytest.mark.cold  # reads the process tree
def test_kill_9_under_staleness_1_loses_and_repeats_no_row(tmp_path: Path):
    out = tmp_path / "run"
    args = [*ASYNC, "trainer.steps=6", f"trainer.output_dir={out}"]
    log = (tmp_path / "first.log").open("w")
    proc = subprocess.Popen([sys.executable, "launch/train.py", *args], cwd=REPO, env=_env(), stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True)
    try:
        _wait_for(out / "checkpoints" / "step_000003" / "state.pt", proc, 300)
        servers = [c for c in psutil.Process(proc.pid).children(recursive=True)
                   if "rollout.bus.server" in " ".join(c.cmdline())]
        os.kill(proc.pid, signal.SIGKILL)  # rollout is running ahead: groups buffered and in flight
        proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
    psutil.wait_procs(servers, timeout=30)
    saved = torch.load(out / "checkpoints" / "step_000003" / "state.pt", weights_only=False)["rollout"]
    assert saved["ready"] or saved["pending"]  # the checkpoint holds work between the stream and the trainer

    again = train(args)
    assert again.returncode == 0, again.stderr[-4000:]
    assert "resuming from" in again.stdout
    rows = metrics(out)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    trained = [row for r in rows for row in r["data/rows"]]
    assert len(trained) == len(set(trained)), trained  # no row trained twice
    # every row the stream handed out was trained or is still held by the final checkpoint
    final = torch.load(out / "checkpoints" / "step_000006" / "state.pt", weights_only=False)["rollout"]
    held = [row_id for row_id, *_ in final["ready"]] + [row_id for row_id, _ in final["pending"]]
    assert not set(held) & set(trained)
    handed_out = {str(i) for i in range(final["drawn"])}  # row ids: places in the stream's draw order
    assert final["drawn"] == final["stream"]["index"]  # one epoch: drawn rows are the stream's position
    assert set(trained) | set(held) == handed_out, sorted(handed_out - set(trained) - set(held))


def _rounds_config(tmp_path: Path, staleness: int) -> Path:
    """One 1-token generation per trajectory, reward = its token id is even: half the groups of
    n = 2 have equal rewards, so dynamic sampling has work to do."""
    import yaml

    cfg = {"model": {"path": "tiny-llama"},
           "data": {"task": "arithmetic", "agent_name": "rounds", "prompts_per_step": 2},
           "rollout": {"engine": "hf", "n": 2, "max_tokens": 1, "staleness": staleness, "dynamic_sampling": True,
                       "agent_loops": {"rounds": "async_workload.RoundsLoop"},
                       "agent": {"rounds": {"rounds": 1, "median_s": 0.0, "p99_s": 0.0}}},
           "sft": {"enabled": False}, "trainer": {"steps": 3, "output_dir": str(tmp_path / "run"), "export_hf": False}}
    path = tmp_path / "rounds.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


@pytest.mark.parametrize("staleness", [0, 1])
def test_dynamic_sampling_keeps_filling_batches_with_groups_that_carry_signal(tmp_path: Path, staleness: int):
    env = {**_env(), "PYTHONPATH": pythonpath(REPO, REPO / "benchmarks")}
    proc = subprocess.run([sys.executable, "launch/train.py", str(_rounds_config(tmp_path, staleness))], cwd=REPO,
                          capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = metrics(tmp_path / "run")
    assert sum(r.get("rollout/filtered_groups", 0) for r in rows) > 0  # some groups had equal rewards and were dropped
    for r in rows:  # every batch is still full, and only of groups whose two rewards differ
        assert r["rollout/trajectories"] == 4 and r["rollout/reward_std"] > 0, r
    assert rows[-1]["data/index"] > 6  # extra rows were drawn to fill in
