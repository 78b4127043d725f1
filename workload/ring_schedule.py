"""NCCL's ring allreduce schedule: which chunk each rank sends at each step, and how big it is.

This follows ``runRing`` in ``src/device/all_reduce.h`` and the protocol primitives it calls
(``prims_simple.h``, ``prims_ll.h``, ``prims_ll128.h``), and, from NCCL 2.20 on, the host code
of ``src/enqueue.cc`` that gives each channel its range of the buffer. The eras differ only in
how a call's elements are cut over channels and in the chunk size of a partial last loop
(:class:`gradtap.workload.nccl.ChannelSplit`):

* **GRID** (2.19): loops of ``nChannels·n·chunkSize`` elements over the whole buffer; in a
  loop, Simple gives each channel ``n`` consecutive chunks, LL/LL128 interleave the channels
  chunk by chunk; the last loop shrinks the chunk (``realChunkSize``) on the device.
* **PER_CHANNEL** (2.20-2.21): ``addCBDCollToPlan`` gives channel ``c`` a contiguous range
  (``workOffset``, ``workCount``) and the host computes the last loop's ``lastChunkCount``;
  ``runRing`` loops ``n·chunkCount`` elements over the channel's range.
* **CBD_PART** (2.22+): ``scheduleCollTasksToPlan`` cuts the buffer into traffic cells and
  gives channels ``lo``, ``mid``…, ``hi`` ranges (``ncclCollCbdPart``); the device sets the last
  loop's chunk to ``alignUp(divUp(remCount, n), 16/sizeof(T))``.

The facts, formulas and tags are listed in ``docs/wire-format.md``. Everything is in elements
of the wire dtype unless a name says bytes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, NamedTuple

import numpy as np

from gradtap.core.errors import PlanError
from gradtap.wire.ll import LL_LINE_DATA_BYTES
from gradtap.wire.ll128 import (LL128_LINE_DATA_WORDS, LL128_LINE_WORDS, LL128_SHMEM_WORDS_PER_THREAD,
                                LL128_WORD_BYTES, WARP_SIZE)
from gradtap.wire.protocol import Protocol
from gradtap.workload.nccl import ChannelSplit, EraFacts, ProtocolGeometry, call_channels_threads

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


# src/include/enqueue.h (2.20-2.21): computeCollAlignCount's units, in bytes
SIMPLE_ALIGNMENT = WARP_SIZE * 8 * 16
LL128_ALIGNMENT_PER_WARP = 480
LL_ALIGNMENT_PER_THREAD = 8
BYTES_ALIGNMENT = 16           # NCCL_BYTES_ALIGNMENT: maxBytesPerChannel granularity
CBD_LAST_CHUNK_ALIGN = 16      # runRing (2.22+): last chunk aligned to 16 bytes


def grain_bytes(protocol: Protocol) -> int:
    """ncclProtoGrainSize (src/include/device.h, 2.22+): chunk sizes are whole grains."""
    if protocol == Protocol.LL:
        return 16
    if protocol == Protocol.LL128:
        return WARP_SIZE * LL128_SHMEM_WORDS_PER_THREAD // LL128_LINE_WORDS * LL128_LINE_DATA_WORDS * LL128_WORD_BYTES
    return 512


def chunk_bytes(geo: ProtocolGeometry) -> int:
    """The ring chunk size in bytes the host computes (computeCollChunkInfo / calcCollChunking):
    a FIFO step times ALLREDUCE_CHUNKSTEPS for Simple, half a step for LL, 15/16 for LL128."""
    size = geo.step_bytes * geo.chunk_steps
    if geo.protocol == Protocol.LL:
        return size // 2
    if geo.protocol == Protocol.LL128:
        return size // LL128_LINE_WORDS * LL128_LINE_DATA_WORDS
    return size


@dataclass(frozen=True)
class ChannelPart:
    """The contiguous range one channel works on in the PER_CHANNEL and CBD_PART eras."""

    channel: int       # the communicator's channel (ring connections) that carries it
    offset: int        # first element (workOffset / partOffset)
    count: int         # elements (workCount / partCount)
    chunk: int         # chunkCount of the full loops
    last_chunk: int    # chunkCount of a partial last loop


def per_channel_parts(count: int, elem_size: int, nranks: int, nchannels: int, nthreads: int,
                      geo: ProtocolGeometry) -> list[ChannelPart]:
    """2.20-2.21, ``addCBDCollToPlan`` for one collective alone in its kernel plan.

    ``maxBytesPerChannel = roundUp(divUp(bytes, nChannels), 16)``; channel ``c`` (in order)
    takes ``min(roundUp(divUp(enqBytes, size), alignCount), remaining)`` elements, and the host
    computes ``lastChunkCount = roundUp(divUp(workCount mod (n·chunkCount), n), alignCount)``.
    """
    proto = geo.protocol
    if proto == Protocol.SIMPLE:
        align = SIMPLE_ALIGNMENT // elem_size
    elif proto == Protocol.LL128:
        align = LL128_ALIGNMENT_PER_WARP // elem_size * (nthreads // WARP_SIZE)
    else:
        align = LL_ALIGNMENT_PER_THREAD // elem_size * nthreads
    chunk = chunk_bytes(geo) // elem_size
    _check_chunk(chunk, geo)
    max_bytes = _round_up(_div_up(count * elem_size, nchannels), BYTES_ALIGNMENT)
    parts, offset, rem_count = [], 0, count
    for c in range(nchannels):
        if rem_count == 0:
            break
        enq = min(max_bytes, rem_count * elem_size)
        work = min(_round_up(_div_up(enq, elem_size), align), rem_count)
        last = _round_up(_div_up(work % (nranks * chunk), nranks), align)
        parts.append(ChannelPart(c, offset, work, chunk, last))
        offset += work
        rem_count -= work
    return parts


def cbd_parts(count: int, elem_size: int, nranks: int, comm_channels: int, call_channels: int,
              geo: ProtocolGeometry, era: EraFacts) -> list[ChannelPart]:
    """2.22+, ``scheduleCollTasksToPlan`` for one collective alone in its kernel plan.

    The call's traffic (2 bytes per byte for allreduce, LL 4 times more from 2.26) is spread
    over ``call_channels`` channels in cells; channel ``lo`` takes the cells of one channel's
    traffic budget, ``mid`` channels ``cellsPerChannel`` each and ``hi`` the rest, starting at
    channel 0 of the plan. Each range's chunk is ``calcCollChunking``'s chunk in whole grains.
    """
    k = era.cbd
    per_byte = 2 * (k.ll_traffic_factor if geo.protocol == Protocol.LL else 1)
    traffic = count * elem_size * per_byte           # task->trafficBytes (allreduce: 2 per byte; LL x4)
    if k.task_min:
        traffic = max(k.min_traffic, traffic)
    nch = min(call_channels, comm_channels)
    if k.per_channel_align16:
        per_channel = _round_up(traffic // nch, 16)
    else:
        per_channel = max(k.min_traffic, traffic // nch)
    cell = _round_up(_div_up(k.min_traffic, per_byte), 16) if k.cell_from_min else 16
    per_cell_elems = cell // elem_size
    cells = _div_up(count * elem_size, cell)
    cell_traffic = cell * per_byte
    per_chan = min(cells, _div_up(per_channel, cell_traffic))
    channel = 0
    if channel + 1 == comm_channels:
        lo = cells
    else:
        budget = per_channel
        lo = min(cells, _div_up(budget, cell_traffic) if k.lo_round_up else budget // cell_traffic)
    nmid = (cells - lo) // per_chan
    hi = (cells - lo) % per_chan
    nused = (lo != 0) + nmid + (hi != 0)
    if comm_channels < channel + nused:              # overflowed the communicator's channels
        nmid = comm_channels - channel - 2
        per_chan = (cells - lo) // (nmid + 1)
        hi = per_chan + (cells - lo) % (nmid + 1)
    if hi == 0 and nmid != 0:
        hi, nmid = per_chan, nmid - 1
    if lo == 0:                                      # the first channel gets nothing: start at the next
        channel += 1
        if nmid == 0:
            lo, hi = hi, 0
        else:
            lo, nmid = per_chan, nmid - 1
    count_mid = per_chan * per_cell_elems if nmid else 0
    count_lo, count_hi = lo * per_cell_elems, hi * per_cell_elems
    excess = cells * per_cell_elems - count
    if count_hi:
        count_hi -= excess
    else:
        count_lo -= excess
    grain = grain_bytes(geo.protocol)
    chunk = chunk_bytes(geo) // grain * (grain // elem_size)
    _check_chunk(chunk, geo)
    align = CBD_LAST_CHUNK_ALIGN // elem_size
    sizes = [count_lo] * (count_lo != 0) + [count_mid] * nmid + [count_hi] * (hi != 0)
    parts, offset = [], 0
    for i, size in enumerate(sizes):
        last = _round_up(_div_up(size % (nranks * chunk), nranks), align)
        parts.append(ChannelPart(channel + i, offset, size, chunk, last))
        offset += size
    return parts


def _check_chunk(chunk: int, geo: ProtocolGeometry) -> None:
    if chunk <= 0:
        raise PlanError(f"nccl.buffsize.{geo.protocol.name}: a FIFO step of {geo.step_bytes} bytes gives "
                        "NCCL a chunk of zero elements; use a larger buffer size")


class CallSchedule:
    """The sends of one ring allreduce call of ``count`` elements on a communicator of
    ``comm_channels`` channels, as NCCL of ``era`` lays them out."""

    def __init__(self, count: int, elem_size: int, nranks: int, comm_channels: int, geo: ProtocolGeometry,
                 era: EraFacts):
        self.count, self.elem_size, self.nranks, self.geo, self.era = count, elem_size, nranks, geo, era
        self.nchannels, self.nthreads = call_channels_threads(count * elem_size, comm_channels, geo)
        self.parts: dict[int, ChannelPart] = {}
        if era.channel_split == ChannelSplit.PER_CHANNEL:
            parts = per_channel_parts(count, elem_size, nranks, self.nchannels, self.nthreads, geo)
        elif era.channel_split == ChannelSplit.CBD_PART:
            parts = cbd_parts(count, elem_size, nranks, comm_channels, self.nchannels, geo, era) if count else []
        else:
            parts = None
        if parts is not None:
            self.parts = {p.channel: p for p in parts}
        self.chunk_elems = geo.data_bytes_per_step // elem_size * geo.chunk_steps
        self.loop_elems = self.nchannels * nranks * self.chunk_elems
        if geo.protocol == Protocol.LL:
            self.min_chunk = self.nthreads * (LL_LINE_DATA_BYTES // elem_size)
        elif geo.protocol == Protocol.LL128:
            grain = LL128_SHMEM_WORDS_PER_THREAD * LL128_LINE_DATA_WORDS * LL128_WORD_BYTES // LL128_LINE_WORDS
            self.min_chunk = self.nthreads * (grain // elem_size) // 2
        else:
            self.min_chunk = 0

    @property
    def channels(self) -> list[int]:
        """The communicator channels that carry this call, in order."""
        if self.era.channel_split == ChannelSplit.GRID:
            return list(range(self.nchannels))
        return sorted(self.parts)

    # -- 2.19: one grid over all channels ------------------------------------------------
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

    def _grid_sends(self, position: int, channel: int) -> Iterator[tuple[int, int, int, int, int]]:
        n = self.nranks
        for loop, grid in enumerate(range(0, self.count, self.loop_elems)):
            real = self._real_chunk(grid)
            for ring_step in range(2 * (n - 1)):
                chunk = sent_chunk(position, ring_step, n)
                offset = self._chunk_offset(grid, real, channel, chunk)
                yield loop, ring_step, chunk, offset, max(0, min(real, self.count - offset))

    # -- 2.20+: one contiguous range per channel -----------------------------------------
    def _range_sends(self, position: int, channel: int) -> Iterator[tuple[int, int, int, int, int]]:
        part = self.parts.get(channel)
        if part is None:
            return
        n = self.nranks
        loop_count = n * part.chunk
        for loop, elem_offset in enumerate(range(0, part.count, loop_count)):
            rem = part.count - elem_offset
            chunk_count = part.chunk if rem >= loop_count else part.last_chunk
            for ring_step in range(2 * (n - 1)):
                chunk = sent_chunk(position, ring_step, n)
                chunk_offset = chunk * chunk_count
                yield (loop, ring_step, chunk, part.offset + elem_offset + chunk_offset,
                       max(0, min(chunk_count, rem - chunk_offset)))

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
        chunks = (self._grid_sends if self.era.channel_split == ChannelSplit.GRID else self._range_sends)
        for loop, ring_step, chunk, offset, nelem in chunks(position, channel):
            for s, (soff, ssize) in enumerate(self._slices(nelem)):
                yield Send(loop, ring_step, chunk, s, offset + soff, ssize, self.geo.slice_steps)

    # -- the same sends as arrays ----------------------------------------------------------
    def send_table(self, position: int | np.ndarray, channel: int) -> SendTable:
        """:meth:`sends` as ``int64`` arrays, one entry per send in posting order; every send
        advances the connection by ``geo.slice_steps`` FIFO steps. ``position`` may be an
        array of ring positions: the arrays are then ``[positions, sends]`` (every rank posts
        as many sends on a channel)."""
        n = self.nranks
        pos = np.atleast_1d(np.asarray(position, dtype=np.int64))[:, None, None]
        ring_steps = np.arange(2 * (n - 1), dtype=np.int64)[None, None, :]
        chunks = (pos - 1 - ring_steps) % n                           # sent_chunk: [positions, 1, ring steps]
        if self.era.channel_split == ChannelSplit.GRID:
            grid = np.arange(0, self.count, self.loop_elems, dtype=np.int64)
            rem = self.count - grid
            if self.geo.protocol == Protocol.SIMPLE:                  # _real_chunk
                real = np.minimum(self.chunk_elems, -(-rem // (self.nchannels * n)))
                align = (self.nthreads - WARP_SIZE) * 8 // self.elem_size
                real = -(-real // align) * align
            else:
                per = self.nchannels * n * self.min_chunk
                real = np.minimum(self.chunk_elems, -(-rem // per) * self.min_chunk)
            grid, real = grid[None, :, None], real[None, :, None]
            if self.geo.protocol == Protocol.SIMPLE:                  # _chunk_offset
                offset = grid + channel * n * real + chunks * real
            else:
                offset = grid + (chunks * self.nchannels + channel) * real
            nelem = np.maximum(0, np.minimum(real, self.count - offset))
        else:
            part = self.parts.get(channel)
            if part is None:
                empty = np.zeros((len(pos), 0), np.int64)
                return SendTable(*(empty if np.ndim(position) else empty[0] for _ in SendTable._fields))
            loop_count = n * part.chunk
            starts = np.arange(0, part.count, loop_count, dtype=np.int64)[None, :, None]
            rem = part.count - starts
            chunk_count = np.where(rem >= loop_count, part.chunk, part.last_chunk)
            chunk_offset = chunks * chunk_count
            offset = part.offset + starts + chunk_offset
            nelem = np.maximum(0, np.minimum(chunk_count, rem - chunk_offset))
        shape = offset.shape                                          # [positions, loops, ring steps]
        cols = [np.broadcast_to(np.arange(shape[1], dtype=np.int64)[None, :, None], shape),
                np.broadcast_to(ring_steps, shape), np.broadcast_to(chunks, shape)]
        if self.geo.protocol == Protocol.SIMPLE:
            # _slices: slice s covers [min(s·size, nelem), min((s+1)·size, nelem)) of the chunk
            slices = self.geo.chunk_steps // self.geo.slice_steps
            step_elems = self.geo.step_bytes // self.elem_size
            size = np.maximum(-(-nelem // (16 * slices)) * 16, step_elems * self.geo.slice_steps // 32)[..., None]
            s = np.arange(slices, dtype=np.int64)
            lo, hi = np.minimum(s * size, nelem[..., None]), np.minimum((s + 1) * size, nelem[..., None])
            shape += (slices,)
            cols = [np.broadcast_to(x[..., None], shape) for x in cols]
            cols += [np.broadcast_to(s, shape), offset[..., None] + lo, hi - lo]
        else:
            cols += [np.zeros(shape, np.int64), offset, nelem]
        flat = [np.ascontiguousarray(x).reshape(len(pos), -1) for x in cols]
        return SendTable(*(x if np.ndim(position) else x[0] for x in flat))


class SendTable(NamedTuple):
    """The sends of one rank (or of each rank) on one channel in one call, as ``int64``
    arrays of one entry per send in posting order: the fields of :class:`Send` but ``steps``."""

    loop: np.ndarray
    ring_step: np.ndarray
    chunk: np.ndarray
    slice: np.ndarray
    elem_offset: np.ndarray
    nelem: np.ndarray
