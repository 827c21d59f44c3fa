"""The collective route: weights from one rank to the others by collective broadcast (NCCL between
GPU ranks, gloo on CPU), bucket by bucket, with a checksum per bucket and an all-or-nothing vote on
the commit. `relay_push` is the multi-node form: one leader per node receives each bucket straight
into a shared-memory slot and feeds that node's engines over the bus."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import TYPE_CHECKING, Any, Iterable, Iterator

from rollout.bus.protocol import ProtocolError, WeightsBucket
from rollout.weights.bus import begin, commit
from rollout.weights.link import Link, Placement, Push, drain
from rollout.weights.shm import ShmSlots
from rollout.weights.codec import DEFAULT_CHECKSUM, bucket_by_size, checksum, slot_bucket, tensor_from_raw, tensor_to_raw

if TYPE_CHECKING:
    import torch

    from rollout.bus.client import GenerateClient


def broadcast_buckets(named: Iterable[tuple[str, "torch.Tensor"]] | None, src: int, group: Any = None,
                      bucket_bytes: int = 256 << 20, device: Any = None) -> Iterator[list[tuple[str, "torch.Tensor"]]]:
    """Weights from rank `src` to every rank of `group` by collective broadcast (NCCL between GPU
    ranks, gloo on CPU), one size-bounded bucket at a time. Every rank calls it and iterates to the
    end; `src` passes `named`, the others None. Each bucket travels as one flat byte tensor after a
    small header (names, dtypes, shapes, CRC32) sent with broadcast_object_list; receivers verify
    the CRC before yielding the bucket's tensors (to feed `engine.update_weights`). A receiver that
    finds a bad bucket yields nothing more but keeps receiving to the end (leaving a collective
    early would hang every other rank), then raises ProtocolError: commit with
    `commit_everywhere(False)` so no rank bumps its version."""
    import torch
    import torch.distributed as dist

    rank = dist.get_rank()
    source: Iterator[list[tuple[str, torch.Tensor]]] = iter(())
    if rank == src and named is not None:
        source = bucket_by_size(named, bucket_bytes)

    failure: str | None = None
    while True:
        header: list[Any] = [None]
        flat = None
        if rank == src:
            bucket = next(source, [])
            if bucket:
                parts = [tensor_to_raw(t) for _, t in bucket]
                flat = torch.cat([raw for raw, _, _ in parts])
                header[0] = {"names": [n for n, _ in bucket], "dtypes": [dtype for _, dtype, _ in parts],
                             "shapes": [shape for _, _, shape in parts], "sizes": [raw.numel() for raw, _, _ in parts],
                             "checksum": checksum([memoryview(flat.numpy())], DEFAULT_CHECKSUM),
                             "checksum_alg": DEFAULT_CHECKSUM}
        dist.broadcast_object_list(header, src=src, group=group)
        head = header[0]
        if head is None:  # the source has nothing more
            if failure:  # raised only now: leaving the stream early would hang the other ranks
                raise ProtocolError(failure)
            return
        if flat is None:
            flat = torch.empty(sum(head["sizes"]), dtype=torch.uint8)
        buf = flat.to(device) if device is not None else flat
        dist.broadcast(buf, src=src, group=group)
        if rank != src:
            flat = buf.cpu()
            got = checksum([memoryview(flat.numpy())], head["checksum_alg"])
            if got != head["checksum"] and failure is None:
                failure = (f"broadcast weight bucket with {head['names'][:2]}... failed its checksum "
                           f"({head['checksum_alg']} {got:#x} != {head['checksum']:#x}); nothing after it was loaded, do not commit this version")
            if failure:
                continue  # drain the stream in step with the other ranks, yielding nothing
        tensors, at = [], 0
        for name, dtype, shape, n in zip(head["names"], head["dtypes"], head["shapes"], head["sizes"]):
            tensors.append((name, tensor_from_raw(flat[at:at + n], dtype, shape, name)))
            at += n
        yield tensors


def commit_everywhere(ok: bool, group: Any = None) -> bool:
    """True only if every rank's engine committed: the version bumps everywhere or nowhere."""
    from parallel.reduce import on_every_rank

    return on_every_rank(ok, group)


