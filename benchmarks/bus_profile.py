"""Where one bus request's time goes: the echo-engine workload of `bus_vs_ray.py` at concurrency 1
(8192-token prompt, 512-token reply), sampled by py-spy in both processes while it runs.

Why: at concurrency 1 the bus costs a multiple of bare pyzmq (bus_vs_ray's `bare` column); this
says which code the difference is spent in, measured, so the fix goes where the time is.

What: the echo EngineServer in its own process and a GenerateClient here issue `--requests`
generate calls back to back; `py-spy record` samples both processes (`--rate` Hz, idle frames
dropped) for the whole loop. Reported per process, as shares of its non-idle samples: the
function on top of the stack (self time), and the same grouped by where that function lives
(protocol, bus code, zmq, asyncio machinery, the engine).

    python benchmarks/bus_profile.py                  # 3000 requests
    python benchmarks/bus_profile.py --requests 500   # quicker
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine, write_result  # noqa: E402

PROMPT_TOKENS, REPLY_TOKENS = 8192, 512
SAMPLING = {"max_tokens": REPLY_TOKENS, "temperature": 1.0}
# where a sample's own (top-of-stack) frame lies; the first matching bucket wins
BUCKETS = [("engine (echo generate)", ("echo.py",)), ("protocol encode/decode (protocol.py)", ("protocol.py",)),
           ("bus code (server.py, client.py, router.py, reader.py, eager.py)",
            ("server.py", "client.py", "router.py", "reader.py", "eager.py")),
           ("zmq socket calls", ("zmq/", "zmq\\")), ("numpy", ("numpy",)),
           ("asyncio machinery (event loop, selector, tasks)", ("asyncio", "selectors.py"))]


def start_spy(pid: int, out: Path, rate: int) -> subprocess.Popen:
    return subprocess.Popen(["py-spy", "record", "--pid", str(pid), "--rate", str(rate), "--format", "raw",
                             "--output", str(out), "--nonblocking"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def summarize(path: Path, top: int) -> dict[str, Any]:
    """Collapsed stacks -> self time by function and by bucket, as sample shares."""
    selfs: collections.Counter[str] = collections.Counter()
    buckets: collections.Counter[str] = collections.Counter()
    total = 0
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack:
            continue
        n = int(count)
        total += n
        frames = stack.split(";")
        selfs[frames[-1]] += n
        label = next((name for name, marks in BUCKETS if any(m in frames[-1] for m in marks)), "other")
        buckets[label] += n
    return {"samples": total, "self": [(f, n / max(total, 1)) for f, n in selfs.most_common(top)],
            "buckets": {k: v / max(total, 1) for k, v in buckets.most_common()}}


async def loop(address: str, requests: int, prompt: np.ndarray, concurrency: int) -> list[float]:
    from rollout.bus.client import GenerateClient

    lat: list[float] = []
    async with GenerateClient([address]) as client:
        await client.wait_ready(timeout_s=60)

        async def caller(n: int) -> None:
            for _ in range(n):
                t0 = time.perf_counter()
                r = await client.generate(prompt, SAMPLING)
                r.token_ids, r.logprobs  # noqa: B018 - usable lists, as bus_vs_ray counts them
                lat.append(time.perf_counter() - t0)

        await asyncio.gather(*(caller(max(1, 200 // concurrency)) for _ in range(concurrency)))  # warm-up
        lat.clear()
        client_spy.append(None)  # the caller starts the samplers now
        await asyncio.sleep(0.5)
        await asyncio.gather(*(caller(requests // concurrency) for _ in range(concurrency)))
    return lat


client_spy: list[Any] = []


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=3000)
    ap.add_argument("--concurrency", type=int, default=1, help="requests in flight (callers issuing back to back)")
    ap.add_argument("--rate", type=int, default=500, help="samples per second per process")
    ap.add_argument("--top", type=int, default=12)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if shutil.which("py-spy") is None:
        raise SystemExit("bus_profile needs py-spy on PATH: pip install py-spy")
    from rollout.bus.launcher import start_server_process

    prompt = np.arange(PROMPT_TOKENS, dtype=np.int32) % 30000
    with tempfile.TemporaryDirectory(prefix="sy-prof-") as tmp_dir:
        tmp = Path(tmp_dir)
        address = f"ipc://{tmp}/echo.sock"
        server = start_server_process("echo", "echo", address, "echo0", log_file=tmp / "server.log", cpu_threads=1)
        spies: list[subprocess.Popen] = []
        try:
            async def run() -> list[float]:
                task = asyncio.create_task(loop(address, args.requests, prompt, args.concurrency))
                while not client_spy and not task.done():
                    await asyncio.sleep(0.01)
                if not task.done():
                    import os

                    spies.extend([start_spy(server.pid, tmp / "server.txt", args.rate),
                                  start_spy(os.getpid(), tmp / "client.txt", args.rate)])
                return await task

            t0 = time.perf_counter()
            lat = asyncio.run(run())
            wall = time.perf_counter() - t0
        finally:
            for s in spies:
                s.send_signal(signal.SIGINT)
            for s in spies:
                s.wait(60)
            server.terminate()
            server.wait(30)
        sides = {side: summarize(tmp / f"{side}.txt", args.top) for side in ("client", "server")
                 if (tmp / f"{side}.txt").exists()}
    p50 = float(np.percentile(np.array(lat) * 1e3, 50))
    print(f"{len(lat)} requests at concurrency {args.concurrency}: p50 {p50:.3f} ms, mean {np.mean(lat) * 1e3:.3f} ms "
          f"({wall:.1f} s with warm-up)")
    for side, s in sides.items():
        print(f"\n{side}: {s['samples']} samples (idle dropped)")
        for k, v in s["buckets"].items():
            print(f"  {v:6.1%}  {k}")
        print("  self time, top functions:")
        for f, v in s["self"]:
            print(f"  {v:6.1%}  {f}")
    report = {"benchmark": "bus_profile", "machine": machine(), "requests": args.requests, "rate": args.rate,
              "p50_ms": p50, "mean_ms": float(np.mean(lat) * 1e3), "sides": sides,
              "command": " ".join(["python benchmarks/bus_profile.py", *(argv if argv is not None else sys.argv[1:])])}
    write_result("bus_profile", report, args.out)
    return report


if __name__ == "__main__":
    main()
