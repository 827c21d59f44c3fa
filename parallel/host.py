"""Host memory settings of a CPU training process.

glibc's malloc serves a block larger than its mmap threshold (at most 32 MiB, 128 KiB at start)
with a fresh `mmap` and unmaps it on free, and it returns freed memory at the top of its heap to the
system. A CPU update allocates and frees blocks of hundreds of MiB for every micro-batch (logits,
their fp32 chunks, autocast casts, attention scores), so every one of them is faulted in page by
page again: on a 2-core AVX-512 box, casting a [944, 49152] bf16 chunk to fp32 took 58 ms into fresh
memory and 7 ms into reused memory. `retain_freed_memory` raises both thresholds so freed blocks stay
in the process for the next micro-batch (a bf16 update of SmolLM2-135M: 1.14x, page faults 5.9 -> 0.6
GiB per update, the same peak RSS; `benchmarks/host_memory.py`).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # mallopt parameters (malloc.h)
RETAIN = 2 ** 31 - 1  # the largest value mallopt takes (an int): blocks below 2 GiB come from the heap


def retain_freed_memory() -> bool:
    """Keep freed memory in this process for reuse (glibc: no mmap per large block, no heap trim).
    True if applied; False where the C library has no `mallopt` (macOS, musl), which is harmless.
    The process's RSS then stays at its peak instead of falling between micro-batches."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(M_MMAP_THRESHOLD, RETAIN)) and bool(mallopt(M_TRIM_THRESHOLD, RETAIN))
