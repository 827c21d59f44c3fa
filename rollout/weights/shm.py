"""Weight buckets through shared memory: the path into an engine process on the sender's node.

The sender packs a bucket's tensors into one flat slot, a file in /dev/shm that it maps (one copy,
which also casts to the engine's dtype), checksums the slot, and sends the engine server a
`WeightsBucket` that names the slot instead of carrying frames. The server maps the same file,
verifies the checksum over it, and hands the engine tensors that are views of the slot; the
engine copies them into its parameters before it acks, after which the sender reuses the slot.
Only the header crosses the socket: nothing is serialised, the bus never copies the bytes. This is
the CPU counterpart of handing a GPU engine CUDA IPC handles of a flat bucket.

A collective broadcast (`rollout.weights.collective.relay_buckets`) receives straight into a slot, so a
node that gets its weights from another node's trainer rank feeds its own engines the same way.

Trust: slot files are created 0600 by the trainer's user under a fixed name prefix; a server maps
only files with that prefix in the shared-memory directory, and only for requests that came in on
its ipc socket (same node, same user: `rollout.bus.server`).
"""

from __future__ import annotations

import mmap
import os
import secrets
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rollout.bus.protocol import ProtocolError
from rollout.weights.bus import BusRoute
from rollout.weights.link import Placement
from rollout.weights.codec import DEFAULT_CHECKSUM, GROW, checksum, layout, views

if TYPE_CHECKING:
    import torch

PREFIX = "switchyard-wb-"


def shm_dir() -> Path:
    """Where slots live: /dev/shm (RAM) where the system has it, else the temp directory."""
    return Path("/dev/shm") if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else Path(tempfile.gettempdir())



def free_bytes(directory: Path | None = None) -> int:
    """Bytes the shared-memory directory can still take (a container's /dev/shm is often 64 MiB)."""
    st = os.statvfs(directory or shm_dir())
    return st.f_bavail * st.f_frsize


def reap_stale(directory: Path | None = None) -> list[Path]:
    """Remove slot files whose creating process is gone (a sender killed with -9 cannot unlink its own)."""
    gone = []
    for path in (directory or shm_dir()).glob(f"{PREFIX}*"):
        pid = path.name[len(PREFIX):].split("-", 1)[0]
        if pid.isdigit() and not _alive(int(pid)):
            path.unlink(missing_ok=True)
            gone.append(path)
    return gone


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive, and not ours to judge
        return True
    return True


