"""The one codec for weight tensors, whatever route carries them: a tensor's raw bytes and back,
the bucketing rule every route shares, the flat layout of a bucket packed into one buffer and views
of it, the payload checksums (xxh3 or CRC32 over bytes, sum64 on a tensor's own device), and the
finite-values check an engine applies before it loads a byte.

A bucket on the wire is a `WeightsBucket` (rollout/bus/protocol.py): its tensors either ride as
raw frames or lie in a buffer the message names (`ref`: a shared-memory slot or a memory handle,
rollout/weights/shm.py and handle.py)."""

from __future__ import annotations

import warnings
import zlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterable, Iterator

from rollout.bus.protocol import ProtocolError, WeightsBucket

if TYPE_CHECKING:
    import torch

ALIGN = 64  # every tensor of a packed bucket starts at a multiple of this many bytes (any dtype may view it)
GROW = 1 << 20  # packed buffers grow in whole MiB
MASK = (1 << 64) - 1


def _xxh3(frames: list[bytes | memoryview]) -> int:
    import xxhash

    h = xxhash.xxh3_64()
    for f in frames:
        h.update(f)
    return h.intdigest()


def _crc32(frames: list[bytes | memoryview]) -> int:
    crc = 0
    for f in frames:
        crc = zlib.crc32(f, crc)
    return crc


# payload checksums by name: xxh3 (~13 GB/s here) where the xxhash package is installed, CRC32
# (~2.3 GB/s here, measured side by side on 64 MiB) otherwise; a bucket says which one it carries
CHECKSUMS = {"xxh3": _xxh3, "crc32": _crc32}
try:
    import xxhash  # noqa: F401

    DEFAULT_CHECKSUM = "xxh3"
except ImportError:
    DEFAULT_CHECKSUM = "crc32"


def checksum(frames: list[bytes | memoryview], alg: str = "crc32") -> int:
    """The `alg` checksum over the payload frames of a weight bucket, checked by the receiver."""
    if alg not in CHECKSUMS:
        raise ProtocolError(f"unknown checksum {alg!r}; this peer knows {sorted(CHECKSUMS)}")
    if alg == "xxh3" and DEFAULT_CHECKSUM != "xxh3":
        raise ProtocolError("the sender checksummed with xxh3 but this peer lacks the xxhash package; pip install "
                            "xxhash")
    return CHECKSUMS[alg](frames)



def sum64(flat: "torch.Tensor") -> int:
    """The `sum64` checksum of a flat uint8 tensor, computed on its device (see the module docstring)."""
    import torch

    n = flat.numel() // 8 * 8
    total = int(flat[:n].view(torch.int64).sum().item()) if n else 0
    tail = flat[n:].cpu().numpy().tobytes()
    return (total + int.from_bytes(tail, "little")) & MASK


def layout(tensors: list[tuple[str, "torch.Tensor"]], dtype: "torch.dtype | None" = None
           ) -> tuple[list[str], list[list[int]], list[int], list[int], int]:
    """(dtype names, shapes, byte offsets, byte sizes, total bytes) of a bucket packed into one slot,
    each tensor cast to `dtype` (float tensors only) and aligned to ALIGN bytes."""
    dtypes, shapes, offsets, sizes, at = [], [], [], [], 0
    for _, t in tensors:
        dt = dtype if dtype is not None and t.is_floating_point() else t.dtype
        n = t.numel() * _itemsize(dt)
        dtypes.append(str(dt).removeprefix("torch."))
        shapes.append(list(t.shape))
        offsets.append(at)
        sizes.append(n)
        at += -(-n // ALIGN) * ALIGN
    return dtypes, shapes, offsets, sizes, at


def _itemsize(dtype: "torch.dtype") -> int:
    import torch

    return torch.empty(0, dtype=dtype).element_size()


def views(flat: "torch.Tensor", dtypes: list[str], shapes: list[list[int]], offsets: list[int],
          sizes: list[int], names: list[str] | None = None) -> list["torch.Tensor"]:
    """Tensors that are views of a flat uint8 buffer, as `layout` placed them (no copy)."""
    return [tensor_from_raw(flat[o:o + n], d, s, name) for d, s, o, n, name
            in zip(dtypes, shapes, offsets, sizes, names or [""] * len(sizes))]


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
                        rid: str = "", dtype: "torch.dtype | None" = None) -> WeightsBucket:
    """Pack (name, tensor) pairs into one bucket message; tensors are copied to CPU bytes, float
    tensors cast to `dtype` (the engines') when given."""
    frames: list[bytes | memoryview] = []
    dtypes, shapes = [], []
    for _, t in tensors:
        if dtype is not None and t.is_floating_point() and t.dtype != dtype:
            t = t.to(dtype)
        raw, dtype_name, shape = tensor_to_raw(t)
        frames.append(memoryview(raw.numpy()).cast("B") if raw.numel() else b"")
        dtypes.append(dtype_name)
        shapes.append(shape)
    return WeightsBucket(rid=rid, weight_version=version, index=index, names=[n for n, _ in tensors],
                         dtypes=dtypes, shapes=shapes, checksum=checksum(frames, DEFAULT_CHECKSUM),
                         frames=frames, checksum_alg=DEFAULT_CHECKSUM)


