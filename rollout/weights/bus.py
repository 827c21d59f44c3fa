"""The bus route: each bucket crosses the engines' sockets as a `WeightsBucket` message, either
carrying its tensors as raw frames or naming the buffer they lie in (a shared-memory slot or a
memory handle on this node); every engine checks the checksum before loading, and the version
switches at a commit every engine acknowledges."""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Any, Iterable, Iterator

from rollout.bus.protocol import Ack, WeightsBegin, WeightsCommit
from rollout.weights.codec import SyncReport, _itemsize, bucket_by_size, bucket_from_tensors, slot_bucket
from rollout.weights.link import Link, Placement, Push, drain

if TYPE_CHECKING:
    import torch

    from rollout.bus.client import GenerateClient


async def push_weights(client: "GenerateClient", named: Iterable[tuple[str, "torch.Tensor"]], version: int,
                       bucket_bytes: int = 256 << 20, timeout_s: float = 600.0, preempt: bool = False,
                       inflight: int = 2, slots: Any = None, engines: list[int] | None = None,
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

    Float tensors are cast to `dtype` (the engines') on the way. With `slots` (engines on this node)
    each bucket is packed into a shared-memory slot and only its name crosses the socket; a slot is refilled once every engine acked it.

    An engine whose connection is lost during the push is left out of it (marked down; failover
    already moves its requests): the version is committed by every engine still there, and one that
    comes back (restarted, at version 0) is brought up to date by the next push.
    """
    t0 = time.perf_counter()
    begun = await begin(client, version, preempt, timeout_s, engines)
    if not begun:
        raise RuntimeError(f"no engine is up to load weight version {version}; check the engine server logs")
    buckets = nbytes = 0
    window: list[asyncio.Future] = []
    try:
        for index, tensors in enumerate(bucket_by_size(named, bucket_bytes)):
            if slots is not None:
                while len(window) >= slots.count:  # the slot this bucket goes into is free once its last user acked
                    await window.pop(0)
                bucket = slot_bucket(slots, index % slots.count, tensors, version, index, dtype)
                nbytes += bucket.ref["total"]
            else:
                bucket = bucket_from_tensors(tensors, version, index, dtype=dtype)
                nbytes += sum(len(f) for f in bucket.frames)
            window.append(asyncio.ensure_future(client.broadcast(bucket, timeout_s, only=begun, skip_down=True)))
            buckets += 1
            while len(window) >= max(1, inflight):
                await window.pop(0)
        while window:
            await window.pop(0)
    finally:
        for task in window:  # a failed bucket: the others are not waited for
            task.cancel()
    acks = await commit(client, version, buckets, begun, timeout_s)
    return SyncReport(version, len(acks), buckets, nbytes, time.perf_counter() - t0,
                      getattr(slots, "kind", "shm") if slots else "bus")


async def begin(client: "GenerateClient", version: int, preempt: bool, timeout_s: float,
                engines: list[int] | None = None) -> list[int]:
    """Open version `version` on the engines (of `engines`) that are up; returns the indices of those
    that began it and are still up. The buckets and the commit go to these only: an engine that
    comes back meanwhile (restarted, at version 0) has not begun this version and waits for the next."""
    targets = client.live(engines)
    await client.broadcast(WeightsBegin(weight_version=version, preempt=preempt), timeout_s, only=targets,
                           skip_down=True)
    return client.live(targets)


async def commit(client: "GenerateClient", version: int, buckets: int, begun: list[int],
                 timeout_s: float = 600.0) -> list[Any]:
    """Switch the `begun` engines to `version` once all `buckets` arrived; raises unless each of them
    acked it or went down meanwhile."""
    acks = await client.broadcast(WeightsCommit(weight_version=version, num_buckets=buckets), timeout_s, only=begun,
                                  skip_down=True)
    wrong = [a for a in acks if not isinstance(a, Ack) or a.weight_version != version]
    down = sum(not client.router.alive[i] for i in begun)
    # none begun (a node whose engines are all down) leaves nothing to commit there; some begun and
    # none acked means every one of them went down mid-push
    if wrong or len(acks) + down < len(begun) or (begun and not acks):
        raise RuntimeError(f"weight version {version} was not committed by every engine ({len(acks)} acks for "
                           f"{len(begun)} engines, unexpected: {wrong[:3]}); check the engine server logs")
    return acks


class BusRoute:
    """Every bucket over the engines' sockets from rank 0: its bytes as frames here, or (the
    subclasses) only the name of the slot on this node its bytes lie in."""

    name = "bus"

    @staticmethod
    def applies(p: Placement) -> bool:
        return p.weight_path == "bus" or not p.shm_room

    def __init__(self) -> None:
        self.slots: Any = None  # where buckets are packed; None: frames

    def make_slots(self) -> Any:
        return None

    def send(self, push: Push, link: Link) -> int:
        if link.rank != 0 or link.control is None:
            return drain(push.named)
        from tqdm import tqdm

        if self.slots is None:
            self.slots = self.make_slots()
        with tqdm(desc=f"weight sync v{push.version}", unit="B", unit_scale=True, unit_divisor=1024, leave=False) as bar:
            report = link.control.run(push_weights(link.control.client, _counted(push.named, bar, push.dtype),
                                                   push.version, push.bucket_bytes, push.timeout_s, push.preempt,
                                                   slots=self.slots, dtype=push.dtype, engines=push.engines))
        return report.bytes

    def close(self) -> None:
        if self.slots is not None:
            self.slots.close()
            self.slots = None


def _counted(named: Iterable[tuple[str, "torch.Tensor"]], bar: Any, dtype: "torch.dtype | None") -> Iterator[
        tuple[str, "torch.Tensor"]]:
    """`named` as it goes by, its bytes as the engines get them (cast to `dtype`) and its tensors on `bar`."""
    tensors = 0
    for name, t in named:
        bar.update(t.numel() * (_itemsize(dtype) if dtype is not None and t.is_floating_point() else t.element_size()))
        tensors += 1
        bar.set_postfix_str(f"{tensors} tensors", refresh=False)
        yield name, t
