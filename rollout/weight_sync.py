"""Turning named tensors into weight-bucket messages and back.

Three ways to an engine, all fed by an iterator of HF-named tensors (`actor.named_hf_weights()`,
which reshards a Megatron model on the fly, `parallel/reshard.py`):
  push_weights       over the bus: each size-bounded bucket is one `WeightsBucket` message with a
                     CRC32 the engine server verifies before loading a byte (CPU, tests, any node)
  load_into_engine   an engine in this very process (colocated): buckets handed over directly
  broadcast_buckets  engines on other ranks: collective broadcast of flat byte buckets (NCCL on
                     GPUs, gloo on CPU), CRC32 checked on receipt; `commit_everywhere` then makes
                     the version bump all-or-nothing
"""

from __future__ import annotations

import asyncio
import time
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterable, Iterator

from rollout.protocol import DEFAULT_CHECKSUM, Ack, ProtocolError, WeightsBegin, WeightsBucket, WeightsCommit, checksum
from rollout.shm import views

if TYPE_CHECKING:
    import torch

    from rollout.shm import ShmReader, ShmSlots

    from rollout.client import GenerateClient


def _nbytes(t: "torch.Tensor") -> int:
    """Bytes a tensor's data occupies: what the bucket size limit counts."""
    return t.numel() * t.element_size()


def bucket_by_size(named: Iterable[tuple[str, "torch.Tensor"]],
                   bucket_bytes: int) -> Iterator[list[tuple[str, "torch.Tensor"]]]:
    """Group (name, tensor) pairs into buckets of at most `bucket_bytes`, in order.

    The one flush rule every transfer path shares: a bucket is flushed before adding a tensor
    that would take it over the limit, so a bucket exceeds `bucket_bytes` only when it holds a
    single larger tensor. Lazy, so the sender never holds more than one bucket plus one tensor.
    """
    pending: list[tuple[str, "torch.Tensor"]] = []
    size = 0
    for name, t in named:
        n = _nbytes(t)
        if pending and size + n > bucket_bytes:
            yield pending
            pending, size = [], 0
        pending.append((name, t))
        size += n
    if pending:
        yield pending


def tensor_to_raw(t: "torch.Tensor") -> tuple["torch.Tensor", str, list[int]]:
    """A tensor as (flat CPU uint8 tensor of its bytes, dtype name, shape): the form in which
    weights cross a process boundary, on the bus and by collective broadcast alike. Viewing as
    uint8 keeps dtypes numpy lacks (bfloat16) intact."""
    import torch

    raw = t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
    return raw, str(t.dtype).removeprefix("torch."), list(t.shape)


def tensor_from_raw(raw: "torch.Tensor | bytes | memoryview", dtype: str, shape: list[int],
                    name: str = "", copy: bool = True) -> "torch.Tensor":
    """Rebuild a tensor from `tensor_to_raw`'s parts. A bytes frame is copied first so the tensor
    stays valid after the frame's buffer goes; `copy=False` views the frame instead (valid only
    while the frame lives; never write to it). An unknown dtype name is a ProtocolError."""
    import torch

    tdtype = getattr(torch, dtype, None)
    if not isinstance(tdtype, torch.dtype):
        raise ProtocolError(f"tensor {name!r} has unknown dtype {dtype!r}")
    if not isinstance(raw, torch.Tensor):
        if not len(raw):
            raw = torch.empty(0, dtype=torch.uint8)
        elif copy:
            raw = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
        else:
            with warnings.catch_warnings():  # a received frame is read-only; the view is only read
                warnings.simplefilter("ignore", UserWarning)
                raw = torch.frombuffer(raw, dtype=torch.uint8)
    return raw.view(tdtype).reshape(shape)


def bucket_from_tensors(tensors: list[tuple[str, "torch.Tensor"]], version: int, index: int,
                        rid: str = "") -> WeightsBucket:
    """Pack (name, tensor) pairs into one bucket message; tensors are copied to CPU bytes."""
    frames: list[bytes | memoryview] = []
    dtypes, shapes = [], []
    for _, t in tensors:
        raw, dtype, shape = tensor_to_raw(t)
        frames.append(memoryview(raw.numpy()).cast("B") if raw.numel() else b"")
        dtypes.append(dtype)
        shapes.append(shape)
    return WeightsBucket(rid=rid, version=version, index=index, names=[n for n, _ in tensors],
                         dtypes=dtypes, shapes=shapes, crc=checksum(frames, DEFAULT_CHECKSUM), frames=frames,
                         alg=DEFAULT_CHECKSUM)


