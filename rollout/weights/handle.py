"""Weight buckets by memory handle: the path into an engine process on the trainer's own device.

The sender packs a bucket into one flat buffer on its device (one copy, cast to the engine's dtype)
and sends a `WeightsBucket` whose `shm` reference carries the buffer's handle instead of a file
name. The engine server opens the handle once per buffer (cached), checksums the bytes where they
are, and hands the engine views of them; it copies them into its parameters before it acks, after
which the sender reuses the buffer (two of them: bucket i+1 is packed while bucket i loads).

On CUDA the buffer is device memory and the handle a CUDA IPC handle: an engine on the same GPU
(colocated placement) reads the trainer's bucket without a trip through host memory. On CPU the
same code shares the buffer through torch's file-backed shared memory, which is how this path is
tested on a machine without a GPU. The CUDA-only calls are the two marked below
(`_share_cuda_`, `_new_shared_cuda`); with a GPU this path is written, not run.

The checksum (`sum64`) is computed on the buffer's device, so the bytes never leave it to be
hashed: the wrapping sum of its 8-byte words plus the tail bytes. A change confined to one word
(a flipped byte, a torn write of one word) always changes it; it is a check against corruption
between two processes on one device, not a cryptographic one (the header carries names, dtypes,
shapes and offsets separately).

Trust: like the shared-memory slots, a handle is only taken on the ipc socket (same node, same
user: `rollout.bus.server`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from rollout.bus.protocol import ProtocolError
from rollout.weights.bus import BusRoute
from rollout.weights.link import Placement
from rollout.weights.codec import GROW, layout, sum64, views

if TYPE_CHECKING:
    import torch

class HandleSlots:
    """`count` reusable flat buckets on `device` that engine processes open by handle."""

    kind = "handle"

    def __init__(self, device: Any = "cpu", count: int = 2) -> None:
        import torch

        self.device = torch.device(device)
        self.count = count
        self.bufs: list[torch.Tensor | None] = [None] * count
        self.handles: list[dict[str, list[Any]] | None] = [None] * count

    def buffer(self, i: int, nbytes: int) -> "torch.Tensor":
        """Buffer `i` as a flat uint8 tensor of `nbytes` (grown if needed; its old content is gone)."""
        import torch

        buf = self.bufs[i]
        if buf is None or buf.numel() < nbytes:
            size = max(GROW, -(-nbytes // GROW) * GROW)
            buf = torch.empty(size, dtype=torch.uint8, device=self.device)
            storage = buf.untyped_storage()
            if self.device.type == "cuda":  # CUDA-only: an IPC handle of the allocation
                self.handles[i] = {"cuda": list(storage._share_cuda_())}
            else:  # the same bytes in torch's file-backed shared memory, named by the file
                self.handles[i] = {"cpu": list(storage._share_filename_cpu_())}
            self.bufs[i] = buf
        return buf[:nbytes]

    def pack(self, i: int, tensors: list[tuple[str, "torch.Tensor"]], dtype: "torch.dtype | None" = None
             ) -> dict[str, Any]:
        """Copy (and cast) `tensors` into buffer `i`; the reference a WeightsBucket carries."""
        dtypes, shapes, offsets, sizes, total = layout(tensors, dtype)
        flat = self.buffer(i, total)
        for (_, t), view in zip(tensors, views(flat, dtypes, shapes, offsets, sizes)):
            view.copy_(t.detach(), non_blocking=False)
        return self.ref(i, offsets, sizes, total) | {"dtypes": dtypes, "shapes": shapes}

    def ref(self, i: int, offsets: list[int], sizes: list[int], total: int) -> dict[str, Any]:
        return {"handle": self.handles[i], "offsets": offsets, "sizes": sizes, "total": total}

    def checksum(self, i: int, total: int) -> tuple[str, int]:
        return "sum64", sum64(self.buffer(i, total))

    def close(self) -> None:
        self.bufs, self.handles = [None] * self.count, [None] * self.count


class HandleReader:
    """The engine server's side: opens the buffers named by handle (a few at a time, cached)."""

    def __init__(self, keep: int = 4) -> None:
        self.keep = keep
        self._open: dict[bytes, "torch.Tensor"] = {}

    def flat(self, ref: dict[str, Any]) -> "torch.Tensor":
        handle, total = ref.get("handle") or {}, int(ref["total"])
        if not isinstance(handle, dict) or len(handle) != 1 or next(iter(handle)) not in ("cpu", "cuda"):
            raise ProtocolError(f"weights bucket handle {handle!r} is neither a cpu nor a cuda handle")
        kind, args = next(iter(handle.items()))
        try:
            key = bytes(args[1]) if kind == "cpu" else bytes(args[1]) + int(args[3]).to_bytes(8, "little")
            buf = self._open.get(key)
            if buf is None:
                buf = _open(kind, args)
        except (RuntimeError, TypeError, ValueError, IndexError) as e:
            raise ProtocolError(f"cannot open the weights bucket's {kind} handle ({e}); the sender must be "
                                "on this node and keep the buffer until the bucket is acked") from e
        if key not in self._open:
            if len(self._open) >= self.keep:
                self._open.pop(next(iter(self._open)))
            self._open[key] = buf
        if buf.numel() < total:
            raise ProtocolError(f"the weights buffer holds {buf.numel()} bytes, the bucket says {total}")
        return buf[:total]

    def release(self) -> None:
        self._open.clear()


def _open(kind: str, args: list[Any]) -> "torch.Tensor":
    import torch

    if kind == "cuda":  # CUDA-only: map the sender's allocation into this process
        torch.cuda._lazy_init()
        storage = torch.UntypedStorage._new_shared_cuda(*args)  # as `_share_cuda_` gave them, via msgpack
    else:
        manager, name, size = args
        storage = torch.UntypedStorage._new_shared_filename_cpu(bytes(manager), bytes(name), int(size))
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


class HandleRoute(BusRoute):
    """Engines on the trainer's own GPU (colocated): each bucket packed into a device buffer they
    open by its CUDA IPC handle. Written for GPUs, not run here (its CPU form is tested directly)."""

    name = "handle"

    @staticmethod
    def applies(p: Placement) -> bool:
        return p.nodes == 1 and p.engines_on_my_gpu

    def make_slots(self) -> HandleSlots:
        import torch

        return HandleSlots(torch.device("cuda", torch.cuda.current_device()))
