"""Memory bandwidth of this machine, measured in the same run as a benchmark.

``memcpy_bandwidth(threads)`` copies one large array into another, split in ``threads``
contiguous parts copied at once by as many threads, and returns the best rate seen in GB/s
(1e9 bytes copied per second; each byte is read once and written once). Benchmarks divide
their own throughput by it to say how close a fast path comes to what memory allows.

Two copies are timed and the faster counts, so that no host's slow copy makes the ratios
look better than they are: ``np.copyto`` on contiguous uint8 slices, which is libc
``memcpy`` (non-temporal stores for large sizes; it releases the GIL, so the threads really
run in parallel), and gradtap's own non-temporal copy (``gradtap.core.memory.stream_bytes``,
64-byte lines, in a kernel that releases the GIL). Which is faster depends on the host: on
an AMD EPYC VM (Zen 3, 2 vCPUs), memcpy moved 8.1 GB/s on one thread and 8.45 on two, the
non-temporal copy 8.4 and 15.3: libc's large copy did not scale there. ``copy_rates`` gives
both. A Numba loop of ordinary stores is not a fair stand-in: every store first reads its
cache line, so it moves half as much again.

``around(measure)`` measures the rate just before and just after ``measure()`` and keeps the
higher (the lower ratio): this project's VM moves between about 22 and 36 GB/s (2 threads)
over minutes, so a figure is held to the rate of its own minute, not to one taken at the
start or the end of a benchmark that may belong to the other spell.

Run ``python -m benchmarks._bandwidth`` to print the figures for 1 and 2 threads.
"""

import os
import threading
import time
from typing import Callable, TypeVar

import numpy as np
from numba import njit

from gradtap.core.jit import JIT
from gradtap.core.memory import store_fence, stream_bytes

T = TypeVar("T")


@njit(**JIT)
def _stream_copy(dst, src):
    stream_bytes(dst, 0, src, 0, dst.size)
    store_fence()


def _libc_copy(dst: np.ndarray, src: np.ndarray) -> None:
    np.copyto(dst, src)


COPIES = {"memcpy": _libc_copy, "non-temporal": _stream_copy}


def memcpy_bandwidth(threads: int, nbytes: int = 256 << 20, repeats: int = 7) -> float:
    """The faster of :func:`copy_rates`, GB/s."""
    return max(copy_rates(threads, nbytes, repeats).values())


def copy_rates(threads: int, nbytes: int = 256 << 20, repeats: int = 7) -> dict[str, float]:
    """Best-of-``repeats`` copy rate of an ``nbytes`` array over ``threads`` threads, GB/s, of
    each of :data:`COPIES`.

    ``nbytes`` should be far larger than the last-level cache so the figure is DRAM's.
    """
    if threads < 1:
        raise ValueError(f"threads = {threads}; must be >= 1")
    # Both written, so every page is faulted in before timing, and with bytes that differ from
    # page to page: pages of one value (np.ones) can be merged by the hypervisor (KSM) into
    # one host page, which the copy then reads from cache (165 GB/s "measured" on a 2-core VM).
    src = np.arange(nbytes // 8 + 1, dtype=np.uint64).view(np.uint8)[:nbytes]
    dst = np.empty(nbytes, np.uint8)
    dst[:] = src[::-1]
    bounds = np.linspace(0, nbytes, threads + 1).astype(np.int64)
    start_line = threading.Barrier(threads)
    # Each copy is timed by the thread that does it: a timing thread of its own would share
    # the cores with the copies and, scheduled late, read its start clock after they were done
    # (268 GB/s "measured" for 2 threads on a 2-core VM).
    _stream_copy(dst[:64], src[:64])     # compiled (or loaded) before the clock starts
    spans = np.zeros((repeats, threads, 2))

    def worker(copy: Callable[[np.ndarray, np.ndarray], None], k: int, lo: int, hi: int) -> None:
        for r in range(repeats):
            start_line.wait()
            spans[r, k, 0] = time.perf_counter()
            copy(dst[lo:hi], src[lo:hi])
            spans[r, k, 1] = time.perf_counter()

    rates = {}
    for name, copy in COPIES.items():
        pool = [threading.Thread(target=worker, args=(copy, i, int(bounds[i]), int(bounds[i + 1])))
                for i in range(threads)]
        for t in pool:
            t.start()
        for t in pool:
            t.join()
        best = float(np.min(spans[:, :, 1].max(axis=1) - spans[:, :, 0].min(axis=1)))
        rates[name] = nbytes / best / 1e9
    return rates


def around(measure: Callable[[], T], threads: int = 2) -> tuple[T, float]:
    """``measure()`` and the memcpy rate of ``threads`` threads just before and just after it,
    the higher of the two (GB/s)."""
    before = memcpy_bandwidth(threads)
    result = measure()
    return result, max(before, memcpy_bandwidth(threads))


if __name__ == "__main__":
    for n in range(1, min(2, os.cpu_count() or 1) + 1):
        rates = copy_rates(n)
        print(f"{n} thread{'s' if n > 1 else ''}: " + ", ".join(f"{k} {v:6.2f} GB/s" for k, v in rates.items()))
