"""``af_packet``: live capture from a TPACKET_V3 memory-mapped ring (``packet(7)``).

The kernel fills fixed-size blocks of a ring it shares with us, many frames per block, and
hands a block over by setting ``TP_STATUS_USER`` in its status word (when it is full or
when ``block_timeout_ms`` passes with frames in it). :func:`_drain` walks every block handed
over, a block at a time, in one Numba call: it follows each block's ``tpacket3_hdr`` chain
(every offset bounds-checked against the block), copies frame and timestamp into the frame
ring, and gives the block back (status ``TP_STATUS_KERNEL``, store-release, pairing with the
kernel's ``smp_wmb``/``smp_rmb`` around the status word). One ``poll`` per idle period, no
system call per frame.

The kernel strips an 802.1Q/802.1ad tag from the frame data (VLAN acceleration) and reports
it in the header; the tag is put back in place here, as libpcap does, so the parser sees
the frame as it was on the wire.

Kernel drops: ``PACKET_STATISTICS`` (``tp_packets``, ``tp_drops``, ``tp_freeze_q_cnt``),
which the kernel zeroes on each read, so they are accumulated.
"""

from __future__ import annotations

import errno
import mmap
import os
import select
import socket
import struct

import numpy as np
from numba import njit

from gradtap.capture.ring import FrameRing, ring_begin, ring_publish, ring_reserve, ring_store
from gradtap.capture.shared_memory import unmap
from gradtap.capture.source import CaptureSource, available_memory, in_netns, interface_index, privilege_problem, \
    require_root
from gradtap.core.bytes import write_be
from gradtap.core.errors import CaptureError
from gradtap.core.jit import JIT
from gradtap.core.memory import load_acquire, store_release

# linux/if_packet.h and linux/if_ether.h.
SOL_PACKET = 263
PACKET_RX_RING, PACKET_STATISTICS, PACKET_VERSION, PACKET_IGNORE_OUTGOING = 5, 6, 10, 23
TPACKET_V3 = 2
ETH_P_ALL = 0x0003
TP_STATUS_KERNEL, TP_STATUS_USER = 0, 1 << 0
TP_STATUS_VLAN_VALID, TP_STATUS_VLAN_TPID_VALID = 1 << 4, 1 << 6
ETH_P_8021Q = 0x8100


def layout(fields) -> dict[str, int]:
    """Byte offset of each field of a C struct given as ``(name, struct format)`` pairs, with
    the platform's natural alignment (``"0" + type`` aligns without adding a field)."""
    fmt, out = "@", {}
    for name, code in fields:
        out[name] = struct.calcsize(fmt + "0" + code[-1])
        fmt += code
    out["sizeof"] = struct.calcsize(fmt)
    return out


#: struct tpacket_block_desc (version, offset_to_priv) + struct tpacket_hdr_v1.
BLOCK = layout((("version", "I"), ("offset_to_priv", "I"), ("block_status", "I"), ("num_pkts", "I"),
                ("offset_to_first_pkt", "I"), ("blk_len", "I"), ("seq_num", "Q"),
                ("ts_first_pkt", "2I"), ("ts_last_pkt", "2I")))
#: struct tpacket3_hdr with its tpacket_hdr_variant1.
PKT = layout((("tp_next_offset", "I"), ("tp_sec", "I"), ("tp_nsec", "I"), ("tp_snaplen", "I"),
              ("tp_len", "I"), ("tp_status", "I"), ("tp_mac", "H"), ("tp_net", "H"), ("tp_rxhash", "I"),
              ("tp_vlan_tci", "I"), ("tp_vlan_tpid", "H"), ("tp_padding", "H"), ("tp_padding2", "8B")))
_B_STATUS, _B_NUM, _B_FIRST = BLOCK["block_status"], BLOCK["num_pkts"], BLOCK["offset_to_first_pkt"]
_P_NEXT, _P_SEC, _P_NSEC, _P_SNAP = PKT["tp_next_offset"], PKT["tp_sec"], PKT["tp_nsec"], PKT["tp_snaplen"]
_P_LEN, _P_STATUS, _P_MAC = PKT["tp_len"], PKT["tp_status"], PKT["tp_mac"]
_P_TCI, _P_TPID, _P_SIZE = PKT["tp_vlan_tci"], PKT["tp_vlan_tpid"], PKT["sizeof"]
_MAC_ADDRS = 12                  # destination + source MAC: the VLAN tag goes after them

# Counters kept by _drain, in the order of AfPacketSource.COUNTERS after the kernel's three.
_RECEIVED, _BLOCKS, _BAD_BLOCKS, _VLAN_RESTORED = range(4)


