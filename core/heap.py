"""The process's heap (glibc malloc): freed memory kept in it while the simulator runs, and
freed memory given back to the system while a large state is copied out of a checkpoint.

Where the C library has no ``mallopt`` and ``malloc_trim`` (not glibc), nothing changes.

**Kept.** Each rank's backward pass allocates its gradients and temporaries afresh (GPT-2's
tied embedding alone has a 154 MB gradient per rank). glibc serves blocks that large with
``mmap`` and unmaps them when they are freed, so the next rank's backward faults in, and the
kernel zeroes, as many fresh pages again: 2 million page faults and 4 of the 22 system
CPU-seconds of one GPT-2-small iteration of 8 ranks. Inside :func:`retained_heap` every block
comes from the heap, and freed blocks stay there for the next allocations. On leaving,
glibc's defaults are set back and the free memory is returned to the system
(``malloc_trim``). The values computed are the same either way: PyTorch aligns every tensor
to 64 bytes.

**Given back.** glibc's threshold for serving a block with ``mmap`` is not fixed: each
``mmap``-served block freed raises it to that block's size, up to 32 MiB (``mallopt(3)``,
``M_MMAP_THRESHOLD``). Once a process has freed such blocks, a checkpoint loaded later has
most of its tensors (every one under 32 MiB: all but GPT-2's embeddings) in the heap, and a
tensor freed there stays resident until the pages around it are free and glibc trims them.
A replica built from a checkpoint handed over frees each tensor as it copies it
(``updater/state.py``), so that the two are never both held; with the tensors in the heap,
both were held all the same. :func:`give_back_freed` returns the heap's free pages, in the
middle of the heap as well as at its top (``malloc_trim(0)``, glibc 2.8 and later).
GPT-2 small, replayed by ``benchmarks.replay`` in a process that had replayed before: the
start-up's peak took 23.9 B per parameter (the checkpoint's 12 and the replica's 12), and
22.7 given back every 64 MiB, the replay's own peak.
"""

from __future__ import annotations

import ctypes
import ctypes.util
from contextlib import contextmanager
from functools import cache

# mallopt parameters (glibc malloc.h) and glibc's defaults for them.
M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4
DEFAULT_TRIM_THRESHOLD = 128 * 1024
DEFAULT_MMAP_MAX = 65536
KEEP_FREE_BYTES = 2**31 - 1      # free memory at the heap's top kept, at most (an int)
# Bytes freed between two give-backs while a checkpoint is copied out: what the copy may hold
# beyond its own state at most. GPT-2 small's 1.5 GB: 17 calls, 9 ms in all in a fresh
# process and 94-108 ms in one that had replayed before (the kernel freeing the pages).
GIVE_BACK_BYTES = 64 << 20


@cache
def libc() -> ctypes.CDLL | None:
    """The C library when it is glibc's (it has ``mallopt`` and ``malloc_trim``), else None."""
    name = ctypes.util.find_library("c")
    lib = ctypes.CDLL(name) if name else None
    if lib is None or not hasattr(lib, "mallopt") or not hasattr(lib, "malloc_trim"):
        return None
    return lib


@contextmanager
def retained_heap():
    """Within the block, allocations come from the heap and freed memory stays in it."""
    lib = libc()
    if lib is None:
        yield
        return
    lib.mallopt(M_MMAP_MAX, 0)
    lib.mallopt(M_TRIM_THRESHOLD, KEEP_FREE_BYTES)
    try:
        yield
    finally:
        lib.mallopt(M_MMAP_MAX, DEFAULT_MMAP_MAX)
        lib.mallopt(M_TRIM_THRESHOLD, DEFAULT_TRIM_THRESHOLD)
        give_back_freed()


def give_back_freed() -> None:
    """Return the free pages of every arena of the heap to the system."""
    lib = libc()
    if lib is not None:
        lib.malloc_trim(0)


class GiveBack:
    """Counts the bytes a caller frees, and gives the heap's free pages back each time they
    reach ``every`` bytes (:data:`GIVE_BACK_BYTES`), so that the caller's frees are returned
    to the system as it makes them, never more than ``every`` behind."""

    def __init__(self, every: int = GIVE_BACK_BYTES):
        self.every, self.pending = every, 0

    def freed(self, nbytes: int) -> None:
        self.pending += nbytes
        if self.pending >= self.every:
            give_back_freed()
            self.pending = 0
