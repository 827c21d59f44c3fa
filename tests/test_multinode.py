"""Two nodes on one box: two torchrun launchers on loopback (static rendezvous, `--node-rank`),
each pinned to its own core with its own hf engine. Both nodes' engines serve in every step,
all engines hold the same weight version, node 1's engine is reached over tcp with the run's
keys, the run survives kill -9 of both launchers, and killing node 1's engine mid-rollout loses
no trajectory."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

REPO = Path(__file__).resolve().parents[1]
TINY = ["model.path=tiny-llama", "model.dtype=float32", "data.val_path=null", "rollout.engine=hf", "data.prompts_per_step=4", "rollout.n=2",
        "rollout.max_tokens=24", "sft.enabled=false", "rollout.num_workers=0"]
pytestmark = pytest.mark.slow


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(node: int, port: int, args: list[str], log: Path, script: str = "launch/train.py") -> subprocess.Popen:
    cores = sorted(os.sched_getaffinity(0))
    core = cores[node % len(cores)]
    cmd = ["taskset", "-c", str(core), sys.executable, "-m", "torch.distributed.run", "--nnodes", "2",
           "--nproc-per-node", "1", "--node-rank", str(node), "--master-addr", "127.0.0.1", "--master-port",
           str(port), script, *args]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT,
                            start_new_session=True)


def _run_two_nodes(args: list[str], tmp: Path, tag: str, timeout: float = 600, script: str = "launch/train.py") -> None:
    port = _free_port()
    procs = [_launch(n, port, args, tmp / f"{tag}-node{n}.log", script) for n in (0, 1)]
    try:
        for p in procs:
            p.wait(timeout)
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
    for n, p in enumerate(procs):
        assert p.returncode == 0, f"node {n} exited {p.returncode}:\n{(tmp / f'{tag}-node{n}.log').read_text()[-5000:]}"


def _metrics(out: Path) -> list[dict]:
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()]


def _engines(row: dict) -> dict[str, dict[str, float]]:
    found: dict[str, dict[str, float]] = {}
    for k, v in row.items():
        if k.startswith("engine/"):
            _, eid, name = k.split("/")
            found.setdefault(eid, {})[name] = v
    return found


def _wait_for(predicate, procs, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        dead = [p.returncode for p in procs if p.poll() is not None]
        assert not dead, f"a launcher exited ({dead}) before {what}"
        assert time.monotonic() < deadline, f"{what} did not happen in {timeout} s"
        time.sleep(0.05)


@pytest.mark.cold  # reads the process tree
def test_two_nodes_serve_every_step_and_resume_after_kill_9(tmp_path: Path):
    out = tmp_path / "run"
    # the SFT warm-up moves the actors away from the engines' base weights (~5e-4 in logprobs), so a
    # push that did not arrive shows in the drift, before and after the resume (fresh engines)
    warm = ["sft.enabled=true", "sft.steps=4", "sft.lr=1e-3", "sft.batch_size=4"]
    args = [*TINY, *warm, "trainer.steps=6", f"trainer.output_dir={out}"]
    port = _free_port()
    procs = [_launch(n, port, args, tmp_path / f"first-node{n}.log") for n in (0, 1)]
    try:
        _wait_for(lambda: (out / "checkpoints" / "step_000002" / "state.pt").exists(), procs, 420, "step 2's checkpoint")
        engines = json.loads((out / "engines.json").read_text())
        ranks = [c for p in procs for c in psutil.Process(p.pid).children(recursive=True)]
        for p in procs:
            p.kill()  # kill -9 of both launchers; their ranks run in sessions of their own
        for p in procs:
            p.wait(30)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    # the ranks notice their launcher is gone and exit; every node's engines follow their rank
    _, alive = psutil.wait_procs([*ranks, *(psutil.Process(e["pid"]) for e in engines if psutil.pid_exists(e["pid"]))],
                                 timeout=30)
    assert not alive, [p.cmdline()[:4] for p in alive]
    assert len(_metrics(out)) < 6  # killed mid-run
    placement = (out / "placement.txt").read_text()
    assert "node0-engine0: node 0" in placement and "node1-engine0: node 1" in placement, placement
    assert [e["node"] for e in engines] == [0, 1] and engines[1]["tcp"].startswith("tcp://127.0.0.1:")
    assert "bus_keys" not in " ".join(p.name for p in out.rglob("*"))  # keys never land in the run dir

    _run_two_nodes(args, tmp_path, "second")
    log0 = (tmp_path / "second-node0.log").read_text()
    assert "resuming from" in log0, log0[-3000:]
    rows = _metrics(out)
    steps = [r["step"] for r in rows]
    assert steps == [1, 2, 3, 4, 5, 6], steps  # none repeated or missing
    for r in rows:
        eng = _engines(r)
        assert sorted(eng) == ["node0-engine0", "node1-engine0"], r
        assert {e["node"] for e in eng.values()} == {0.0, 1.0}
        for eid, e in eng.items():  # both nodes' engines served trajectories in every step
            assert e["alive"] == 1.0 and e["requests"] > 0 and e["tokens"] > 0, (r["step"], eid, e)
        # every engine rolled out on the weights of the previous sync
        assert {e["weight_version"] for e in eng.values()} == {r["weight_version"] - 1}, r
        assert r["rollout/trajectories"] == 8
        # weights: node 0's engine through shared memory, node 1's by broadcast to its leader; both
        # engines' logprobs equal the actors' (fp32 on both sides, see test_train's drift test)
        assert r["sync/engines_shm"] == 1 and r["sync/engines_collective"] == 1 and r["drift/max"] < 1e-4, r
        # each rank received only its own rows: rank 0 kept its 2 groups and sent rank 1 the other 2
        assert r["handoff/replicas"] == 2 and r["handoff/rows_local"] == 4 and r["handoff/rows_sent"] == 4, r


def test_killing_node_1_engine_mid_rollout_loses_no_trajectory(tmp_path: Path):
    out = tmp_path / "run"
    # engines run one request at a time, so node 1's first answer leaves the rest of its share in flight
    # (queued at its engine) however long a loaded box takes to see that answer and kill it
    args = [*TINY, "trainer.steps=4", "rollout.request_log=true", "rollout.max_tokens=48",
            "rollout.engine_options.max_batch_size=1", f"trainer.output_dir={out}"]
    port = _free_port()
    procs = [_launch(n, port, args, tmp_path / f"node{n}.log") for n in (0, 1)]
    log1 = out / "engines" / "node1-engine0.jsonl"

    def step_2_rollout_started() -> bool:  # node 1's engine answered a request on step 1's weights
        return log1.exists() and any(json.loads(x)["weight_version"] >= 1 for x in log1.read_text().splitlines()
                                     if x.endswith("}"))

    try:
        _wait_for(step_2_rollout_started, procs, 420, "step 2's rollout on node 1")
        victim = next(e for e in json.loads((out / "engines.json").read_text()) if e["node"] == 1)
        os.kill(victim["pid"], signal.SIGKILL)
        for n, p in enumerate(procs):
            assert p.wait(420) == 0, (tmp_path / f"node{n}.log").read_text()[-5000:]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert "re-issuing" in (tmp_path / "node0.log").read_text()  # the kill hit requests in flight
    rows = _metrics(out)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    for r in rows:  # every trajectory of every step finished, the interrupted ones on node 0's engine
        assert r["rollout/trajectories"] == 8 and r["rollout/invalid"] == 0, r
    eng = [_engines(r) for r in rows]
    assert eng[0]["node1-engine0"]["requests"] > 0
    for e in eng[2:]:  # after the kill node 0's engine serves alone and the run goes on syncing it
        assert e["node1-engine0"]["alive"] == 0.0 and e["node0-engine0"]["requests"] > 0
    assert [e["node0-engine0"]["weight_version"] for e in eng] == [r["weight_version"] - 1 for r in rows]


def test_two_nodes_train_asynchronously_within_the_staleness_bound(tmp_path: Path):
    """rollout.staleness=1 across two nodes: rank 0's rollout keeps both nodes' engines busy through
    the updates, each node trains its shard of every batch, no token is older than version - 1."""
    out = tmp_path / "run"
    _run_two_nodes([*TINY, "rollout.max_tokens=48", "rollout.staleness=1", "trainer.steps=4",
                    f"trainer.output_dir={out}"], tmp_path, "async")
    rows = _metrics(out)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    trained = [row for r in rows for row in r["data/rows"]]
    assert len(trained) == len(set(trained)) == 16
    for r in rows:
        produced = [int(v) for v in r["async/token_versions"]]
        assert min(produced) >= r["weight_version"] - 2, r  # trained on version - 1, tokens at most 1 older
        assert r["handoff/rows_sent"] > 0 and r["rollout/trajectories"] == 8  # node 1 got its shard
        assert r["sync/engines_collective"] == 1, r  # pushed by broadcast while rank 0 rolls out
    for e in ("node0-engine0", "node1-engine0"):  # both nodes' engines generated for the run
        assert sum(_engines(r)[e]["requests"] for r in rows) > 0, e
