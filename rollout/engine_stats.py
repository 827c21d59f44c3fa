"""What the trainer reads of its engines between steps: every engine's status (asked of all at once)
and the per-engine metrics of a step (requests, tokens, busy fraction, node, weight version, memory)."""

from __future__ import annotations

import asyncio
from typing import Any

COUNTERS = {"requests": "requests", "tokens": "generated_tokens", "busy_s": "busy_s", "preemptions": "preemptions"}


def statuses(control: Any, count: int) -> list[Any]:
    """Every engine's status; None for an engine that is down or died meanwhile (failover already
    handles its work: a metric gap, never a failed step)."""
    client = control.client

    async def one(i: int) -> Any:
        if not client.router.alive[i]:
            return None
        try:
            return await client.status(i)
        except Exception:
            return None

    async def every() -> list[Any]:
        return list(await asyncio.gather(*(one(i) for i in range(count))))

    return control.run(every())


def engine_metrics(engines: list[Any], states: list[Any], last: dict[str, dict[str, float]],
                   seconds: float) -> dict[str, float]:
    """Per engine since the previous call (`last` holds its counters and is updated): requests
    served, tokens generated, preemptions, busy fraction of `seconds`; its node, weight version and
    resident memory now."""
    out: dict[str, float] = {}
    for e, st in zip(engines, states):
        p = f"engine/{e.engine_id}/"
        if st is None:
            out[p + "alive"] = 0.0
            continue
        now = {k: float(st.stats.get(key, 0)) for k, key in COUNTERS.items()}
        before = last.get(e.engine_id, dict.fromkeys(COUNTERS, 0.0))
        last[e.engine_id] = now
        out.update({p + "alive": 1.0, p + "node": float(e.node), p + "weight_version": float(st.weight_version),
                    p + "requests": now["requests"] - before["requests"], p + "tokens": now["tokens"] - before["tokens"],
                    p + "preemptions": now["preemptions"] - before["preemptions"],
                    p + "busy": min(1.0, (now["busy_s"] - before["busy_s"]) / max(seconds, 1e-9)),
                    p + "rss_mb": float(st.stats.get("rss_mb", 0.0))})
    return out
