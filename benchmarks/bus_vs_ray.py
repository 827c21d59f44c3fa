"""The token bus against a Ray async actor, same echo engine behind both, measured side by side.

Why: agent loops issue thousands of generate calls with long prompts; the transport's
per-request cost and how it holds up under many concurrent callers decide whether engines
idle. The echo engine (engines/inference/echo.py) answers instantly, so every millisecond here
is transport: serialisation, copies, scheduling, process hops.

What: per-request latency (p50, p99, ms, from call to usable token ids) and throughput (req/s)
with 8192-token prompts and 512-token replies, c concurrent callers issuing requests back to
back for c in 1 / 16 / 256, a fixed request count per level after a warm-up. Both engines run
in their own process, both callers in one asyncio loop in this one, and the two sides alternate
per concurrency level, so they see the same machine state:
  bus  EngineServer subprocess (ipc://) <- GenerateClient
  ray  @ray.remote async actor (max_concurrency=1000) <- `await actor.generate.remote(...)`
  bare the floor: bare pyzmq, same bytes and process layout, no protocol (benchmarks/bare_zmq.py),
       measured after Ray has shut down (its idle processes share the cores), in `--rounds`
       alternating (bus, bare) rounds per level; the ratios are the medians of the per-round ones
The Ray side is what a careful Ray user writes: prompts go as numpy int32 arrays (pickle-5
out-of-band buffers; Python lists would be pickled int by int and be slower), replies come back
as numpy arrays, the same bytes the bus moves. Both callers end with Python lists of ids and
logprobs, as GenerateClient returns them. One request per side is checked against the expected
echo before timing, so errors cannot be measured as speed.

    python benchmarks/bus_vs_ray.py                 # 200 / 800 / 800 requests
    python benchmarks/bus_vs_ray.py --quick         # smaller counts
    python benchmarks/bus_vs_ray.py --requests 400  # the same count at every level
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Awaitable, Callable

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

PROMPT_TOKENS, REPLY_TOKENS = 8192, 512
SAMPLING: dict[str, Any] = {"max_tokens": REPLY_TOKENS, "ignore_eos": True}
LEVELS = (1, 16, 256)
Call = Callable[[np.ndarray], Awaitable[tuple[list[int], list[float], str]]]


def check_reply(side: str, prompt: np.ndarray, reply: tuple[list[int], list[float], str]) -> None:
    """The echo engine answers the prompt's first 512 ids with logprob 0 and finish 'length'."""
    ids, logprobs, finish = reply
    if ids != prompt[:REPLY_TOKENS].tolist() or logprobs != [0.0] * REPLY_TOKENS or finish != "length":
        raise RuntimeError(f"{side}: echo reply is wrong ({len(ids)} ids, finish {finish!r}, first ids "
                           f"{ids[:4]} vs {prompt[:4].tolist()}); refusing to time a broken transport")


async def drive(call: Call, prompts: list[np.ndarray], concurrency: int, total: int) -> dict[str, float]:
    """`concurrency` callers issue `total` requests back to back; latency per request in ms."""
    latencies: list[float] = []
    issued = 0

    async def caller() -> None:
        nonlocal issued
        while issued < total:
            prompt = prompts[issued % len(prompts)]
            issued += 1
            t = time.perf_counter()
            ids, _, _ = await call(prompt)
            latencies.append((time.perf_counter() - t) * 1e3)
            if len(ids) != REPLY_TOKENS:
                raise RuntimeError(f"got {len(ids)} tokens, expected {REPLY_TOKENS}")

    t0 = time.perf_counter()
    await asyncio.gather(*(caller() for _ in range(concurrency)))
    wall = time.perf_counter() - t0
    lat = np.array(latencies)
    return {"p50_ms": float(np.percentile(lat, 50)), "p99_ms": float(np.percentile(lat, 99)),
            "mean_ms": float(lat.mean()), "rps": total / wall, "requests": total, "wall_s": wall}


def start_ray_actor() -> Any:
    """ray.init on this box and one async echo actor; returns the actor handle."""
    import ray

    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # no network here; don't try
    ray.init(num_cpus=2, include_dashboard=False, logging_level="ERROR", log_to_driver=False)

    @ray.remote(max_concurrency=1000)
    class EchoActor:
        def __init__(self) -> None:
            from engines.inference import make_engine

            self.engine = make_engine("echo", "echo")
            self.n = 0

        async def generate(self, prompt_ids: np.ndarray, sampling: dict) -> tuple[np.ndarray, np.ndarray, str]:
            from engines.inference import SamplingParams

            self.n += 1
            out = await self.engine.generate(str(self.n), prompt_ids, SamplingParams.from_dict(sampling))  # as the server does
            return np.asarray(out.token_ids, np.int32), np.asarray(out.logprobs, np.float32), out.finish_reason

    return EchoActor.remote()


