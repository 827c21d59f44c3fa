"""Benchmarks keep running: a tiny run must finish, print its RESULT line and write its JSON."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_bus_vs_ray_small_run(tmp_path):
    pytest.importorskip("ray")
    out = tmp_path / "bus_vs_ray.json"
    proc = subprocess.run([sys.executable, "benchmarks/bus_vs_ray.py", "--requests", "40", "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    last = proc.stdout.strip().splitlines()[-1]
    assert last.startswith("RESULT p50_ratio_c1=")
    report = json.loads(out.read_text())
    assert set(report["bus"]) == set(report["ray"]) == {"1", "16", "256"}
    assert all(v > 0 for v in report["ratios"].values())
