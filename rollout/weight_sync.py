"""Turning named tensors into weight-bucket messages and back.

The trainer side groups HF-named tensors into size-bounded buckets; each bucket travels as one
`WeightsBucket` with a CRC32 the engine side verifies before loading a single byte.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterable, Iterator

from rollout.protocol import Ack, ProtocolError, WeightsBegin, WeightsBucket, WeightsCommit, checksum

if TYPE_CHECKING:
    import torch

    from rollout.client import GenerateClient


def bucket_from_tensors(tensors: list[tuple[str, "torch.Tensor"]], version: int, index: int,
                        rid: str = "") -> WeightsBucket:
    """Pack (name, tensor) pairs into one bucket message; tensors are copied to CPU bytes."""
    import torch

    frames, dtypes, shapes = [], [], []
    for _, t in tensors:
        t = t.detach().to("cpu").contiguous()
        frames.append(memoryview(t.view(torch.uint8).numpy()).cast("B") if t.numel() else b"")
        dtypes.append(str(t.dtype).removeprefix("torch."))
        shapes.append(list(t.shape))
    return WeightsBucket(rid=rid, version=version, index=index, names=[n for n, _ in tensors],
                         dtypes=dtypes, shapes=shapes, crc=checksum(frames), frames=frames)


def tensors_from_bucket(bucket: WeightsBucket) -> list[tuple[str, "torch.Tensor"]]:
    """Verify the bucket's CRC32 and rebuild its tensors (copies, safe after the frames go)."""
    import torch

    got = checksum(bucket.frames)
    if got != bucket.crc:
        raise ProtocolError(f"weights bucket {bucket.index} of version {bucket.version} failed its "
                            f"checksum (crc32 {got:#x} != {bucket.crc:#x}); resend the bucket")
    out = []
    for name, dtype, shape, frame in zip(bucket.names, bucket.dtypes, bucket.shapes, bucket.frames):
        tdtype = getattr(torch, dtype, None)
        if not isinstance(tdtype, torch.dtype):
            raise ProtocolError(f"tensor {name!r} has unknown dtype {dtype!r}")
        raw = torch.frombuffer(bytearray(frame), dtype=torch.uint8) if len(frame) else torch.empty(0, dtype=torch.uint8)
        out.append((name, raw.view(tdtype).reshape(shape)))
    return out


def iter_buckets(named: Iterable[tuple[str, "torch.Tensor"]], version: int,
                 bucket_bytes: int = 256 << 20) -> Iterator[WeightsBucket]:
    """Group tensors into buckets of at most `bucket_bytes` (a larger tensor gets its own)."""
    pending: list[tuple[str, "torch.Tensor"]] = []
    size = index = 0
    for name, t in named:
        nbytes = t.numel() * t.element_size()
        if pending and size + nbytes > bucket_bytes:
            yield bucket_from_tensors(pending, version, index)
            pending, size, index = [], 0, index + 1
        pending.append((name, t))
        size += nbytes
    if pending:
        yield bucket_from_tensors(pending, version, index)


@dataclass
class SyncReport:
    version: int
    engines: int
    buckets: int
    bytes: int
    seconds: float


async def push_weights(client: "GenerateClient", named: Iterable[tuple[str, "torch.Tensor"]], version: int,
                       bucket_bytes: int = 256 << 20, timeout_s: float = 600.0) -> SyncReport:
    """Load weight version `version` into every live engine behind `client`, bucket by bucket.

    Each engine pauses admission at `weights_begin` (running requests finish first), checks every
    bucket's CRC32 as it arrives, and switches at `weights_commit`; the call returns only after
    every engine acknowledged the commit with `version`, so the next rollout is on-policy. Buckets
    are produced lazily, so the trainer never holds more than one extra bucket of bytes.
    """
    t0 = time.perf_counter()
    begun = await client.broadcast(WeightsBegin(version=version), timeout_s)
    buckets = nbytes = 0
    for bucket in iter_buckets(named, version, bucket_bytes):
        await client.broadcast(bucket, timeout_s)
        buckets += 1
        nbytes += sum(len(f) for f in bucket.frames)
    acks = await client.broadcast(WeightsCommit(version=version, num_buckets=buckets), timeout_s)
    wrong = [a for a in acks if not isinstance(a, Ack) or a.weight_version != version]
    if wrong or len(acks) != len(begun):
        raise RuntimeError(f"weight version {version} was not committed by every engine ({len(acks)} acks for "
                           f"{len(begun)} engines, unexpected: {wrong[:3]}); check the engine server logs")
    return SyncReport(version, len(acks), buckets, nbytes, time.perf_counter() - t0)
