"""Weight sync: the actor's weights into every engine of the run (all it knows of them: the
`Topology`, `rollout/topology.py`), one call per weight version, by the route the run's placement
picks from `routes.ROUTES`. One node: rank 0 packs each bucket into a shared-memory slot its
node's engines map (`shm`), or, colocated on one GPU, into a device buffer they open by its CUDA
IPC handle (`handle`). Several nodes: rank 0 broadcasts each bucket to every node's leader, which
feeds its engines the same way (`collective`). `rollout.weight_path=bus`: frames over the sockets
(`bus`); `rollout.in_process`: tensors by reference (`in_process`).

`WeightSync.version` is the run's weight version, the one place the trainer keeps it: `publish`
pushes the actor's weights as the next version (preempting running generations under asynchronous
RL), `catch_up` brings attached engines that restarted back to it, `load` sets it at start or
resume. Whatever the route, a LoRA actor's push is the adapter alone (`engines/lora.py`) when the
run's engines apply adapters (`takes_adapters`), and the merged weights otherwise. After a push of
whole weights every engine's digest is compared with what was sent (`verify.py`)."""

from __future__ import annotations

import sys
import time
from collections.abc import Iterable
from typing import Any

import torch

from engines.inference import ENGINES
from rollout.topology import Topology
from rollout.weights.link import Link, Placement, Push, drain
from rollout.weights.routes import ROUTES, choose
from rollout.weights.shm import free_bytes, shm_dir
from rollout.weights.verify import DigestTap, check_engines, tied_embeddings, warn_mismatched


