"""``pcap``: a capture file (classic pcap or pcapng) as a capture source.

Frames come from :class:`gradtap.capture.pcap.PcapReader` in bounded batches and are copied into
the ring in file order, as fast as the consumer takes them: a file has no wire to lose
frames on, so a full ring makes the source wait (in bounded sleeps) rather than drop.
"""

from __future__ import annotations

import os
import time

from gradtap.capture.frames import FrameBatch
from gradtap.capture.pcap import PcapReader
from gradtap.capture.ring import FrameRing
from gradtap.capture.source import CaptureSource
from gradtap.core.errors import CaptureError

# Waiting for room in the ring: the consumer frees slots a batch at a time.
_WAIT_MIN_S, _WAIT_MAX_S = 50e-6, 2e-3


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

    def open(self) -> None:
        if not os.path.isfile(self.path):
            raise CaptureError(f"pcap: {self.path}: no such file")
        self._reader = PcapReader(self.path, max_frames=self.max_frames)
        self._batches = iter(self._reader)

    def receive(self, ring: FrameRing, timeout: float) -> int | None:
        self.ring = ring
        if self._pending is None:
            self._pending, self._next = next(self._batches, None), 0
            if self._pending is None:
                return None
        deadline = time.monotonic() + timeout
        pause, moved = _WAIT_MIN_S, 0
        while True:
            stop = ring.push(self._pending, drop=False, start=self._next)
            moved += stop - self._next
            self._next = stop
            if stop == len(self._pending):
                self._pending = None
                break
            now = time.monotonic()
            if now >= deadline:
                break
            time.sleep(min(pause, deadline - now))
            pause = min(2 * pause, _WAIT_MAX_S)
        self.received += moved
        return moved

    def counters(self) -> dict[str, int]:
        truncated = self._reader.truncated if self._reader is not None else 0
        return {"received": self.received, "kernel_drops": 0, "file_truncated": truncated}

    def close(self) -> None:
        if self._reader is not None:
            self._reader.close()
            self._reader = self._batches = self._pending = None
