"""The reward model's own engine group (`reward.model`, see agent/rewards/model.py): started by rank 0
beside the policy's engines, or attached to when `reward.model.addresses` lists servers already
running. The policy's weight pushes, sleeps and wakes never address them; the run stops the ones
it started. An engine this run started that dies is started again at once, at the same address, by
a watcher thread (a judge killed mid-step would otherwise hold that step's scores until
`reward.model.timeout_s`); the requests it held are re-issued to it by the clients.

On a CPU box they share the node's cores with the rest of the run. On a GPU node,
`reward.model.devices` names the GPUs they get (`CUDA_VISIBLE_DEVICES`, split evenly over
`num_engines`); written for GPUs and not run on one yet.
"""

from __future__ import annotations

import functools
import shutil
import threading
from pathlib import Path
from typing import Any, Callable

from engines.inference import ENGINES


class RewardEngines:
    """`start()` returns the addresses the agent workers' reward clients use; `close()` stops what it started."""

    def __init__(self, model: dict[str, Any], dtype: str, run_dir: Path, request_log: bool,
                 startup_timeout_s: float) -> None:
        self.model, self.dtype, self.run_dir = dict(model), dtype, Path(run_dir)
        self.request_log, self.startup_timeout_s = request_log, startup_timeout_s
        self.procs: list[Any] = []
        self.logs: list[Path] = []
        self.tmp: Path | None = None
        self._launch: list[Callable[[], Any]] = []  # per engine: start its server again, same address and options
        self.restarts = 0
        self._lock = threading.Lock()  # the watcher and the step's revive() never restart one engine twice
        self._stop = threading.Event()
        self._watcher: threading.Thread | None = None

    def start(self) -> list[str]:
        from engines.models import resolve_model
        from rollout.bus.launcher import read_endpoints, socket_dir, start_server_process

        m = self.model
        if m.get("addresses"):
            return list(m["addresses"])  # attached: someone else runs (and stops) them
        engine = str(m["engine"])
        if engine not in ENGINES:
            raise ValueError(f"reward.model.engine={engine!r} is not an engine; choose one of {sorted(ENGINES)}")
        model_dir = str(resolve_model(str(m["path"])))
        import torch

        devices = [int(d) for d in m.get("devices") or []]
        on_gpu = dict(ENGINES[engine].on_gpu) if devices and torch.cuda.is_available() else {}
        options = {**ENGINES[engine].defaults, "dtype": self.dtype, **on_gpu, **dict(m.get("engine_options") or {})}
        self.tmp = socket_dir("switchyard-reward-")  # 0700: the ipc sockets' trust boundary
        n = int(m.get("num_engines", 1))
        started = []
        for i in range(n):
            eid = f"reward{i}"
            env = None
            if devices:
                share = devices[i * len(devices) // n:(i + 1) * len(devices) // n] or devices
                env = {"CUDA_VISIBLE_DEVICES": ",".join(map(str, share))}
            log_file = self.tmp / f"{eid}.log"
            request_log = None
            if self.request_log:
                (self.run_dir / "engines").mkdir(parents=True, exist_ok=True)
                request_log = self.run_dir / "engines" / f"{eid}.jsonl"
            launch = functools.partial(start_server_process, engine, model_dir, [f"ipc://{self.tmp}/{eid}.sock"], eid,
                                       options, log_file=log_file, env=env, endpoint_file=self.tmp / f"{eid}.json",
                                       request_log=request_log)
            proc = launch()
            self._launch.append(launch)
            self.procs.append(proc)
            self.logs.append(log_file)
            started.append((proc, self.tmp / f"{eid}.json", log_file))
        addresses = [read_endpoints(f, p, self.startup_timeout_s, log)[0] for p, f, log in started]
        self._watcher = threading.Thread(target=self._watch, name="reward-engines-watcher", daemon=True)
        self._watcher.start()
        return addresses

    def _watch(self, every_s: float = 0.5) -> None:
        while not self._stop.wait(every_s):
            try:
                self.revive()
            except Exception as e:  # noqa: BLE001 - the next step's revive() tries again and fails the run
                if self._stop.is_set():
                    return  # stopped while it was starting one: not a failure
                print(f"WARNING: restarting a reward model engine failed ({type(e).__name__}: {e}); the next "
                      "step tries once more", flush=True)
                return

    def revive(self) -> list[str]:
        """Start again, at the same address, every engine this run started that has died (a judge
        killed or crashed mid-run would otherwise fail every later trajectory's score), and wait until
        each serves; the agents' clients reconnect on their own. The ids of those restarted."""
        with self._lock:
            return [] if self._stop.is_set() else self._revive_locked()

    def _revive_locked(self) -> list[str]:
        from rollout.bus.launcher import read_endpoints

        dead = [i for i, p in enumerate(self.procs) if p.poll() is not None]
        for i in dead:
            eid = f"reward{i}"
            code = self.procs[i].returncode
            print(f"WARNING: reward model engine {eid} died (exit code {code}); restarting it (log: {self.logs[i]})",
                  flush=True)
            assert self.tmp is not None
            for stale in (self.tmp / f"{eid}.json", self.tmp / f"{eid}.sock"):
                stale.unlink(missing_ok=True)
            with open(self.logs[i], "a") as f:
                f.write(f"\n--- restarted after exit code {code}\n")
            self.procs[i] = self._launch[i]()
            read_endpoints(self.tmp / f"{eid}.json", self.procs[i], self.startup_timeout_s, self.logs[i])
            self.restarts += 1
        return [f"reward{i}" for i in dead]

    def describe(self, addresses: list[str]) -> str:
        m = self.model
        how = "attached" if m.get("addresses") else f"{len(self.procs)} x {m['engine']}"
        return f"reward model ({m['kind']}) {m['path']}: {how}, {', '.join(addresses)}"

    def close(self) -> None:
        from rollout.bus.launcher import stop_processes

        self._stop.set()  # first: an engine being stopped is not one that died
        if self._watcher is not None:
            self._watcher.join(timeout=5)
            self._watcher = None
        stop_processes(self.procs)
        self.procs = []
        if self.tmp is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)
            self.tmp = None
