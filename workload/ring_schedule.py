"""NCCL's ring allreduce schedule: which chunk each rank sends at each step, and how big it is.

This follows ``runRing`` in ``src/device/all_reduce.h`` of NCCL 2.19.3 and the protocol
primitives it calls (``prims_simple.h``, ``prims_ll.h``, ``prims_ll128.h``); the facts are
listed with their sources in ``docs/wire-format.md``. Everything is in elements of the wire
dtype unless a name says bytes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

from gradtap.wire.ll import LL_LINE_DATA_BYTES
from gradtap.wire.ll128 import (LL128_LINE_DATA_WORDS, LL128_LINE_WORDS, LL128_SHMEM_WORDS_PER_THREAD,
                                LL128_WORD_BYTES, WARP_SIZE)
from gradtap.wire.protocol import Protocol
from gradtap.workload.nccl import ProtocolGeometry

RS, AG = 0, 1  # phases: reduce-scatter, allgather


def _div_up(a: int, b: int) -> int:
    return -(-a // b)


def _round_up(a: int, b: int) -> int:
    return _div_up(a, b) * b


def sent_chunk(position: int, step: int, nranks: int) -> int:
    """The ring chunk that the rank at ring ``position`` sends at ring step ``step``.

    runRing sends chunk ringIx-1 at step 0, ringIx-j at the reduce steps j=2..n-1, ringIx at
    step n-1 (the first allgather send, fully reduced) and ringIx-j at the copy steps j=1..n-2:
    all of which is chunk (position - 1 - step) mod n.
    """
    return (position - 1 - step) % nranks


def step_phase(step: int, nranks: int) -> int:
    """Steps 0..n-2 carry partial sums (reduce-scatter); steps n-1..2n-3 fully reduced data."""
    return RS if step < nranks - 1 else AG


@dataclass(frozen=True)
class Send:
    """One protocol-level send of a rank on one channel (before splitting into RDMA writes)."""

    loop: int
    ring_step: int
    chunk: int
    slice: int
    elem_offset: int  # in the call's buffer
    nelem: int        # elements carried (0 for an empty send)
    steps: int        # FIFO steps this send advances the connection by


class CallSchedule:
    """The sends of one ring allreduce call of ``count`` elements over ``nchannels`` channels."""

    def __init__(self, count: int, elem_size: int, nranks: int, nchannels: int, nthreads: int,
                 geo: ProtocolGeometry):
        self.count, self.elem_size, self.nranks = count, elem_size, nranks
        self.nchannels, self.nthreads, self.geo = nchannels, nthreads, geo
        self.chunk_elems = geo.data_bytes_per_step // elem_size * geo.chunk_steps
        self.loop_elems = nchannels * nranks * self.chunk_elems
        if geo.protocol == Protocol.LL:
            self.min_chunk = nthreads * (LL_LINE_DATA_BYTES // elem_size)
        elif geo.protocol == Protocol.LL128:
            grain = LL128_SHMEM_WORDS_PER_THREAD * LL128_LINE_DATA_WORDS * LL128_WORD_BYTES // LL128_LINE_WORDS
            self.min_chunk = nthreads * (grain // elem_size) // 2
        else:
            self.min_chunk = 0

    def _real_chunk(self, grid_offset: int) -> int:
        rem = self.count - grid_offset
        if self.geo.protocol == Protocol.SIMPLE:
            real = min(self.chunk_elems, _div_up(rem, self.nchannels * self.nranks))
            return _round_up(real, (self.nthreads - WARP_SIZE) * 8 // self.elem_size)
        per = self.nchannels * self.nranks * self.min_chunk
        return min(self.chunk_elems, _div_up(rem, per) * self.min_chunk)

    def _chunk_offset(self, grid_offset: int, real: int, channel: int, chunk: int) -> int:
        if self.geo.protocol == Protocol.SIMPLE:
            return grid_offset + channel * self.nranks * real + chunk * real
        # LL and LL128 interleave channels within a loop.
        return grid_offset + (chunk * self.nchannels + channel) * real

    def _slices(self, nelem: int) -> Iterator[tuple[int, int]]:
        """(offset, size) of each slice of a chunk send; Simple cuts a chunk in two slices."""
        if self.geo.protocol != Protocol.SIMPLE:
            yield 0, nelem
            return
        slices = self.geo.chunk_steps // self.geo.slice_steps
        step_elems = self.geo.step_bytes // self.elem_size
        size = max(_div_up(nelem, 16 * slices) * 16, step_elems * self.geo.slice_steps // 32)
        offset = 0
        for _ in range(slices):
            this = max(0, min(size, nelem - offset))
            yield offset, this
            offset += this

    def sends(self, position: int, channel: int) -> Iterator[Send]:
        """Every send of the rank at ``position`` on ``channel``, in the order it posts them."""
        n = self.nranks
        for loop, grid in enumerate(range(0, self.count, self.loop_elems)):
            real = self._real_chunk(grid)
            for ring_step in range(2 * (n - 1)):
                chunk = sent_chunk(position, ring_step, n)
                offset = self._chunk_offset(grid, real, channel, chunk)
                nelem = max(0, min(real, self.count - offset))
                for s, (soff, ssize) in enumerate(self._slices(nelem)):
                    yield Send(loop, ring_step, chunk, s, offset + soff, ssize, self.geo.slice_steps)
