"""FrameBatch: the unit every capture source hands to the parser.

A batch holds ``n`` frames packed in one contiguous byte array, so a Numba kernel can walk
them without Python objects per frame. Frame ``i`` is
``data[offsets[i] : offsets[i] + caplens[i]]``; frames need not be adjacent (a source may
leave its own record headers between them) but never overlap.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numba import njit

from gradtap.core.jit import JIT
from gradtap.core.memory import copy_bytes

LINKTYPE_ETHERNET = 1  # pcap/pcapng LINKTYPE_ETHERNET (tcpdump.org link-layer header types)


@dataclass(frozen=True)
class FrameBatch:
    """Frames, their lengths and arrival times.

    Attributes
    ----------
    data:
        ``uint8[m]``, C-contiguous: the bytes the frames live in.
    offsets:
        ``int64[n]``: byte offset of each frame's first byte in ``data``.
    caplens:
        ``int32[n]``: bytes captured of each frame (what is in ``data``).
    wirelens:
        ``int32[n]``: length of each frame on the wire, in bytes (>= caplen unless the
        source lies; a capture may be cut at a snap length).
    ts_ns:
        ``int64[n]``: arrival time of each frame, nanoseconds since the Unix epoch (0 when
        the source recorded none).
    linktype:
        pcap LINKTYPE of every frame in the batch (``LINKTYPE_ETHERNET``).
    lasting:
        Whether ``data`` stays as it is for as long as the batch is referenced: a batch's own
        copy, or a capture file's mapping. A ring's batch is a view of slots the source
        overwrites once they are released, so it is not; :meth:`owned` copies only those.
    """

    data: np.ndarray
    offsets: np.ndarray
    caplens: np.ndarray
    wirelens: np.ndarray
    ts_ns: np.ndarray
    linktype: int = LINKTYPE_ETHERNET
    lasting: bool = False

    def __post_init__(self):
        expect = (("data", np.uint8), ("offsets", np.int64), ("caplens", np.int32),
                  ("wirelens", np.int32), ("ts_ns", np.int64))
        for name, dtype in expect:
            array = getattr(self, name)
            if not isinstance(array, np.ndarray) or array.dtype != dtype or array.ndim != 1:
                raise TypeError(f"FrameBatch.{name} must be a 1-D {np.dtype(dtype)} array, "
                                f"got {getattr(array, 'dtype', type(array))}")
        if not self.data.flags.c_contiguous:
            raise TypeError("FrameBatch.data must be C-contiguous")
        n = len(self.offsets)
        if not len(self.caplens) == len(self.wirelens) == len(self.ts_ns) == n:
            raise ValueError(
                f"FrameBatch arrays disagree on the frame count: offsets {n}, caplens "
                f"{len(self.caplens)}, wirelens {len(self.wirelens)}, ts_ns {len(self.ts_ns)}")
        if n and (self.offsets.min() < 0 or (self.offsets + self.caplens).max() > len(self.data)
                  or self.caplens.min() < 0):
            raise ValueError("FrameBatch frames reach outside data")

    def __len__(self) -> int:
        return len(self.offsets)

    def frame(self, i: int) -> memoryview:
        """Frame ``i``'s captured bytes (a view into ``data``)."""
        start = int(self.offsets[i])
        return memoryview(self.data)[start:start + int(self.caplens[i])]

    def frames(self, lo: int, hi: int | None = None) -> FrameBatch:
        """Frames ``lo:hi`` of the batch, sharing ``data`` (no copy)."""
        return FrameBatch(data=self.data, offsets=self.offsets[lo:hi], caplens=self.caplens[lo:hi],
                          wirelens=self.wirelens[lo:hi], ts_ns=self.ts_ns[lo:hi], linktype=self.linktype,
                          lasting=self.lasting)

    def tail(self, start: int) -> FrameBatch:
        """The batch from frame ``start`` on, sharing ``data`` (no copy)."""
        return self.frames(start)

    def pieces(self, n: int) -> list[FrameBatch]:
        """The batch cut into ``n`` runs of consecutive frames, as even in frame count as can
        be (none empty: fewer when the batch holds fewer than ``n`` frames), each sharing
        ``data``."""
        m = len(self.offsets)
        bounds = [m * k // n for k in range(n + 1)]
        return [self.frames(a, b) for a, b in zip(bounds[:-1], bounds[1:]) if b > a]

    def bursts(self, gap_ns: int) -> list[FrameBatch]:
        """The batch cut where its frames pause for ``gap_ns`` or longer (a training step's
        traffic between two forward passes, say), each part sharing ``data``."""
        cuts = np.flatnonzero(np.diff(self.ts_ns) >= gap_ns) + 1
        bounds = np.r_[0, cuts, len(self.offsets)]
        return [self.frames(a, b) for a, b in zip(bounds[:-1], bounds[1:]) if b > a]

    def owned(self, start: int = 0) -> FrameBatch:
        """Frames ``start:`` in bytes that stay valid while the batch is held: the batch itself
        (its :meth:`tail`) when it is ``lasting``, else a packed copy (a ring's batch is a view),
        read-only when the batch is (the kernels that take it then need no other compilation)."""
        if self.lasting:
            return self.tail(start)
        offsets, caplens = self.offsets[start:], self.caplens[start:]
        new_offsets = np.zeros(len(offsets), np.int64)
        if len(offsets):
            np.cumsum(caplens[:-1], out=new_offsets[1:])
        data = np.empty(int(caplens.sum(dtype=np.int64)), np.uint8)
        _gather(data, new_offsets, self.data, offsets, caplens)
        data.flags.writeable = bool(self.data.flags.writeable)
        return FrameBatch(data, new_offsets, caplens.copy(), self.wirelens[start:].copy(),
                          self.ts_ns[start:].copy(), self.linktype, lasting=True)

    @property
    def nbytes(self) -> int:
        """Captured bytes in the batch (sum of caplens)."""
        return int(self.caplens.sum(dtype=np.int64))

    @classmethod
    def from_frames(cls, frames, ts_ns=None, wirelens=None,
                    linktype: int = LINKTYPE_ETHERNET) -> FrameBatch:
        """Pack a sequence of ``bytes``-like frames adjacently into one batch.

        ``ts_ns`` and ``wirelens`` default to zeros and to the captured lengths.
        """
        frames = [bytes(f) for f in frames]
        caplens = np.fromiter((len(f) for f in frames), np.int32, len(frames))
        offsets = np.zeros(len(frames), np.int64)
        np.cumsum(caplens[:-1], dtype=np.int64, out=offsets[1:])
        data = np.frombuffer(b"".join(frames), np.uint8).copy()
        ts = np.zeros(len(frames), np.int64) if ts_ns is None else np.asarray(ts_ns, np.int64)
        wire = caplens.copy() if wirelens is None else np.asarray(wirelens, np.int32)
        return cls(data, offsets, caplens, wire, ts, linktype, lasting=True)

    @classmethod
    def concat(cls, batches, linktype: int = LINKTYPE_ETHERNET) -> FrameBatch:
        """One batch holding the frames of ``batches`` in order (their data concatenated)."""
        batches = list(batches)
        if len(batches) == 1:
            return batches[0]
        if any(b.linktype != linktype for b in batches):
            raise ValueError(f"cannot concatenate batches of link types "
                             f"{sorted({b.linktype for b in batches})} into {linktype}")
        bases = np.cumsum([0] + [len(b.data) for b in batches[:-1]], dtype=np.int64)
        return cls(_join((b.data for b in batches), np.uint8),
                   _join((b.offsets + base for b, base in zip(batches, bases)), np.int64),
                   _join((b.caplens for b in batches), np.int32),
                   _join((b.wirelens for b in batches), np.int32),
                   _join((b.ts_ns for b in batches), np.int64), linktype, lasting=True)


@njit(**JIT)
def _gather(out, out_offsets, data, offsets, caplens):
    """Frame i of ``data`` to ``out[out_offsets[i]:]`` (bounds checked by FrameBatch)."""
    for i in range(len(offsets)):
        copy_bytes(out, out_offsets[i], data, offsets[i], caplens[i])


def _join(arrays, dtype) -> np.ndarray:
    arrays = list(arrays)
    return np.concatenate(arrays).astype(dtype, copy=False) if arrays else np.zeros(0, dtype)
