"""The engine fleet of a run: the engine servers every node starts (or the ones it attaches to),
their addresses and keys, the trainer's control client, sleep/wake, status, logs and shutdown.

On every node, local rank 0 starts that node's engines from the placement plan (`parallel.mesh`):
a slice of the node's cores each on CPU, their own GPUs (`CUDA_VISIBLE_DEVICES`) on GPU nodes. Each
engine binds ipc for clients on its node and, when the job spans nodes, tcp for the others, behind
the run's CURVE keys (`rollout.bus.auth`); the addresses travel to every rank over
torch.distributed, so no shared filesystem is needed. Global rank 0 prints the plan and writes it to
the run directory, and holds the control client (status, sleep/wake, weight pushes). Colocated
engines sleep through the actor's update and wake for the sync. A reward model's engines
(`rollout/reward_engines.py`) are started here too, on rank 0, and never sleep.
"""

from __future__ import annotations

import json
import os
import socket
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from engines.inference import ENGINES
from rollout.bus.control import ControlClient
from rollout.config import RolloutConfig
from rollout.engine_stats import engine_metrics, statuses
from rollout.topology import EngineInfo, Topology


def node_topology() -> tuple[int, int, int]:
    """(node index, number of nodes, local rank) of this process under torchrun (0, 1, 0 alone)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
    node = int(os.environ.get("GROUP_RANK", os.environ.get("NODE_RANK", "0")))
    return node, max(1, world // max(1, local_world)), int(os.environ.get("LOCAL_RANK", "0"))


def bind_host(configured: str | None) -> str:
    """The address other nodes reach this node's engines on: the config, $SWITCHYARD_HOST, or the
    local address of the route to the rendezvous host (what torchrun's other nodes reach too)."""
    if configured:
        return configured
    if os.environ.get("SWITCHYARD_HOST"):
        return os.environ["SWITCHYARD_HOST"]
    master = os.environ.get("MASTER_ADDR", "127.0.0.1")
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((master, 9))  # no packet is sent; this only picks the outgoing interface
            return s.getsockname()[0]
    except OSError:
        return socket.gethostbyname(socket.gethostname())


def resolve_placement(mode: str, asynchronous: bool = False) -> str:
    """`rollout.placement` with `auto` decided: on GPUs colocated, or split where rollout runs on during
    the update (`asynchronous`: `RolloutConfig.asynchronous`; colocated engines sleep through it) and
    the node has GPUs past its training ranks; on a CPU-only machine the cores. A GPU node left with
    none for such engines is an error naming the fixes, raised before any model loads."""
    if mode != "auto":
        return mode
    if not torch.cuda.is_available():
        return "cpu"
    if not asynchronous:
        return "colocated"
    gpus, training = torch.cuda.device_count(), int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if gpus > training:
        return "split"
    raise ValueError(f"rollout.staleness >= 1 needs engines that generate during the update, and all {gpus} "
                     f"GPU(s) of this node train ({training} rank(s)): start fewer ranks so engines get GPUs of their "
                     f"own (rollout.placement=split), put the engines on the CPU (rollout.placement=cpu), or set "
                     f"rollout.staleness=0")


class EngineFleet:
    def __init__(self, cfg: RolloutConfig, model_dir: str, dtype: str, rank: int, world: int,
                 sleep_level: int = 2) -> None:
        """`sleep_level`: how deep colocated engines sleep through the update (`RolloutConfig.sleep_level_for`)."""
        self.cfg, self.model_dir, self.dtype, self.rank, self.world = cfg, model_dir, dtype, rank, world
        self.sleep_level = sleep_level
        self.replica_of: list[int] = [0]  # every rank's data-parallel replica (start)
        self.node, self.nodes, self.local_rank = node_topology()
        self.placement = resolve_placement(cfg.placement, cfg.asynchronous)  # never colocated when asynchronous
        self.sleeps = self.placement == "colocated"
        self.procs: list[Any] = []
        self.engines: list[EngineInfo] = []
        self.engine_logs: list[Path] = []
        self.keys: Any = None
        self.control: ControlClient | None = None  # rank 0's client to every engine (connect)
        self.tmp_dirs: list[Path] = []  # this node's sockets, keys and engine logs
        self.run_dir = Path(".")  # the run's output directory (start)
        self._last: dict[str, dict[str, float]] = {}  # engine id -> counters at the last report
        self.leaders: list[int] = [0]  # the global rank that started each node's engines (its local rank 0)
        self.inproc: Any = None  # rollout.in_process: the engine this process serves
        self.reward_engines: Any = None  # rank 0: the reward model's engines (rollout/reward_engines.py)
        self.launched: list[tuple[Any, ...]] | None = None  # this node's engines once spawned (launch/start)

    # ------------------------------------------------------------------ start-up
    def start(self, run_dir: Path, engine_options: dict[str, Any], dp_rank: int = 0) -> Topology:
        """Every node's local rank 0 starts its engines (`engine_options` on top of the config's
        defaults), unless `launch` did; every rank learns every engine's addresses and every rank's
        data-parallel replica (this one's: `dp_rank`). Returns what every rank now knows of them."""
        self.run_dir = run_dir
        multi = self.nodes > 1
        attached = bool(self.cfg.engines)  # engines as a service (rollout/service.py): started elsewhere
        if attached:
            from rollout.service import service_keys

            self.keys, self.sleeps = service_keys(self.cfg), False
        elif multi:
            from rollout.bus.auth import BusKeys

            box = [BusKeys.generate() if self.rank == 0 else None]
            torch.distributed.broadcast_object_list(box, src=0)  # never written to the run directory
            self.keys = box[0]
        if self.spawns(launching=False):
            self.launched = self._spawn(run_dir, multi, engine_options)
        local = self._bound(self.launched, multi) if self.launched is not None else []
        self._keep_off_engine_cores()
        if self.world > 1:
            everyone: list[Any] = [None] * self.world
            torch.distributed.all_gather_object(everyone, (local, dp_rank, self.local_rank))
            self.engines = [e for part, _, _ in everyone for e in part]
            self.replica_of = [dp for _, dp, _ in everyone]
            self.leaders = [r for r, (_, _, lr) in enumerate(everyone) if lr == 0]
        else:
            self.engines = local
        if attached:
            self.engines = [EngineInfo(f"service{i}", -1, (), a, a, 0) for i, a in enumerate(self.cfg.engines)]
        if self.rank == 0:
            text = self.describe()
            print(text, flush=True)
            run_dir.mkdir(parents=True, exist_ok=True)
            (run_dir / "placement.txt").write_text(text + "\n")
            (run_dir / "engines.json").write_text(json.dumps([asdict(e) for e in self.engines], indent=1) + "\n")
        return Topology(self.rank, self.world, self.node, self.nodes, self.local_rank, tuple(self.leaders),
                        tuple(self.engines), self.placement, self.keys, self.inproc)

    def spawns(self, launching: bool) -> bool:
        """Whether this process spawns its node's engines at `launch` (`launching`) or at `start`:
        local rank 0, engines of the run's own, not spawned yet."""
        if self.launched is not None or self.local_rank != 0:
            return False
        return self.loads_beside_the_trainer if launching else not self.cfg.engines

    @property
    def loads_beside_the_trainer(self) -> bool:
        """Whether this run's engines are spawned at setup and load while the trainer works (`launch`);
        the same answer on every rank, so every rank orders its collectives alike around `start`."""
        colocated_gpu = self.placement == "colocated" and torch.cuda.is_available()
        return not (self.cfg.engines or self.cfg.in_process or self.nodes > 1 or colocated_gpu)

    def launch(self, run_dir: Path, engine_options: dict[str, Any]) -> None:
        """One node, engines of its own on the CPU or on GPUs apart from the trainer's: their processes
        are spawned now and load while the trainer builds its actor (`start` then waits for them).
        Elsewhere (several nodes exchange keys first; colocated engines measure the GPU memory they
        find free, so the actor must hold its share first; in-process or attached engines) `start`
        does it all."""
        if not self.spawns(launching=True):
            return
        self.run_dir = run_dir
        self.launched = self._spawn(run_dir, False, engine_options)

    def _spawn(self, run_dir: Path, tcp: bool, engine_options: dict[str, Any]) -> list[tuple[Any, ...]]:
        """This node's engine processes (or in-process engine), started; (id, slot, proc, endpoint file, log) each."""
        from parallel.mesh import plan_placement
        from rollout.bus.launcher import socket_dir, start_server_process

        cfg = self.cfg
        if torch.cuda.is_available() and self.placement != "cpu":  # written for GPU nodes, not run here
            # every node plans alike: colocated engines on its training GPUs; split engines on the
            # GPUs past its local ranks (train.sbatch's ENGINE_GPUS_PER_NODE leaves them free)
            tp = int(cfg.engine_options.get("tensor_parallel_size", 1))
            local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
            plan = plan_placement(self.placement, nodes=1, devices_per_node=torch.cuda.device_count(),
                                  train_devices=local_ranks, rollout_tp=tp)
            slots = list(plan.engines)
        else:
            slots = list(plan_placement("cpu", num_engines=cfg.num_engines, cores=cfg.engine_cores or None).engines)
        tmp = socket_dir("switchyard-")  # mode 0700: the ipc sockets' trust boundary
        self.tmp_dirs.append(tmp)  # removed by close()
        keys_file = self.keys.write(tmp / "bus_keys.json") if self.keys is not None else None
        on_gpus = torch.cuda.is_available() and self.placement != "cpu"  # each engine sees its own GPUs as cuda:0..
        device = dict(ENGINES[cfg.engine].on_gpu) if on_gpus else {}
        options = {**ENGINES[cfg.engine].defaults, "dtype": self.dtype, **device, **engine_options,
                   **cfg.engine_options}
        host = bind_host(cfg.bind_host) if tcp else None
        started = []
        for i, slot in enumerate(slots):
            eid = f"node{self.node}-engine{i}" if self.nodes > 1 else slot.engine_id
            addrs = [f"ipc://{tmp}/{eid}.sock"] + ([f"tcp://{host}:0"] if tcp else [])
            log, env, cores = tmp / f"{eid}.log", None, list(slot.devices)
            if torch.cuda.is_available() and self.placement != "cpu":
                env, cores = {"CUDA_VISIBLE_DEVICES": ",".join(map(str, slot.devices))}, None
            request_log = None
            if cfg.request_log:
                (run_dir / "engines").mkdir(parents=True, exist_ok=True)
                request_log = run_dir / "engines" / f"{eid}.jsonl"
            if cfg.in_process:  # served from this process: weights load by reference (rollout/inproc.py)
                from rollout.inproc import InProcessEngine

                if self.nodes > 1:
                    raise RuntimeError("rollout.in_process=true is for one node; across nodes weights travel by "
                                       "collective broadcast: turn it off")
                self.inproc = InProcessEngine(cfg.engine, self.model_dir, addrs, eid, options,
                                              str(request_log) if request_log else None)
                self.procs.append(self.inproc)
                started.append((eid, slot, self.inproc, None, log))
                continue
            proc = start_server_process(cfg.engine, self.model_dir, addrs, eid, options, log_file=log, env=env,
                                        cpu_cores=cores, keys_file=keys_file, endpoint_file=tmp / f"{eid}.json",
                                        request_log=request_log)
            self.procs.append(proc)
            self.engine_logs.append(log)
            started.append((eid, slot, proc, tmp / f"{eid}.json", log))
        return started

    def _bound(self, started: list[tuple[Any, ...]], tcp: bool) -> list[EngineInfo]:
        """The started engines once each has bound its addresses (within rollout.startup_timeout_s)."""
        from rollout.bus.launcher import read_endpoints

        infos = []
        for eid, slot, proc, endpoint_file, log in started:
            bound = (proc.endpoints(self.cfg.startup_timeout_s) if endpoint_file is None
                     else read_endpoints(endpoint_file, proc, self.cfg.startup_timeout_s, log))
            infos.append(EngineInfo(eid, self.node, tuple(slot.devices), bound[0], bound[1] if tcp else None, proc.pid))
        return infos

    def _keep_off_engine_cores(self) -> None:
        """`rollout.engine_cores` on CPU: this rank (and the agent workers it starts) keeps to the other cores."""
        if self.cfg.engine_cores and self.placement == "cpu":
            from parallel.mesh import keep_off_cores

            keep_off_cores(list(self.cfg.engine_cores))

    def describe(self) -> str:
        if self.cfg.engines:
            return (f"attached to {len(self.engines)} engine(s) started on their own (rollout.engines); weights go "
                    f"over the bus, and this run never sleeps or stops them:\n  " + "\n  ".join(self.cfg.engines))
        kind = "cores" if self.placement == "cpu" or not torch.cuda.is_available() else "GPUs"
        lines = [f"placement {self.placement}: {self.nodes} node(s), {len(self.engines)} engine(s); agent workers "
                 f"on node 0 route over all of them"]
        if self.placement == "cpu":
            lines.append(f"  engines on cores {list(self.cfg.engine_cores)}, the trainer ranks on the others"
                         if self.cfg.engine_cores else "  engines share each node's cores with its trainer ranks")
        if self.sleeps:
            lines.append(f"  engines sleep (level {self.sleep_level}) during each update and wake for the sync")
        for e in self.engines:
            where = e.tcp or e.ipc
            lines.append(f"  {e.engine_id}: node {e.node}, {kind} {list(e.devices)}, {where}")
        return "\n".join(lines)

    def addresses(self) -> list[str]:
        """How this rank reaches every engine: ipc on its own node, tcp elsewhere."""
        return [e.ipc if e.node == self.node else str(e.tcp) for e in self.engines]

    def connect(self) -> None:
        """Rank 0: the trainer's control client, connected to every engine."""
        from rollout.bus.auth import TRAINER

        if self.rank == 0 and self.control is None:
            self.control = ControlClient(self.addresses(), self.keys.for_role(TRAINER) if self.keys is not None
                                         else None, self.cfg.startup_timeout_s)

    def start_reward_engines(self, model: dict[str, Any]) -> list[str]:
        """Rank 0: the reward model's or judge's own engines, started (or attached to); their addresses."""
        from rollout.reward_engines import RewardEngines

        self.reward_engines = RewardEngines(model, self.dtype, self.run_dir, self.cfg.request_log,
                                            self.cfg.startup_timeout_s)
        judges = self.reward_engines.start()
        self.engine_logs += self.reward_engines.logs
        print(self.reward_engines.describe(judges), flush=True)
        return judges

    def revive_reward_engines(self) -> dict[str, float]:
        """Rank 0, each step before the rollout: the reward model's engines that died and that its
        watcher has not restarted yet, started again (rollout/reward_engines.py `revive`); the run's
        count of such restarts as a metric."""
        if self.reward_engines is None:
            return {}
        self.reward_engines.revive()
        return {"reward_model/restarts": float(self.reward_engines.restarts)}

    # ------------------------------------------------------------------ every step
    def engine_metrics(self, seconds: float) -> dict[str, float]:
        """Rank 0: per engine since the last call (`rollout/engine_stats.py`); {} elsewhere."""
        if self.control is None:
            return {}
        return engine_metrics(self.engines, self._statuses(), self._last, seconds)

    def engine_busy_s(self) -> float:
        """Rank 0: the engines' summed seconds with a generation inside them so far (0 elsewhere)."""
        if self.control is None:
            return 0.0
        return sum(float(st.stats.get("busy_s", 0.0)) for st in self._statuses() if st is not None)

    def sleep(self) -> dict[str, float]:
        """Colocated: every engine frees its memory for the update (level `sleep_level`). Returns
        each engine's resident memory once asleep (rank 0; {} elsewhere or when not colocated)."""
        if not self.sleeps or self.control is None:
            return {}
        from rollout.bus import protocol as P

        self.control.run(self.control.client.broadcast(P.Sleep(level=self.sleep_level)))
        return {f"engine/{e.engine_id}/rss_asleep_mb": float(st.stats.get("rss_mb", 0))
                for e, st in zip(self.engines, self._statuses()) if st is not None}

    def _statuses(self) -> list[Any]:
        assert self.control is not None
        return statuses(self.control, len(self.engines))

    def wake(self) -> None:
        """Colocated: engines take their memory back; after level 2 they serve again only once the
        next weight push has committed."""
        if self.sleeps and self.control is not None:
            from rollout.bus import protocol as P

            self.control.run(self.control.client.broadcast(P.Wake()))

    # ------------------------------------------------------------------ shutdown
    def print_engine_logs(self, tail: int = 3000) -> None:
        """The last lines of every engine's log on this node, on stderr: what a failed run needs."""
        for log in self.engine_logs:
            if log.exists():
                print(f"--- {log.name} (last lines) ---\n{log.read_text()[-tail:]}", file=sys.stderr)

    def close(self) -> None:
        if self.control is not None:
            self.control.close()
        self.control = None
        if self.reward_engines is not None:
            self.reward_engines.close()
            self.reward_engines = None
        from rollout.bus.launcher import stop_processes

        stop_processes(self.procs)
        self.procs = []
        import shutil

        for d in self.tmp_dirs:  # sockets, keys and engine logs (their tails were printed on failure)
            shutil.rmtree(d, ignore_errors=True)
        self.tmp_dirs = []
