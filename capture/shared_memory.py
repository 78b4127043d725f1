"""Shared memory for frame rings: a memfd mapping, on huge pages when the host has them.

The mapping is a ``memfd_create`` file, so it has no name to collide with or leak in
``/dev/shm``: it lives as long as a descriptor or a mapping of it does. It passes to a
child process as a descriptor: pickling a :class:`SharedMemory` while a ``multiprocessing``
process is being started duplicates the descriptor into the child (``reduction.DupFd``),
which maps the same pages. That works for the ``spawn``, ``forkserver`` and ``fork``
start methods alike.

Huge pages come from ``MFD_HUGETLB`` (the kernel's default huge page size, usually 2 MiB):
no hugetlbfs mount is needed, only free pages in the pool (``vm.nr_hugepages``). The
kernel reserves them at ``mmap`` time, so a short pool shows up there as ``ENOMEM`` and
never later as a fault in the middle of a capture.
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
from multiprocessing import reduction
from typing import Literal

from gradtap.core.errors import CaptureError

log = logging.getLogger(__name__)

HugePages = Literal["auto", "require", "off"]
HUGEPAGES_MODES = ("auto", "require", "off")


def hugepage_pool() -> dict[str, int]:
    """The default huge page pool from ``/proc/meminfo``: ``size`` (bytes), ``total``, ``free``."""
    fields = {}
    with open("/proc/meminfo") as f:
        for line in f:
            key, _, value = line.partition(":")
            fields[key] = value.split()
    size = int(fields.get("Hugepagesize", ["0"])[0]) * 1024
    return {"size": size, "total": int(fields.get("HugePages_Total", ["0"])[0]),
            "free": int(fields.get("HugePages_Free", ["0"])[0]) - int(fields.get("HugePages_Rsvd", ["0"])[0])}


class SharedMemory:
    """A shared, writable mapping of ``size`` bytes (rounded up to the page size).

    Attributes: ``size`` (bytes mapped), ``page_size`` (bytes; the huge page size when
    ``huge``), ``huge`` (backed by huge pages), ``buf`` (the ``mmap``).
    """

    def __init__(self, fd: int, size: int, page_size: int, huge: bool):
        self.fd, self.size, self.page_size, self.huge = fd, size, page_size, huge
        # MAP_POPULATE: allocate (creator) or map (attacher) every page now, so the first
        # lap of a capture does not stall on page faults while the kernel's ring fills.
        self.buf = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE,
                             prot=mmap.PROT_READ | mmap.PROT_WRITE)

    @classmethod
    def create(cls, size: int, *, hugepages: HugePages = "auto", name: str = "gradtap") -> SharedMemory:
        """Map ``size`` bytes of new shared memory.

        ``hugepages``: ``"auto"`` uses huge pages if the pool has enough free ones and
        otherwise falls back to normal pages with one log line; ``"require"`` raises
        :class:`CaptureError` instead of falling back; ``"off"`` uses normal pages.
        """
        if size <= 0:
            raise ValueError(f"size = {size}; must be > 0")
        if hugepages not in HUGEPAGES_MODES:
            raise ValueError(f"hugepages = {hugepages!r}; allowed {', '.join(HUGEPAGES_MODES)}")
        if hugepages != "off":
            why = None
            try:
                fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_HUGETLB)
            except OSError as exc:
                why = f"memfd_create(MFD_HUGETLB) failed: {os.strerror(exc.errno)}"
            else:
                page = os.fstat(fd).st_blksize
                rounded = -(-size // page) * page
                try:
                    os.ftruncate(fd, rounded)
                    return cls(fd, rounded, page, True)
                except OSError as exc:
                    os.close(fd)
                    pool = hugepage_pool()
                    why = (f"{rounded // page} huge pages of {page >> 10} KiB needed, {pool['free']} free "
                           f"(mmap: {os.strerror(exc.errno)})" if exc.errno == errno.ENOMEM
                           else f"mapping huge pages failed: {os.strerror(exc.errno)}")
            if hugepages == "require":
                raise CaptureError(f"shared memory {name!r} ({size} bytes) needs huge pages: {why}; reserve them "
                                   f"with `sysctl vm.nr_hugepages=N` (or hugepages: auto to accept normal pages)")
            log.warning("shared memory %r: no huge pages (%s); using %d KiB pages", name, why,
                        mmap.PAGESIZE >> 10)
        fd = os.memfd_create(name, os.MFD_CLOEXEC)
        rounded = -(-size // mmap.PAGESIZE) * mmap.PAGESIZE
        os.ftruncate(fd, rounded)
        return cls(fd, rounded, mmap.PAGESIZE, False)

    def __reduce__(self):
        # DupFd hands the descriptor to the child being started (or through a resource
        # sharer outside start-up); the child maps the same pages.
        return _attach, (reduction.DupFd(self.fd), self.size, self.page_size, self.huge)

    def close(self) -> None:
        """Unmap and close the descriptor; the pages go when no process maps them."""
        if self.buf is not None:
            unmap(self.buf)
            self.buf = None
            os.close(self.fd)


def unmap(mapping: mmap.mmap) -> None:
    """Close ``mapping`` once its owner has dropped its own NumPy views of it.

    A view that outlives them (Numba keeps the arguments of the call that compiled a kernel;
    a consumer may still hold a batch) makes ``close`` raise ``BufferError``; the mapping is
    then unmapped when that last view goes away."""
    try:
        mapping.close()
    except BufferError:
        pass


def _attach(dup, size: int, page_size: int, huge: bool) -> SharedMemory:
    return SharedMemory(dup.detach(), size, page_size, huge)