@njit(**JIT)
def _drain(blocks8, blocks16, blocks32, block_size, nblocks, current,
           hdr, caplens, wirelens, ts_ns, data, slot_size, counts):
    """Move the frames of every block the kernel handed over, from block ``current`` on,
    into the frame ring, and return the blocks to the kernel. Returns the next block to
    look at. ``counts`` (int64[4]) accumulates received frames, blocks, bad blocks and
    restored VLAN tags."""
    slots = len(caplens)
    head, tail = ring_begin(hdr)
    frames = nbytes = drops = truncated = 0
    for _ in range(nblocks):
        base = current * block_size
        if load_acquire(blocks32, (base + _B_STATUS) // 4) & TP_STATUS_USER == 0:
            break
        num = np.int64(blocks32[(base + _B_NUM) // 4])
        off = np.int64(blocks32[(base + _B_FIRST) // 4])
        for _k in range(num):
            # The kernel wrote this block; still, nothing is read outside it.
            if off % 4 != 0 or off < _B_FIRST or off + _P_SIZE > block_size:
                counts[_BAD_BLOCKS] += 1
                break
            p = base + off
            snap = np.int64(blocks32[(p + _P_SNAP) // 4])
            wire = np.int64(blocks32[(p + _P_LEN) // 4])
            mac = np.int64(blocks16[(p + _P_MAC) // 2])
            if mac < _P_SIZE or off + mac + snap > block_size:
                counts[_BAD_BLOCKS] += 1
                break
            counts[_RECEIVED] += 1
            slot, tail = ring_reserve(hdr, head, tail, slots)
            if slot < 0:
                drops += 1
            else:
                status = blocks32[(p + _P_STATUS) // 4]
                src = p + mac
                if status & TP_STATUS_VLAN_VALID and snap >= _MAC_ADDRS:
                    tpid = blocks16[(p + _P_TPID) // 2] if status & TP_STATUS_VLAN_TPID_VALID else ETH_P_8021Q
                    tci = blocks32[(p + _P_TCI) // 4]
                    ring_store(data, slot_size, slot, 0, blocks8, src, _MAC_ADDRS)
                    tag = slot * slot_size + _MAC_ADDRS      # slot_size >= 64: the tag fits
                    write_be(data, tag, tpid, 2)
                    write_be(data, tag + 2, tci, 2)
                    n = _MAC_ADDRS + 4 + ring_store(data, slot_size, slot, _MAC_ADDRS + 4, blocks8,
                                                    src + _MAC_ADDRS, snap - _MAC_ADDRS)
                    snap += 4
                    wire += 4
                    counts[_VLAN_RESTORED] += 1
                else:
                    n = ring_store(data, slot_size, slot, 0, blocks8, src, snap)
                truncated += n < snap
                caplens[slot] = n
                wirelens[slot] = wire
                ts_ns[slot] = np.int64(blocks32[(p + _P_SEC) // 4]) * 1_000_000_000 + \
                    np.int64(blocks32[(p + _P_NSEC) // 4])
                head += 1
                frames += 1
                nbytes += n
            off += np.int64(blocks32[(p + _P_NEXT) // 4])
        store_release(blocks32, (base + _B_STATUS) // 4, TP_STATUS_KERNEL)
        counts[_BLOCKS] += 1
        current = (current + 1) % nblocks
    ring_publish(hdr, head, frames, nbytes, drops, truncated)
    return current


class AfPacketSource(CaptureSource):
    """Capture every frame arriving on ``interface`` through a TPACKET_V3 ring.

    Parameters
    ----------
    interface:
        Interface name (in ``netns`` if given).
    netns:
        ``ip netns`` name of the namespace the interface is in (None: this one).
    block_size:
        Bytes per ring block; a power of two, a multiple of the page size, and larger
        than the largest frame.
    block_count:
        Blocks in the ring (the kernel-side buffer is ``block_size * block_count``).
    block_timeout_ms:
        A block holding frames is handed over after this long even if not full (latency
        bound at low rates).
    """

    name = "af_packet"
    summary = "TPACKET_V3 memory-mapped ring (any Linux interface)"
    COUNTERS = ("tp_packets", "tp_drops", "tp_freeze_q_cnt", "blocks", "bad_blocks", "vlan_restored")

    def __init__(self, interface: str, *, netns: str | None = None, block_size: int = 1 << 20,
                 block_count: int = 32, block_timeout_ms: int = 2):
        super().__init__()
        if block_size < mmap.PAGESIZE or block_size & (block_size - 1):
            raise ValueError(f"block_size = {block_size}; must be a power of two >= {mmap.PAGESIZE}")
        if block_count < 2:
            raise ValueError(f"block_count = {block_count}; must be >= 2")
        if not 1 <= block_timeout_ms <= 1000:
            raise ValueError(f"block_timeout_ms = {block_timeout_ms}; allowed 1..1000")
        self.interface, self.netns = interface, netns
        self.block_size, self.block_count, self.block_timeout_ms = block_size, block_count, block_timeout_ms
        self._sock = self._map = None
        self._kernel = np.zeros(3, np.int64)        # tp_packets, tp_drops, tp_freeze_q_cnt
        self._counts = np.zeros(4, np.int64)
        self._current = 0

    @classmethod
    def probe(cls) -> str | None:
        problem = privilege_problem("af_packet capture")
        if problem is None:
            try:
                socket.socket(socket.AF_PACKET, socket.SOCK_RAW, 0).close()
            except OSError as exc:
                return f"af_packet needs CONFIG_PACKET; socket(AF_PACKET) failed: {os.strerror(exc.errno)}"
        return problem

    def locate(self) -> None:
        interface_index(self.interface, self.netns, self.name)

    def open(self) -> None:
        require_root("af_packet capture")
        self.locate()
        # The kernel allocates the whole ring at once and would rather invoke the OOM
        # killer than refuse: keep it well inside what the host can give.
        size, available = self.block_size * self.block_count, available_memory()
        if size > available // 2:
            raise CaptureError(f"af_packet: a ring of {self.block_count} x {self.block_size} bytes "
                               f"({size >> 20} MiB) exceeds half of the available memory "
                               f"({available >> 20} MiB); use fewer or smaller blocks")
        with in_netns(self.netns):
            # Protocol 0: no frames until bind, so none from other interfaces slip in first.
            self._sock = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, 0)
        try:
            self._setup()
        except BaseException:
            self.close()
            raise

    def _setup(self) -> None:
        sock, size = self._sock, self.block_size * self.block_count
        sock.setsockopt(SOL_PACKET, PACKET_VERSION, TPACKET_V3)
        # The mirror port only receives; frames this host sends on it are not the job's.
        sock.setsockopt(SOL_PACKET, PACKET_IGNORE_OUTGOING, 1)
        frame_size = 2048        # TPACKET_V3 ignores frames; the kernel still checks the arithmetic
        req = struct.pack("7I", self.block_size, self.block_count, frame_size,
                          self.block_size // frame_size * self.block_count, self.block_timeout_ms, 0, 0)
        try:
            sock.setsockopt(SOL_PACKET, PACKET_RX_RING, req)
        except OSError as exc:
            raise CaptureError(f"af_packet: the kernel refused a TPACKET_V3 ring of {self.block_count} x "
                               f"{self.block_size} bytes on {self.interface!r}: {os.strerror(exc.errno)}"
                               + ("; use fewer or smaller blocks" if exc.errno == errno.ENOMEM else
                                  "; TPACKET_V3 needs Linux >= 3.2 with CONFIG_PACKET_MMAP")) from exc
        self._map = mmap.mmap(sock.fileno(), size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        self._views = (np.frombuffer(self._map, np.uint8), np.frombuffer(self._map, np.uint16),
                       np.frombuffer(self._map, np.uint32))
        try:
            sock.bind((self.interface, ETH_P_ALL))
        except OSError as exc:
            raise CaptureError(f"af_packet: cannot bind to {self.interface!r}: {os.strerror(exc.errno)}") from exc
        self._poll = select.poll()
        self._poll.register(sock.fileno(), select.POLLIN | select.POLLERR)

    def info(self) -> dict[str, object]:
        return {"block_size": self.block_size, "block_count": self.block_count,
                "block_timeout_ms": self.block_timeout_ms}

    def receive(self, ring: FrameRing, timeout: float) -> int:
        self.ring = ring
        before = int(self._counts[_RECEIVED])
        if not self._drain(ring):
            self._poll.poll(max(0, int(timeout * 1000)))
            self._drain(ring)
        return int(self._counts[_RECEIVED]) - before

    def _drain(self, ring: FrameRing) -> int:
        blocks = int(self._counts[_BLOCKS])
        hdr, caplens, wirelens, ts_ns, data, slot_size = ring.producer_arrays()
        self._current = _drain(*self._views, self.block_size, self.block_count, self._current,
                               hdr, caplens, wirelens, ts_ns, data, slot_size, self._counts)
        return int(self._counts[_BLOCKS]) - blocks

    def counters(self) -> dict[str, int]:
        if self._sock is not None:
            # Reading zeroes the kernel's counters: add them up here.
            self._kernel += struct.unpack("3I", self._sock.getsockopt(SOL_PACKET, PACKET_STATISTICS, 12))
        tp_packets, tp_drops, freezes = (int(v) for v in self._kernel)
        return {"received": int(self._counts[_RECEIVED]), "kernel_drops": tp_drops,
                "tp_packets": tp_packets, "tp_drops": tp_drops, "tp_freeze_q_cnt": freezes,
                "blocks": int(self._counts[_BLOCKS]), "bad_blocks": int(self._counts[_BAD_BLOCKS]),
                "vlan_restored": int(self._counts[_VLAN_RESTORED])}

    def close(self) -> None:
        if self._map is not None:
            self._views = None
            unmap(self._map)
            self._map = None
        if self._sock is not None:
            self.counters()       # keep the final kernel counts
            self._sock.close()
            self._sock = None