def relay_buckets(named: Iterable[tuple[str, "torch.Tensor"]] | None, src: int, group: Any, slots: "ShmSlots",
                  version: int, bucket_bytes: int = 256 << 20, dtype: "torch.dtype | None" = None,
                  wait_free: Any = None, device: Any = None) -> Iterator[WeightsBucket]:
    """The collective path: one weight source, one receiving rank per node, engines fed through
    shared memory on every node. Every rank of `group` calls it and iterates to the end; `src`
    passes `named`. `src` packs each bucket into a slot (cast to `dtype`) and broadcasts its header
    and then its bytes; each other rank receives the bytes straight into the same slot of its own
    `slots`. Yields, on every rank, the bucket message naming the local slot, for this node's
    engines (which verify the checksum before loading; a corrupt broadcast is refused there).
    `wait_free(i)` is called before slot i is refilled: block until its last bucket was acked.
    `device`: where the group's backend wants the bytes (a CUDA device under NCCL; None on gloo)."""
    import torch.distributed as dist

    rank = dist.get_rank()
    source = bucket_by_size(named, bucket_bytes) if rank == src and named is not None else iter(())
    index = 0
    while True:
        i = index % slots.count
        if wait_free is not None:
            wait_free(i)
        header: list[Any] = [None]
        msg = None
        if rank == src:
            tensors = next(source, [])
            if tensors:
                msg = slot_bucket(slots, i, tensors, version, index, dtype)
                header[0] = msg  # a bucket naming a slot carries no frames: small to pickle
        dist.broadcast_object_list(header, src=src, group=group)
        head = header[0]
        if head is None:
            return
        ref = head.ref
        flat = slots.buffer(i, ref["total"])
        buf = flat if device is None else flat.to(device)
        dist.broadcast(buf, src=src, group=group)
        if msg is None:
            if device is not None:
                flat.copy_(buf)
            msg = dataclasses.replace(head, rid="", ref=slots.ref(i, ref["offsets"], ref["sizes"], ref["total"]))
        yield msg
        index += 1


def relay_push(client: "GenerateClient", loop: asyncio.AbstractEventLoop, named: Iterable[tuple[str, "torch.Tensor"]],
               is_source: bool, group: Any, slots: "ShmSlots", version: int, bucket_bytes: int = 256 << 20,
               dtype: "torch.dtype | None" = None, preempt: bool = False, timeout_s: float = 600.0,
               device: Any = None) -> int:
    """One node leader's part of the collective push: begin on this node's engines (the ipc
    addresses of `client`, whose event loop `loop` runs in another thread), receive every bucket
    by `relay_buckets` (the source, global rank 0 of `group`, sends `named`), hand each to the
    engines while the next one is broadcast, then vote: the version commits on every node only if
    every node's engines took every bucket (`commit_everywhere`), else nowhere, and this raises.
    A leader that is not the source drains `named` in a thread, since a sharded actor's gathers run
    on the default group while this rank receives on `group`. Returns the bytes received."""
    import concurrent.futures
    import threading

    mine = [i for i, a in enumerate(client.addresses) if a.startswith("ipc://")]  # this node's engines

    def run(coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, loop).result()

    drain = None
    if not is_source:
        drain = threading.Thread(target=lambda: [None for _ in named], name="weights-gather", daemon=True)
        drain.start()
    begun = run(begin(client, version, preempt, timeout_s, mine))
    inflight: list[concurrent.futures.Future | None] = [None] * slots.count
    failure: list[BaseException] = []

    def wait_free(i: int) -> None:
        fut, inflight[i] = inflight[i], None
        if fut is not None:
            try:
                fut.result()
            except BaseException as e:  # noqa: BLE001 - kept until the stream ends: leaving early hangs the others
                failure.append(e)

    buckets = received = 0
    for msg in relay_buckets(named if is_source else None, 0, group, slots, version, bucket_bytes, dtype, wait_free,
                             device):
        if not failure:
            inflight[buckets % slots.count] = asyncio.run_coroutine_threadsafe(
                client.broadcast(msg, timeout_s, only=begun), loop)
        buckets += 1
        received += msg.ref["total"]
    for i in range(slots.count):
        wait_free(i)
    if drain is not None:
        drain.join()
    if not commit_everywhere(not failure, group):
        raise RuntimeError(f"weight version {version} was not committed on any node: "
                           + (f"{type(failure[0]).__name__}: {failure[0]}" if failure else "another node failed; see its log"))
    run(commit(client, version, buckets, begun, timeout_s))
    return received


class CollectiveRoute:
    """Several nodes: rank 0 broadcasts each bucket to every node's leader (gloo here, NCCL between
    GPU nodes), which receives it into a shared-memory slot and hands it to its engines; a version
    is committed on every node or on none. Bytes per node."""

    name = "collective"

    @staticmethod
    def applies(p: Placement) -> bool:
        return p.nodes > 1

    def __init__(self) -> None:
        self.slots: ShmSlots | None = None

    def send(self, push: Push, link: Link) -> int:
        from parallel.mesh import transfer_device

        if link.local_rank != 0:  # not a leader: only take part in the actor's gathers
            return drain(push.named)
        control = link.control if link.rank == 0 else link.local_control
        assert control is not None, "start_workers() makes every node leader's control client"
        if self.slots is None:
            self.slots = ShmSlots()
        device = transfer_device(link.weight_group)  # the GPU under NCCL: written for GPU nodes, not run here
        return relay_push(control.client, control.loop, push.named, link.rank == 0, link.weight_group, self.slots,
                          push.version, push.bucket_bytes, push.dtype, push.preempt, push.timeout_s, device)

    def close(self) -> None:
        if self.slots is not None:
            self.slots.close()
            self.slots = None
