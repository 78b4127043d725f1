"""``af_xdp``: live capture through an AF_XDP socket (XSK) with its own UMEM.

Set-up (``Documentation/networking/af_xdp.rst``), all through system calls:

1. an ``AF_XDP`` socket and a UMEM: ``frames`` chunks of ``chunk_size`` bytes of anonymous
   memory registered with ``XDP_UMEM_REG`` (see "Chunk size" below);
2. the fill, completion and RX rings sized with ``setsockopt`` and ``mmap``-ed at the
   offsets ``XDP_MMAP_OFFSETS`` reports;
3. ``bind`` to (interface, queue): zero-copy if asked or possible, copy mode otherwise
   (veth has copy mode only), multi-buffer (``XDP_USE_SG``) so frames longer than a chunk
   arrive as several descriptors;
4. the redirect program (:mod:`gradtap.capture.bpf`) and its XSKMAP, the socket put at the queue's
   index, the program attached to the interface with pyroute2 (native XDP where the driver
   has it, generic otherwise), never replacing a program someone else attached.

Receiving: :func:`_rx` load-acquires the RX producer, copies every complete frame (its
descriptors up to one without ``XDP_PKT_CONTD``) into the frame ring, gives the chunks back
through the fill ring and store-releases both indices (the kernel's side of the pairing is
in ``net/xdp/xsk_queue.h``). The descriptors carry no time; every frame of one pass gets the
``CLOCK_REALTIME`` reading taken just before it, so times are batch-granular (a pass holds
at most what arrived during one poll) and never decrease.

Chunk size. A frame that fits in one chunk takes one RX descriptor and one fill entry; a
longer one takes one per chunk it spans (multi-buffer), which costs the kernel's copy and
this loop a descriptor each. What a chunk holds and which sizes exist
(``Documentation/networking/af_xdp.rst``, "XDP_UMEM_REG setsockopt", and
``net/xdp/xdp_umem.c`` ``xdp_umem_reg``, ``net/xdp/xsk_buff_pool.c``):

- the kernel takes ``XDP_PACKET_HEADROOM`` (256 bytes) plus the UMEM headroom (0 here) at the
  start of every chunk, so a chunk holds a frame of ``chunk_size - 256`` bytes
  (``pool->frame_len``);
- ``chunk_size`` is at least ``XDP_UMEM_MIN_CHUNK_SIZE`` (2048) and at most the page size,
  a power of two unless the UMEM is registered with ``XDP_UMEM_UNALIGNED_CHUNK_FLAG``
  ("unaligned chunk mode", where any size in that range is allowed and fill addresses are
  not masked to a chunk boundary).

``chunk_size="auto"`` (the default) therefore picks the smallest power of two that holds a
whole frame of ``frame_bytes`` (the longest frame the job sends), between 2048 and the page
size. On a 4 KiB-page host (x86-64) a chunk holds at most 3840 bytes, and a RoCEv2 frame of
MTU 4096 (about 4.2 KB) cannot fit in one: it spans two chunks there, whatever the chunk size
or mode. Measured on Linux 6.18 (x86-64): ``XDP_UMEM_REG`` refuses every chunk size above
4096 with ``EINVAL`` (8192, 16384, 65536 aligned; 4608 unaligned), even on a UMEM of 2 MiB
huge pages, which the 2023 patch series "xsk: Support UMEM chunk_size > PAGE_SIZE" proposed
to allow. On hosts with 16 or 64 KiB pages (arm64, ppc64le)
"auto" takes a chunk that holds the whole frame, and each frame is one descriptor.

Kernel drops: ``XDP_STATISTICS`` (``rx_dropped``: no chunk or frame too large;
``rx_ring_full``: the RX ring was full; plus ``rx_invalid_descs``,
``rx_fill_ring_empty_descs``).
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import select
import socket
import struct
import time

import numpy as np
from numba import njit
from pyroute2 import IPRoute
from pyroute2.netlink.exceptions import NetlinkError as PyrouteNetlinkError

from gradtap.capture import bpf
from gradtap.capture.ring import FrameRing, ring_begin, ring_publish, ring_reserve, ring_store
from gradtap.capture.shared_memory import unmap
from gradtap.capture.source import CaptureSource, available_memory, in_netns, interface_index, privilege_problem, \
    require_root
from gradtap.core.errors import CaptureError
from gradtap.core.jit import JIT
from gradtap.core.memory import load_acquire, store_release

# linux/if_xdp.h, linux/socket.h.
AF_XDP, SOL_XDP = 44, 283
XDP_MMAP_OFFSETS, XDP_RX_RING, XDP_UMEM_REG = 1, 2, 4
XDP_UMEM_FILL_RING, XDP_UMEM_COMPLETION_RING, XDP_STATISTICS, XDP_OPTIONS = 5, 6, 7, 8
XDP_PGOFF_RX_RING, XDP_UMEM_PGOFF_FILL_RING, XDP_UMEM_PGOFF_COMPLETION_RING = 0, 0x100000000, 0x180000000
XDP_COPY, XDP_ZEROCOPY, XDP_USE_SG = 1 << 1, 1 << 2, 1 << 4
XDP_OPTIONS_ZEROCOPY = 1 << 0
XDP_PKT_CONTD = 1 << 0
XDP_UMEM_UNALIGNED_CHUNK_FLAG = 1 << 0
XDP_UMEM_MIN_CHUNK_SIZE = 2048        # net/xdp: the smallest chunk the kernel registers
XDP_PACKET_HEADROOM = 256             # include/uapi/linux/bpf.h: reserved at each chunk's start
PAGE_SIZE = mmap.PAGESIZE             # the largest chunk the kernel registers
#: The longest RoCEv2 frame at MTU 4096: Ethernet, IPv6, UDP, BTH, RETH, ImmDt, payload, ICRC.
ROCE_4096_FRAME_BYTES = 14 + 40 + 8 + 12 + 16 + 4 + 4096 + 4
# linux/if_link.h XDP_FLAGS_*.
XDP_FLAGS_UPDATE_IF_NOEXIST, XDP_FLAGS_SKB_MODE, XDP_FLAGS_DRV_MODE, XDP_FLAGS_REPLACE = 1, 2, 4, 16
ATTACH_FLAGS = {"native": XDP_FLAGS_DRV_MODE, "generic": XDP_FLAGS_SKB_MODE}
#: struct xdp_statistics, in order.
XDP_STATS = ("rx_dropped", "rx_invalid_descs", "tx_invalid_descs", "rx_ring_full",
             "rx_fill_ring_empty_descs", "tx_ring_empty_descs")
_DESC_BYTES = 16                      # struct xdp_desc: u64 addr, u32 len, u32 options
_COMPLETION_ENTRIES = 64              # nothing is sent; the kernel still wants the ring
_BUSY_RETRY_S = 2.0
#: A pass that found fewer RX descriptors than this is followed by the ``coalesce_us`` pause
#: and another pass within the same ``receive``. Under steady traffic a pass right after a
#: long one finds only what arrived in between; without the pause, the worker made about 4
#: passes, a ``select`` and a pause per 200 us at 0.3 Mpps (13-25 frames a pass).
SHORT_PASS = 64

# Counters kept by _rx.
_RECEIVED, _FRAGMENTS, _BAD_DESCS = range(3)


@njit(**JIT)
def _rx(rx32, rx_desc64, rx_desc32, rx_prod, rx_cons, fq32, fq_addrs, fq_prod, umem, chunk_size, now_ns,
        hdr, caplens, wirelens, ts_ns, data, slot_size, counts):
    """Move the complete frames on the RX ring into the frame ring and refill the fill ring.

    ``rx32``/``fq32`` are uint32 views of the RX/fill ring mappings, ``rx_prod`` etc. the
    word indexes of their producer/consumer fields; ``rx_desc64``/``rx_desc32`` view the RX
    descriptors, ``fq_addrs`` the fill entries. Ring sizes are powers of two and indices
    free-running u32. Returns the descriptors consumed. The fill ring has one entry per
    UMEM chunk, so every chunk handed back fits.
    """
    rx_mask = len(rx_desc64) // 2 - 1
    fq_mask = len(fq_addrs) - 1
    slots = len(caplens)
    cons = np.int64(rx32[rx_cons])
    avail = (np.int64(load_acquire(rx32, rx_prod)) - cons) & 0xFFFFFFFF
    # Only whole frames: stop after the last descriptor that ends one.
    end = avail
    while end > 0 and rx_desc32[4 * ((cons + end - 1) & rx_mask) + 3] & XDP_PKT_CONTD:
        end -= 1
    fill = np.int64(fq32[fq_prod])
    head, tail = ring_begin(hdr)
    frames = nbytes = drops = truncated = 0
    slot = -1
    pos = wire = 0
    starting = True
    for k in range(end):
        d = (cons + k) & rx_mask
        addr = np.int64(rx_desc64[2 * d])
        length = np.int64(rx_desc32[4 * d + 2])
        more = rx_desc32[4 * d + 3] & XDP_PKT_CONTD
        if starting:
            counts[_RECEIVED] += 1
            slot, tail = ring_reserve(hdr, head, tail, slots)
            drops += slot < 0
            pos = wire = 0
            starting = False
        counts[_FRAGMENTS] += 1
        if 0 <= addr and length <= chunk_size and addr + length <= len(umem):
            if slot >= 0:
                pos += ring_store(data, slot_size, slot, pos, umem, addr, length)
            fq_addrs[fill & fq_mask] = addr - addr % chunk_size
            fill += 1
        else:
            counts[_BAD_DESCS] += 1     # the kernel's own descriptor; its chunk is not reused
        wire += length
        if not more:
            if slot >= 0:
                caplens[slot] = pos
                wirelens[slot] = wire
                ts_ns[slot] = now_ns
                truncated += pos < wire
                head += 1
                frames += 1
                nbytes += pos
            starting = True
    store_release(rx32, rx_cons, np.uint32((cons + end) & 0xFFFFFFFF))
    store_release(fq32, fq_prod, np.uint32(fill & 0xFFFFFFFF))
    ring_publish(hdr, head, frames, nbytes, drops, truncated)
    return end


#: Chunk sizes the kernel registers without XDP_UMEM_UNALIGNED_CHUNK_FLAG (powers of two).
CHUNK_SIZES = tuple(1 << k for k in range(XDP_UMEM_MIN_CHUNK_SIZE.bit_length() - 1, PAGE_SIZE.bit_length())
                    if 1 << k <= PAGE_SIZE)


def chunk_frame_bytes(chunk_size: int) -> int:
    """The longest frame one chunk of ``chunk_size`` bytes holds (the kernel's ``frame_len``)."""
    return chunk_size - XDP_PACKET_HEADROOM


def chunk_size_for(frame_bytes: int, page_size: int = PAGE_SIZE) -> int:
    """The smallest chunk (a power of two from 2048 to ``page_size``) that holds a frame of
    ``frame_bytes``; ``page_size`` when none does (the frame then spans several chunks)."""
    size = XDP_UMEM_MIN_CHUNK_SIZE
    while size < page_size and chunk_frame_bytes(size) < frame_bytes:
        size *= 2
    return min(size, page_size)


class _MappedRing:
    """One kernel ring of the socket: its mapping and the word indexes of its fields."""

    def __init__(self, sock: socket.socket, offsets: tuple[int, int, int, int], entries: int,
                 entry_bytes: int, pgoff: int):
        producer, consumer, desc, _flags = offsets
        self.map = mmap.mmap(sock.fileno(), desc + entries * entry_bytes, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE,
                             prot=mmap.PROT_READ | mmap.PROT_WRITE, offset=pgoff)
        self.u32 = np.frombuffer(self.map, np.uint32)
        self.prod, self.cons = producer // 4, consumer // 4
        self.desc64 = np.frombuffer(self.map, np.uint64, entries * entry_bytes // 8, desc)
        self.desc32 = np.frombuffer(self.map, np.uint32, entries * entry_bytes // 4, desc)

    def close(self) -> None:
        self.u32 = self.desc64 = self.desc32 = None
        unmap(self.map)


_libc = ctypes.CDLL(None, use_errno=True)


def _no_af_xdp(exc: OSError) -> str:
    if exc.errno in (errno.EAFNOSUPPORT, errno.EINVAL):
        return (f"af_xdp needs Linux >= 4.18 with CONFIG_XDP_SOCKETS; this kernel refused socket(AF_XDP): "
                f"{errno.errorcode[exc.errno]}; use the af_packet source instead")
    return f"af_xdp: socket(AF_XDP) failed: {os.strerror(exc.errno)}"


class AfXdpSource(CaptureSource):
    """Capture the frames of one receive queue of ``interface`` through an AF_XDP socket.

    Parameters
    ----------
    interface, netns:
        Interface name, and the ``ip netns`` namespace it is in (None: this one).
    queue:
        Receive queue to bind (a veth has one per CPU it was created with; 0 here).
    frames:
        UMEM chunks (a power of two); also the fill ring size.
    chunk_size:
        Bytes per chunk: ``"auto"`` (:func:`chunk_size_for` of ``frame_bytes``), or a power of
        two from 2048 to the page size. A chunk holds a frame of ``chunk_size - 256`` bytes;
        longer frames use several chunks (multi-buffer).
    frame_bytes:
        The longest frame expected (bytes, no FCS), for ``chunk_size="auto"``; by default a
        RoCEv2 frame of MTU 4096 (:data:`ROCE_4096_FRAME_BYTES`).
    rx_size:
        RX ring entries (a power of two).
    mode:
        ``"auto"`` (zero-copy if the driver can, else copy), ``"zerocopy"`` or ``"copy"``.
    attach:
        ``"auto"`` (native XDP, else generic), ``"native"`` or ``"generic"``.
    coalesce_us:
        After a wait ends on new frames, or after a pass that found fewer than
        :data:`SHORT_PASS` descriptors (the few that landed while the last pass ran), pause
        this many microseconds before moving them, so one pass takes a whole burst: fewer
        wake-ups and passes per frame, that much more latency.
    """

    name = "af_xdp"
    summary = "AF_XDP socket with a UMEM and an XDP redirect program (Linux >= 4.18)"
    COUNTERS = XDP_STATS + ("fragments", "bad_descs")

    def __init__(self, interface: str, *, netns: str | None = None, queue: int = 0, frames: int = 32768,
                 chunk_size: int | str = "auto", frame_bytes: int = ROCE_4096_FRAME_BYTES, rx_size: int = 16384,
                 mode: str = "auto", attach: str = "auto", coalesce_us: int = 200):
        super().__init__()
        for label, value in (("frames", frames), ("rx_size", rx_size)):
            if value < 64 or value & (value - 1):
                raise ValueError(f"{label} = {value}; must be a power of two >= 64")
        if not 60 <= frame_bytes <= 65535:
            raise ValueError(f"frame_bytes = {frame_bytes}; allowed 60..65535")
        if chunk_size == "auto":
            chunk_size = chunk_size_for(frame_bytes)
        elif chunk_size not in CHUNK_SIZES:
            raise ValueError(f"chunk_size = {chunk_size!r}; allowed 'auto' or {', '.join(map(str, CHUNK_SIZES))} "
                             f"(powers of two from {XDP_UMEM_MIN_CHUNK_SIZE} to the page size)")
        if mode not in ("auto", "zerocopy", "copy"):
            raise ValueError(f"mode = {mode!r}; allowed auto, zerocopy, copy")
        if attach not in ("auto", "native", "generic"):
            raise ValueError(f"attach = {attach!r}; allowed auto, native, generic")
        if queue < 0:
            raise ValueError(f"queue = {queue}; must be >= 0")
        if not 0 <= coalesce_us <= 10_000:
            raise ValueError(f"coalesce_us = {coalesce_us}; allowed 0..10000")
        self.interface, self.netns, self.queue = interface, netns, queue
        self.frames, self.chunk_size, self.rx_size = frames, chunk_size, rx_size
        self.frame_bytes = frame_bytes
        self.mode, self.attach, self.coalesce_us = mode, attach, coalesce_us
        #: After open: "zerocopy" or "copy", "native" or "generic", multi-buffer on or off.
        self.bound_mode = self.attach_mode = None
        self.multibuffer = False
        self._sock = self._umem = self._ipr = None
        self._rings: dict[str, _MappedRing] = {}
        self._map_fd = self._prog_fd = None
        self._ifindex = 0
        self._counts = np.zeros(3, np.int64)
        self._stats = np.zeros(len(XDP_STATS), np.int64)

    # -- open ------------------------------------------------------------------------------

    @classmethod
    def probe(cls) -> str | None:
        problem = privilege_problem("af_xdp capture")
        if problem is None:
            try:
                socket.socket(AF_XDP, socket.SOCK_RAW, 0).close()
            except OSError as exc:
                return _no_af_xdp(exc)
        return problem

    def locate(self) -> None:
        interface_index(self.interface, self.netns, self.name)

    def open(self) -> None:
        require_root("af_xdp capture")
        self._ifindex = interface_index(self.interface, self.netns, self.name)
        size, available = self.frames * self.chunk_size, available_memory()
        if size > available // 2:
            raise CaptureError(f"af_xdp: a UMEM of {self.frames} x {self.chunk_size} bytes ({size >> 20} MiB) "
                               f"exceeds half of the available memory ({available >> 20} MiB); use fewer frames")
        try:
            with in_netns(self.netns):
                self._socket()
                self._ipr = IPRoute()
            self._bind()
            self._program()
        except BaseException:
            self.close()
            raise

    def _socket(self) -> None:
        try:
            self._sock = socket.socket(AF_XDP, socket.SOCK_RAW, 0)
        except OSError as exc:
            raise CaptureError(_no_af_xdp(exc)) from exc
        size = self.frames * self.chunk_size
        self._umem = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | mmap.MAP_POPULATE)
        base = ctypes.addressof(ctypes.c_char.from_buffer(self._umem))
        # struct xdp_umem_reg v1: addr, len, chunk_size, headroom.
        self._setsockopt(XDP_UMEM_REG, struct.pack("QQII", base, size, self.chunk_size, 0), "registering the UMEM")
        for option, entries in ((XDP_UMEM_FILL_RING, self.frames), (XDP_UMEM_COMPLETION_RING, _COMPLETION_ENTRIES),
                                (XDP_RX_RING, self.rx_size)):
            self._setsockopt(option, struct.pack("I", entries), "sizing the rings")
        off = struct.unpack("16Q", self._sock.getsockopt(SOL_XDP, XDP_MMAP_OFFSETS, 128))
        self._rings["rx"] = _MappedRing(self._sock, off[0:4], self.rx_size, _DESC_BYTES, XDP_PGOFF_RX_RING)
        self._rings["fill"] = _MappedRing(self._sock, off[8:12], self.frames, 8, XDP_UMEM_PGOFF_FILL_RING)
        self._rings["completion"] = _MappedRing(self._sock, off[12:16], _COMPLETION_ENTRIES, 8,
                                                XDP_UMEM_PGOFF_COMPLETION_RING)
        self._umem_view = np.frombuffer(self._umem, np.uint8)
        fill = self._rings["fill"]
        fill.desc64[:] = np.arange(self.frames, dtype=np.uint64) * self.chunk_size
        fill.u32[fill.prod] = self.frames       # nobody else runs yet: no ordering needed

    def _setsockopt(self, option: int, value: bytes, what: str) -> None:
        try:
            self._sock.setsockopt(SOL_XDP, option, value)
        except OSError as exc:
            raise CaptureError(f"af_xdp: {what} failed: {os.strerror(exc.errno)} (frames={self.frames}, "
                               f"chunk_size={self.chunk_size}, rx_size={self.rx_size})") from exc

    def _bind(self) -> None:
        modes = {"auto": (XDP_ZEROCOPY, XDP_COPY), "zerocopy": (XDP_ZEROCOPY,), "copy": (XDP_COPY,)}[self.mode]
        # A socket closed a moment ago gives its queue back from deferred kernel work
        # (xp_release_deferred): EBUSY for a short while is retried, then reported.
        deadline = time.monotonic() + _BUSY_RETRY_S
        while True:
            failures, codes = [], set()
            for flags in modes:
                for sg in (XDP_USE_SG, 0):       # multi-buffer needs Linux >= 6.6
                    addr = ctypes.create_string_buffer(struct.pack("HHIII", AF_XDP, flags | sg, self._ifindex,
                                                                   self.queue, 0), 16)
                    if _libc.bind(self._sock.fileno(), addr, 16) == 0:
                        opts = struct.unpack("I", self._sock.getsockopt(SOL_XDP, XDP_OPTIONS, 4))[0]
                        self.bound_mode = "zerocopy" if opts & XDP_OPTIONS_ZEROCOPY else "copy"
                        self.multibuffer = bool(sg)
                        return
                    code = ctypes.get_errno()
                    codes.add(code)
                    failures.append(f"{'zero-copy' if flags == XDP_ZEROCOPY else 'copy'}"
                                    f"{' multi-buffer' if sg else ''}: {os.strerror(code)}")
            if errno.EBUSY not in codes or time.monotonic() > deadline:
                break
            time.sleep(0.02)
        hint = ""
        if errno.EBUSY in codes:
            hint = f"another AF_XDP socket is bound to queue {self.queue} of {self.interface!r}"
        elif errno.EINVAL in codes:
            hint = f"queue {self.queue} may not exist on {self.interface!r}"
        if self.mode == "zerocopy" and errno.EOPNOTSUPP in codes:
            hint = f"the driver of {self.interface!r} has no AF_XDP zero-copy support; use mode copy or auto"
        raise CaptureError(f"af_xdp: cannot bind to {self.interface!r} queue {self.queue} "
                           f"({'; '.join(failures)}){'; ' + hint if hint else ''}")

    def _program(self) -> None:
        self._map_fd = bpf.create_xskmap(self.queue + 1)
        code = bpf.xsk_redirect_program(self._map_fd)
        self._prog_fd = bpf.load_xdp_program(code, frags=self.multibuffer)
        try:
            bpf.map_update(self._map_fd, self.queue, self._sock.fileno())
        except OSError as exc:
            raise CaptureError(f"af_xdp: putting the socket in the XSKMAP failed: {exc.strerror}") from exc
        attempts = ("native", "generic") if self.attach == "auto" else (self.attach,)
        failures = []
        for how in attempts:
            try:
                self._link_xdp(self._prog_fd, XDP_FLAGS_UPDATE_IF_NOEXIST | ATTACH_FLAGS[how])
                self.attach_mode = how
                return
            except PyrouteNetlinkError as exc:
                if exc.code == errno.EBUSY:
                    raise CaptureError(f"af_xdp: {self.interface!r} already has an XDP program attached; "
                                       f"gradtap does not replace it. If it is a stale one, remove it "
                                       f"(ip link set dev {self.interface} xdp off)") from exc
                failures.append(f"{how}: {os.strerror(exc.code)}")
        raise CaptureError(f"af_xdp: attaching the XDP program to {self.interface!r} failed "
                           f"({'; '.join(failures)})"
                           + ("; the MTU is too large for native XDP without multi-buffer"
                              if any("range" in f for f in failures) else ""))

    def _link_xdp(self, fd: int, flags: int, expected: int | None = None) -> None:
        attrs = [("IFLA_XDP_FD", fd), ("IFLA_XDP_FLAGS", flags)]
        if expected is not None:
            attrs.append(("IFLA_XDP_EXPECTED_FD", expected))
        self._ipr.link("set", index=self._ifindex, xdp={"attrs": attrs})

    def info(self) -> dict[str, object]:
        return {"mode": self.bound_mode, "attach": self.attach_mode, "multibuffer": self.multibuffer,
                "queue": self.queue, "umem_bytes": self.frames * self.chunk_size, "chunk_size": self.chunk_size,
                "chunk_frame_bytes": chunk_frame_bytes(self.chunk_size),
                "chunks_per_frame": -(-self.frame_bytes // chunk_frame_bytes(self.chunk_size))}

    # -- receive ---------------------------------------------------------------------------

    def receive(self, ring: FrameRing, timeout: float) -> int:
        self.ring = ring
        before = int(self._counts[_RECEIVED])
        found = self._rx(ring)
        if found == 0 and not select.select([self._sock], [], [], max(0.0, timeout))[0]:
            return 0
        if found < SHORT_PASS:
            # Woken by the first frames of a burst, or a pass found only a few: let the
            # burst land so that one pass moves many frames (what TPACKET's block timer
            # does for af_packet).
            if self.coalesce_us:
                time.sleep(self.coalesce_us * 1e-6)
            self._rx(ring)
        return int(self._counts[_RECEIVED]) - before

    def _rx(self, ring: FrameRing) -> int:
        rx, fill = self._rings["rx"], self._rings["fill"]
        hdr, caplens, wirelens, ts_ns, data, slot_size = ring.producer_arrays()
        return _rx(rx.u32, rx.desc64, rx.desc32, rx.prod, rx.cons, fill.u32, fill.desc64, fill.prod,
                   self._umem_view, self.chunk_size, time.time_ns(),
                   hdr, caplens, wirelens, ts_ns, data, slot_size, self._counts)

    # -- stats and close -------------------------------------------------------------------

    def counters(self) -> dict[str, int]:
        if self._sock is not None and self.bound_mode is not None:
            self._stats[:] = struct.unpack("6Q", self._sock.getsockopt(SOL_XDP, XDP_STATISTICS, 48))
        xdp = dict(zip(XDP_STATS, (int(v) for v in self._stats)))
        return {"received": int(self._counts[_RECEIVED]), "kernel_drops": xdp["rx_dropped"] + xdp["rx_ring_full"],
                **xdp, "fragments": int(self._counts[_FRAGMENTS]), "bad_descs": int(self._counts[_BAD_DESCS])}

    def close(self) -> None:
        """Detach our program (only if it is still the attached one), then free everything."""
        if self._ipr is not None:
            if self.attach_mode is not None:
                try:
                    self._link_xdp(-1, ATTACH_FLAGS[self.attach_mode] | XDP_FLAGS_REPLACE, self._prog_fd)
                except PyrouteNetlinkError as exc:
                    # ENODEV: the interface (or its namespace) is already gone, and the program with it.
                    if exc.code not in (errno.ENODEV, errno.EEXIST):
                        raise CaptureError(f"af_xdp: detaching the XDP program from {self.interface!r} failed: "
                                           f"{os.strerror(exc.code)}") from exc
                self.attach_mode = None
            self._ipr.close()
            self._ipr = None
        if self._sock is not None:
            self.counters()
            self._sock.close()
            self._sock = None
        for ring in self._rings.values():
            ring.close()
        self._rings = {}
        for name in ("_prog_fd", "_map_fd"):
            if getattr(self, name) is not None:
                os.close(getattr(self, name))
                setattr(self, name, None)
        if self._umem is not None:
            self._umem_view = None
            unmap(self._umem)
            self._umem = None