def tensors_from_bucket(bucket: WeightsBucket, slots: "ShmReader | None" = None) -> list[tuple[str, "torch.Tensor"]]:
    """Verify the bucket's checksum and rebuild its tensors without copying: views of its frames, or
    of the shared-memory slot `slots` maps; valid while the message lives and the bucket is not
    acked (the engine copies them into its parameters before that)."""
    if bucket.shm is not None:
        if slots is None:
            raise ProtocolError("this receiver does not map shared memory; send the bucket's frames")
        flat = slots.flat(bucket.shm)
        if bucket.alg == "sum64":  # a buffer opened by handle: checked on its own device (rollout/handles.py)
            from rollout.handles import sum64

            got = sum64(flat)
        else:
            got = checksum([memoryview(flat.numpy())], bucket.alg)
        if got != bucket.crc:
            where = bucket.shm.get("path") or "a buffer opened by handle"
            raise ProtocolError(f"weights bucket {bucket.index} of version {bucket.version} in {where} "
                                f"failed its checksum ({bucket.alg} {got:#x} != {bucket.crc:#x}); resend the bucket")
        return finite(list(zip(bucket.names, views(flat, bucket.dtypes, bucket.shapes, bucket.shm["offsets"],
                                                   bucket.shm["sizes"], bucket.names))),
                      f"weights bucket {bucket.index} of version {bucket.version}")
    got = checksum(bucket.frames, bucket.alg)
    if got != bucket.crc:
        raise ProtocolError(f"weights bucket {bucket.index} of version {bucket.version} failed its "
                            f"checksum ({bucket.alg} {got:#x} != {bucket.crc:#x}); resend the bucket")
    return finite([(name, tensor_from_raw(frame, dtype, shape, name, copy=False))
                   for name, dtype, shape, frame in zip(bucket.names, bucket.dtypes, bucket.shapes, bucket.frames)],
                  f"weights bucket {bucket.index} of version {bucket.version}")


def finite(tensors: list[tuple[str, "torch.Tensor"]], where: str) -> list[tuple[str, "torch.Tensor"]]:
    """`tensors`, or a ProtocolError naming the first floating tensor with a NaN or an infinity:
    an engine never serves weights a diverged update produced (on every weight path)."""
    for name, t in tensors:
        if t.is_floating_point() and t.numel() and not bool(t.isfinite().all()):
            bad = int((~t.isfinite()).sum())
            raise ProtocolError(f"{where}: tensor {name!r} holds {bad} NaN or infinite value(s); the update that "
                                "made them diverged (lower actor.lr, set actor.grad_clip); the bucket is refused and "
                                "the version's commit fails")
    return tensors


def iter_buckets(named: Iterable[tuple[str, "torch.Tensor"]], version: int,
                 bucket_bytes: int = 256 << 20) -> Iterator[WeightsBucket]:
    """Bucket messages of at most `bucket_bytes` each (a larger tensor gets its own)."""
    for index, tensors in enumerate(bucket_by_size(named, bucket_bytes)):
        yield bucket_from_tensors(tensors, version, index)


def shm_bucket(slots: "ShmSlots", i: int, tensors: list[tuple[str, "torch.Tensor"]], version: int, index: int,
               dtype: "torch.dtype | None" = None) -> WeightsBucket:
    """Pack `tensors` into shared-memory slot `i` (cast to `dtype`) and checksum it: a bucket message
    that carries only the slot's name, for engines on this node (`rollout.shm`)."""
    ref = slots.pack(i, tensors, dtype)
    dtypes, shapes = ref.pop("dtypes"), ref.pop("shapes")
    alg, crc = slots.checksum(i, ref["total"])
    return WeightsBucket(version=version, index=index, names=[n for n, _ in tensors], dtypes=dtypes, shapes=shapes,
                         crc=crc, alg=alg, shm=ref)


@dataclass
class SyncReport:
    version: int
    engines: int
    buckets: int
    bytes: int
    seconds: float
    path: str = "bus"


async def push_weights(client: "GenerateClient", named: Iterable[tuple[str, "torch.Tensor"]], version: int,
                       bucket_bytes: int = 256 << 20, timeout_s: float = 600.0, preempt: bool = False,
                       inflight: int = 2, slots: "ShmSlots | None" = None, engines: list[int] | None = None,
                       dtype: "torch.dtype | None" = None) -> SyncReport:
    """Load weight version `version` into every live engine behind `client` (of `engines`, indices
    into its addresses, if given), bucket by bucket.

    Each engine pauses admission at `weights_begin` (running requests finish first, or with
    `preempt` stop at once and are continued by their clients on the new weights), checks every
    bucket's checksum as it arrives, and switches at `weights_commit`; the call returns only after
    every engine acknowledged the commit with `version`, so the next rollout is on-policy. Buckets
    are produced lazily and up to `inflight` of them are on their way at once: the next bucket is
    gathered and serialised while the engines load the previous ones (they apply them in arrival
    order), and the trainer never holds more than `inflight` buckets of bytes.

    With `slots` (engines on this node) each bucket is packed into a shared-memory slot, cast to
    `dtype`, and only its name crosses the socket; a slot is refilled once every engine acked it.
    """
    t0 = time.perf_counter()
    begun = await client.broadcast(WeightsBegin(version=version, preempt=preempt), timeout_s, only=engines)
    buckets = nbytes = 0
    window: list[asyncio.Future] = []
    try:
        for index, tensors in enumerate(bucket_by_size(named, bucket_bytes)):
            if slots is not None:
                while len(window) >= slots.count:  # the slot this bucket goes into is free once its last user acked
                    await window.pop(0)
                bucket = shm_bucket(slots, index % slots.count, tensors, version, index, dtype)
                nbytes += bucket.shm["total"]
            else:
                bucket = bucket_from_tensors(tensors, version, index)
                nbytes += sum(len(f) for f in bucket.frames)
            window.append(asyncio.ensure_future(client.broadcast(bucket, timeout_s, only=engines)))
            buckets += 1
            while len(window) >= max(1, inflight):
                await window.pop(0)
        while window:
            await window.pop(0)
    finally:
        for task in window:  # a failed bucket: the others are not waited for
            task.cancel()
    acks = await commit(client, version, buckets, len(begun), timeout_s, engines)
    return SyncReport(version, len(acks), buckets, nbytes, time.perf_counter() - t0,
                      getattr(slots, "kind", "shm") if slots else "bus")


