"""FrameSender: put frames on a Linux interface at a set rate (the traffic side of live tests).

Live tests, the capture benchmark and the end-to-end run send captured or simulated frames
from one network namespace to another over veth. A ``send()`` per frame costs a system call
each and tops out well below what the capture side can take, so this sender uses a
``PACKET_TX_RING`` (TPACKET_V2, ``packet(7)``): a Numba kernel writes a burst of frames
into the shared ring and marks them ``TP_STATUS_SEND_REQUEST`` (store-release), and one
``send()`` transmits the burst. Bursts are paced to ``rate`` frames per second by sleeping
until each burst's due time (no busy wait: the sender shares the machine with the receiver
it measures).
"""

from __future__ import annotations

import mmap
import socket
import struct
import time

import numpy as np
from numba import njit

from gradtap.capture.af_packet import SOL_PACKET, layout
from gradtap.capture.frames import FrameBatch
from gradtap.capture.shared_memory import unmap
from gradtap.capture.source import in_netns, interface_index, require_root
from gradtap.core.errors import CaptureError
from gradtap.core.jit import JIT
from gradtap.core.memory import copy_bytes, load_acquire, store_release

PACKET_VERSION, PACKET_TX_RING, PACKET_QDISC_BYPASS = 10, 13, 20
TPACKET_V2 = 1
TP_STATUS_AVAILABLE, TP_STATUS_SEND_REQUEST, TP_STATUS_WRONG_FORMAT = 0, 1, 1 << 2
#: struct tpacket2_hdr; the frame follows at TPACKET_ALIGN(sizeof) (no PACKET_TX_HAS_OFF).
TX_HDR = layout((("tp_status", "I"), ("tp_len", "I"), ("tp_snaplen", "I"), ("tp_mac", "H"), ("tp_net", "H"),
                 ("tp_sec", "I"), ("tp_nsec", "I"), ("tp_vlan_tci", "H"), ("tp_vlan_tpid", "H"),
                 ("tp_padding", "4B")))
_DATA = -(-TX_HDR["sizeof"] // 16) * 16
_STATUS, _LEN = TX_HDR["tp_status"], TX_HDR["tp_len"]


@njit(**JIT)
def _fill(tx8, tx32, frame_size, nslots, current, data, offsets, caplens, start, count):
    """Queue frames ``start .. start+count`` of a batch in the TX ring from slot ``current``
    until a slot is still busy. Returns ``(next slot, frames queued, frames the kernel
    refused since the last call)``."""
    refused = 0
    done = 0
    while done < count:
        base = current * frame_size
        status = load_acquire(tx32, (base + _STATUS) // 4)
        if status & TP_STATUS_WRONG_FORMAT:
            refused += 1
        elif status != TP_STATUS_AVAILABLE:
            break
        i = start + done
        n = min(np.int64(caplens[i]), frame_size - _DATA)
        copy_bytes(tx8, base + _DATA, data, offsets[i], n)
        tx32[(base + _LEN) // 4] = n
        store_release(tx32, (base + _STATUS) // 4, TP_STATUS_SEND_REQUEST)
        current = (current + 1) % nslots
        done += 1
    return current, done, refused


class FrameSender:
    """Send FrameBatches on ``interface`` (in ``netns``), paced.

    ``frame_size``: bytes per TX slot (a frame longer than ``frame_size - 32`` is cut);
    ``slots``: TX slots (the largest burst).
    """

    def __init__(self, interface: str, *, netns: str | None = None, frame_size: int = 16384, slots: int = 256):
        if frame_size % mmap.PAGESIZE and mmap.PAGESIZE % frame_size:
            raise ValueError(f"frame_size = {frame_size}; must divide or be a multiple of {mmap.PAGESIZE}")
        self.interface, self.netns, self.frame_size, self.slots = interface, netns, frame_size, slots
        self.sent = self.refused = 0
        self._sock = self._map = None
        self._current = 0

    def open(self) -> FrameSender:
        require_root("sending raw frames")
        interface_index(self.interface, self.netns, "sender")
        with in_netns(self.netns):
            self._sock = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, 0)
        try:
            self._sock.setsockopt(SOL_PACKET, PACKET_VERSION, TPACKET_V2)
            self._sock.setsockopt(SOL_PACKET, PACKET_QDISC_BYPASS, 1)
            block = max(self.frame_size, mmap.PAGESIZE)
            per_block = block // self.frame_size
            blocks = -(-self.slots // per_block)
            self.slots = blocks * per_block
            self._sock.setsockopt(SOL_PACKET, PACKET_TX_RING, struct.pack("4I", block, blocks, self.frame_size,
                                                                           self.slots))
            self._map = mmap.mmap(self._sock.fileno(), block * blocks)
            self._views = (np.frombuffer(self._map, np.uint8), np.frombuffer(self._map, np.uint32))
            self._sock.bind((self.interface, 0))
        except OSError as exc:
            self.close()
            raise CaptureError(f"sender on {self.interface!r}: {exc.strerror}") from exc
        return self

    def send(self, batch: FrameBatch, rate: float | None = None, burst: int = 32, stop=None,
             repeat: int = 1) -> float:
        """Send every frame of ``batch`` in order, ``repeat`` times over, ``burst`` frames per
        system call, at ``rate`` frames per second (None: as fast as the kernel takes them).
        Returns the seconds it took. ``stop`` (``is_set()``) ends it early."""
        burst = max(1, min(burst, self.slots))
        start = time.perf_counter()
        total = len(batch) * repeat
        k = 0
        while k < total and not (stop is not None and stop.is_set()):
            if rate:
                ahead = start + k / rate - time.perf_counter()
                if ahead > 0:
                    time.sleep(ahead)
            i = k % len(batch)
            self._current, done, refused = _fill(*self._views, self.frame_size, self.slots, self._current,
                                                 batch.data, batch.offsets, batch.caplens, i,
                                                 min(burst, len(batch) - i, total - k))
            self.refused += refused
            self._sock.send(b"")       # transmits every slot marked SEND_REQUEST
            k += done
            self.sent += done
        return time.perf_counter() - start

    def close(self) -> None:
        if self._map is not None:
            self._views = None
            unmap(self._map)
            self._map = None
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def __enter__(self):
        return self.open()

    def __exit__(self, *exc):
        self.close()
