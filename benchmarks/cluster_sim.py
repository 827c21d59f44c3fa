"""A cluster on one box: N simulated nodes x G `sim` engines (engines/inference/sim.py, a 7B on an
H100 each) behind real EngineServer sockets, driven by the real control plane: the agent workers
running the tool agent on GSM8K rows, the feeder with its staleness bound, the routers, and weight
pushes through the real bus route. Only the model's arithmetic is replaced: the engines' timing
model, the tools' latency (log-normal, median 1 s, p99 30 s) and the trainer's update (`--update-s`
simulated seconds). Every simulated second runs in 1/`--time-scale` real seconds.

Per step it reports:
- tokens/sim_s: generated tokens per simulated second, all engines together;
- gpu_idle: the share of the engines' simulated time they did not compute;
- cp_share: the control plane's CPU seconds (the trainer process with the feeder, and the agent
  workers) over the step's simulated seconds: on a real cluster, where those seconds are real, the
  share of one core the control plane would take; engine_host_share the same for the processes
  hosting the engines (their servers, plus the simulator's own bookkeeping: an upper bound);
- hit_rate: prompt tokens served from the engines' prefix caches / prompt tokens;
- cp_ms_per_req, host_ms_per_req: those CPU times per generate request.
The simulated clock is the wall clock times the scale: when the box cannot keep up (cp_share x
time_scale near the cores it has), the control plane's lag shows as GPU idle time, so keep
`cpu_busy` (the box's CPU use during the run) well under its core count.

    python benchmarks/cluster_sim.py --quick      # 2 x 2 engines, sticky_group against round_robin, < 1 min
    python benchmarks/cluster_sim.py --nodes 8 --gpus 8 --steps 4 --policies sticky_group,round_robin
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ROOT, child_env, gsm8k_file, gsm8k_tool_rows, machine, result_line, write_result  # noqa: E402

from rollout.bus.router import POLICIES  # noqa: E402

TOOL_SCHEMA = {"type": "function", "function": {
    "name": "calculator", "description": "Evaluate an arithmetic expression.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}
TOOL_CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "6 * 7"}}\n</tool_call>'
ANSWER = "So the answer is 42.\n#### 42"


class Rows:
    """The feeder's stream: GSM8K rows in a cycle, a batch at a time."""

    def __init__(self, rows: list[dict[str, Any]]) -> None:
        self.rows, self.i = rows, 0

    def next_batch(self, k: int) -> list[dict[str, Any]]:
        out = [self.rows[(self.i + j) % len(self.rows)] for j in range(k)]
        self.i += k
        return out

    def state_dict(self) -> dict[str, Any]:
        return {"i": self.i}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.i = int(state["i"])


def engine_options(tok: Any, args: argparse.Namespace) -> dict[str, Any]:
    eos = [tok.eos_token_id] if tok.eos_token_id is not None else []
    return {"model": "7b-h100", "time_scale": args.time_scale, "reply_median": args.reply_median,
            "reply_p99": args.reply_p99, "filler_id": tok.encode(" so", add_special_tokens=False)[-1],
            "suffixes": [tok.encode(TOOL_CALL, add_special_tokens=False) + eos,
                         tok.encode(ANSWER, add_special_tokens=False) + eos],
            "suffix_weights": [args.tool_share, 1.0 - args.tool_share]}


