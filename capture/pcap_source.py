"""``pcap``: a capture file (classic pcap or pcapng) as a capture source.

Frames come from :class:`gradtap.capture.pcap.PcapReader` in bounded batches and are copied into
the ring in file order, as fast as the consumer takes them: a file has no wire to lose
frames on, so a full ring makes the source wait (``wait_until``: bounded sleeps) rather
than drop.
"""

from __future__ import annotations

import os

from gradtap.capture.frames import FrameBatch
from gradtap.capture.pcap import PcapReader
from gradtap.capture.ring import FrameRing, wait_until
from gradtap.capture.source import CaptureSource
from gradtap.core.errors import CaptureError


class PcapSource(CaptureSource):
    """Frames of the capture file ``path``, in order, with their recorded times.

    ``max_frames``: frames read from the file per batch.
    """

    name = "pcap"
    summary = "pcap/pcapng capture file (µs or ns timestamps)"
    COUNTERS = ("file_truncated",)
    drop_when_full = False

    def __init__(self, path, *, max_frames: int = 8192):
        super().__init__()
        self.path = os.fspath(path)
        self.max_frames = max_frames
        self._reader: PcapReader | None = None
        self._batches = None
        self._pending: FrameBatch | None = None
        self._next = 0              # first frame of _pending not yet in the ring

    def locate(self) -> None:
        if not os.path.isfile(self.path):
            raise CaptureError(f"pcap: {self.path}: no such file")

    def open(self) -> None:
        self.locate()
        self._reader = PcapReader(self.path, max_frames=self.max_frames)
        self._batches = iter(self._reader)

    def receive(self, ring: FrameRing, timeout: float) -> int | None:
        self.ring = ring
        if self._pending is None:
            self._pending, self._next = next(self._batches, None), 0
            if self._pending is None:
                return None
        first = self._next

        def pushed_all() -> bool:
            self._next = ring.push(self._pending, drop=False, start=self._next)
            return self._next == len(self._pending)

        if wait_until(pushed_all, timeout):
            self._pending = None
        moved = self._next - first
        self.received += moved
        return moved

    def counters(self) -> dict[str, int]:
        truncated = self._reader.truncated if self._reader is not None else 0
        return {"received": self.received, "kernel_drops": 0, "file_truncated": truncated}

    def close(self) -> None:
        if self._reader is not None:
            self._reader.close()
            self._reader = self._batches = self._pending = None
