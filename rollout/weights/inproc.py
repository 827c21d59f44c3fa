"""The in-process route: an engine served from the trainer's own process takes the tensors by
reference, bucket by bucket, on the engine server's loop in order with its other weight jobs;
nothing is copied through bytes and nothing is checksummed, since nothing leaves the process."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterable

from rollout.weights.codec import SyncReport, _nbytes, bucket_by_size, finite
from rollout.weights.link import Link, Placement, Push, drain

if TYPE_CHECKING:
    import torch


@dataclass
class LocalLoad:
    """A weight update from the process that hosts an EngineServer (InProcessEngine): the tensors by
    reference, loaded on the server's loop in order with every other weight job; `done` (a
    concurrent future) gets the SyncReport or the error."""

    named: Any
    weight_version: int
    bucket_bytes: int
    preempt: bool
    done: Any
    rid: str = "local"
    TYPE: str = "local_load"


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


class InProcessRoute:
    """The engine this process serves (rollout.in_process): tensors by reference."""

    name = "in_process"

    @staticmethod
    def applies(p: Placement) -> bool:
        return p.in_process

    def send(self, push: Push, link: Link) -> int:
        if link.rank != 0 or link.inproc is None:
            return drain(push.named)
        return link.inproc.load(push.named, push.version, push.bucket_bytes, push.dtype, push.preempt).bytes

    def close(self) -> None:
        pass