class WeightSync:
    """The run's weights into its fleet's engines. Every rank holds one; rank 0 is the source.
    `adapter_rank`: the actor trains a LoRA adapter of that rank (0: none); `frees_weights`: the
    engines free their weights while asleep (colocated, sleep level 2). What it knows of the engines
    themselves is the `Topology` the fleet returned (`connect`) and rank 0's control client
    (`connect_clients`)."""

    def __init__(self, cfg: Any, dtype: str, model_dir: str, adapter_rank: int = 0, frees_weights: bool = False) -> None:
        self.cfg, self.dtype, self.model_dir = cfg, dtype, model_dir
        self.adapter_rank, self.frees_weights = adapter_rank, frees_weights
        self.topology: Topology | None = None  # the engines, once started (connect)
        self.control: Any = None  # rank 0's control client to every engine (connect_clients)
        self.version = 0  # the weight version the engines serve (or are being sent)
        self.routes: dict[str, Any] = {}  # the routes used so far, by name (they keep their buffers)
        self.last_sync: dict[str, float] = {}  # the last push's figures (engines per route, GB, GB/s, digests)
        self.mismatched: dict[int, list[tuple[str, float]]] = {}  # the last push's differing tensors per engine
        self.verified_pushes = 0  # pushes checked against the engines' digests so far (which share the next checks)
        self.group: Any = None  # the node leaders' process group, for the collective route (connect)
        self.local_control: Any = None  # another node's leader: its client to its own engines (connect_clients)
        self._no_room = False  # shared memory too small for two buckets on this one-node run: the bus instead
        self._attached_dtype: str | None = None  # what attached engines hold (they report it), learned at the first push

    def takes_adapters(self) -> bool:
        """Whether each push carries only the actor's LoRA adapter: it trains one, and this run's
        engines apply one (`EngineSpec.adapters`) on top of base weights they keep. Merged weights
        instead go to engines started elsewhere (they may not have been told to take adapters) and
        to colocated engines that free their weights while asleep (`rollout.sleep_level=2`, which a LoRA
        run does not take unless told)."""
        spec = ENGINES[self.cfg.engine]
        if self.cfg.in_process and spec.in_process:
            spec = ENGINES[spec.in_process]
        return self.adapter_rank > 0 and spec.adapters and not self.cfg.engines and not self.frees_weights

    def adapter_options(self) -> dict[str, Any]:
        """Engine options that ready an engine for adapters of the actor's rank (`EngineSpec.adapter_option`)."""
        spec = ENGINES[self.cfg.engine]
        option = spec.adapter_option
        return {option: self.adapter_rank} if option and self.takes_adapters() else {}

    def route(self) -> str:
        """How weights reach the engines: the first route of `rollout.weights.routes.ROUTES` that
        applies to this run's placement (in_process, bus, collective, handle, shm; see there)."""
        path = "bus" if self.cfg.engines else self.cfg.weight_path  # attached engines: only the bus reaches them
        nodes = self._topology().nodes
        return choose(Placement(in_process=bool(self.cfg.in_process), weight_path=path,
                                shm_room=not self._no_room, nodes=nodes,
                                engines_on_my_gpu=nodes == 1 and self._engines_on_my_gpu()))

    def _topology(self) -> Topology:
        if self.topology is None:
            raise RuntimeError("the weight sync knows no engines yet: connect(topology) once the fleet started")
        return self.topology

    def _engines_on_my_gpu(self) -> bool:
        """Colocated on one GPU node with every engine on rank 0's GPU: buckets go by CUDA IPC handle
        (`rollout.weights.handle`) and never leave the device. Written for GPUs, not run here."""
        engines = self._topology().engines
        if self._topology().placement != "colocated" or not torch.cuda.is_available() or not engines:
            return False
        mine = (torch.cuda.current_device(),)
        return all(tuple(e.devices) == mine for e in engines)

    def check_room(self, node: int, nodes: int, local_rank: int) -> None:
        """Before this node's engines are spawned: shared memory must hold two buckets (a container's
        /dev/shm is often 64 MiB): one node falls back to the bus with a warning; several nodes, whose
        leaders all take the collective path, stop with what to change."""
        need = 2 * (self.cfg.weight_bucket_mb << 20)
        if self.cfg.weight_path == "bus" or self.cfg.in_process or local_rank != 0:
            return
        free = free_bytes()
        if free >= need:
            return
        text = (f"{shm_dir()} has {free >> 20} MiB free, the weight path through shared memory needs "
                f"{need >> 20} MiB (2 x rollout.weight_bucket_mb)")
        if nodes > 1:
            raise RuntimeError(f"node {node}: {text}; enlarge it (docker run --shm-size=2g), lower "
                               "rollout.weight_bucket_mb, or set rollout.weight_path=bus")
        print(f"WARNING: {text}; weights go over the bus instead (slower). Enlarge it (docker run --shm-size=2g) "
              "or lower rollout.weight_bucket_mb to use it.", file=sys.stderr, flush=True)
        self._no_room = True

    def push(self, named: Iterable[tuple[str, torch.Tensor]], version: int, preempt: bool = False,
             engines: list[int] | None = None) -> float:
        """Load `named` into every engine as `version` by the route `route()` names (one of
        `rollout.weights.routes.ROUTES`); seconds taken. Every rank iterates `named` (a sharded actor
        gathers while it yields); rank 0 is the source. `preempt`: running generations stop and
        continue on the new weights instead of finishing first. `engines`: only these (indices into
        the run's engines; the bus routes), e.g. attached engines that restarted and lag behind.
        `last_sync` holds the step's figures (engines per route, GB, GB/s)."""
        name = self.route()
        t = self._topology()
        if name != "collective" and (t.rank != 0 or self.control is None):
            drain(named)
            return 0.0
        if name not in self.routes:
            self.routes[name] = ROUTES[name]()
        t0 = time.perf_counter()
        timeout_s = self.cfg.startup_timeout_s if name == "collective" else 600.0
        # the source keeps a digest of each tensor it sends (or of a rotating share of them), to compare
        # with what the engines then serve
        tap = DigestTap(named, self.engine_dtype(), *self._verify_share(engines)) if self._verifies() else None
        sent = self.routes[name].send(
            Push(tap if tap is not None else named, version, preempt, self.cfg.weight_bucket_mb << 20,
                 self.engine_dtype(), timeout_s, engines),
            Link(t.rank, t.local_rank, self.control, self.local_control, self.group, t.inproc))
        seconds = time.perf_counter() - t0
        if t.rank == 0:
            here = sum(e.node == t.node for e in t.engines)
            self.last_sync = {f"sync/engines_{name}": float(len(t.engines) - here if name == "collective" else
                                                             len(t.engines)),
                              "sync/gb": sent / 1e9, "sync/gb_per_s": sent / 1e9 / max(seconds, 1e-9)}
            if name == "collective":
                self.last_sync["sync/engines_shm"] = float(here)
            if tap is not None:
                self._verify(tap, version, engines)
        return seconds

    def connect(self, topology: Topology) -> None:
        """Every rank, once the fleet started (`topology`): the node leaders' process group for the
        collective route (torch.distributed asks every rank to create it)."""
        self.topology = topology
        if self.route() == "collective":
            self.group = torch.distributed.new_group(list(topology.leaders))

    def connect_clients(self, control: Any) -> None:
        """Once the fleet's control client is up: rank 0 pushes through `control`. Another node's leader
        on the collective route: a control client to its own engines."""
        from rollout.bus.auth import TRAINER
        from rollout.bus.control import ControlClient

        t, self.control = self._topology(), control
        if t.rank != 0 and t.local_rank == 0 and self.route() == "collective":
            mine = [e.ipc for e in t.engines if e.node == t.node]
            self.local_control = ControlClient(mine, t.keys.for_role(TRAINER) if t.keys is not None else None,
                                               self.cfg.startup_timeout_s)

    def publish(self, actor: Any, preempt: bool = False) -> float:
        """The actor's weights into every engine as the next version; seconds taken. `preempt`:
        running generations stop for it and go on with the new weights (asynchronous RL)."""
        self.version += 1
        return self.push(actor.named_sync_weights(self.takes_adapters()), self.version, preempt)

    def load(self, actor: Any, version: int) -> float:
        """At start: the engines (started from the base model) brought to the actor as `version`."""
        self.version = version
        return self.push(actor.named_sync_weights(self.takes_adapters()), version)

    def catch_up(self, actor: Any) -> float:
        """Attached engines that restarted (and serve an older version) get the current weights
        again before a rollout (rollout/service.py); the others already hold them."""
        lagging = self._behind()
        if not lagging:
            return 0.0
        return self.push(actor.named_sync_weights(self.takes_adapters()), self.version, engines=lagging)

    def _behind(self) -> list[int]:
        """Every rank: the attached engines that serve an older weight version than the run's (they
        restarted, by the version each reports: `rollout/engine_stats.py`), to push the weights to again
        before the rollout (rollout/service.py); the others already hold it and would refuse it."""
        if not self.cfg.engines:
            return []
        from rollout.engine_stats import statuses

        t = self._topology()
        box = [[i for i, st in enumerate(statuses(self.control, len(t.engines)))
                if st is not None and st.weight_version < self.version] if self.control is not None else []]
        if t.world > 1:
            torch.distributed.broadcast_object_list(box, src=0)
        return list(box[0])

    def _verifies(self) -> bool:
        """Whether this push is checked against the engines' digests (rank 0, whole weights, not off)."""
        return self._topology().rank == 0 and self.control is not None and self.cfg.verify_weights \
            and not self.takes_adapters()

    def _verify_share(self, engines: list[int] | None) -> tuple[int, int]:
        """(every, offset) of the tensors this push checks: all of them on the first push this process
        makes (a run's start, a resume's) and to restarted engines (`engines`), else with
        `rollout.verify_weights_every` N every N-th, the start moving by one each push, so each tensor
        is checked at least every N pushes."""
        every = self.cfg.verify_weights_every
        if engines is not None or self.verified_pushes == 0 or every <= 1:
            return 1, 0
        return every, self.verified_pushes % every

    def _verify(self, tap: DigestTap, version: int, engines: list[int] | None) -> None:
        """Compare what every engine serves now with what `tap` saw sent; name what differs (verify.py)."""
        dtype = str(self.engine_dtype()).removeprefix("torch.")
        tied = tied_embeddings(self.model_dir)
        found = check_engines(self.control, tap.sent, dtype, tied, engines, names=tap.asked(tied))
        self.verified_pushes += 1
        self.mismatched = found["mismatched"]
        self.last_sync.update({"sync/verified_tensors": float(found["compared"]),
                               "sync/mismatched_tensors": float(sum(len(b) for b in self.mismatched.values())),
                               "sync/unverified_engines": float(found["unavailable"])})
        if self.mismatched:
            warn_mismatched(self.mismatched, version, dtype)

    def close(self) -> None:
        self.control = None  # the fleet's: it closes it
        if self.local_control is not None:
            self.local_control.close()
            self.local_control = None
        for route in self.routes.values():
            route.close()
        self.routes = {}

    def engine_dtype(self) -> torch.dtype | None:
        """The engines' dtype, which buckets are cast to before they travel (None: as the actor has them):
        the run's `model.dtype` for engines it starts, and what attached engines report (`rollout.engines`
        run in the dtype they were started with, whatever this run trains in)."""
        name = self._attached() if self.cfg.engines else str(self.dtype)
        dtype = getattr(torch, str(name), None)
        return dtype if isinstance(dtype, torch.dtype) else None

    def _attached(self) -> str:
        """Rank 0: the dtype every attached engine reports in its status (asked once); engines that hold
        different dtypes cannot take one push, and are named."""
        if self._attached_dtype is not None or self.control is None:
            return self._attached_dtype or str(self.dtype)
        from rollout.engine_stats import statuses

        held = {self.cfg.engines[i]: st.stats.get("dtype") for i, st in
                enumerate(statuses(self.control, len(self._topology().engines))) if st is not None}
        kinds = {d for d in held.values() if d}
        if len(kinds) > 1:
            raise RuntimeError(f"the attached engines hold different dtypes ({held}); one push cannot serve them all: "
                               "start every engine server with the same --option dtype=...")
        self._attached_dtype = kinds.pop() if kinds else str(self.dtype)
        if self._attached_dtype != str(self.dtype) and self._topology().rank == 0:
            print(f"the attached engines hold {self._attached_dtype} and this run trains in model.dtype={self.dtype}: "
                  f"each push is cast to {self._attached_dtype} on the way", flush=True)
        return self._attached_dtype