async def run_levels(address: str, actor: Any, levels: list[tuple[int, int]], warmup: int,
                     prompts: list[np.ndarray]) -> dict[str, dict[str, dict[str, float]]]:
    """Validate both sides, then per level: warm up and time the bus, then Ray."""
    from rollout.bus.client import GenerateClient

    async with GenerateClient([address]) as client:
        await client.wait_ready(timeout_s=60)

        async def bus_call(prompt: np.ndarray) -> tuple[list[int], list[float], str]:
            r = await client.generate(prompt, SAMPLING)
            return r.token_ids, r.logprobs, r.finish_reason

        async def ray_call(prompt: np.ndarray) -> tuple[list[int], list[float], str]:
            ids, logprobs, finish = await actor.generate.remote(prompt, SAMPLING)
            return ids.tolist(), logprobs.tolist(), finish

        sides: dict[str, Call] = {"bus": bus_call, "ray": ray_call}
        for name, call in sides.items():
            check_reply(name, prompts[1], await call(prompts[1]))
        out: dict[str, dict[str, dict[str, float]]] = {name: {} for name in sides}
        for c, n in levels:
            for name, call in sides.items():
                await drive(call, prompts, c, max(warmup, c))
                out[name][str(c)] = s = await drive(call, prompts, c, n)
                print(f"  c={c:<3} {name}: p50 {s['p50_ms']:.2f} ms  p99 {s['p99_ms']:.2f} ms  "
                      f"{s['rps']:.0f} req/s", flush=True)
    return out


async def run_floor(address: str, bare_address: str, levels: list[tuple[int, int]], warmup: int,
                    prompts: list[np.ndarray], rounds: int) -> dict[str, Any]:
    """The bus against bare pyzmq: per level, `rounds` rounds of (bus, bare), each warmed up; per
    level the medians of each side and the median of the per-round ratios."""
    from bare_zmq import BareClient

    from rollout.bus.client import GenerateClient

    bare = BareClient(bare_address)
    out: dict[str, Any] = {"bus": {}, "bare": {}, "rounds": {}}
    async with GenerateClient([address]) as client:
        await client.wait_ready(timeout_s=60)

        async def bus_call(prompt: np.ndarray) -> tuple[list[int], list[float], str]:
            r = await client.generate(prompt, SAMPLING)
            return r.token_ids, r.logprobs, r.finish_reason

        sides: dict[str, Call] = {"bus": bus_call, "bare": bare.generate}
        for name, call in sides.items():
            check_reply(name, prompts[1], await call(prompts[1]))
        for c, n in levels:
            per_round: list[dict[str, dict[str, float]]] = []
            for _ in range(rounds):
                one: dict[str, dict[str, float]] = {}
                for name, call in sides.items():
                    await drive(call, prompts, c, max(warmup, c))
                    one[name] = await drive(call, prompts, c, n)
                per_round.append(one)
                print(f"  c={c:<3} bus p50 {one['bus']['p50_ms']:.3f} ms {one['bus']['rps']:.0f} req/s | bare p50 "
                      f"{one['bare']['p50_ms']:.3f} ms {one['bare']['rps']:.0f} req/s", flush=True)
            for name in sides:
                out[name][str(c)] = {k: float(np.median([r[name][k] for r in per_round]))
                                     for k in ("p50_ms", "p99_ms", "mean_ms", "rps")}
            out["rounds"][str(c)] = {
                "p50_bus_over_bare": [r["bus"]["p50_ms"] / r["bare"]["p50_ms"] for r in per_round],
                "rps_bus_of_bare": [r["bus"]["rps"] / r["bare"]["rps"] for r in per_round]}
    bare.close()
    return out