class ShmSlots:
    """`count` reusable shared-memory slots on the sending side (double buffering by default).
    Making one first removes slot files that killed senders left behind."""

    def __init__(self, count: int = 2, directory: Path | None = None) -> None:
        self.dir = directory or shm_dir()
        reap_stale(self.dir)
        self.count = count
        self.paths: list[Path | None] = [None] * count
        self.maps: list[mmap.mmap | None] = [None] * count
        self._old: list[mmap.mmap] = []  # outgrown maps tensors may still view: closed with the rest

    def buffer(self, i: int, nbytes: int) -> "torch.Tensor":
        """Slot `i` as a flat uint8 tensor of `nbytes` (grown if needed; its old content is gone)."""
        import torch

        mm = self.maps[i]
        if mm is None or len(mm) < nbytes:
            self._replace(i, max(GROW, -(-nbytes // GROW) * GROW))
            mm = self.maps[i]
        if nbytes == 0:
            return torch.empty(0, dtype=torch.uint8)
        return torch.frombuffer(mm, dtype=torch.uint8, count=nbytes)

    def _replace(self, i: int, size: int) -> None:
        self._drop(i)
        path = self.dir / f"{PREFIX}{os.getpid()}-{secrets.token_hex(8)}"
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            if hasattr(os, "posix_fallocate"):  # reserve the pages now: a full tmpfs fails here, not with SIGBUS later
                os.posix_fallocate(fd, 0, size)
            else:
                os.ftruncate(fd, size)
            self.maps[i] = mmap.mmap(fd, size)
        except OSError as e:
            os.close(fd)
            path.unlink(missing_ok=True)
            raise OSError(f"cannot make a {size >> 20} MiB weight slot in {self.dir} ({e}); give the shared-memory "
                          "directory room for two buckets (rollout.weight_bucket_mb), or set "
                          "rollout.weight_path=bus") from e
        os.close(fd)
        self.paths[i] = path

    def _drop(self, i: int) -> None:
        if self.paths[i] is not None:
            self.paths[i].unlink(missing_ok=True)  # a server's cached map of it stays valid until it lets go
        if self.maps[i] is not None:
            self._old.append(self.maps[i])
        self.paths[i], self.maps[i] = None, None

    def pack(self, i: int, tensors: list[tuple[str, "torch.Tensor"]], dtype: "torch.dtype | None" = None
             ) -> dict[str, Any]:
        """Copy (and cast) `tensors` into slot `i`; the `shm` reference a WeightsBucket carries."""
        dtypes, shapes, offsets, sizes, total = layout(tensors, dtype)
        flat = self.buffer(i, total)
        for (name, t), view in zip(tensors, views(flat, dtypes, shapes, offsets, sizes)):
            view.copy_(t.detach())  # from any device, casting on the way
        return self.ref(i, offsets, sizes, total) | {"dtypes": dtypes, "shapes": shapes}

    def ref(self, i: int, offsets: list[int], sizes: list[int], total: int) -> dict[str, Any]:
        return {"path": str(self.paths[i]), "offsets": offsets, "sizes": sizes, "total": total}

    def checksum(self, i: int, total: int) -> tuple[str, int]:
        """The checksum a bucket in slot `i` carries: (algorithm, value) over its first `total` bytes."""
        return DEFAULT_CHECKSUM, checksum([memoryview(self.buffer(i, total).numpy())], DEFAULT_CHECKSUM)

    def close(self) -> None:
        for i in range(self.count):
            self._drop(i)
        for mm in self._old:
            try:
                mm.close()
            except BufferError:  # a tensor still views it: the memory goes with the tensor
                pass
        self._old = []


class ShmReader:
    """The engine server's side: maps the slots named in buckets (a few at a time) and checks them."""

    def __init__(self, directory: Path | None = None, keep: int = 4) -> None:
        self.dir = (directory or shm_dir()).resolve()
        self.keep = keep
        self._maps: dict[str, mmap.mmap] = {}

    def flat(self, ref: dict[str, Any]) -> "torch.Tensor":
        """The referenced slot's bytes as a flat uint8 tensor (a view of the shared file)."""
        import torch

        path = Path(str(ref.get("path", "")))
        if path.parent.resolve() != self.dir or not path.name.startswith(PREFIX):
            raise ProtocolError(f"weights bucket names shared memory {str(path)!r}; only {self.dir}/{PREFIX}* files "
                                "are mapped")
        total = int(ref["total"])
        mm = self._maps.get(str(path))
        if mm is None or len(mm) < total:
            try:
                fd = os.open(path, os.O_RDWR)
            except OSError as e:
                raise ProtocolError(f"cannot open the weight slot {path} ({e}); the sender must be on this node "
                                    "and keep the slot until the bucket is acked") from e
            try:
                mm = mmap.mmap(fd, 0)
            finally:
                os.close(fd)
            if len(self._maps) >= self.keep:
                self._maps.pop(next(iter(self._maps)))  # the oldest; tensors viewing it keep it alive
            self._maps[str(path)] = mm
        if len(mm) < total:
            raise ProtocolError(f"weight slot {path} holds {len(mm)} bytes, the bucket says {total}")
        return torch.frombuffer(mm, dtype=torch.uint8, count=total) if total else torch.empty(0, dtype=torch.uint8)

    def release(self) -> None:
        """Unmap every slot (after a commit): the engine's RSS then counts only its own memory, and a
        slot the sender replaced is let go. A map some tensor still views is kept until next time."""
        for path, mm in list(self._maps.items()):
            try:
                mm.close()
            except BufferError:
                continue
            del self._maps[path]


class ShmRoute(BusRoute):
    """Engines on the sender's node: each bucket packed into a shared-memory slot they map."""

    name = "shm"

    @staticmethod
    def applies(p: Placement) -> bool:
        return p.nodes == 1

    def make_slots(self) -> ShmSlots:
        return ShmSlots()
