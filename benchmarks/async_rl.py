"""Asynchronous RL against the synchronous loop: RL steps per hour and reward against wall-clock
time, `rollout.staleness` 0 (rollout -> update -> sync in turn), 1 and 2, side by side.

Workload (`benchmarks/async_workload.py`): every trajectory makes 3 generations with a tool call
between them whose latency is log-normal (median 1 s, p99 10 s), so a synchronous step waits for
the slowest trajectory of its batch while the engine idles, and the engine idles again through
the update. On a box with two or more cores the engine runs on the last core and the trainer (and
its agent loops) on the others (`rollout.engine_cores`). Each mode is a fresh `launch/train.py`
run of the same config; the first step (engine and model start-up) is left out of the rates.

The ideal gain for this box is (rollout + update + sync) / max(rollout, update + sync) of the
synchronous run: what perfect overlap of its two halves would give. Asynchronous rollout can do
better than that ideal where the synchronous step waits on stragglers: the trainer takes the
first finished groups and the stragglers are trained later (or generated again if too stale).

    python benchmarks/async_rl.py --quick    # tiny-llama, hf engine
    python benchmarks/async_rl.py            # SmolLM2-135M-Instruct, hf engine
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ROOT, child_env, machine, result_line, write_result  # noqa: E402

MODES = (0, 1, 2)


def config(model: str, staleness: int, steps: int, out: Path, prompts: int, max_tokens: int, median_s: float = 1.0,
           p99_s: float = 10.0) -> dict[str, Any]:
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    return {
        "model": {"path": model},
        "data": {"task": "arithmetic", "agent_name": "rounds", "prompts_per_step": prompts},
        "rollout": {"engine": "hf", "n": 4, "max_tokens": max_tokens, "staleness": staleness,
                    "engine_cores": cores[-1:] if len(cores) >= 2 else [],
                    "agent_loops": {"rounds": "async_workload.RoundsLoop"},
                    "agent": {"rounds": {"rounds": 3, "median_s": median_s, "p99_s": p99_s}}},
        "actor": {"lr": 1e-4, "micro_batch_size": 8},
        "sft": {"enabled": False},
        "trainer": {"steps": steps, "output_dir": str(out), "export_hf": False},
    }


def run_mode(model: str, staleness: int, steps: int, prompts: int, max_tokens: int, tmp: Path,
             median_s: float, p99_s: float) -> dict[str, Any]:
    out = tmp / f"k{staleness}"
    cfg_path = tmp / f"k{staleness}.yaml"
    cfg_path.write_text(yaml.safe_dump(config(model, staleness, steps, out, prompts, max_tokens, median_s, p99_s)))
    env = child_env(ROOT / "benchmarks")
    proc = subprocess.run([sys.executable, "launch/train.py", str(cfg_path)], cwd=ROOT, env=env,
                          capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"staleness {staleness} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    t = [r["time"] for r in rows]
    rest = rows[1:]  # the first step includes start-up
    span = t[-1] - t[0]
    mean = lambda key: sum(float(r.get(key) or 0.0) for r in rest) / len(rest)  # noqa: E731
    return {"staleness": staleness, "steps": len(rows), "wall_s_after_first": span,
            "steps_per_hour": 3600 * len(rest) / span, "rollout_s": mean("time/rollout_s"),
            "update_s": mean("time/update_s"), "sync_s": mean("time/sync_s"),
            "engine_busy_in_update": mean("time/engine_busy_in_update"),
            "staleness_mean": mean("async/staleness_mean"), "dropped_stale_groups": sum(
                float(r.get("async/dropped_stale_groups") or 0) for r in rows),
            "reward_first": [r["rollout/reward_mean"] for r in rows[:3]],
            "reward_last": [r["rollout/reward_mean"] for r in rows[-3:]],
            "reward_curve": [(round(r["time"] - t[0], 2), r["rollout/reward_mean"]) for r in rows]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--median-s", type=float, default=1.0, help="tool latency median")
    ap.add_argument("--p99-s", type=float, default=10.0, help="tool latency 99th percentile")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    model = "tiny-llama" if args.quick else "smollm2-135m-instruct"
    steps = args.steps or (10 if args.quick else 12)
    prompts, max_tokens = (4, 32) if args.quick else (4, 48)
    report: dict[str, Any] = {"machine": machine(), "model": model, "steps": steps, "prompts_per_step": prompts,
                              "n": 4, "max_tokens": max_tokens, "rounds": 3, "tool_median_s": args.median_s, "tool_p99_s": args.p99_s,
                              "runs": []}
    with tempfile.TemporaryDirectory(prefix="async-rl-") as tmp:
        for k in MODES:
            r = run_mode(model, k, steps, prompts, max_tokens, Path(tmp), args.median_s, args.p99_s)
            report["runs"].append(r)
            print(f"staleness {k}: {r['steps_per_hour']:.0f} steps/h, rollout wait {r['rollout_s']:.2f} s, update "
                  f"{r['update_s']:.2f} s, engine busy in update {r['engine_busy_in_update']:.2f}, reward "
                  f"{r['reward_first']} -> {r['reward_last']}", flush=True)
    sync = report["runs"][0]
    report["ideal_ratio"] = (sync["rollout_s"] + sync["update_s"] + sync["sync_s"]) / max(
        sync["rollout_s"], sync["update_s"] + sync["sync_s"])
    for r in report["runs"]:
        r["ratio_vs_sync"] = r["steps_per_hour"] / sync["steps_per_hour"]
    write_result("async_rl", report, args.out)
    print(result_line({"k1_vs_sync": report["runs"][1]["ratio_vs_sync"],
                       "k2_vs_sync": report["runs"][2]["ratio_vs_sync"], "ideal": report["ideal_ratio"]}))


if __name__ == "__main__":
    main()