async def commit(client: "GenerateClient", version: int, buckets: int, begun: int, timeout_s: float = 600.0,
                 engines: list[int] | None = None) -> list[Any]:
    """Switch the engines to `version` once all `buckets` arrived; raises unless all `begun` acked it."""
    acks = await client.broadcast(WeightsCommit(version=version, num_buckets=buckets), timeout_s, only=engines)
    wrong = [a for a in acks if not isinstance(a, Ack) or a.weight_version != version]
    if wrong or len(acks) != begun:
        raise RuntimeError(f"weight version {version} was not committed by every engine ({len(acks)} acks for "
                           f"{begun} engines, unexpected: {wrong[:3]}); check the engine server logs")
    return acks


# ---------------------------------------------------------------------- without the bus
async def load_into_engine(engine: Any, named: Iterable[tuple[str, "torch.Tensor"]],
                           bucket_bytes: int = 256 << 20) -> SyncReport:
    """A colocated engine in this process: hand it the tensors bucket by bucket, then commit.
    No copy through bytes and no checksum: nothing leaves the process."""
    t0 = time.perf_counter()
    buckets = total = 0
    for tensors in bucket_by_size(named, bucket_bytes):
        await engine.update_weights(finite(tensors, f"in-process weights bucket {buckets}"))
        buckets += 1
        total += sum(_nbytes(t) for _, t in tensors)
    await engine.finish_weight_update()
    return SyncReport(-1, 1, buckets, total, time.perf_counter() - t0)


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
                             "crc": checksum([memoryview(flat.numpy())], DEFAULT_CHECKSUM), "alg": DEFAULT_CHECKSUM}
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
            got = checksum([memoryview(flat.numpy())], head["alg"])
            if got != head["crc"] and failure is None:
                failure = (f"broadcast weight bucket with {head['names'][:2]}... failed its checksum ({head['alg']} "
                           f"{got:#x} != {head['crc']:#x}); nothing after it was loaded, do not commit this version")
            if failure:
                continue  # drain the stream in step with the other ranks, yielding nothing
        tensors, at = [], 0
        for name, dtype, shape, n in zip(head["names"], head["dtypes"], head["shapes"], head["sizes"]):
            tensors.append((name, tensor_from_raw(flat[at:at + n], dtype, shape, name)))
            at += n
        yield tensors


def commit_everywhere(ok: bool, group: Any = None) -> bool:
    """True only if every rank's engine committed: the version bumps everywhere or nowhere."""
    import torch
    import torch.distributed as dist

    flag = torch.tensor([1 if ok else 0], dtype=torch.int32)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    return bool(flag.item())


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
                msg = shm_bucket(slots, i, tensors, version, index, dtype)
                header[0] = msg.header()
        dist.broadcast_object_list(header, src=src, group=group)
        head = header[0]
        if head is None:
            return
        ref = head["shm"]
        flat = slots.buffer(i, ref["total"])
        buf = flat if device is None else flat.to(device)
        dist.broadcast(buf, src=src, group=group)
        if msg is None:
            if device is not None:
                flat.copy_(buf)
            msg = WeightsBucket.from_parts({**head, "shm": slots.ref(i, ref["offsets"], ref["sizes"], ref["total"])}, [])
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
    begun = run(client.broadcast(WeightsBegin(version=version, preempt=preempt), timeout_s, only=mine))
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
                client.broadcast(msg, timeout_s, only=mine), loop)
        buckets += 1
        received += msg.shm["total"]
    for i in range(slots.count):
        wait_free(i)
    if drain is not None:
        drain.join()
    if not commit_everywhere(not failure, group):
        raise RuntimeError(f"weight version {version} was not committed on any node: "
                           + (f"{type(failure[0]).__name__}: {failure[0]}" if failure else "another node failed; see its log"))
    run(commit(client, version, buckets, len(begun), timeout_s, mine))
    return received