def _timeout(signum: int, frame: Any) -> None:
    raise TimeoutError("benchmark ran past --timeout; raise it or lower --requests")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="50 / 200 / 512 requests per level")
    ap.add_argument("--requests", type=int, default=None, help="requests at every level (default 200 / 800 / 800)")
    ap.add_argument("--warmup", type=int, default=32, help="warm-up requests per level and side (at least c)")
    ap.add_argument("--rounds", type=int, default=3, help="alternating (bus, bare) rounds per level for the floor")
    ap.add_argument("--timeout", type=float, default=600, help="give up after this many seconds in all")
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/bus_vs_ray.json"))
    args = ap.parse_args()
    counts = [args.requests] * 3 if args.requests else [50, 200, 512] if args.quick else [200, 800, 800]
    levels = list(zip(LEVELS, counts))
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 50_000, PROMPT_TOKENS, dtype=np.int32) for _ in range(8)]
    signal.signal(signal.SIGALRM, _timeout)
    signal.alarm(int(args.timeout))
    t_start = time.perf_counter()

    from rollout.bus.launcher import start_server_process

    tmp = Path(tempfile.mkdtemp(prefix="switchyard-bus-vs-ray-"))
    address, server_log = f"ipc://{tmp}/echo0.sock", tmp / "server.log"
    server: subprocess.Popen | None = None
    bare_address = f"ipc://{tmp}/bare.sock"
    bare = subprocess.Popen([sys.executable, str(ROOT / "benchmarks" / "bare_zmq.py"), bare_address, str(REPLY_TOKENS)])
    try:
        server = start_server_process("echo", "echo", address, "echo0", log_file=server_log, cpu_threads=1)
        t0 = time.perf_counter()
        actor = start_ray_actor()
        print(f"ray up in {time.perf_counter() - t0:.1f}s; measuring", flush=True)
        res = asyncio.run(run_levels(address, actor, levels, args.warmup, prompts))
        import ray

        ray.shutdown()  # its idle processes would share the 2 cores with the floor's rounds
        print("ray down; the bus against bare pyzmq", flush=True)
        floor = asyncio.run(run_floor(address, bare_address, levels, args.warmup, prompts, args.rounds))
    except Exception:
        if server_log.exists():
            print(f"server log {server_log}:\n{server_log.read_text()[-2000:]}", file=sys.stderr)
        raise
    finally:
        bare.kill()
        if server is not None:
            server.terminate()
            try:
                server.wait(10)
            except subprocess.TimeoutExpired:
                server.kill()
        import ray

        ray.shutdown()
        signal.alarm(0)
    elapsed = time.perf_counter() - t_start

    bus, ray_res, bare_res = res["bus"], res["ray"], floor["bare"]
    print(f"\n{PROMPT_TOKENS}-token prompts, {REPLY_TOKENS}-token replies, echo engine; "
          f"{platform.machine()}, {os.cpu_count()} cores; latencies in ms; run {elapsed:.0f}s")
    head = ["conc", "bus p50", "bus p99", "bus req/s", "ray p50", "ray p99", "ray req/s", "p50 ray/bus",
            "req/s bus/ray"]
    print(" | ".join(f"{h:>{max(len(h), 8)}}" for h in head))
    ratios: dict[str, float] = {}
    for c, _ in levels:
        b, r = bus[str(c)], ray_res[str(c)]
        ratios[f"p50_ratio_c{c}"], ratios[f"rps_ratio_c{c}"] = r["p50_ms"] / b["p50_ms"], b["rps"] / r["rps"]
        rounds = floor["rounds"][str(c)]  # the bus against its floor: the median of the per-round ratios
        ratios[f"p50_bus_over_bare_c{c}"] = float(np.median(rounds["p50_bus_over_bare"]))
        ratios[f"rps_bus_of_bare_c{c}"] = float(np.median(rounds["rps_bus_of_bare"]))
        cells = [f"{c}", f"{b['p50_ms']:.2f}", f"{b['p99_ms']:.2f}", f"{b['rps']:.0f}", f"{r['p50_ms']:.2f}",
                 f"{r['p99_ms']:.2f}", f"{r['rps']:.0f}", f"{ratios[f'p50_ratio_c{c}']:.2f}",
                 f"{ratios[f'rps_ratio_c{c}']:.2f}"]
        print(" | ".join(f"{v:>{max(len(h), 8)}}" for v, h in zip(cells, head)))
    order = [f"p50_ratio_c{c}" for c in LEVELS] + [f"rps_ratio_c{c}" for c in LEVELS]
    order += [f"p50_bus_over_bare_c{c}" for c in LEVELS] + [f"rps_bus_of_bare_c{c}" for c in LEVELS]
    report = {"benchmark": "bus_vs_ray", "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
              "machine": {"platform": platform.platform(), "machine": platform.machine(), "cpus": os.cpu_count(),
                          "python": platform.python_version()},
              "params": {"prompt_tokens": PROMPT_TOKENS, "reply_tokens": REPLY_TOKENS, "levels": levels,
                         "warmup": args.warmup, "ray_prompt_type": "np.int32", "floor_rounds": args.rounds},
              "ratios": {k: ratios[k] for k in order}, "bus": bus, "ray": ray_res, "bare": bare_res,
              "bus_floor_rounds": floor["bus"], "floor_rounds": floor["rounds"], "run_s": elapsed}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    print("RESULT " + " ".join(f"{k}={ratios[k]:.2f}" for k in order))


if __name__ == "__main__":
    main()
