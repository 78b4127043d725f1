"""FrameRing: a fixed-slot shared-memory ring from one capture worker to one parser.

Layout of the shared mapping (:mod:`gradtap.capture.shared_memory`, huge pages when available)::

    header    4096 B   int64 words: geometry, head, tail, counters, source counters
    caplens   int32[slots]   captured bytes of the frame in each slot
    wirelens  int32[slots]   its length on the wire
    ts_ns     int64[slots]   its arrival time (ns since the Unix epoch)
    data      slots x slot_size bytes (starts on a 4 KiB boundary)

``head`` (written by the producer) and ``tail`` (written by the consumer) count frames
since the ring was made and never wrap; frame ``k`` lives in slot ``k % slots``. They sit
on separate cache lines. The ordering protocol is the one in :mod:`gradtap.core.memory`: a
producer fills slots, then store-releases ``head``; the consumer load-acquires ``head``,
reads, then store-releases ``tail``; the producer load-acquires ``tail`` before reusing a
slot.

**Non-temporal stores.** A producer fills its slots with non-temporal stores
(``core.memory.stream_bytes``) and fences them before it publishes ``head``. A slot is
reused a whole ring later (16,384 slots of 4.3 KB: 71 MB by default), long after it left
the producer's caches, so an ordinary store would first read each of its lines from memory
(a read for ownership) only to overwrite it; the af_xdp capture worker spent more than half
of its samples waiting on those. Streamed, a frame costs its writes alone: on a 2-vCPU Xeon
(family 6, model 207), ``python -m benchmarks.capture``, 4 KiB-class frames at 0.3 Mpps and
unpaced, the af_xdp worker took 1.13-1.45 core-s per Mframe against 1.49-1.67 with ordinary
stores (three alternations), with the consumer's time unchanged. The consumer finds the
frames in memory either way: a slot is read long after other slots pushed it out of the
caches.

Full ring: a live source drops the frame and counts it in ``ring_drops`` (a capture cannot
wait, the kernel would drop instead and less visibly); a file source waits for room. A
frame longer than ``slot_size`` keeps its first ``slot_size`` bytes, its true length in
``wirelens``, and is counted in ``truncated``.

The consumer's :meth:`FrameRing.read` returns a :class:`FrameBatch` whose arrays are views
of the slots (no copy), the frame bytes read-only: the parser's kernels then take the array
types a replay of capture files (read-only mappings) gives them, and a rehearsal before the
capture starts (``gradtap/rehearsal.py``) compiles the very kernels the live frames run. The
slots stay the consumer's until the next ``read`` or :meth:`FrameRing.release`; copy what
must outlive that.
"""

from __future__ import annotations

import time

import numpy as np
from numba import njit

from gradtap.capture.frames import LINKTYPE_ETHERNET, FrameBatch
from gradtap.capture.shared_memory import HugePages, SharedMemory
from gradtap.core.jit import JIT
from gradtap.core.memory import acquire, load_acquire, release, store_fence, store_release, stream_bytes

HEADER_BYTES = 4096
MAGIC = 0x31474E4952544701  # "\x01GTRING1" little-endian: a mapping that is a frame ring
MIN_SLOT_SIZE = 64
DEFAULT_SLOT_SIZE = 4352    # a 4096-byte RoCE MTU frame with IPv6, VLAN, RETH, ImmDt and ICRC
DEFAULT_SLOTS = 16384
#: Source-specific counters the producer publishes (see :meth:`FrameRing.publish`).
SOURCE_COUNTERS = 32

# Header word indexes (int64).
_MAGIC, _SLOTS, _SLOT_SIZE, _META, _DATA = 0, 1, 2, 3, 4
_HEAD = 16                                    # byte 128: producer's cache line
_FRAMES, _BYTES, _RING_DROPS, _TRUNCATED, _CLOSED = 17, 18, 19, 20, 21
_TAIL = 32                                    # byte 256: consumer's cache line
_SOURCE = 64                                  # bytes 512..767: source counters

# Backoff of a side waiting for the other (frames to read, room to write): short first (a
# producer publishes a pass every few hundred microseconds under load, a consumer frees a
# batch at a time), then capped so a quiet ring costs ~1000 wake-ups a second, not a core.
# Each wake-up costs a few microseconds of CPU.
_WAIT_MIN_S, _WAIT_MAX_S = 100e-6, 1e-3


def wait_until(done, timeout: float) -> bool:
    """Call ``done()`` until it returns True or ``timeout`` seconds have passed, sleeping
    between calls (from 100 µs, doubling up to 1 ms). Whether ``done()`` last returned True;
    it is called at least once."""
    deadline = time.monotonic() + timeout
    pause = _WAIT_MIN_S
    while not done():
        now = time.monotonic()
        if now >= deadline:
            return False
        time.sleep(min(pause, deadline - now))
        pause = min(2 * pause, _WAIT_MAX_S)
    return True


@njit(**JIT, inline="always")
def ring_begin(hdr):
    """``(head, tail)`` for a producer run: its own head, and the consumer's tail (acquired)."""
    return hdr[_HEAD], load_acquire(hdr, _TAIL)


