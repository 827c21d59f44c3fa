"""The simulated cluster's two stand-ins: a process hosting many `sim` engines, each behind its own
real EngineServer socket, and a tool whose latency follows a heavy tail.

    python benchmarks/sim_nodes.py --addresses ipc:///tmp/x/e0.sock,ipc:///tmp/x/e1.sock --options '{...}'

serves one `sim` engine per address until SIGTERM; `--options` are the engines' options (JSON), each
engine seeded by its index so replies differ. `LatencyTool` is loaded by the agent workers from a
tools.yaml (verl's format); its config: median_s, p99_s and time_scale (the same factor as the
engines', so a simulated second of tool latency is as short as the engines' one).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import signal
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from agent.tools.base import BaseTool, ToolResponse  # noqa: E402


class LatencyTool(BaseTool):
    """Answers after a log-normal delay (median `median_s`, 99th percentile `p99_s`, simulated
    seconds), like a search or a sandbox whose slowest calls take 30 times the median."""

    async def execute(self, instance_id: str, arguments: dict[str, Any]) -> ToolResponse:
        median, p99 = float(self.config.get("median_s", 1.0)), float(self.config.get("p99_s", 30.0))
        sim_s = random.lognormvariate(math.log(median), math.log(p99 / median) / 2.326)
        await asyncio.sleep(sim_s / float(self.config.get("time_scale", 1.0)))
        return ToolResponse(text="42", metrics={"sim_latency_s": sim_s})


async def serve(addresses: list[str], options: dict[str, Any], first_index: int) -> None:
    from engines.inference import make_engine
    from rollout.bus.server import EngineServer

    servers = [EngineServer(make_engine("sim", options.get("model", "7b-h100"),
                                        **{**{k: v for k, v in options.items() if k != "model"},
                                           "seed": first_index + i}),
                            address, f"sim{first_index + i}") for i, address in enumerate(addresses)]
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    tasks = [asyncio.ensure_future(s.run()) for s in servers]
    waiter = asyncio.ensure_future(stop.wait())
    done, _ = await asyncio.wait([waiter, *tasks], return_when=asyncio.FIRST_COMPLETED)
    for s in servers:
        s.stop()
    await asyncio.gather(*tasks, return_exceptions=True)
    failed = [t.exception() for t in done if t is not waiter and t.exception()]
    if failed:
        raise failed[0]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--addresses", required=True, help="comma-separated EngineServer addresses, one engine each")
    ap.add_argument("--options", default="{}", help="the sim engines' options as JSON")
    ap.add_argument("--first-index", type=int, default=0, help="index of the first engine (ids and seeds)")
    args = ap.parse_args(argv)
    asyncio.run(serve([a for a in args.addresses.split(",") if a], json.loads(args.options), args.first_index))


if __name__ == "__main__":
    main()
