"""Rollout throughput with 1 vs 2 simulated nodes: real torchrun launchers on loopback, each node
pinned to its own core(s) with its own engine, running `launch/train.py` as a user would.

    python benchmarks/nodes.py --quick      # tiny-llama, hf engines (~2 min on 2 cores)
    python benchmarks/nodes.py              # SmolLM2-135M-Instruct, hf engines

Tokens/s of a step = tokens every engine generated in that step's rollout / the rollout's wall
time (agent loops, routing, engines; the handoff to the ranks included), averaged over the steps
after the first. The ideal for 2 nodes is 2x the single node.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ROOT, machine, result_line, write_result  # noqa: E402


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_nodes(nodes: int, cores: list[list[int]], args: list[str], out: Path, timeout: float) -> list[dict[str, Any]]:
    port, procs = _port(), []
    for n in range(nodes):
        cmd = ["taskset", "-c", ",".join(map(str, cores[n])), sys.executable, "-m", "torch.distributed.run",
               "--nnodes", str(nodes), "--nproc-per-node", "1", "--node-rank", str(n), "--master-addr", "127.0.0.1",
               "--master-port", str(port), "launch/train.py", *args, f"trainer.output_dir={out}"]
        log = (out.parent / f"{out.name}-node{n}.log").open("w")
        procs.append(subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                      env={**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}))
    deadline = time.monotonic() + timeout
    for n, p in enumerate(procs):
        if p.wait(max(1.0, deadline - time.monotonic())) != 0:
            raise SystemExit(f"node {n} of the {nodes}-node run failed; see {out.parent / f'{out.name}-node{n}.log'}")
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()]


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    steps = rows[1:] or rows  # the first step warms caches and allocators
    rates, busy, share = [], [], {}
    for r in steps:
        tokens = {k.split("/")[1]: v for k, v in r.items() if k.startswith("engine/") and k.endswith("/tokens")}
        rates.append(sum(tokens.values()) / r["time/rollout_s"])
        busy += [v for k, v in r.items() if k.startswith("engine/") and k.endswith("/busy")]
        for eid, t in tokens.items():
            share[eid] = share.get(eid, 0.0) + t
    total = sum(share.values()) or 1.0
    return {"tokens_per_s": sum(rates) / len(rates), "rollout_s": sum(r["time/rollout_s"] for r in steps) / len(steps),
            "engine_busy_mean": sum(busy) / max(1, len(busy)),
            "token_share": {k: v / total for k, v in sorted(share.items())},
            "handoff_s": sum(r.get("handoff/seconds", 0.0) for r in steps) / len(steps), "steps": len(steps)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=8, help="prompts per step (x n=4 samples)")
    ap.add_argument("--out", default=None, help="JSON path (default benchmarks/results/nodes.json)")
    args = ap.parse_args()
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        raise SystemExit("this benchmark gives each simulated node its own core; it needs at least 2")
    half = len(cores) // 2
    slices = [cores[:half], cores[half:2 * half]]
    model = "tiny-llama" if args.quick else "smollm2-135m-instruct"
    common = [f"model.path={model}", "data.val_path=null", "rollout.engine=hf", "rollout.n=4", "rollout.max_tokens=64", "sft.enabled=false",
              f"trainer.steps={args.steps}", "trainer.export_hf=false", "actor.trainable=[model.norm.]",
              "trainer.save_every=1000"]
    report: dict[str, Any] = {"machine": machine(), "model": model, "params": {
        "prompts_per_step": args.prompts, "n": 4, "max_tokens": 64, "steps": args.steps, "cores_per_node": half}}
    # the same step on 1 and 2 nodes; then 2 nodes with twice the prompts, so each engine batches
    # as many sequences as the single engine did (what splitting a fixed batch costs per engine)
    runs = {"nodes1": (1, args.prompts), "nodes2": (2, args.prompts), "nodes2_same_engine_batch": (2, 2 * args.prompts)}
    with tempfile.TemporaryDirectory(prefix="nodes-bench-") as tmp:
        for name, (nodes, prompts) in runs.items():
            t0 = time.perf_counter()
            rows = run_nodes(nodes, slices, [*common, f"data.prompts_per_step={prompts}"], Path(tmp) / name, 1800)
            report[name] = {**summarize(rows), "nodes": nodes, "prompts_per_step": prompts,
                            "wall_s": time.perf_counter() - t0}
            print(f"{name}: {report[name]}", flush=True)
    one = report["nodes1"]["tokens_per_s"]
    report["speedup"] = report["nodes2"]["tokens_per_s"] / one
    report["speedup_same_engine_batch"] = report["nodes2_same_engine_batch"]["tokens_per_s"] / one
    write_result("nodes", report, args.out)
    print(result_line({"speedup": report["speedup"], "speedup_same_engine_batch": report["speedup_same_engine_batch"],
                       "ideal": 2.0, "tok_s_1node": one, "tok_s_2nodes": report["nodes2"]["tokens_per_s"]}))


if __name__ == "__main__":
    main()