@njit(**JIT, inline="always")
def ring_reserve(hdr, head, tail, slots):
    """Slot for frame ``head`` and the refreshed ``tail``; slot -1 when the ring is full.
    ``tail`` is the producer's cached copy: re-acquired only when it says full."""
    if head - tail >= slots:
        tail = load_acquire(hdr, _TAIL)
        if head - tail >= slots:
            return -1, tail
    return head % slots, tail


@njit(**JIT, inline="always")
def ring_store(data, slot_size, slot, pos, src, src_pos, n):
    """Copy ``n`` bytes of ``src`` to offset ``pos`` of ``slot``, cut at the slot's end, with
    non-temporal stores (see the module docstring); returns the bytes copied."""
    n = min(n, slot_size - pos)
    if n > 0:
        stream_bytes(data, slot * slot_size + pos, src, src_pos, n)
        return n
    return 0


@njit(**JIT, inline="always")
def ring_publish(hdr, head, frames, nbytes, drops, truncated):
    """Add a run's counters and make frames up to ``head`` visible to the consumer (their
    streamed bytes fenced first)."""
    store_fence()
    hdr[_FRAMES] += frames
    hdr[_BYTES] += nbytes
    hdr[_RING_DROPS] += drops
    hdr[_TRUNCATED] += truncated
    store_release(hdr, _HEAD, head)


@njit(**JIT)
def _push(hdr, caplens, wirelens, ts_ns, data, slot_size, src, offsets, src_caplens, src_wirelens,
          src_ts, start, drop):
    """Copy frames ``start..`` of a batch into the ring. When full: drop and count them if
    ``drop``, else stop there. Returns the index of the first frame not handled."""
    slots = len(caplens)
    head, tail = ring_begin(hdr)
    frames = nbytes = drops = truncated = 0
    i = start
    while i < len(offsets):
        slot, tail = ring_reserve(hdr, head, tail, slots)
        if slot < 0:
            if not drop:
                break
            drops += 1
            i += 1
            continue
        n = ring_store(data, slot_size, slot, 0, src, offsets[i], src_caplens[i])
        truncated += n < src_caplens[i]
        caplens[slot] = n
        wirelens[slot] = src_wirelens[i]
        ts_ns[slot] = src_ts[i]
        head += 1
        frames += 1
        nbytes += n
        i += 1
    ring_publish(hdr, head, frames, nbytes, drops, truncated)
    return i


