"""A burst of submits while large results wait in the worker's pipe: neither side may block the
other (the feeder submits a step's groups at once while the first trajectories finish)."""

from __future__ import annotations

import os
import signal
import threading
import time

from agent.loop import AgentLoopBase, AgentLoopOutput
from rollout.manager import AgentLoopManager, ManagerConfig

TOKENS = 20_000  # a result of ~100 KB pickled: one fills the results pipe's buffer


class BigLoop(AgentLoopBase):
    async def run(self, sampling_params, **row):
        ids = list(range(TOKENS))
        return AgentLoopOutput([1, 2], ids, [1] * TOKENS, [-0.5] * TOKENS, 1.0, 1, "stop",
                               session_id=row["session_id"])


def test_a_burst_of_submits_does_not_deadlock_on_full_pipes(servers):
    srv = servers(1, backend="echo", model="tiny-llama")
    cfg = ManagerConfig(addresses=srv.addresses, tokenizer="tiny-llama", num_workers=1, n=1,
                        agent_loops={"big": f"{__name__}.BigLoop"}, progress=False)
    row = {"agent_name": "big", "prompt": [{"role": "user", "content": "x" * 4000}]}  # fills the task pipe soon
    calls = 60
    mgr = AgentLoopManager(cfg).start()
    submitted = threading.Event()
    try:
        def burst() -> None:  # as the feeder does: every group of a step, before polling any result
            for _ in range(calls):
                mgr.submit([row])
            submitted.set()

        threading.Thread(target=burst, daemon=True).start()
        assert submitted.wait(60), "submit() blocked: the worker stopped reading tasks while its results pipe was full"
        got, deadline = 0, time.monotonic() + 120
        while got < calls:
            assert time.monotonic() < deadline, f"{got} of {calls} results came back"
            got += len(mgr.poll(timeout_s=1.0))
    finally:
        if not submitted.is_set():  # deadlocked: close() could not even send the worker its stop
            for pid in mgr.worker_pids:
                os.kill(pid, signal.SIGKILL)
        mgr.close()
