"""Process groups and placement: who trains what, and where the engines live.

Training: tensor (TP) x pipeline (PP) x data (DP) parallel groups, built by megatron-core's
`parallel_state` (TP fastest, then DP, then PP), with every rank's coordinates gathered once so
code never has to assume the rank order.

Engines: a placement plan, printed at start-up.
  colocated  engines run on the training GPUs; they sleep (free their KV cache and move weights
             off the GPU) while the actor updates, and wake for the next rollout
  split      the first `train_gpus` GPUs train, the rest hold engines that never sleep; weights
             travel to them by broadcast
  cpu        engines are processes on the trainer's box, each on its own slice of the cores
Each engine spans `rollout_tp` devices (vLLM/SGLang run their own TP inside the engine); the
engines together are the rollout's data-parallel dimension.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

PLACEMENTS = ("colocated", "split", "cpu")


@dataclass(frozen=True)
class TrainMesh:
    rank: int
    world: int
    tp: int
    pp: int
    dp: int
    tp_rank: int
    pp_rank: int
    dp_rank: int
    coords: tuple[tuple[int, int, int], ...]  # (tp_rank, pp_rank, dp_rank) of every global rank
    groups: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    def rank_of(self, tp_rank: int, pp_rank: int, dp_rank: int) -> int:
        return self.coords.index((tp_rank, pp_rank, dp_rank))

    def stage_leader(self, stage: int) -> int:
        """TP rank 0 of pipeline stage `stage` in the first data-parallel replica."""
        return self.rank_of(0, stage, 0)

    @property
    def first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def last_stage(self) -> bool:
        return self.pp_rank == self.pp - 1

    def describe(self) -> str:
        return (f"training mesh: {self.world} ranks = TP {self.tp} x PP {self.pp} x DP {self.dp}; this rank "
                f"{self.rank} is tp {self.tp_rank}, pp {self.pp_rank}, dp {self.dp_rank}")


def init_training_mesh(tp: int = 1, pp: int = 1) -> TrainMesh:
    """Initialize torch.distributed (gloo on CPU, NCCL on GPUs; a one-rank group without torchrun)
    and megatron-core's model-parallel groups."""
    import tempfile

    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    if not dist.is_initialized():
        if "RANK" in os.environ:
            init_process_group()
        else:
            store = os.path.join(tempfile.mkdtemp(prefix="switchyard-pg-"), "store")
            dist.init_process_group(process_group_backend(torch.cuda.is_available()), init_method=f"file://{store}",
                                    rank=0, world_size=1)
    world = dist.get_world_size()
    if world % (tp * pp):
        raise ValueError(f"{world} ranks cannot be split into TP {tp} x PP {pp}; the world size must be a multiple "
                         f"of {tp * pp}")
    if not ps.model_parallel_is_initialized():
        ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    me = (ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank(), ps.get_data_parallel_rank())
    coords: list[Any] = [None] * world
    dist.all_gather_object(coords, me)
    groups = {"tp": ps.get_tensor_model_parallel_group(), "pp": ps.get_pipeline_model_parallel_group(),
              "dp": ps.get_data_parallel_group(), "mp": ps.get_model_parallel_group()}
    if pp > 1:
        groups["embedding"] = ps.get_embedding_group()
    return TrainMesh(rank=dist.get_rank(), world=world, tp=tp, pp=pp, dp=world // (tp * pp), tp_rank=me[0],
                     pp_rank=me[1], dp_rank=me[2], coords=tuple(tuple(c) for c in coords), groups=groups)


@dataclass(frozen=True)
class EngineSlot:
    engine_id: str
    node: int
    devices: tuple[int, ...]  # GPU indices on the node, or CPU cores for placement "cpu"


