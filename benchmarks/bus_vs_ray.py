"""The token bus against a Ray async actor, same echo engine behind both, measured side by side.

Why: agent loops issue thousands of small generate calls with long prompts; the transport's
per-request cost and its behaviour at high concurrency decide whether engines idle. The echo
engine (engines/inference/echo.py) answers instantly, so every millisecond here is transport:
serialisation, copies, scheduling, process hops.

Workload: 8192-token prompts, 512-token replies, c concurrent callers issuing requests back to
back, for c in 1 / 16 / 256. Both sides run the engine in another process and the caller in an
asyncio loop in this one. The Ray side passes numpy int32 arrays (what a careful Ray user does;
Python lists would be slower) and returns numpy arrays, the same bytes the bus moves.

    python benchmarks/bus_vs_ray.py            # default run
    python benchmarks/bus_vs_ray.py --quick    # smaller counts
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Awaitable, Callable

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

PROMPT_TOKENS, REPLY_TOKENS = 8192, 512
SAMPLING = {"max_tokens": REPLY_TOKENS, "ignore_eos": True}


def expected_reply(prompt: np.ndarray) -> list[int]:
    return prompt[:REPLY_TOKENS].tolist()  # the echo engine cycles the prompt


async def drive(call: Callable[[np.ndarray], Awaitable[list[int]]], prompts: list[np.ndarray],
                concurrency: int, total: int) -> dict[str, float]:
    """`concurrency` callers issue `total` requests back to back; per-request latency in ms."""
    latencies: list[float] = []
    issued = 0

    async def caller() -> None:
        nonlocal issued
        while issued < total:
            prompt = prompts[issued % len(prompts)]
            issued += 1
            t = time.perf_counter()
            ids = await call(prompt)
            latencies.append((time.perf_counter() - t) * 1e3)
            if len(ids) != REPLY_TOKENS:
                raise RuntimeError(f"got {len(ids)} tokens, expected {REPLY_TOKENS}")

    t0 = time.perf_counter()
    await asyncio.gather(*(caller() for _ in range(concurrency)))
    wall = time.perf_counter() - t0
    lat = np.array(latencies)
    return {"p50_ms": float(np.percentile(lat, 50)), "p99_ms": float(np.percentile(lat, 99)),
            "rps": total / wall, "requests": total}


async def measure(name: str, call: Callable[[np.ndarray], Awaitable[list[int]]], levels: list[tuple[int, int]],
                  prompts: list[np.ndarray], warmup: int) -> dict[int, dict]:
    """Check one answer, then time every concurrency level after its own warm-up."""
    if await call(prompts[0]) != expected_reply(prompts[0]):
        raise RuntimeError(f"{name} echo returned the wrong tokens; refusing to time it")
    out = {}
    for c, n in levels:
        await drive(call, prompts, c, warmup)
        out[c] = await drive(call, prompts, c, n)
    return out


async def bench_bus(levels: list[tuple[int, int]], prompts: list[np.ndarray], warmup: int) -> dict[int, dict]:
    from rollout.client import GenerateClient
    from rollout.server import start_server_process

    tmp = Path(tempfile.mkdtemp(prefix="switchyard-bench-"))
    proc = start_server_process("echo", "echo", f"ipc://{tmp}/echo.sock", "echo0", cpu_threads=1)
    try:
        async with GenerateClient([f"ipc://{tmp}/echo.sock"]) as client:
            await client.wait_ready(timeout_s=60)

            async def call(prompt: np.ndarray) -> list[int]:
                return (await client.generate(prompt, SAMPLING)).token_ids

            return await measure("bus", call, levels, prompts, warmup)
    finally:
        proc.terminate()
        proc.wait(10)


def bench_ray(levels: list[tuple[int, int]], prompts: list[np.ndarray], warmup: int) -> dict[int, dict]:
    import ray

    ray.init(num_cpus=2, include_dashboard=False, logging_level="ERROR", log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": str(Path(__file__).resolve().parent.parent)}})

    @ray.remote(max_concurrency=1000)
    class EchoActor:
        def __init__(self) -> None:
            from engines.inference import make_engine

            self.engine = make_engine("echo", "echo")
            self.n = 0

        async def generate(self, prompt: np.ndarray, sampling: dict) -> tuple[np.ndarray, np.ndarray, str]:
            from engines.inference import SamplingParams

            self.n += 1
            out = await self.engine.generate(str(self.n), prompt.tolist(), SamplingParams.from_dict(sampling))
            return np.asarray(out.token_ids, np.int32), np.asarray(out.logprobs, np.float32), out.finish_reason

    try:
        actor = EchoActor.remote()

        async def main() -> dict[int, dict]:
            async def call(prompt: np.ndarray) -> list[int]:
                ids, _, _ = await actor.generate.remote(prompt, SAMPLING)
                return ids.tolist()

            return await measure("ray", call, levels, prompts, warmup)

        return asyncio.run(main())
    finally:
        ray.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer requests per level")
    ap.add_argument("--requests", type=int, default=None, help="requests per concurrency level")
    ap.add_argument("--out", default="benchmarks/results/bus_vs_ray.json")
    args = ap.parse_args()
    n = args.requests or (200 if args.quick else 1000)
    levels = [(1, n), (16, n), (256, max(n, 512))]
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 50_000, PROMPT_TOKENS, dtype=np.int32) for _ in range(8)]
    warmup = 32
    # one transport at a time so they never share the two cores
    bus = asyncio.run(bench_bus(levels, prompts, warmup))
    ray_res = bench_ray(levels, prompts, warmup)

    print(f"\n8192-token prompts, 512-token replies, echo engine; {platform.processor() or platform.machine()}, "
          f"{os.cpu_count()} cores; latencies in ms")
    print(f"{'conc':>5} | {'bus p50':>8} {'bus p99':>8} {'bus req/s':>9} | {'ray p50':>8} {'ray p99':>8} "
          f"{'ray req/s':>9} | {'p50 ray/bus':>11} {'req/s bus/ray':>13}")
    result: dict[str, Any] = {}
    for c, _ in levels:
        b, r = bus[c], ray_res[c]
        p50_ratio, rps_ratio = r["p50_ms"] / b["p50_ms"], b["rps"] / r["rps"]
        result[f"p50_ratio_c{c}"], result[f"rps_ratio_c{c}"] = p50_ratio, rps_ratio
        print(f"{c:>5} | {b['p50_ms']:8.2f} {b['p99_ms']:8.2f} {b['rps']:9.0f} | {r['p50_ms']:8.2f} "
              f"{r['p99_ms']:8.2f} {r['rps']:9.0f} | {p50_ratio:11.1f} {rps_ratio:13.1f}")
    report = {"benchmark": "bus_vs_ray", "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
              "machine": {"platform": platform.platform(), "cpus": os.cpu_count()},
              "params": {"prompt_tokens": PROMPT_TOKENS, "reply_tokens": REPLY_TOKENS, "levels": levels},
              "bus": bus, "ray": ray_res, "ratios": result}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    order = [f"p50_ratio_c{c}" for c, _ in levels] + [f"rps_ratio_c{c}" for c, _ in levels]
    print("RESULT " + " ".join(f"{k}={result[k]:.2f}" for k in order))


if __name__ == "__main__":
    main()