def tensors_from_bucket(bucket: WeightsBucket, slots: Any = None) -> list[tuple[str, "torch.Tensor"]]:
    """Verify the bucket's checksum and rebuild its tensors without copying: views of its frames, or
    of the shared-memory slot `slots` maps; valid while the message lives and the bucket is not
    acked (the engine copies them into its parameters before that)."""
    if bucket.ref is not None:
        if slots is None:
            raise ProtocolError("this receiver does not map shared memory; send the bucket's frames")
        flat = slots.flat(bucket.ref)
        if bucket.checksum_alg == "sum64":  # a buffer opened by handle: checked on its own device (rollout/weights/handle.py)
            got = sum64(flat)
        else:
            got = checksum([memoryview(flat.numpy())], bucket.checksum_alg)
        if got != bucket.checksum:
            where = bucket.ref.get("path") or "a buffer opened by handle"
            raise ProtocolError(f"weights bucket {bucket.index} of version {bucket.weight_version} in {where} "
                                f"failed its checksum ({bucket.checksum_alg} {got:#x} != {bucket.checksum:#x}); resend the bucket")
        return finite(list(zip(bucket.names, views(flat, bucket.dtypes, bucket.shapes, bucket.ref["offsets"],
                                                   bucket.ref["sizes"], bucket.names))),
                      f"weights bucket {bucket.index} of version {bucket.weight_version}")
    got = checksum(bucket.frames, bucket.checksum_alg)
    if got != bucket.checksum:
        raise ProtocolError(f"weights bucket {bucket.index} of version {bucket.weight_version} failed its "
                            f"checksum ({bucket.checksum_alg} {got:#x} != {bucket.checksum:#x}); resend the bucket")
    return finite([(name, tensor_from_raw(frame, dtype, shape, name, copy=False))
                   for name, dtype, shape, frame in zip(bucket.names, bucket.dtypes, bucket.shapes, bucket.frames)],
                  f"weights bucket {bucket.index} of version {bucket.weight_version}")


def finite(tensors: list[tuple[str, "torch.Tensor"]], where: str) -> list[tuple[str, "torch.Tensor"]]:
    """`tensors`, or a ProtocolError naming the first floating tensor with a NaN or an infinity:
    an engine never serves weights a diverged update produced (on every weight path)."""
    for name, t in tensors:
        if t.is_floating_point() and t.numel() and not _all_finite(t):
            bad = int((~t.isfinite()).sum())
            raise ProtocolError(f"{where}: tensor {name!r} holds {bad} NaN or infinite value(s); the update that "
                                "made them diverged (lower actor.lr, set actor.grad_clip); the bucket is refused and "
                                "the version's commit fails")
    return tensors


def _all_finite(t: "torch.Tensor") -> bool:
    """No NaN or infinity in `t`. A NaN or an infinity makes any sum over it non-finite (inf + x is inf or
    NaN, NaN absorbs everything), so a finite sum proves every element finite, at the cost of one read
    (30x faster on a CPU than `isfinite().all()`, which writes a bool per element); only a sum that is
    not finite (a real NaN, or finite values whose sum overflows) is checked element by element."""
    import torch

    total = t.sum(dtype=torch.float64 if t.dtype == torch.float64 else torch.float32)
    return bool(total.isfinite()) or bool(t.isfinite().all())


def iter_buckets(named: Iterable[tuple[str, "torch.Tensor"]], version: int,
                 bucket_bytes: int = 256 << 20) -> Iterator[WeightsBucket]:
    """Bucket messages of at most `bucket_bytes` each (a larger tensor gets its own)."""
    for index, tensors in enumerate(bucket_by_size(named, bucket_bytes)):
        yield bucket_from_tensors(tensors, version, index)


@dataclass
class SyncReport:
    version: int
    engines: int
    buckets: int
    bytes: int
    seconds: float
    path: str = "bus"


def slot_bucket(slots: Any, i: int, tensors: list[tuple[str, "torch.Tensor"]], version: int, index: int,
               dtype: "torch.dtype | None" = None) -> WeightsBucket:
    """Pack `tensors` into slot `i` of `slots` (cast to `dtype`) and checksum it: a bucket message that
    carries only the slot's reference, for engines on this node (`ShmSlots`: a shared-memory file,
    rollout/weights/shm.py; `HandleSlots`: a buffer named by its memory handle, handle.py)."""
    ref = slots.pack(i, tensors, dtype)
    dtypes, shapes = ref.pop("dtypes"), ref.pop("shapes")
    alg, crc = slots.checksum(i, ref["total"])
    return WeightsBucket(weight_version=version, index=index, names=[n for n, _ in tensors], dtypes=dtypes, shapes=shapes,
                         checksum=crc, checksum_alg=alg, ref=ref)