@dataclass(frozen=True)
class PlacementPlan:
    mode: str
    nodes: int
    devices_per_node: int
    train_devices: int
    rollout_tp: int
    engines: tuple[EngineSlot, ...]

    def describe(self) -> str:
        kind = "cores" if self.mode == "cpu" else "GPUs"
        if self.mode == "cpu":
            lines = [f"placement cpu: {len(self.engines)} engine process(es) on {self.devices_per_node} cores of "
                     "this box, which the trainer shares"]
        else:
            lines = [f"placement {self.mode}: {self.nodes} node(s) x {self.devices_per_node} {kind}; training on "
                     f"{self.train_devices} {kind}; {len(self.engines)} engine(s) of rollout TP {self.rollout_tp}"]
        if self.mode == "colocated":
            lines.append("  engines share the training GPUs: they sleep during each update and wake for rollout")
        for e in self.engines:
            lines.append(f"  {e.engine_id}: node {e.node}, {kind} {list(e.devices)}")
        return "\n".join(lines)


DEFAULT_TIMEOUT_S = 3600.0  # a collective may wait through a whole rollout; NCCL's own default is 10 min


def process_group_backend(cuda: bool) -> str:
    """One process group, a backend per device type: gloo for CPU tensors (metrics, norms, the
    batch handoff of CPU shards), NCCL for CUDA tensors. $SWITCHYARD_PG_BACKEND overrides it, e.g.
    `cpu:gloo,cuda:gloo` runs the GPU layout's per-device dispatch on a CPU-only box."""
    return os.environ.get("SWITCHYARD_PG_BACKEND") or ("cpu:gloo,cuda:nccl" if cuda else "gloo")


def cuda_backend(backend: str) -> str:
    """The backend a process group's `backend` string (`dist.get_backend()`: "nccl", "gloo" or a per-device
    list "cpu:gloo,cuda:nccl") names for CUDA tensors."""
    if ":" not in backend:
        return backend
    return dict(part.split(":", 1) for part in backend.split(",")).get("cuda", "")


def transfer_device(group: Any = None) -> Any:
    """Where this rank's tensors travel over `group` (the default one if None): its GPU where NCCL carries
    CUDA tensors, else the host (None): gloo's send and recv take no CUDA memory (writev of a device
    pointer fails), as with `cpu:gloo,cuda:gloo` for two ranks on one GPU."""
    import torch
    import torch.distributed as dist

    if not torch.cuda.is_available() or cuda_backend(str(dist.get_backend(group))) != "nccl":
        return None
    return torch.device("cuda", torch.cuda.current_device())


def send_tensor(t: Any, dst: int) -> None:
    """Point-to-point send (a pipeline activation, a gradient, a weight for the sync) that travels where
    `transfer_device` says: gloo cannot send device memory, so CUDA tensors go through the host there."""
    import torch.distributed as dist

    dist.send(t.to(transfer_device() or "cpu").contiguous(), dst=dst)


def recv_tensor(shape: tuple[int, ...], dtype: Any, src: int, device: Any) -> Any:
    """The counterpart of `send_tensor`: received where the backend can take it, returned on `device`."""
    import torch
    import torch.distributed as dist

    buf = torch.empty(shape, dtype=dtype, device=transfer_device() or "cpu")
    dist.recv(buf, src=src)
    return buf.to(device)


def local_gpu() -> int:
    """This rank's GPU on its node: `LOCAL_RANK`, or with `$SWITCHYARD_RANKS_PER_GPU=k` (k ranks on one
    GPU: the smoke suite's two-rank checks on a one-GPU machine, over gloo, since NCCL refuses two ranks
    on one device) `LOCAL_RANK // k`. A rank left without a GPU is an error naming the fix."""
    import torch

    local = int(os.environ.get("LOCAL_RANK", "0"))
    per = int(os.environ.get("SWITCHYARD_RANKS_PER_GPU", "1") or 1)
    gpu, count = local // max(1, per), torch.cuda.device_count()
    if gpu >= count:
        raise RuntimeError(f"LOCAL_RANK={local} has no GPU of its own: this node has {count}; start torchrun with "
                           f"--nproc-per-node {count * max(1, per)} or fewer")
    return gpu