def start_hosts(addresses: list[str], hosts: int, options: dict[str, Any]) -> list[subprocess.Popen]:
    per = -(-len(addresses) // hosts)
    procs = []
    for h in range(0, len(addresses), per):
        procs.append(subprocess.Popen(
            [sys.executable, str(ROOT / "benchmarks/sim_nodes.py"), "--addresses", ",".join(addresses[h:h + per]),
             "--options", json.dumps(options), "--first-index", str(h)], env=child_env(ROOT / "benchmarks")))
    return procs


def cpu_s(pids: list[int]) -> float:
    total = 0.0
    for pid in pids:
        try:
            t = psutil.Process(pid).cpu_times()
            total += t.user + t.system
        except psutil.NoSuchProcess:
            pass
    return total


def engine_totals(control: Any, count: int) -> dict[str, float]:
    import asyncio

    async def all_stats() -> list[dict[str, Any]]:
        return [s.stats for s in await asyncio.gather(*(control.client.status(i) for i in range(count)))]

    stats = control.run(all_stats())
    keys = ("generated_tokens", "prompt_tokens", "cached_prompt_tokens", "busy_sim_s", "requests")
    return {k: float(sum(s[k] for s in stats)) for k in keys}


def run_policy(args: argparse.Namespace, policy: str, rows: list[dict[str, Any]], tok_path: str,
               options: dict[str, Any], tmp: Path) -> dict[str, Any]:
    import torch

    from rollout.bus.control import ControlClient
    from rollout.config import ManagerConfig
    from rollout.feeder import RolloutFeeder
    from rollout.manager import AgentLoopManager
    from rollout.weights.bus import push_weights

    engines = args.nodes * args.gpus
    addresses = [f"ipc://{tmp}/{policy}-n{i // args.gpus}g{i % args.gpus}.sock" for i in range(engines)]
    tools = tmp / "tools.yaml"
    tools.write_text(yaml.safe_dump({"tools": [{"class_name": "sim_nodes.LatencyTool", "tool_schema": TOOL_SCHEMA,
                                                "config": {"median_s": args.tool_median, "p99_s": args.tool_p99,
                                                           "time_scale": args.time_scale, "timeout_s": 1e6}}]}))
    t0 = time.monotonic()
    hosts = start_hosts(addresses, args.hosts, options)
    control = manager = feeder = None
    try:
        control = ControlClient(addresses, None, 120)
        t_engines = time.monotonic() - t0
        cfg = ManagerConfig(addresses=addresses, tokenizer=tok_path, num_workers=args.workers, n=args.n,
                            sampling={"temperature": 1.0, "max_tokens": args.max_tokens}, tools_config=str(tools),
                            agent_configs={"tool_agent": {"max_assistant_turns": args.turns,
                                                          "max_turn_tokens": args.max_tokens,
                                                          "max_response_tokens": args.turns * (args.max_tokens + 64),
                                                          "tool_timeout_s": 1e6}},
                            policy=policy, progress=False, max_concurrent=100_000)
        manager = AgentLoopManager(cfg).start()
        feeder = RolloutFeeder(manager, Rows(rows), args.prompts, args.n, args.staleness)
        pids = [os.getpid(), *manager.worker_pids]
        host_pids = [p.pid for p in hosts]
        blob = torch.zeros(int(args.push_mb * (1 << 20)), dtype=torch.uint8)
        print(f"[{policy}] {engines} engines up in {t_engines:.1f} s, {args.workers} agent workers in "
              f"{time.monotonic() - t0 - t_engines:.1f} s", flush=True)
        feeder.start()
        steps, version = [], 0
        before, t_prev = engine_totals(control, engines), time.monotonic()
        cp_prev, host_prev, box_prev = cpu_s(pids), cpu_s(host_pids), psutil.cpu_times()
        for step in range(args.steps):
            taken = feeder.take(version, timeout_s=600)
            time.sleep(args.update_s / args.time_scale)  # the trainer's update, by its time model
            version += 1
            t_push = time.monotonic()
            control.run(push_weights(control.client, [("blob", blob)], version, preempt=args.staleness > 0))
            push_s = time.monotonic() - t_push
            feeder.trained(version)
            now, after = time.monotonic(), engine_totals(control, engines)
            cp, host, box = cpu_s(pids), cpu_s(host_pids), psutil.cpu_times()
            sim_s = (now - t_prev) * args.time_scale
            d = {k: after[k] - before[k] for k in after}
            busy_box = sum(getattr(box, f) - getattr(box_prev, f) for f in ("user", "system", "nice"))
            steps.append({"step": step, "sim_s": sim_s, "wall_s": now - t_prev, "trajectories": len(taken.outputs),
                          "tokens_per_sim_s": d["generated_tokens"] / sim_s,
                          "gpu_idle": 1.0 - d["busy_sim_s"] / (engines * sim_s),
                          "hit_rate": d["cached_prompt_tokens"] / max(1.0, d["prompt_tokens"]),
                          "requests": d["requests"], "cp_share": (cp - cp_prev) / sim_s,
                          "engine_host_share": (host - host_prev) / sim_s,
                          "cp_ms_per_req": 1e3 * (cp - cp_prev) / max(1.0, d["requests"]),
                          "host_ms_per_req": 1e3 * (host - host_prev) / max(1.0, d["requests"]),
                          "push_sim_s": push_s * args.time_scale, "cpu_busy": busy_box / (now - t_prev),
                          "staleness_mean": taken.metrics["async/staleness_mean"]})
            print(f"[{policy}] step {step}: " + " ".join(
                f"{k}={v:.3g}" for k, v in steps[-1].items() if k != "step"), flush=True)
            before, t_prev, cp_prev, host_prev, box_prev = after, now, cp, host, box
    finally:
        if feeder is not None:
            feeder.close()
        if manager is not None:
            manager.close()
        if control is not None:
            control.close()
        for p in hosts:
            p.terminate()
        for p in hosts:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
    measured = steps[1:] or steps  # the first step includes start-up (the pipeline filling)
    mean = {k: sum(s[k] for s in measured) / len(measured) for k in measured[0] if k != "step"}
    # rates over the measured steps together, not means of per-step rates (steps differ in length)
    sim, reqs = sum(s["sim_s"] for s in measured), max(1.0, sum(s["requests"] for s in measured))
    mean["tokens_per_sim_s"] = sum(s["tokens_per_sim_s"] * s["sim_s"] for s in measured) / sim
    mean["gpu_idle"] = sum(s["gpu_idle"] * s["sim_s"] for s in measured) / sim
    mean["cp_share"] = sum(s["cp_share"] * s["sim_s"] for s in measured) / sim
    mean["engine_host_share"] = sum(s["engine_host_share"] * s["sim_s"] for s in measured) / sim
    mean["cp_ms_per_req"] = sum(s["cp_ms_per_req"] * max(1.0, s["requests"]) for s in measured) / reqs
    mean["host_ms_per_req"] = sum(s["host_ms_per_req"] * max(1.0, s["requests"]) for s in measured) / reqs
    mean["requests_per_sim_s"] = reqs / sim
    failed = [h.returncode for h in hosts if h.returncode not in (0, -15)]
    if failed:
        raise RuntimeError(f"an engine host exited with {failed}; see its output above")
    return {"policy": policy, "engines": engines, "steps": steps, "mean": mean}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="the CI form: 2 x 2 engines, 3 short steps per policy")
    ap.add_argument("--nodes", type=int, default=8)
    ap.add_argument("--gpus", type=int, default=8, help="engines per node")
    ap.add_argument("--hosts", type=int, default=2, help="processes hosting the engines")
    ap.add_argument("--workers", type=int, default=2, help="agent worker processes")
    ap.add_argument("--prompts", type=int, default=None, help="GRPO groups per step (default: 2 per engine)")
    ap.add_argument("--n", type=int, default=8, help="samples per prompt")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--staleness", type=int, default=1, help="0: synchronous; 1, 2: asynchronous")
    ap.add_argument("--policies", default="sticky_group,round_robin")
    ap.add_argument("--time-scale", type=float, default=20.0, help="simulated seconds per real second")
    ap.add_argument("--update-s", type=float, default=20.0, help="the trainer's update, simulated seconds")
    ap.add_argument("--push-mb", type=float, default=4.0, help="bytes each weight push carries (MiB, scaled down)")
    ap.add_argument("--turns", type=int, default=4, help="most assistant turns of a trajectory")
    ap.add_argument("--max-tokens", type=int, default=512, help="most tokens of one reply")
    ap.add_argument("--reply-median", type=float, default=150.0)
    ap.add_argument("--reply-p99", type=float, default=600.0)
    ap.add_argument("--tool-share", type=float, default=0.7, help="share of replies that call the tool")
    ap.add_argument("--tool-median", type=float, default=1.0, help="tool latency median, simulated s")
    ap.add_argument("--tool-p99", type=float, default=30.0, help="tool latency p99, simulated s")
    ap.add_argument("--gsm8k-dir", default=None)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.quick:
        args.nodes, args.gpus, args.hosts, args.workers, args.steps = 2, 2, 1, 1, 3
        args.n, args.prompts, args.update_s, args.turns, args.max_tokens = 4, 4, 5.0, 3, 128
        args.reply_median, args.reply_p99, args.time_scale = 40.0, 120.0, 20.0
    policies = [p for p in args.policies.split(",") if p]
    if set(policies) - set(POLICIES):
        raise SystemExit(f"unknown policies {sorted(set(policies) - set(POLICIES))}; choose from {list(POLICIES)}")
    engines = args.nodes * args.gpus
    args.prompts = args.prompts or 2 * engines
    from engines.models import load_tokenizer, resolve_model

    tok_path = str(resolve_model("tiny-llama"))
    tok = load_tokenizer(tok_path)
    rows = gsm8k_tool_rows(gsm8k_file(args.gsm8k_dir), min(1000, max(64, args.prompts * (args.steps + 3))))
    options = engine_options(tok, args)
    results = []
    with tempfile.TemporaryDirectory(prefix="sy-csim-") as tmp:
        for policy in policies:
            results.append(run_policy(args, policy, rows, tok_path, options, Path(tmp)))
    print(f"\n{'policy':>13} | engines | tokens/sim_s | gpu_idle | hit_rate | cp_share | cp_ms/req | host_ms/req "
          "| cpu_busy")
    for r in results:
        m = r["mean"]
        print(f"{r['policy']:>13} | {r['engines']:>7} | {m['tokens_per_sim_s']:>12.0f} | {m['gpu_idle']:>8.3f} | "
              f"{m['hit_rate']:>8.3f} | {m['cp_share']:>8.4f} | {m['cp_ms_per_req']:>9.3f} | "
              f"{m['host_ms_per_req']:>11.3f} | {m['cpu_busy']:>8.2f}")
    summary = {f"{r['policy']}_{k}": r["mean"][k] for r in results
               for k in ("tokens_per_sim_s", "gpu_idle", "hit_rate", "cp_share", "cp_ms_per_req")}
    report = {"benchmark": "cluster_sim", "machine": machine(), "load_avg": os.getloadavg(),
              "args": {k: v for k, v in vars(args).items()}, "results": results, "summary": summary,
              "command": " ".join(["python benchmarks/cluster_sim.py", *(argv if argv is not None else sys.argv[1:])])}
    write_result("cluster_sim", report, args.out)
    print(result_line(summary))
    return report


if __name__ == "__main__":
    main()
