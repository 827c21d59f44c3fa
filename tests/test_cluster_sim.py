"""The cluster simulator's CI form: sim engines behind real servers, the real workers, feeder and
weight pushes, both routing policies; its report must hold sane values."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_cluster_sim_quick_run_reports_sane_values(tmp_path):
    out = tmp_path / "cluster_sim.json"
    proc = subprocess.run([sys.executable, "benchmarks/cluster_sim.py", "--quick", "--out", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1].startswith("RESULT sticky_group_tokens_per_sim_s=")
    report = json.loads(out.read_text())
    by = {r["policy"]: r for r in report["results"]}
    assert set(by) == {"sticky_group", "round_robin"}
    for r in by.values():
        assert len(r["steps"]) == 3 and all(s["trajectories"] == 4 * 4 for s in r["steps"])
        assert all(s["staleness_mean"] <= 1 for s in r["steps"])  # the feeder's bound (--staleness 1)
        m = r["mean"]
        assert m["tokens_per_sim_s"] > 0 and m["requests"] > 0
        assert 0.0 <= m["gpu_idle"] < 1.0 and 0.0 < m["cp_share"] and m["cp_ms_per_req"] > 0
        assert 0.0 < m["hit_rate"] < 1.0
    # the n samples of a group and every later turn of a trajectory find their prefix on one engine
    assert by["sticky_group"]["mean"]["hit_rate"] > by["round_robin"]["mean"]["hit_rate"] + 0.05
