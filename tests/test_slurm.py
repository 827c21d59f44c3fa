"""launch/slurm/train.sbatch on a real Slurm: `launch/slurm/local_cluster.sh up` brings up two
Slurm nodes on this machine (munged, slurmctld, `slurmd -N n1`, `slurmd -N n2`), the test submits
`sbatch -N 2` and waits for a 2-step run in which both nodes' engines serve. Skipped where the
daemons cannot start (not root, no apt, no Slurm packages)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
CLUSTER = REPO / "launch" / "slurm" / "local_cluster.sh"
SBATCH = REPO / "launch" / "slurm" / "train.sbatch"
NODES = 2
TINY = ["model.path=tiny-llama", "data.val_path=null", "rollout.engine=hf", "rollout.num_engines=1", "rollout.num_workers=0",
        "data.task=arithmetic", "data.prompts_per_step=4", "rollout.n=2", "rollout.max_tokens=24",
        "sft.enabled=false", "trainer.steps=2"]
DONE = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED", "BOOT_FAIL",
        "DEADLINE")

pytestmark = pytest.mark.slow


def _cluster(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(CLUSTER), *args], check=False, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def slurm_env() -> dict[str, str]:
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        pytest.skip("needs root: local_cluster.sh starts munged/slurmctld/slurmd and edits /etc/hosts")
    if not all(shutil.which(b) for b in ("slurmctld", "slurmd", "munged")) and not shutil.which("apt-get"):
        pytest.skip("Slurm (slurm-wlm) and MUNGE are not installed and there is no apt-get to install them")
    t0 = time.monotonic()
    up = _cluster("up", "--nodes", str(NODES))
    try:
        if up.returncode != 0:
            errors = [line for line in up.stderr.splitlines() if "error:" in line]
            pytest.skip(f"the local Slurm cluster did not start: {errors[-1] if errors else up.stderr[-500:]}")
        conf = re.search(r"SLURM_CONF=(\S+)", up.stderr)
        assert conf, up.stderr
        print(f"local cluster up in {time.monotonic() - t0:.1f} s")
        env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SBATCH_", "SRUN_"))}
        yield {**env, "SLURM_CONF": conf.group(1), "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1",
               "PROCS_PER_NODE": "1"}
    finally:
        down = _cluster("down")
        assert down.returncode == 0, down.stderr[-2000:]


def _job_state(job: str, env: dict[str, str]) -> dict[str, str]:
    out = subprocess.run(["scontrol", "show", "job", "-o", job], check=False, capture_output=True, text=True, env=env).stdout
    return dict(f.split("=", 1) for f in out.split() if "=" in f)


def _wait(job: str, env: dict[str, str], timeout: float) -> dict[str, str]:
    deadline = time.monotonic() + timeout
    while True:
        state = _job_state(job, env)
        if state.get("JobState") in DONE:
            return state
        if time.monotonic() > deadline:
            subprocess.run(["scancel", job], check=False, env=env)
            return {**state, "JobState": f"still {state.get('JobState')} after {timeout:.0f} s (cancelled)"}
        time.sleep(2)


def test_sbatch_two_nodes_runs_and_both_nodes_engines_serve(slurm_env: dict[str, str], tmp_path: Path):
    out = tmp_path / "run"
    log = tmp_path / "job-%j.out"
    cmd = ["sbatch", "--parsable", "-N", str(NODES), f"--output={log}", str(SBATCH), *TINY, f"trainer.output_dir={out}"]
    sub = subprocess.run(cmd, check=False, cwd=REPO, env=slurm_env, capture_output=True, text=True, timeout=60)
    assert sub.returncode == 0, sub.stderr
    job = sub.stdout.strip().split(";")[0]
    t0 = time.monotonic()
    state = _wait(job, slurm_env, timeout=600)
    log = tmp_path / f"job-{job}.out"
    # two nodes write one file: a multibyte character (a progress bar's) may arrive cut by the other's line
    output = log.read_text(errors="replace") if log.exists() else f"(no job output file {log})"
    print(f"job {job}: {state.get('JobState')} exit {state.get('ExitCode')} after {time.monotonic() - t0:.0f} s")
    tail = output[-8000:]
    print(f"--- job output {log}\n{tail}")  # shown when the test fails

    assert state.get("JobState") == "COMPLETED" and state.get("ExitCode") == "0:0", \
        f"job {job}: {state.get('JobState')} exit {state.get('ExitCode')}\n{tail}"
    assert f"{NODES} node(s) x 1 process(es)" in output, tail
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    assert [m["step"] for m in rows] == [1, 2], tail

    for m in rows:  # every step: each engine served, and the engines sit on both nodes
        engines = [k[len("engine/"):-len("/requests")] for k in m if k.startswith("engine/") and k.endswith("/requests")]
        assert engines, f"step {m['step']}: no engine/<id>/requests metrics in {sorted(m)}\n{tail}"
        idle = [e for e in engines if not m[f"engine/{e}/requests"] > 0]
        assert not idle, f"step {m['step']}: engines {idle} served no requests: {m}"
        missing = [e for e in engines if f"engine/{e}/node" not in m]
        assert not missing, f"step {m['step']}: engines {missing} have no engine/<id>/node: {m}"
        nodes = {int(m[f"engine/{e}/node"]) for e in engines}
        assert nodes == set(range(NODES)), f"step {m['step']}: engines on nodes {nodes}, want both: {m}"
