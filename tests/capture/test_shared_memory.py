"""Huge pages for real: the test reserves a pool (``vm.nr_hugepages``), a ring lands on it
with the page size reported and its pages taken from the pool, a spawned process maps the
same pages; with the pool empty, ``auto`` falls back to normal pages with one log line and
``require`` says what to do. The pool is restored whatever happens."""

from __future__ import annotations

import logging
import mmap
import multiprocessing
import os
from contextlib import contextmanager

import numpy as np
import pytest

from gradtap.capture.frames import FrameBatch
from gradtap.capture.ring import FrameRing
from gradtap.capture.shared_memory import SharedMemory, hugepage_pool, unmap
from gradtap.core.errors import CaptureError

pytestmark = [pytest.mark.privileged, pytest.mark.timeout(60),
              pytest.mark.skipif(os.geteuid() != 0, reason="needs root to size the huge page pool")]

NR_HUGEPAGES = "/proc/sys/vm/nr_hugepages"


@contextmanager
def hugepage_pool_of(free: int):
    """Resize the default pool so that ``free`` pages are free; restore it afterwards."""
    with open(NR_HUGEPAGES) as f:
        before = int(f.read())
    pool = hugepage_pool()
    in_use = pool["total"] - pool["free"]
    try:
        with open(NR_HUGEPAGES, "w") as f:
            f.write(str(in_use + free))
        yield hugepage_pool()
    finally:
        with open(NR_HUGEPAGES, "w") as f:
            f.write(str(before))


def _child_reads(ring: FrameRing, conn) -> None:
    batch = ring.read(timeout=5)
    conn.send((ring.hugepages, ring.page_size, [bytes(batch.frame(i)) for i in range(len(batch))]))


def test_a_ring_on_huge_pages_reports_them_and_is_shared_with_a_child():
    slots, slot_size = 1024, 4352                       # 4.4 MB: three 2 MiB pages
    with hugepage_pool_of(8) as pool:
        if pool["free"] < 8:
            pytest.skip(f"the kernel found only {pool['free']} free huge pages (memory fragmented)")
        ring = FrameRing.create(slots, slot_size, hugepages="require")
        try:
            assert ring.hugepages and ring.page_size == pool["size"]
            assert ring.memory.size % pool["size"] == 0
            used = ring.memory.size // pool["size"]
            assert hugepage_pool()["free"] == 8 - used        # reserved from the pool at mmap
            frames = [bytes([i]) * (100 + i) for i in range(50)]
            ring.push(FrameBatch.from_frames(frames))
            ctx = multiprocessing.get_context("spawn")
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_child_reads, args=(ring, child))
            proc.start()
            try:
                assert parent.poll(30)
                assert parent.recv() == (True, pool["size"], frames)
            finally:
                proc.join(10)
                if proc.is_alive():
                    proc.kill()
        finally:
            ring.close()
        assert hugepage_pool()["free"] == 8                   # given back when unmapped


def test_an_empty_pool_falls_back_once_or_refuses(caplog):
    with hugepage_pool_of(0):
        with caplog.at_level(logging.WARNING, logger="gradtap.capture.shared_memory"):
            ring = FrameRing.create(1024, 4352, hugepages="auto")
        try:
            assert (ring.hugepages, ring.page_size) == (False, os.sysconf("SC_PAGE_SIZE"))
            assert [r.getMessage() for r in caplog.records if "huge" in r.getMessage()] == [
                caplog.records[0].getMessage()]
            assert "0 free" in caplog.records[0].getMessage()
        finally:
            ring.close()
        with pytest.raises(CaptureError, match=r"needs huge pages.*sysctl vm.nr_hugepages"):
            SharedMemory.create(1 << 20, hugepages="require")


def test_unmap_leaves_a_mapping_still_viewed_to_its_last_view():
    mapping = mmap.mmap(-1, 4096)
    view = np.frombuffer(mapping, np.uint8)
    unmap(mapping)                     # BufferError inside: the view keeps the pages
    view[0] = 7
    assert not mapping.closed and view[0] == 7
    del view
    unmap(mapping)
    assert mapping.closed
