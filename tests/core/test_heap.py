"""The process's heap: freed memory kept while the simulator runs, and given back
(``core/heap.py``). What glibc does with a freed block depends on the process's history (its
``mmap`` threshold rises as blocks are freed), so the give-back tests run in forked children
that fix that threshold first."""

from __future__ import annotations

import json
import os

import pytest
import torch

from gradtap.core.heap import libc, retained_heap
from tests.forked import Child

pytestmark = pytest.mark.skipif(libc() is None, reason="the C library has no mallopt (not glibc)")

# A forked child: blocks under 64 MiB come from the heap (M_MMAP_THRESHOLD, glibc malloc.h),
# as they do once glibc has raised its threshold; 32 tensors of 4 MiB are made and freed,
# then the resident growth is printed before and after give_back_freed.
GIVE_BACK = """
import json, torch
from gradtap.core.heap import give_back_freed, libc
from tests.core.test_heap import resident_bytes
libc().mallopt(-3, 64 << 20)
torch.ones(1 << 20)           # torch's first allocation sets up what it keeps: not counted below
give_back_freed()
base = resident_bytes()
blocks = [torch.ones(1 << 20) for _ in range(32)]
del blocks[::2]               # every other one: the free pages lie between blocks still held
kept = resident_bytes() - base
give_back_freed()
print(json.dumps({"kept": kept, "given": resident_bytes() - base}))
"""


def resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_retained_heap_keeps_freed_blocks_and_gives_them_back_after():
    """A freed 256 MB tensor stays resident inside (for the next allocation to reuse without
    faulting its pages in again) and is given back on leaving; outside, glibc unmaps it at
    once (its default for blocks this large)."""
    size = 256 << 20
    base = resident_bytes()
    torch.ones(size // 4)
    assert resident_bytes() - base < size // 2
    with retained_heap():
        torch.ones(size // 4)
        assert resident_bytes() - base > size * 3 // 4
    assert resident_bytes() - base < size // 2


def test_freed_blocks_between_held_ones_are_given_back(tmp_path):
    """16 freed blocks of 4 MiB in the heap, each between two held ones, stay resident until
    given back; then the process shrinks by those 16. (What else the forked child holds by
    then varies with the fork server's state: 0-26 MB in runs of the suite.)"""
    with Child(GIVE_BACK, stderr=tmp_path / "err") as child:
        assert child.wait(120) == 0, (tmp_path / "err").read_text()
        got = json.loads(child.stdout.read())
    block = 4 << 20
    assert got["kept"] > 30 * block, got
    assert 15 * block < got["kept"] - got["given"] < 17 * block, got
