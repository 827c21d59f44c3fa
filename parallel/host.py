"""Host memory settings of a CPU training process and of a CPU engine server.

glibc's malloc serves a block larger than its mmap threshold (at most 32 MiB, 128 KiB at start)
with a fresh `mmap` and unmaps it on free, and it returns freed memory at the top of its heap to the
system. A CPU update allocates and frees blocks of hundreds of MiB for every micro-batch (logits,
their fp32 chunks, autocast casts, attention scores), so every one of them is faulted in page by
page again: on a 2-core AVX-512 box, casting a [944, 49152] bf16 chunk to fp32 took 58 ms into fresh
memory and 7 ms into reused memory. `retain_freed_memory` raises both thresholds so freed blocks stay
in the process for the next micro-batch (a bf16 update of SmolLM2-135M: 1.14x, page faults 5.9 -> 0.6
GiB per update, the same peak RSS; `benchmarks/host_memory.py`). Kept that way, the process's RSS is the
highest it ever was: a long run's one unusually long batch raises it for good (a 400-step soak's trainer
stepped up 144 MiB at step 311 and stayed there). So the actor keeps freed memory through an update and
hands it back when the update ends (`release_freed_memory`, glibc's `malloc_trim`): between steps the
trainer's RSS is what it holds (at a cost: the next update faults most of its buffers in again, 3.7 GiB
against 0.5 kept and 5.3 with glibc's defaults in `benchmarks/host_memory.py` on a 2-core AMD EPYC).

An engine server is the opposite case: it runs for days, and every step brings new shapes (a batch
of other lengths, a fresh copy of the weights), so glibc's heap keeps what a step freed in holes it
never hands back, and oneDNN caches a primitive per shape it ran (torch keeps up to 1024). An hf engine
on this CPU box grew 6-9 MiB a step for hundreds of steps that way, with no Python object held.
`bound_freed_memory` fixes both thresholds low (freed large blocks go back to the system at once)
and caps the shape caches; `benchmarks/engine_heap.py` measures it against the defaults (60 rounds
of a step's work on tiny-llama: +1.1 MiB over the second half against +54.5, each round 1.09-1.16x
the time: an mmap per large block).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
import sys

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # mallopt parameters (malloc.h)
RETAIN = 2 ** 31 - 1  # the largest value mallopt takes (an int): blocks below 2 GiB come from the heap
# an engine server's settings (bound_freed_memory): blocks from 256 KiB up get an mmap of their own and
# are unmapped on free; the heap's top is returned past 1 MiB; torch's cache of oneDNN computations
# (LRU_CACHE_CAPACITY, 1024 by default) holds 16 shapes, oneDNN's own primitive cache 64
ENGINE_MMAP_THRESHOLD, ENGINE_TRIM_THRESHOLD = 256 * 1024, 1024 * 1024
SHAPE_CACHES = {"LRU_CACHE_CAPACITY": "16", "ONEDNN_PRIMITIVE_CACHE_CAPACITY": "64"}


def retain_freed_memory() -> bool:
    """Keep freed memory in this process for reuse (glibc: no mmap per large block, no heap trim).
    True if applied; False where the C library has no `mallopt` (macOS, musl), which is harmless.
    The process's RSS then stays at its peak instead of falling between micro-batches."""
    return _mallopt(RETAIN, RETAIN)


def release_freed_memory() -> bool:
    """Hand the heap's free pages back to the system now (glibc `malloc_trim(0)`: the top of the heap
    and every free page inside it). True if it ran; False without glibc, which is harmless."""
    libc = _libc()
    if libc is None or not hasattr(libc, "malloc_trim"):
        return False
    libc.malloc_trim.argtypes, libc.malloc_trim.restype = [ctypes.c_size_t], ctypes.c_int
    libc.malloc_trim(0)
    return True


def bound_freed_memory() -> bool:
    """Give freed memory back to the system and cap oneDNN's per-shape cache: a long-lived engine
    server's RSS then follows what it holds, not every shape it ever served. Call it before the
    engine computes anything (oneDNN reads its cache size once); a value the user exported wins.
    True if the heap thresholds were applied (glibc), False elsewhere, which is harmless."""
    for name, value in SHAPE_CACHES.items():
        os.environ.setdefault(name, value)
    return _mallopt(ENGINE_MMAP_THRESHOLD, ENGINE_TRIM_THRESHOLD)


def _mallopt(mmap_threshold: int, trim_threshold: int) -> bool:
    """Fix glibc's two thresholds (setting them turns its dynamic adjustment off); False without glibc."""
    libc = _libc()
    mallopt = getattr(libc, "mallopt", None)
    if mallopt is None:
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(M_MMAP_THRESHOLD, mmap_threshold)) and bool(mallopt(M_TRIM_THRESHOLD, trim_threshold))


@functools.cache
def _libc() -> ctypes.CDLL | None:
    """glibc, where this is Linux; None elsewhere. Found once: `find_library` runs ldconfig, and the
    actor asks for it after every update."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None
