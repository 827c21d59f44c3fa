"""How a run's weights reach its engines, by placement: the part of `RolloutPlane` that pushes a
new version after each update (`route`, `push_weights`). One node: rank 0 packs each bucket into a
shared-memory slot its node's engines map (`rollout.shm`), or, colocated on one GPU, hands them CUDA IPC
handles of each bucket (`rollout.handles`). Several nodes: rank 0 broadcasts each
bucket to every node's leader (`rollout.weight_sync.relay_push`), which feeds its engines the same
way. `rollout.weight_path=bus`: frames over the sockets."""

from __future__ import annotations

import sys
import time
from collections.abc import Iterable
from typing import Any

import torch


class WeightRoutes:
    """Mixed into `RolloutPlane`, whose attributes it reads (cfg, rank, nodes, local_rank, node,
    engines, control, local_control, weight_group, slots, feeder, dtype, last_sync, _no_room)."""

    cfg: Any
    rank: int
    nodes: int
    node: int
    local_rank: int
    engines: list[Any]
    control: Any
    local_control: Any
    weight_group: Any
    slots: Any
    feeder: Any
    dtype: str
    last_sync: dict[str, float]
    _no_room: bool
    inproc: Any

    def route(self) -> str:
        """How weights reach the engines: `shm` (one node: rank 0 packs buckets into shared memory that
        the node's engines map), `collective` (several nodes: rank 0 broadcasts buckets to each node's
        leader, which feeds its engines through shared memory), or `bus` (frames over the sockets;
        rollout.weight_path=bus), or `in_process` (rollout.in_process: the engine is served from this
        process and takes the tensors by reference), or `ipc` (colocated on one GPU: CUDA IPC handles
        of each bucket, `rollout.handles`)."""
        if self.cfg.in_process:
            return "in_process"
        if self.cfg.weight_path == "bus" or self._no_room:
            return "bus"
        if self.nodes > 1:
            return "collective"
        return "ipc" if self._engines_on_my_gpu() else "shm"

    def _engines_on_my_gpu(self) -> bool:
        """Colocated on one GPU node with every engine on rank 0's GPU: buckets go by CUDA IPC handle
        (`rollout.handles`) and never leave the device. Written for GPUs, not run here."""
        placement = getattr(self, "placement", None)
        if placement != "colocated" or not torch.cuda.is_available() or not self.engines:
            return False
        mine = (torch.cuda.current_device(),)
        return all(tuple(e.devices) == mine for e in self.engines)

    def _check_shm_room(self) -> None:
        """Shared memory must hold two buckets (a container's /dev/shm is often 64 MiB): one node falls
        back to the bus with a warning; several nodes, whose leaders all take the collective path,
        stop with what to change."""
        from rollout.shm import free_bytes, shm_dir

        need = 2 * (self.cfg.weight_bucket_mb << 20)
        if self.cfg.weight_path == "bus" or self.cfg.in_process or self.local_rank != 0:
            return
        free = free_bytes()
        if free >= need:
            return
        text = (f"{shm_dir()} has {free >> 20} MiB free, the weight path through shared memory needs "
                f"{need >> 20} MiB (2 x rollout.weight_bucket_mb)")
        if self.nodes > 1:
            raise RuntimeError(f"node {self.node}: {text}; enlarge it (docker run --shm-size=2g), lower "
                               "rollout.weight_bucket_mb, or set rollout.weight_path=bus")
        print(f"WARNING: {text}; weights go over the bus instead (slower). Enlarge it (docker run --shm-size=2g) "
              "or lower rollout.weight_bucket_mb to use it.", file=sys.stderr, flush=True)
        self._no_room = True

    def push_weights(self, named: Iterable[tuple[str, torch.Tensor]], version: int, preempt: bool = False) -> float:
        """Load `named` into every engine as `version` by the route `route()` names; seconds taken.
        Every rank iterates `named` (a sharded actor gathers while it yields); rank 0 is the source.
        `preempt`: running generations stop and continue on the new weights instead of finishing
        first. `last_sync` holds the step's figures (engines per path, GB, GB/s)."""
        route = self.route()
        t0 = time.perf_counter()
        if route == "collective":
            sent = self._push_collective(named, version, preempt)
        elif self.rank != 0 or self.control is None:
            for _ in named:
                pass
            return 0.0
        elif route == "in_process":
            report = self.inproc.load(named, version, self.cfg.weight_bucket_mb << 20, self.engine_dtype(), preempt)
            sent = report.bytes
        else:
            from tqdm import tqdm

            from rollout.weight_sync import push_weights

            if route == "shm" and self.slots is None:
                from rollout.shm import ShmSlots

                self.slots = ShmSlots()
            elif route == "ipc" and self.slots is None:  # written for GPUs, not run here
                from rollout.handles import HandleSlots

                self.slots = HandleSlots(torch.device("cuda", torch.cuda.current_device()))
            bar = tqdm(named, desc="weight sync", unit="tensor", leave=False)
            report = self.control.run(push_weights(
                self.control.client, bar, version, bucket_bytes=self.cfg.weight_bucket_mb << 20, preempt=preempt,
                slots=self.slots if route in ("shm", "ipc") else None, dtype=self.engine_dtype()))
            sent = report.bytes
        seconds = time.perf_counter() - t0
        if self.rank == 0:
            here = sum(e.node == self.node for e in self.engines)
            self.last_sync = {f"sync/engines_{route}": float(len(self.engines) - here if route == "collective" else
                                                              len(self.engines)),
                              "sync/gb": sent / 1e9, "sync/gb_per_s": sent / 1e9 / max(seconds, 1e-9)}
            if route == "collective":
                self.last_sync["sync/engines_shm"] = float(here)
        if self.feeder is not None:
            self.feeder.weights_pushed()
        return seconds

    def engine_dtype(self) -> torch.dtype | None:
        """The engines' dtype, which buckets are cast to before they travel (None: as the actor has them)."""
        dtype = getattr(torch, str(self.dtype), None)
        return dtype if isinstance(dtype, torch.dtype) else None

    def _push_collective(self, named: Iterable[tuple[str, torch.Tensor]], version: int, preempt: bool) -> int:
        """Rank 0 broadcasts each bucket to every node's leader (gloo here, NCCL between GPU nodes),
        which receives it into a shared-memory slot and hands it to its engines; a version is
        committed on every node or on none. Bytes per node."""
        from rollout.shm import ShmSlots
        from rollout.weight_sync import relay_push

        if self.local_rank != 0:  # not a leader: only take part in the actor's gathers
            for _ in named:
                pass
            return 0
        control = self.control if self.rank == 0 else self.local_control
        assert control is not None, "start_workers() makes every node leader's control client"
        if self.slots is None:
            self.slots = ShmSlots()
        device = torch.device("cuda", torch.cuda.current_device()) if torch.distributed.get_backend(
            self.weight_group) == "nccl" else None  # written for GPU nodes, not run here
        return relay_push(control.client, control.loop, named, self.rank == 0, self.weight_group, self.slots, version,
                          self.cfg.weight_bucket_mb << 20, self.engine_dtype(), preempt, self.cfg.startup_timeout_s,
                          device)