def init_process_group(timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
    """The default process group, as every entry point creates it: on GPU nodes this rank's
    device is `LOCAL_RANK` (without it every local rank would use cuda:0)."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(local_gpu())  # CUDA-only call
    dist.init_process_group(process_group_backend(cuda), timeout=timedelta(seconds=timeout_s))


def close_process_group() -> None:
    """Destroy the default process group if this process made one: a rank that exits with it still
    open can abort at interpreter exit (seen in FSDP runs), turning a finished run into a crash."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def init_distributed(timeout_s: float = DEFAULT_TIMEOUT_S) -> tuple[int, int]:
    """(rank, world) of this process under torchrun; creates the default process group when there
    is more than one rank (`init_process_group`). On CPU the ranks of a box share its cores
    (torchrun alone would leave each one thread)."""
    import torch

    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    if not torch.cuda.is_available():
        local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local))
    if world > 1 and not torch.distributed.is_initialized():
        init_process_group(timeout_s)
    return rank, world


def usable_cores() -> list[int]:
    """The cores this process may run on."""
    return sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))


def keep_off_cores(engine_cores: list[int]) -> None:
    """This process (and what it starts later: agent workers) runs on the cores not in
    `engine_cores`, its torch threads spread over them with the node's other ranks."""
    import torch

    if not hasattr(os, "sched_setaffinity"):
        return
    rest = [c for c in usable_cores() if c not in set(engine_cores)]
    if not rest:
        raise ValueError(f"rollout.engine_cores={engine_cores} leaves no core for the trainer (this node has "
                         f"{usable_cores()}); list fewer cores")
    os.sched_setaffinity(0, rest)
    torch.set_num_threads(max(1, len(rest) // int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))


def cpu_slices(n: int, cores: list[int] | None = None) -> list[list[int]]:
    """Split `cores` (default: the cores this process may use) into `n` disjoint, contiguous
    slices (one per CPU engine on this box); with fewer cores than engines, engines share cores."""
    if n < 1:
        raise ValueError(f"cpu_slices(n={n}): need at least one engine")
    cores = sorted(cores) if cores else usable_cores()
    if len(cores) < n:
        return [[cores[i % len(cores)]] for i in range(n)]
    per = len(cores) // n
    return [cores[i * per:(i + 1) * per] for i in range(n)]


def plan_placement(mode: str, nodes: int = 1, devices_per_node: int = 1, train_devices: int | None = None,
                   rollout_tp: int = 1, num_engines: int | None = None, cores: list[int] | None = None) -> PlacementPlan:
    """Where engines go. `train_devices` (split) is how many of all GPUs train; `num_engines`
    (cpu) how many engine processes share the box's cores (`cores`, default all of them)."""
    if mode not in PLACEMENTS:
        raise ValueError(f"placement {mode!r}; choose one of {list(PLACEMENTS)}")
    if rollout_tp < 1 or nodes < 1 or devices_per_node < 1:
        raise ValueError("placement needs rollout_tp, nodes and devices_per_node >= 1")
    total = nodes * devices_per_node
    if mode == "cpu":
        n = num_engines or 1
        slots = tuple(EngineSlot(f"engine{i}", 0, tuple(c)) for i, c in enumerate(cpu_slices(n, cores)))
        return PlacementPlan(mode, 1, len({c for s in slots for c in s.devices}), 0, 1, slots)
    if devices_per_node % rollout_tp:
        raise ValueError(f"rollout_tp={rollout_tp} must divide the {devices_per_node} GPUs of a node (an engine "
                         "never spans nodes)")
    if mode == "colocated":
        train, first = total, 0
    else:
        train = train_devices if train_devices is not None else total // 2
        if not 0 < train < total or (total - train) % rollout_tp:
            raise ValueError(f"split placement: train_devices={train} must leave GPUs for engines out of {total}, "
                             f"and the engine part must be a multiple of rollout_tp={rollout_tp}")
        first = train
    slots = []
    for start in range(first, total - rollout_tp + 1, rollout_tp):
        node, local = divmod(start, devices_per_node)
        if local + rollout_tp > devices_per_node:
            continue
        slots.append(EngineSlot(f"engine{len(slots)}", node, tuple(range(local, local + rollout_tp))))
    if not slots:
        raise ValueError(f"no engine fits: {total - first} GPUs left for engines of rollout_tp={rollout_tp}")
    return PlacementPlan(mode, nodes, devices_per_node, train, rollout_tp, tuple(slots))
