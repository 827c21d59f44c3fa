"""An hf engine server's memory over many steps, with and without `parallel.host.bound_freed_memory`.

    python benchmarks/engine_heap.py                  # tiny-llama, 60 rounds, 2 pairs
    python benchmarks/engine_heap.py --rounds 200 --model smollm2-135m-instruct
    python benchmarks/engine_heap.py --quick          # 12 rounds, 1 pair

Why: a training run's engine serves a batch of new lengths and takes a fresh copy of the weights every
step. With glibc's and oneDNN's defaults the server's RSS grew 6-9 MiB a step on a CPU box for hundreds
of steps (a 400-step soak: +248 MiB in its second half) while no Python object or tensor was held:
freed heap glibc keeps and the cache of oneDNN computations torch keeps per shape (1024 of them).
Each setting runs in a process of its own (both are process-wide), alternating (bounded, default,
...); a round is what a step asks of the engine: 16 requests of 50-400 random prompt tokens and 48 sampled tokens each, then every
weight sent again and committed. Reported per setting: RSS growth over the second half of the rounds
(a leak grows in both halves, a warm-up in the first), growth after the first 5, and the median round
time (what the bound costs in speed), with the per-pair ratio of round times.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine, result_line, write_result  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
WARM = 5  # rounds before the growth is counted from


def one(model: str, bounded: bool, rounds: int, seed: int = 0) -> dict[str, Any]:
    """In this process: `rounds` engine steps; the RSS and seconds of each."""
    import asyncio
    import random
    import time

    sys.path.insert(0, str(ROOT))
    from parallel.host import bound_freed_memory

    if bounded:  # before the engine computes anything, as the engine server does
        bound_freed_memory()
    import psutil

    from engines.inference.base import SamplingParams
    from engines.inference.hf import HFEngine
    from engines.models import resolve_model

    me = psutil.Process()
    engine = HFEngine(str(resolve_model(model)), dtype="bfloat16", max_batch_size=64)

    async def main() -> dict[str, Any]:
        await engine.start()
        weights = [(k, v.detach().clone()) for k, v in engine.model.state_dict().items()]
        vocab = int(engine.model.config.vocab_size)
        rng = random.Random(seed)
        rss, seconds = [], []
        try:
            for r in range(rounds):
                t0 = time.perf_counter()
                sp = SamplingParams(max_tokens=48, temperature=1.0, seed=r)
                await asyncio.gather(*(engine.generate(
                    f"r{r}-{i}", [rng.randrange(100, vocab) for _ in range(rng.randrange(50, 400))], sp)
                    for i in range(16)))
                await engine.update_weights(weights)
                await engine.finish_weight_update()
                seconds.append(time.perf_counter() - t0)
                rss.append(me.memory_info().rss / 2 ** 20)
        finally:
            await engine.close()
        return {"rss_mib": rss, "round_s": seconds}

    return asyncio.run(main())


def growth(rss: list[float]) -> dict[str, float]:
    mid = len(rss) // 2
    return {"second_half_mib": rss[-1] - rss[mid], "after_warm_mib": rss[-1] - rss[min(WARM, len(rss) - 1)]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="tiny-llama")
    ap.add_argument("--rounds", type=int, default=60)
    ap.add_argument("--pairs", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="12 rounds, 1 pair")
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)  # internal: one setting in this process
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.quick:
        args.rounds, args.pairs = 12, 1
    if args.one is not None:
        print(json.dumps(one(args.model, args.one == "bounded", args.rounds)))
        return
    runs: dict[str, list[dict[str, Any]]] = {"bounded": [], "default": []}
    for p in range(args.pairs):
        for setting in runs:
            cmd = [sys.executable, __file__, "--one", setting, "--model", args.model, "--rounds", str(args.rounds)]
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=3600, cwd=ROOT)
            if out.returncode:
                raise SystemExit(f"{setting} run failed:\n{out.stderr[-3000:]}")
            r = json.loads(out.stdout.strip().splitlines()[-1])
            r.update(growth(r["rss_mib"]), round_s_median=statistics.median(r["round_s"]))
            runs[setting].append(r)
            print(f"pair {p + 1} {setting}: RSS {r['rss_mib'][0]:.1f} -> {r['rss_mib'][-1]:.1f} MiB, second half "
                  f"+{r['second_half_mib']:.1f}, after round {WARM} +{r['after_warm_mib']:.1f}; round "
                  f"{r['round_s_median']:.3f} s (median)", flush=True)
    med = {k: {m: statistics.median(r[m] for r in v) for m in ("second_half_mib", "after_warm_mib", "round_s_median")}
           for k, v in runs.items()}
    ratios = [b["round_s_median"] / d["round_s_median"] for b, d in zip(runs["bounded"], runs["default"])]
    report = {"machine": machine(), "model": args.model, "rounds": args.rounds, "pairs": args.pairs,
              "runs": runs, "median": med, "round_time_bounded_over_default": ratios}
    write_result("engine_heap", report, args.out)
    print(result_line({"second_half_mib_bounded": med["bounded"]["second_half_mib"],
                       "second_half_mib_default": med["default"]["second_half_mib"],
                       "round_time_bounded_over_default": statistics.median(ratios)}))


if __name__ == "__main__":
    main()
