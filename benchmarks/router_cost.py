"""The router's cost per decision against the number of engines: a new session's first turn (a
least-loaded choice under sticky_group) and a known session's later turn, and round robin.

    python benchmarks/router_cost.py
"""

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from rollout.bus.router import Router  # noqa: E402


for policy in ("sticky_group", "round_robin"):
    for n in (8, 64, 256):
        r = Router(n, policy)
        k = 20000
        t = time.perf_counter()
        for i in range(k):
            r.pick(f"s{i}", f"g{i // 8}")  # a new session each time (first turns)
        new = (time.perf_counter() - t) / k * 1e6
        t = time.perf_counter()
        for i in range(k):
            r.pick(f"s{i}", f"g{i // 8}")  # later turns of known sessions
        old = (time.perf_counter() - t) / k * 1e6
        print(f"{policy:>13} engines={n:>3}: first turn {new:6.1f} us/pick, later turns {old:6.1f} us/pick")