class FrameRing:
    """A single-producer, single-consumer ring of ``slots`` frames of up to ``slot_size`` bytes.

    Make one with :meth:`create` in the process that owns the pipeline, then hand it to a
    capture worker and a parser process (it pickles as a descriptor of the same memory).
    """

    def __init__(self, memory: SharedMemory):
        self.memory = memory
        buf = memory.buf
        self._hdr = np.frombuffer(buf, np.int64, HEADER_BYTES // 8)
        if self._hdr[_MAGIC] != MAGIC:
            raise ValueError("shared memory does not hold a frame ring (bad magic)")
        self.slots, self.slot_size = int(self._hdr[_SLOTS]), int(self._hdr[_SLOT_SIZE])
        meta, data = int(self._hdr[_META]), int(self._hdr[_DATA])
        self._caplens = np.frombuffer(buf, np.int32, self.slots, meta)
        self._wirelens = np.frombuffer(buf, np.int32, self.slots, meta + 4 * self.slots)
        self._ts = np.frombuffer(buf, np.int64, self.slots, meta + 8 * self.slots)
        self._data = np.frombuffer(buf, np.uint8, self.slots * self.slot_size, data)
        self._frames = self._data.view()          # what read() lends (see the module docstring)
        self._frames.flags.writeable = False
        self._offsets = np.arange(self.slots, dtype=np.int64) * self.slot_size
        self._lent = 0          # frames handed out by read() and not yet released

    @classmethod
    def create(cls, slots: int = DEFAULT_SLOTS, slot_size: int = DEFAULT_SLOT_SIZE, *,
               hugepages: HugePages = "auto", name: str = "gradtap-ring") -> FrameRing:
        """A new empty ring.

        Parameters
        ----------
        slots:
            Frames the ring holds (>= 2).
        slot_size:
            Bytes per slot, a multiple of 64 and >= 64; longer frames are truncated.
        hugepages:
            ``"auto"``, ``"require"`` or ``"off"`` (:meth:`SharedMemory.create`).
        name:
            Shown in ``/proc/<pid>/maps`` and in the fallback log line.
        """
        if slots < 2:
            raise ValueError(f"slots = {slots}; must be >= 2")
        if slot_size < MIN_SLOT_SIZE or slot_size % 64:
            raise ValueError(f"slot_size = {slot_size}; must be a multiple of 64, >= {MIN_SLOT_SIZE}")
        meta = HEADER_BYTES
        data = -(-(meta + 16 * slots) // 4096) * 4096
        memory = SharedMemory.create(data + slots * slot_size, hugepages=hugepages, name=name)
        hdr = np.frombuffer(memory.buf, np.int64, HEADER_BYTES // 8)
        hdr[[_SLOTS, _SLOT_SIZE, _META, _DATA]] = slots, slot_size, meta, data
        hdr[_MAGIC] = MAGIC
        del hdr
        return cls(memory)

    def __reduce__(self):
        return FrameRing, (self.memory,)

    # -- geometry ------------------------------------------------------------------------

    @property
    def page_size(self) -> int:
        """Bytes per page of the mapping (the huge page size when huge pages back it)."""
        return self.memory.page_size

    @property
    def hugepages(self) -> bool:
        return self.memory.huge

    def producer_arrays(self) -> tuple:
        """``(hdr, caplens, wirelens, ts_ns, data, slot_size)`` for producer kernels
        (:func:`ring_begin`, :func:`ring_reserve`, :func:`ring_store`, :func:`ring_publish`)."""
        return self._hdr, self._caplens, self._wirelens, self._ts, self._data, self.slot_size

    # -- producer ------------------------------------------------------------------------

    def push(self, batch: FrameBatch, *, drop: bool = True, start: int = 0) -> int:
        """Copy ``batch.frames[start:]`` into the ring. A full ring drops (and counts) the
        rest if ``drop``, otherwise stops. Returns the index of the first frame not handled.
        A ring holds Ethernet frames only (what the parser decodes)."""
        if batch.linktype != LINKTYPE_ETHERNET:
            raise ValueError(f"a frame ring holds Ethernet frames; batch link type is {batch.linktype}")
        return int(_push(self._hdr, self._caplens, self._wirelens, self._ts, self._data, self.slot_size,
                         batch.data, batch.offsets, batch.caplens, batch.wirelens, batch.ts_ns, start, drop))

    def publish(self, values) -> None:
        """Store up to :data:`SOURCE_COUNTERS` source counters (producer only)."""
        values = np.asarray(values, np.int64)
        if len(values) > SOURCE_COUNTERS:
            raise ValueError(f"{len(values)} source counters; the ring holds {SOURCE_COUNTERS}")
        self._hdr[_SOURCE:_SOURCE + len(values)] = values

    def close_producer(self) -> None:
        """Mark the end of the stream: the consumer drains the ring and then sees ``finished``."""
        release(self._hdr, _CLOSED, 1)

    # -- consumer ------------------------------------------------------------------------

    def read(self, max_frames: int = 4096, timeout: float = 0.1, stop=None) -> FrameBatch:
        """Release the previous batch, then wait up to ``timeout`` seconds for frames.

        Returns the frames available now (at most ``max_frames``, and never across the
        ring's end, so a batch is one run of slots); an empty batch when none came in time,
        ``stop`` (an object with ``is_set()``) was set, or the stream is ``finished``.
        """
        if max_frames < 1:
            raise ValueError(f"max_frames = {max_frames}; must be >= 1")
        self.release()
        hdr, tail = self._hdr, int(self._hdr[_TAIL])
        wait_until(lambda: int(acquire(hdr, _HEAD)) > tail or bool(acquire(hdr, _CLOSED))
                   or (stop is not None and stop.is_set()), timeout)
        head = int(acquire(hdr, _HEAD))
        first = tail % self.slots
        n = min(head - tail, max_frames, self.slots - first)
        self._lent = n
        end = first + n
        return FrameBatch(self._frames, self._offsets[first:end], self._caplens[first:end],
                          self._wirelens[first:end], self._ts[first:end])

    def release(self) -> None:
        """Give the slots of the last batch back to the producer."""
        if self._lent:
            release(self._hdr, _TAIL, int(self._hdr[_TAIL]) + self._lent)
            self._lent = 0

    @property
    def finished(self) -> bool:
        """The producer closed the stream and every frame was read and released."""
        return bool(acquire(self._hdr, _CLOSED)) and int(acquire(self._hdr, _HEAD)) == int(self._hdr[_TAIL])

    # -- both ----------------------------------------------------------------------------

    def stats(self) -> dict[str, int]:
        """Ring counters: ``frames`` (accepted), ``bytes`` (captured bytes accepted),
        ``ring_drops`` (refused, ring full), ``truncated`` (cut at the slot size),
        ``consumed`` (released by the consumer), ``occupancy`` (frames waiting)."""
        h = self._hdr
        head, tail = int(acquire(h, _HEAD)), int(acquire(h, _TAIL))
        return {"frames": int(h[_FRAMES]), "bytes": int(h[_BYTES]), "ring_drops": int(h[_RING_DROPS]),
                "truncated": int(h[_TRUNCATED]), "consumed": tail, "occupancy": head - tail}

    def source_counters(self, n: int = SOURCE_COUNTERS) -> np.ndarray:
        """A copy of the first ``n`` counters the producer published."""
        return self._hdr[_SOURCE:_SOURCE + n].copy()

    def close(self) -> None:
        """Drop this process's views and mapping (other processes keep theirs)."""
        self._hdr = self._caplens = self._wirelens = self._ts = self._data = self._frames = None
        self.memory.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
