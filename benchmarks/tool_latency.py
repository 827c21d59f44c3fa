"""Rollout throughput against tool latency: the async agent loop over the bus against the classic
batch-synchronous multi-turn rollout, same engine, same loops, same tools, same concurrency.

Why: a tool call that takes a second leaves the engine with nothing to do unless other
trajectories are ready to generate. The product's claim is that async loops keep the engine
busy while tools run; this measures it.

Workload: GSM8K test prompts through `tool_agent` with the calculator (a model taught the call
format by the project's SFT warm-up, built once and cached), the calculator delayed by L seconds,
L in {0, 0.1, 0.5, 1, 2}. Per L and mode, N trajectories with at most C in flight:
  async  every trajectory runs on its own; a finished one is replaced at once (asyncio, one bus)
  sync   waves of C: a turn's generations are sent together and answered together when the last
         finishes, then all tools run, then the next turn: every trajectory waits for the slowest
         generation and the slowest tool of its wave
Then the long-tail workload of `benchmarks/async_rl.py` (3 generations per trajectory with a
tool call between each, latency log-normal with median 1 s and p99 10 s), async vs sync alike.
Measured: generated (mask-1) tokens per second of wall time, and the engine's busy fraction
(seconds with at least one request inside the engine, as the server reports it, over the
window). The two modes alternate per L, so they see the same machine state.

    python benchmarks/tool_latency.py --quick              # hf engine, tiny llama, ~6 min on 2 cores
    python benchmarks/tool_latency.py                      # vllm engine, SmolLM2-135M
    python benchmarks/tool_latency.py --backend hf --model smollm2-135m-instruct --trajectories 96
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (RESULTS, SFT_STEPS_HELP, calculator_workload, machine, result_line, servers,  # noqa: E402
                    sft_steps, write_result)

from agent.loop import AgentContext, AgentLoopOutput  # noqa: E402
from agent.tool_agent import ToolAgentLoop  # noqa: E402
from agent.tools.base import ToolResponse  # noqa: E402
from agent.tools.calculator import CalculatorTool  # noqa: E402
from async_workload import RoundsLoop  # noqa: E402
from rollout.bus.client import GenerateClient  # noqa: E402

LATENCIES = (0.0, 0.1, 0.5, 1.0, 2.0)
MODES = ("async", "sync")


class SlowCalculator(CalculatorTool):
    """The calculator behind a network-like delay (`latency_s`), spent awaiting, as a remote
    tool would: the event loop stays free."""

    async def execute(self, instance_id: str, arguments: dict[str, Any]) -> ToolResponse:
        await asyncio.sleep(float(self.config.get("latency_s", 0.0)))
        return await super().execute(instance_id, arguments)


class Lockstep:
    """Makes a wave of trajectories batch-synchronous: generate() calls are held until every live
    trajectory of the wave has made one (or finished), sent together, and answered together once
    the last is done. Everything else passes through to the real client."""

    def __init__(self, client: GenerateClient, live: int) -> None:
        self.client, self.live = client, live
        self.pending: list[tuple[tuple, dict, asyncio.Future]] = []
        self.phases: list[float] = []  # seconds from a turn's send to its last answer

    async def generate(self, *args: Any, **kwargs: Any) -> Any:
        fut = asyncio.get_running_loop().create_future()
        self.pending.append((args, kwargs, fut))
        self._release()
        return await fut

    def finished(self) -> None:
        self.live -= 1
        self._release()

    def _release(self) -> None:
        if self.pending and len(self.pending) >= self.live:
            wave, self.pending = self.pending, []
            asyncio.ensure_future(self._send(wave))

    async def _send(self, wave: list[tuple[tuple, dict, asyncio.Future]]) -> None:
        t0 = time.perf_counter()
        results = await asyncio.gather(*(self.client.generate(*a, **kw) for a, kw, _ in wave), return_exceptions=True)
        self.phases.append(time.perf_counter() - t0)
        for (_, _, fut), r in zip(wave, results):
            if isinstance(r, BaseException):
                fut.set_exception(r)
            else:
                fut.set_result(r)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.client, name)


async def run_mode(mode: str, addresses: list[str], tokenizer: Any, rows: list[dict[str, Any]], latency: float,
                   concurrency: int, agent_cfg: dict[str, Any], sampling: dict[str, Any], tag: str,
                   longtail: float = 0.0) -> dict[str, Any]:
    """`longtail` > 0: `async_workload.RoundsLoop` (3 generations, log-normal tool delays with that
    median and a p99 10x it) instead of the calculator agent; `latency` is then only a label."""
    tool = SlowCalculator({"latency_s": latency, "timeout_s": latency + 30}, _schema())
    async with GenerateClient(addresses) as client:
        await client.wait_ready(timeout_s=900)
        before = [await client.status(i) for i in range(len(addresses))]
        t0 = time.perf_counter()

        async def one(i: int, row: dict[str, Any], via: Any) -> AgentLoopOutput:
            if longtail:
                loop: Any = RoundsLoop(AgentContext(via, tokenizer, {}, {"rounds": 3, "median_s": longtail,
                                                                          "p99_s": 10 * longtail}))
            else:
                loop = ToolAgentLoop(AgentContext(via, tokenizer, {"calculator": tool}, agent_cfg))
            return await loop.run(dict(sampling), **{**row, "session_id": f"{tag}-{i}", "group_id": f"{tag}-{i}"})

        outs: list[AgentLoopOutput] = []
        phases: list[float] = []
        if mode == "async":
            sem = asyncio.Semaphore(concurrency)

            async def limited(i: int, row: dict[str, Any]) -> AgentLoopOutput:
                async with sem:
                    return await one(i, row, client)

            outs = list(await asyncio.gather(*(limited(i, r) for i, r in enumerate(rows))))
        else:
            for start in range(0, len(rows), concurrency):
                wave = rows[start:start + concurrency]
                lock = Lockstep(client, len(wave))

                async def stepped(i: int, row: dict[str, Any]) -> AgentLoopOutput:
                    try:
                        return await one(i, row, lock)
                    finally:
                        lock.finished()

                outs += await asyncio.gather(*(stepped(start + j, r) for j, r in enumerate(wave)))
                phases += lock.phases
        wall = time.perf_counter() - t0
        after = [await client.status(i) for i in range(len(addresses))]
    busy = sum(a.stats["busy_s"] - b.stats["busy_s"] for a, b in zip(after, before))
    span = sum(a.stats["uptime_s"] - b.stats["uptime_s"] for a, b in zip(after, before))
    errors = [o.error for o in outs if o.termination == "error"]
    if errors:
        raise RuntimeError(f"{len(errors)} trajectories failed, e.g. {errors[0]}")
    tokens = sum(len(o.model_token_ids()) for o in outs)
    calls = sum(int(t.get("calls", 0)) for o in outs for t in o.turns if t.get("kind") == "tools")
    frac = busy / span if span else 0.0
    out = {"mode": mode, "latency_s": latency, "trajectories": len(outs), "wall_s": wall, "tokens": tokens,
           "tokens_per_s": tokens / wall, "busy_fraction": frac, "tool_calls": calls,
           "tokens_per_busy_s": tokens / (frac * wall) if frac else 0.0,
           "turns_mean": sum(o.num_turns for o in outs) / len(outs),
           "reward_mean": sum(o.reward for o in outs) / len(outs)}
    if phases:  # sync: the waves' generation phases; the rest of the wall time the waves sat in tools
        out.update(gen_phases=len(phases), gen_phase_s_mean=sum(phases) / len(phases), gen_s=sum(phases),
                   tool_wait_s=wall - sum(phases))
    return out


def _schema() -> dict[str, Any]:
    from agent.tools.registry import load_tools
    from common import ROOT

    return load_tools(ROOT / "launch/configs/tools_calculator.yaml")["calculator"].tool_schema


def plot(rows: list[dict[str, Any]], path: Path, device: str) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(6, 3.6))
    for mode, style in (("async", "o-"), ("sync", "s--")):
        pts = sorted((r["latency_s"], r["tokens_per_s"]) for r in rows if r["mode"] == mode)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], style, label=f"{mode} rollout")
    ax.set_xlabel("tool latency (s)")
    ax.set_ylabel("generated tokens / s")
    ax.set_title(device, fontsize=8)
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="hf engine with a tiny llama (minutes on a laptop)")
    ap.add_argument("--backend", default=None, help="hf | vllm (default: hf with --quick, else vllm)")
    ap.add_argument("--model", default=None, help="base model to teach the calculator (default by mode)")
    ap.add_argument("--sft-steps", type=int, default=None, help=SFT_STEPS_HELP)
    ap.add_argument("--trajectories", type=int, default=None, help="per latency and mode")
    ap.add_argument("--concurrency", type=int, default=None, help="trajectories in flight (a sync wave)")
    ap.add_argument("--latencies", default=",".join(str(x) for x in LATENCIES))
    ap.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (0 = greedy)")
    ap.add_argument("--gsm8k-dir", default=None, help="directory with GSM8K train.jsonl and test.jsonl")
    ap.add_argument("--longtail-median-s", type=float, default=1.0,
                    help="median tool latency of the long-tail workload (p99 10x it); 0 skips it")
    ap.add_argument("--longtail-trajectories", type=int, default=None,
                    help="trajectories of the long-tail workload (default 12 waves of --concurrency: a steady "
                         "state, not one wave's ramp-down)")
    ap.add_argument("--out", default=None, help=f"JSON path (default {RESULTS}/tool_latency.json)")
    args = ap.parse_args(argv)
    quick = args.quick
    backend = args.backend or ("hf" if quick else "vllm")
    base = args.model or ("tiny-llama" if quick else "smollm2-135m-instruct")
    n = args.trajectories or (256 if quick else 96)
    conc = args.concurrency or (64 if quick else 48)
    steps = sft_steps(args.sft_steps, base)
    latencies = [float(x) for x in args.latencies.split(",") if x.strip()]
    n_long = args.longtail_trajectories or 12 * conc
    model, tok, all_rows = calculator_workload(args.gsm8k_dir, base, steps, max(n, n_long))
    rows = all_rows[:n]
    agent_cfg = {"max_assistant_turns": 3, "max_turn_tokens": 64, "max_response_tokens": 256, "tool_timeout_s": 60}
    sampling = {"temperature": args.temperature, "max_tokens": 64}
    info = machine()
    results: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="sy-bench-") as tmp:
        options = {"dtype": "float32"} if backend == "vllm" else {"max_batch_size": max(64, conc)}
        with servers(backend, model, 1, Path(tmp), options) as addrs:
            asyncio.run(run_mode("async", addrs, tok, rows[:8], 0.0, conc, agent_cfg, sampling, "warm"))  # warm-up
            for k, lat in enumerate(latencies):
                for mode in (MODES if k % 2 == 0 else MODES[::-1]):
                    r = asyncio.run(run_mode(mode, addrs, tok, rows, lat, conc, agent_cfg, sampling, f"{mode}{lat}"))
                    results.append(r)
                    print(f"L={lat:>4}s {mode:>5}: {r['tokens_per_s']:7.1f} tok/s  busy {r['busy_fraction']:.2f}  "
                          f"wall {r['wall_s']:6.1f}s  tool calls {r['tool_calls']}", flush=True)
            longtail = []  # several tool rounds per trajectory, log-normal latency (median 1 s, p99 10 s)
            for mode in MODES if args.longtail_median_s > 0 else ():
                r = asyncio.run(run_mode(mode, addrs, tok, all_rows[:n_long], -1.0, conc, agent_cfg, sampling, f"lt-{mode}",
                                         longtail=args.longtail_median_s))
                longtail.append(r)
                print(f"long tail {mode:>5}: {r['tokens_per_s']:7.1f} tok/s  busy {r['busy_fraction']:.2f}  "
                      f"wall {r['wall_s']:6.1f}s", flush=True)

    def get(mode: str, lat: float) -> dict[str, Any]:
        return next(r for r in results if r["mode"] == mode and r["latency_s"] == lat)

    # A rollout can beat the synchronous one by filling the time the engine sits idle in it, so at
    # the same tokens per busy second the gain is at most 1 / (sync busy fraction): `ceiling`.
    print(f"\n{'L (s)':>6} | {'async tok/s':>11} {'busy':>5} | {'sync tok/s':>10} {'busy':>5} {'gen phase':>9} | "
          f"async/sync  ceiling")
    for lat in latencies:
        a, s = get("async", lat), get("sync", lat)
        print(f"{lat:>6} | {a['tokens_per_s']:>11.1f} {a['busy_fraction']:>5.2f} | {s['tokens_per_s']:>10.1f} "
              f"{s['busy_fraction']:>5.2f} {s.get('gen_phase_s_mean', 0):>8.2f}s | "
              f"{a['tokens_per_s'] / s['tokens_per_s']:>9.2f}x {1 / max(s['busy_fraction'], 1e-9):>7.2f}x")
    ratios: dict[str, float] = {}
    if 0.0 in latencies and 1.0 in latencies:
        ratios["async_keep_1s"] = get("async", 1.0)["tokens_per_s"] / get("async", 0.0)["tokens_per_s"]
        ratios["async_vs_sync_1s"] = get("async", 1.0)["tokens_per_s"] / get("sync", 1.0)["tokens_per_s"]
        ratios["sync_idle_ceiling_1s"] = 1 / max(get("sync", 1.0)["busy_fraction"], 1e-9)
        ratios["sync_gen_phase_s"] = get("sync", 1.0).get("gen_phase_s_mean", 0.0)
    for lat in latencies:
        ratios[f"async_vs_sync_{lat:g}s"] = get("async", lat)["tokens_per_s"] / get("sync", lat)["tokens_per_s"]
    if longtail:
        ratios["longtail_async_vs_sync"] = longtail[0]["tokens_per_s"] / longtail[1]["tokens_per_s"]
    out = Path(args.out) if args.out else RESULTS / "tool_latency.json"
    png = plot(results, out.with_suffix(".png"), info["device"])
    report = {"benchmark": "tool_latency", "machine": info, "backend": backend, "model": base,
              "sft_steps": steps, "trajectories": n, "longtail_trajectories": n_long, "concurrency": conc, "agent": agent_cfg,
              "sampling": sampling, "results": results, "longtail": longtail, "ratios": ratios,
              "plot": str(png) if png else None, "command": " ".join(["python benchmarks/tool_latency.py",
                                                                    *(argv if argv is not None else sys.argv[1:])])}
    write_result("tool_latency", report, str(out))
    print(result_line(ratios))
    return report


if __name__ == "__main__":
    main()
