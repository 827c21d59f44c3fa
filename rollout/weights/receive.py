"""The engine side of every weight route: an engine server hands its weight messages here, in
arrival order. `weights_begin` pauses generation (the server's gate), each `weights_bucket` is
checked and loaded (its tensors as raw frames, or in a buffer the bucket names: a shared-memory
slot or a memory handle, opened by the reader registered for that kind of reference), and
`weights_commit` switches the served version; an in-process load does the three at once."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from rollout.bus.protocol import Digest, ProtocolError, WeightsBegin, WeightsBucket, WeightsCommit
from rollout.weights.codec import SyncReport, tensors_from_bucket
from rollout.weights.handle import HandleReader
from rollout.weights.inproc import LocalLoad, load_into_engine
from rollout.weights.shm import ShmReader

if TYPE_CHECKING:
    import torch

# the key of a bucket's `ref` -> the reader that opens such a buffer on the engine's side
READERS: dict[str, type] = {"path": ShmReader, "handle": HandleReader}


class BucketReader:
    """Opens the buffer a bucket's reference names with the reader of its kind (made on first use)."""

    def __init__(self) -> None:
        self._readers: dict[str, Any] = {}

    def flat(self, ref: dict[str, Any]) -> "torch.Tensor":
        kind = next((k for k in READERS if k in ref), None)
        if kind is None:
            raise ProtocolError(f"weights bucket reference names none of {sorted(READERS)}: {ref!r:.200}")
        if kind not in self._readers:
            self._readers[kind] = READERS[kind]()
        return self._readers[kind].flat(ref)

    def release(self) -> None:
        for reader in self._readers.values():
            reader.release()


class Host(Protocol):
    """What the receiver needs of the engine server that hosts it."""

    engine: Any
    weight_version: int

    async def pause_for_update(self, version: int, preempt: bool) -> None: ...

    async def resume(self, version: int) -> None: ...


class WeightReceiver:
    def __init__(self, host: Host) -> None:
        self.host = host
        self.reader = BucketReader()
        self.pending: int | None = None  # the version being loaded
        self.loaded = 0

    async def digest(self, rid: str, names: list[str] | None = None) -> Digest:
        """What the engine serves now, per tensor (engines/weight_digest.py; of `names` only, when given),
        for the trainer to compare with what it sent; `available=False` from an engine that cannot take one."""
        take = getattr(self.host.engine, "weight_digest", None)
        held = await take(names or None) if take is not None else None
        if held is None:
            return Digest(rid=rid, weight_version=self.host.weight_version, available=False)
        names = sorted(held)
        return Digest(rid=rid, weight_version=self.host.weight_version, names=names,
                      values=np.array([held[n] for n in names], dtype="<f8").reshape(len(names), 2))

    async def apply(self, msg: Any) -> SyncReport | None:
        """Apply one weight message; raise (the server answers with an error) when it is out of order."""
        host = self.host
        if isinstance(msg, WeightsBegin):
            await host.pause_for_update(msg.weight_version, msg.preempt)
            self.pending, self.loaded = msg.weight_version, 0
        elif isinstance(msg, WeightsBucket):
            if msg.weight_version != self.pending:
                raise ValueError(f"bucket for version {msg.weight_version} but the update in progress is "
                                 f"{self.pending}; send weights_begin first")
            await host.engine.update_weights(tensors_from_bucket(msg, self.reader))
            self.loaded += 1
        elif isinstance(msg, WeightsCommit):
            if msg.weight_version != self.pending or msg.num_buckets != self.loaded:
                raise ValueError(f"commit of version {msg.weight_version} with {msg.num_buckets} buckets, but "
                                 f"{self.loaded} buckets of version {self.pending} were loaded")
            await host.engine.finish_weight_update()
            self.reader.release()
            self.pending = None
            await host.resume(msg.weight_version)
        elif isinstance(msg, LocalLoad):
            await host.pause_for_update(msg.weight_version, msg.preempt)
            report = await load_into_engine(host.engine, msg.named, msg.bucket_bytes)
            await host.resume(msg.weight_version)
            return report
        else:
            raise TypeError(f"{type(msg).__name__} is not a weight message")
        return None
