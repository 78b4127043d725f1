"""Freed memory kept in the process's heap while the simulator runs (glibc ``mallopt``).

Each rank's backward pass allocates its gradients and temporaries afresh (GPT-2's tied
embedding alone has a 154 MB gradient per rank). glibc serves blocks that large with
``mmap`` and unmaps them when they are freed, so the next rank's backward faults in, and the
kernel zeroes, as many fresh pages again: 2 million page faults and 4 of the 22 system
CPU-seconds of one GPT-2-small iteration of 8 ranks. Inside :func:`retained_heap` every block
comes from the heap, and freed blocks stay there for the next allocations. On leaving,
glibc's defaults are set back and the free memory is returned to the system
(``malloc_trim``). Where the C library has no ``mallopt`` (not glibc), nothing changes.
The values computed are the same either way: PyTorch aligns every tensor to 64 bytes.
"""

from __future__ import annotations

import ctypes
import ctypes.util
from contextlib import contextmanager

# mallopt parameters (glibc malloc.h) and glibc's defaults for them.
M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4
DEFAULT_TRIM_THRESHOLD = 128 * 1024
DEFAULT_MMAP_MAX = 65536
KEEP_FREE_BYTES = 2**31 - 1      # free memory at the heap's top kept, at most (an int)


def _libc():
    name = ctypes.util.find_library("c")
    libc = ctypes.CDLL(name) if name else None
    if libc is None or not hasattr(libc, "mallopt") or not hasattr(libc, "malloc_trim"):
        return None
    return libc


@contextmanager
def retained_heap():
    """Within the block, allocations come from the heap and freed memory stays in it."""
    libc = _libc()
    if libc is None:
        yield
        return
    libc.mallopt(M_MMAP_MAX, 0)
    libc.mallopt(M_TRIM_THRESHOLD, KEEP_FREE_BYTES)
    try:
        yield
    finally:
        libc.mallopt(M_MMAP_MAX, DEFAULT_MMAP_MAX)
        libc.mallopt(M_TRIM_THRESHOLD, DEFAULT_TRIM_THRESHOLD)
        libc.malloc_trim(0)
