"""Turning named tensors into weight-bucket messages and back.

The trainer side groups HF-named tensors into size-bounded buckets; each bucket travels as one
`WeightsBucket` with a CRC32 the engine side verifies before loading a single byte.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterable, Iterator

from rollout.protocol import ProtocolError, WeightsBucket, checksum

if TYPE_CHECKING:
    import torch


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
