"""pcap and pcapng files: a batch reader and streaming writers.

Formats: classic pcap (tcpdump.org pcap-savefile / draft-ietf-opsawg-pcap: either byte order,
microsecond magic 0xA1B2C3D4 or nanosecond magic 0xA1B23C4D) and pcapng
(draft-ietf-opsawg-pcapng: SHB in either byte order, several sections, IDB with
``if_tsresol`` as a power of 10 or of 2 and ``if_tsoffset``, EPB, SPB and the obsolete OPB;
other blocks are skipped). Only LINKTYPE_ETHERNET is accepted.

The reader maps the file (``mmap``) and walks its records in a Numba kernel that copies each
frame into the batch's own contiguous buffer, so a :class:`FrameBatch` owns its bytes and
stays valid after the file is closed. With ``copy=False`` nothing is copied: the batch's
``data`` is the mapping itself (read-only) and its offsets point at the frames in the file,
which saves a pass over memory for a consumer that reads each frame once (the replay), and
the mapping lives as long as any batch refers to it. Batches are bounded by ``max_frames``
and ``max_bytes``. A file is operator input: a malformed one raises :class:`CaptureError` naming
the file, the byte offset and the fault. A record cut off by the end of the file (a capture
that was still being written) is the exception: it is counted in ``truncated``, logged, and
ends the reading.

Writers stream: each ``write_batch`` packs record headers and frames in a Numba kernel, in
pieces of bounded size, and appends them to a buffered file.
"""

from __future__ import annotations

import logging
import mmap
import os
import struct

import numpy as np
from numba import njit

from gradtap.capture.frames import LINKTYPE_ETHERNET, FrameBatch
from gradtap.capture.shared_memory import unmap
from gradtap.core.bytes import read_uint, write_le
from gradtap.core.errors import CaptureError
from gradtap.core.jit import JIT
from gradtap.core.memory import copy_bytes, prefetch_bytes

log = logging.getLogger(__name__)

# Wireshark's WTAP_MAX_PACKET_SIZE_STANDARD: a longer record is corrupt, not a frame.
MAX_CAPLEN = 262144

PCAP_MAGIC_US = 0xA1B2C3D4
PCAP_MAGIC_NS = 0xA1B23C4D
PCAP_HEADER_LEN = 24
PCAP_RECORD_LEN = 16
PCAPNG_SHB = 0x0A0D0D0A
PCAPNG_BYTE_ORDER_MAGIC = 0x1A2B3C4D
_BYTE_ORDER_MAGIC_SWAPPED = 0x4D3C2B1A  # how the magic reads in the other byte order
PCAPNG_IDB = 0x00000001
PCAPNG_OPB = 0x00000002
PCAPNG_SPB = 0x00000003
PCAPNG_EPB = 0x00000006
_OPT_ENDOFOPT = 0
_OPT_SHB_USERAPPL = 4
_OPT_IF_TSRESOL = 9
_OPT_IF_TSOFFSET = 14

# Records whose first cache line the walk fetches ahead of its turn, guessing that the records
# between are as long as the current one (a wrong guess costs one useless fetch). Each record
# starts a line the walk must read from memory, and the hardware's stream prefetchers stop at
# every 4 KiB page, so with 4 KB frames each record began with a full memory latency. On a Xeon
# (family 6 model 207, KVM), walking the 3 streams of the GPT-2 replay (batches of 8192, no
# copy): 91-93 ns per record against 126-127 without (3 alternations; 8 or 16 ahead: 90-92);
# one of them as pcapng, 90-91 against 115-116. With four lines in flight the walk is still
# bound by memory latency; a single guess further ahead is wrong more often (an ACK among the
# records between moves the line by a whole frame), so the walk fetches at two distances, the
# near one covering what the far one misses. On a Xeon (family 6 model 167, KVM), the same
# walk in batches of 16384 (3 alternations of 4): 74-89 ms against 107-118 at 4 ahead alone,
# and one of the streams as pcapng 29-35 ms against 39-41; in ``benchmarks.replay``'s replays
# (3 alternations of 5), the reader's walk took 0.117 s of its thread's CPU (median) against
# 0.145, and the replay 0.653 s against 0.694.
WALK_NEAR = 4
WALK_FAR = 16

# Kernel status codes.
_EOF, _FULL, _BLOCK, _TRUNCATED, _BAD_BLOCK_LEN, _BAD_TRAILER, _BAD_IFACE, _BAD_CAPLEN = range(8)
# Columns of the per-interface table handed to the pcapng kernel.
_IF_MUL, _IF_DIV, _IF_POW2, _IF_OFFSET_NS, _IF_SNAPLEN = range(5)


@njit(**JIT, inline="always")
def _put(out, used, buf, src, caplen, offsets, caplens, wirelens, ts_ns, n, wirelen, ts):
    """Frame ``n``: copied to ``out[used:]``, or (``out`` empty: no copy) left in ``buf``."""
    if len(out):
        copy_bytes(out, used, buf, src, caplen)
        offsets[n] = used
    else:
        offsets[n] = src
    caplens[n] = caplen
    wirelens[n] = wirelen
    ts_ns[n] = ts


@njit(**JIT, inline="always")
def _fetch_ahead(buf, pos, length):
    """Fetch the first cache line of the records ``WALK_NEAR`` and ``WALK_FAR`` records past
    the one of ``length`` bytes at ``pos``, were they all that long (pcapng: and the line
    before each, which holds the trailing length of the block before it)."""
    for records in (WALK_NEAR, WALK_FAR):
        ahead = pos + records * length
        prefetch_bytes(buf, ahead - 4, ahead + 1)


@njit(**JIT)
def _walk_pcap(buf, pos, end, big, frac_ns, n, used, budget, out, offsets, caplens, wirelens, ts_ns):
    """Copy classic pcap records from ``buf[pos:end]`` into ``out`` (none if ``out`` is
    empty) and the per-frame arrays, starting at frame ``n`` and byte ``used``, while the
    frames' bytes stay within ``budget``. Returns ``(n, used, pos, status)``; on a fault
    ``pos`` is the offending record."""
    while pos < end:
        if n == len(offsets):
            return n, used, pos, _FULL
        if end - pos < PCAP_RECORD_LEN:
            return n, used, pos, _TRUNCATED
        caplen = read_uint(buf, pos + 8, 4, big)
        if caplen > MAX_CAPLEN:
            return n, used, pos, _BAD_CAPLEN
        _fetch_ahead(buf, pos, PCAP_RECORD_LEN + caplen)
        if end - pos - PCAP_RECORD_LEN < caplen:
            return n, used, pos, _TRUNCATED
        if used + caplen > budget:
            return n, used, pos, _FULL
        ts = read_uint(buf, pos, 4, big) * 1_000_000_000 + read_uint(buf, pos + 4, 4, big) * frac_ns
        _put(out, used, buf, pos + PCAP_RECORD_LEN, caplen, offsets, caplens, wirelens, ts_ns,
             n, read_uint(buf, pos + 12, 4, big), ts)
        used += caplen
        n += 1
        pos += PCAP_RECORD_LEN + caplen
    return n, used, pos, _EOF


@njit(**JIT, inline="always")
def _ts_to_ns(ts, iface):
    """A pcapng timestamp in interface units -> ns since the epoch (floor)."""
    pow2 = iface[_IF_POW2]
    if pow2 >= 0:
        sec = ts >> pow2
        frac = ts & ((np.int64(1) << pow2) - 1)
        if pow2 > 32:  # keep frac * 1e9 within int64; costs < 1 ns of precision
            frac >>= pow2 - 32
            pow2 = 32
        return sec * 1_000_000_000 + ((frac * 1_000_000_000) >> pow2) + iface[_IF_OFFSET_NS]
    return ts * iface[_IF_MUL] // iface[_IF_DIV] + iface[_IF_OFFSET_NS]


@njit(**JIT)
def _walk_pcapng(buf, pos, end, big, ifaces, n, used, budget, out, offsets, caplens, wirelens, ts_ns):
    """Like ``_walk_pcap`` for pcapng blocks. ``ifaces`` is ``int64[k, 5]`` (the ``_IF_*``
    columns) for the current section. Stops with ``_BLOCK`` at an SHB or IDB, which the
    caller parses before resuming after it."""
    while pos < end:
        if n == len(offsets):
            return n, used, pos, _FULL
        if end - pos < 8:
            return n, used, pos, _TRUNCATED
        btype = read_uint(buf, pos, 4, big)
        if btype == PCAPNG_SHB or btype == PCAPNG_IDB:
            return n, used, pos, _BLOCK
        blen = read_uint(buf, pos + 4, 4, big)
        if blen < 12 or blen % 4 != 0:
            return n, used, pos, _BAD_BLOCK_LEN
        if blen > end - pos:
            return n, used, pos, _TRUNCATED
        if read_uint(buf, pos + blen - 4, 4, big) != blen:
            return n, used, pos, _BAD_TRAILER
        _fetch_ahead(buf, pos, blen)
        if btype == PCAPNG_EPB or btype == PCAPNG_OPB:
            if blen < 32:
                return n, used, pos, _BAD_BLOCK_LEN
            if btype == PCAPNG_EPB:
                iface = read_uint(buf, pos + 8, 4, big)
            else:
                iface = read_uint(buf, pos + 8, 2, big)
            caplen = read_uint(buf, pos + 20, 4, big)
            wirelen = read_uint(buf, pos + 24, 4, big)
            data = pos + 28
            if iface >= len(ifaces):
                return n, used, pos, _BAD_IFACE
            ts = _ts_to_ns((read_uint(buf, pos + 12, 4, big) << 32) | read_uint(buf, pos + 16, 4, big),
                           ifaces[iface])
        elif btype == PCAPNG_SPB:
            if blen < 16:
                return n, used, pos, _BAD_BLOCK_LEN
            if len(ifaces) == 0:
                return n, used, pos, _BAD_IFACE
            wirelen = read_uint(buf, pos + 8, 4, big)
            caplen = wirelen  # the spec's min(original length, snaplen); no caplen field
            if ifaces[0, _IF_SNAPLEN] > 0:
                caplen = min(caplen, ifaces[0, _IF_SNAPLEN])
            data = pos + 12
            ts = 0  # an SPB records no time
        else:
            pos += blen
            continue
        if caplen > MAX_CAPLEN or data + caplen > pos + blen - 4:
            return n, used, pos, _BAD_CAPLEN
        if used + caplen > budget:
            return n, used, pos, _FULL
        _put(out, used, buf, data, caplen, offsets, caplens, wirelens, ts_ns, n, wirelen, ts)
        used += caplen
        n += 1
        pos += blen
    return n, used, pos, _EOF


def detect_format(path) -> str:
    """``"pcap"`` or ``"pcapng"`` from the file's magic; ``CaptureError`` otherwise."""
    with open(path, "rb") as f:
        head = f.read(4)
    if len(head) == 4:
        magic = struct.unpack("<I", head)[0]
        if magic == PCAPNG_SHB:
            return "pcapng"
        if magic in (PCAP_MAGIC_US, PCAP_MAGIC_NS) or \
                struct.unpack(">I", head)[0] in (PCAP_MAGIC_US, PCAP_MAGIC_NS):
            return "pcap"
    raise CaptureError(
        f"{path}: byte 0: not a pcap or pcapng file (starts {head.hex() or 'empty'})")


class PcapReader:
    """Frames of a pcap or pcapng file, as :class:`FrameBatch` es.

    Parameters
    ----------
    path:
        The capture file.
    max_frames:
        At most this many frames per batch.
    max_bytes:
        At most this many captured bytes per batch (>= ``MAX_CAPLEN``).
    copy:
        Copy the frames into each batch's own buffer (default). ``False``: batches refer to
        the file's mapping (read-only ``data``, valid for as long as the batch is).

    ``format`` is ``"pcap"`` or ``"pcapng"``; after iteration ``frames`` and ``bytes`` count
    what was read and ``truncated`` is 1 if the last record was cut off.
    """

    def __init__(self, path, max_frames: int = 65536, max_bytes: int = 64 << 20, copy: bool = True):
        if max_frames < 1:
            raise ValueError(f"max_frames = {max_frames}; must be >= 1")
        if max_bytes < MAX_CAPLEN:
            raise ValueError(f"max_bytes = {max_bytes}; must be >= {MAX_CAPLEN} (one frame)")
        self.path = os.fspath(path)
        self.max_frames = max_frames
        self.max_bytes = max_bytes
        self.copy = copy
        self.format = detect_format(self.path)
        self.linktype = LINKTYPE_ETHERNET
        self.frames = 0
        self.bytes = 0
        self.truncated = 0
        with open(self.path, "rb") as f:
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        self._buf = np.frombuffer(self._map, np.uint8)
        self._end = len(self._buf)
        self._big = False
        self._ifaces = np.zeros((0, 5), np.int64)
        self._pos = 0
        if self.format == "pcap":
            try:
                self._pos = self._pcap_header()
            except CaptureError:
                self.close()
                raise

    def _error(self, pos: int, what: str) -> CaptureError:
        return CaptureError(f"{self.path}: byte {pos}: {what}")

    def _truncated(self, pos: int, what: str) -> None:
        self.truncated += 1
        log.warning("%s: byte %d: %s cut off by the end of the file; reading stops there",
                    self.path, pos, what)

    def _pcap_header(self) -> int:
        if self._end < PCAP_HEADER_LEN:
            raise self._error(0, f"pcap file header needs {PCAP_HEADER_LEN} bytes, file has "
                                 f"{self._end}")
        magic = struct.unpack_from("<I", self._map, 0)[0]
        self._big = magic not in (PCAP_MAGIC_US, PCAP_MAGIC_NS)
        order = ">" if self._big else "<"
        magic, major, _, _, _, _, network = struct.unpack_from(order + "IHHiIII", self._map, 0)
        if major != 2:
            raise self._error(4, f"pcap version {major} is not supported (only 2.x)")
        self._frac_ns = 1 if magic == PCAP_MAGIC_NS else 1000
        self._check_linktype(20, network & 0xFFFF)
        return PCAP_HEADER_LEN

    def _check_linktype(self, pos: int, linktype: int) -> None:
        if linktype != LINKTYPE_ETHERNET:
            raise self._error(pos, f"link type {linktype} is not Ethernet "
                                   f"(LINKTYPE_ETHERNET = {LINKTYPE_ETHERNET}); "
                                   f"gradtap decodes Ethernet frames only")

    def _pcapng_block(self, pos: int) -> int | None:
        """Parse the SHB or IDB at ``pos``; the position after it, or None if truncated."""
        if self._end - pos < 12:
            self._truncated(pos, "pcapng block header")
            return None
        btype = struct.unpack_from("<I", self._map, pos)[0]
        if btype == PCAPNG_SHB:
            bom = struct.unpack_from("<I", self._map, pos + 8)[0]
            if bom not in (PCAPNG_BYTE_ORDER_MAGIC, _BYTE_ORDER_MAGIC_SWAPPED):
                raise self._error(pos + 8, f"section header byte-order magic {bom:#010x} is "
                                           f"neither {PCAPNG_BYTE_ORDER_MAGIC:#010x} nor swapped")
            self._big = bom != PCAPNG_BYTE_ORDER_MAGIC
        order = ">" if self._big else "<"
        blen = struct.unpack_from(order + "I", self._map, pos + 4)[0]
        minimum = 28 if btype == PCAPNG_SHB else 20
        if blen < minimum or blen % 4:
            raise self._error(pos, f"block length {blen} is invalid (a multiple of 4, "
                                   f">= {minimum})")
        if blen > self._end - pos:
            self._truncated(pos, "pcapng block")
            return None
        if struct.unpack_from(order + "I", self._map, pos + blen - 4)[0] != blen:
            raise self._error(pos + blen - 4, f"block trailer disagrees with length {blen}")
        if btype == PCAPNG_SHB:
            major = struct.unpack_from(order + "H", self._map, pos + 12)[0]
            if major != 1:
                raise self._error(pos + 12, f"pcapng version {major} is not supported (only 1.x)")
            self._ifaces = np.zeros((0, 5), np.int64)
        else:
            linktype, _, snaplen = struct.unpack_from(order + "HHI", self._map, pos + 8)
            self._check_linktype(pos + 8, linktype)
            self._add_interface(order, snaplen, pos + 16, pos + blen - 4)
        return pos + blen

    def _add_interface(self, order: str, snaplen: int, opt: int, end: int) -> None:
        """Append the interface of an IDB whose options span ``[opt, end)``."""
        mul, div, pow2, offset_ns = 1000, 1, -1, 0  # default if_tsresol 6: microseconds
        while opt + 4 <= end:
            code, length = struct.unpack_from(order + "HH", self._map, opt)
            if code == _OPT_ENDOFOPT:
                break
            if opt + 4 + length > end:
                raise self._error(opt, f"interface option {code} of {length} bytes overruns "
                                       f"its block")
            value = bytes(self._map[opt + 4:opt + 4 + length])
            if code == _OPT_IF_TSRESOL and length == 1:
                exp = value[0] & 0x7F
                if value[0] & 0x80:
                    if exp > 62:
                        raise self._error(opt, f"if_tsresol 2^-{exp} is not supported (<= 62)")
                    pow2 = exp
                elif exp > 18:
                    raise self._error(opt, f"if_tsresol 10^-{exp} is not supported (<= 18)")
                elif exp <= 9:
                    mul, div = 10 ** (9 - exp), 1
                else:
                    mul, div = 1, 10 ** (exp - 9)
            elif code == _OPT_IF_TSOFFSET and length == 8:
                offset_ns = struct.unpack(order + "q", value)[0] * 1_000_000_000
            opt += 4 + (length + 3) // 4 * 4
        row = np.array([[mul, div, pow2, offset_ns, snaplen]], np.int64)
        self._ifaces = np.concatenate([self._ifaces, row])

    def __iter__(self):
        while self._pos is not None and self._pos < self._end:
            batch = self._next_batch()
            if len(batch):
                yield batch

    def _next_batch(self) -> FrameBatch:
        remaining = self._end - self._pos
        budget = min(self.max_bytes, remaining)
        out = np.empty(budget if self.copy else 0, np.uint8)
        cap = min(self.max_frames, remaining // PCAP_RECORD_LEN + 1)
        offsets, ts_ns = np.empty(cap, np.int64), np.empty(cap, np.int64)
        caplens, wirelens = np.empty(cap, np.int32), np.empty(cap, np.int32)
        arrays = (out, offsets, caplens, wirelens, ts_ns)
        n = used = 0
        while True:
            if self.format == "pcap":
                n, used, pos, status = _walk_pcap(self._buf, self._pos, self._end, self._big,
                                                  self._frac_ns, n, used, budget, *arrays)
            else:
                n, used, pos, status = _walk_pcapng(self._buf, self._pos, self._end, self._big,
                                                    self._ifaces, n, used, budget, *arrays)
            self._pos = pos
            if status != _BLOCK:
                break
            self._pos = self._pcapng_block(pos)
            if self._pos is None:  # cut off by the end of the file, already counted
                status = _EOF
                break
        if status == _TRUNCATED:
            self._truncated(pos, "last record")
            self._pos = None
        elif status not in (_EOF, _FULL):
            raise self._fault(pos, status)
        self.frames += n
        self.bytes += used
        # Either the batch's own copy or the file's mapping, which lives while a batch refers to it.
        return FrameBatch(out[:used] if self.copy else self._buf, offsets[:n], caplens[:n], wirelens[:n], ts_ns[:n],
                          self.linktype, lasting=True)

    def _fault(self, pos: int, status: int) -> CaptureError:
        order = ">" if self._big else "<"
        if self.format == "pcap":
            caplen = struct.unpack_from(order + "I", self._map, pos + 8)[0]
            return self._error(pos, f"record captured length {caplen} exceeds {MAX_CAPLEN}")
        btype, blen = struct.unpack_from(order + "II", self._map, pos)
        what = {
            _BAD_BLOCK_LEN: f"block type {btype:#x} has invalid length {blen}",
            _BAD_TRAILER: f"block type {btype:#x}: trailer disagrees with length {blen}",
            _BAD_IFACE: f"block type {btype:#x} names an interface not described by an IDB "
                        f"({len(self._ifaces)} in this section)",
            _BAD_CAPLEN: f"block type {btype:#x}: captured length exceeds its block or "
                         f"{MAX_CAPLEN}",
        }[status]
        return self._error(pos, what)

    def stats(self) -> dict:
        """Frames and captured bytes read so far, and truncated records (0 or 1)."""
        return {"frames": self.frames, "bytes": self.bytes, "truncated": self.truncated}

    def close(self) -> None:
        if self._map is not None:
            self._buf = None
            unmap(self._map)
            self._map = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def read_pcap(path) -> FrameBatch:
    """Every frame of a capture file in one batch (for files that fit in memory)."""
    with PcapReader(path) as reader:
        return FrameBatch.concat(list(reader))


@njit(**JIT)
def _pack_records(data, offsets, caplens, wirelens, ts_ns, snaplen, frac_div, pcapng, out):
    """Per frame: record header (pcap) or EPB header (pcapng, interface 0, ns units), the
    frame cut at ``snaplen``, and for pcapng the pad and trailing length, into ``out``.
    Returns the bytes written."""
    pos = 0
    for i in range(len(offsets)):
        caplen = min(caplens[i], snaplen)
        if pcapng:
            blen = 32 + (caplen + 3) // 4 * 4
            write_le(out, pos, PCAPNG_EPB, 4)
            write_le(out, pos + 4, blen, 4)
            write_le(out, pos + 8, 0, 4)
            write_le(out, pos + 12, ts_ns[i] >> 32, 4)
            write_le(out, pos + 16, ts_ns[i] & 0xFFFFFFFF, 4)
            head = 20
        else:
            blen = PCAP_RECORD_LEN + caplen
            write_le(out, pos, ts_ns[i] // 1_000_000_000, 4)
            write_le(out, pos + 4, ts_ns[i] % 1_000_000_000 // frac_div, 4)
            head = 8
        write_le(out, pos + head, caplen, 4)
        write_le(out, pos + head + 4, wirelens[i], 4)
        head += 8
        copy_bytes(out, pos + head, data, offsets[i], caplen)
        if pcapng:
            out[pos + head + caplen:pos + blen - 4] = 0
            write_le(out, pos + blen - 4, blen, 4)
        pos += blen
    return pos


class _Writer:
    """Shared streaming logic of PcapWriter and PcapngWriter (little-endian output)."""

    _CHUNK = 16 << 20  # bytes packed per kernel call: bounds the writer's memory

    def __init__(self, path, header: bytes, snaplen: int, pcapng: bool, frac_div: int):
        if not 0 < snaplen <= MAX_CAPLEN:
            raise ValueError(f"snaplen = {snaplen}; allowed 1..{MAX_CAPLEN}")
        self.path = os.fspath(path)
        self.snaplen = snaplen
        self.frames = 0
        self._pcapng = pcapng
        self._frac_div = frac_div
        self._file = open(self.path, "wb", buffering=1 << 20)
        self._file.write(header)

    def _check_times(self, ts_ns: np.ndarray) -> None:
        limit = (1 << 64) if self._pcapng else (1 << 32) * 1_000_000_000
        if len(ts_ns) and (ts_ns.min() < 0 or int(ts_ns.max()) >= limit):
            raise ValueError(f"{self.path}: timestamps must lie in 0..{limit - 1} ns; got "
                             f"{ts_ns.min()}..{ts_ns.max()}")

    def write_batch(self, batch: FrameBatch) -> None:
        """Append every frame of ``batch``."""
        if batch.linktype != LINKTYPE_ETHERNET:
            raise ValueError(f"{self.path}: batch link type {batch.linktype} is not Ethernet")
        self._check_times(batch.ts_ns)
        caps = np.minimum(batch.caplens, self.snaplen).astype(np.int64)
        sizes = 32 + (caps + 3) // 4 * 4 if self._pcapng else PCAP_RECORD_LEN + caps
        ends = np.cumsum(sizes)
        start = 0
        while start < len(batch):
            base = int(ends[start - 1]) if start else 0
            stop = max(start + 1, int(np.searchsorted(ends, base + self._CHUNK, "right")))
            out = np.empty(int(ends[stop - 1]) - base, np.uint8)
            _pack_records(batch.data, batch.offsets[start:stop], batch.caplens[start:stop],
                          batch.wirelens[start:stop], batch.ts_ns[start:stop], self.snaplen,
                          self._frac_div, self._pcapng, out)
            self._file.write(out)
            start = stop
        self.frames += len(batch)

    def write(self, frame, ts_ns: int, wirelen: int | None = None) -> None:
        """Append one frame (``bytes``-like) captured at ``ts_ns`` (ns since the epoch)."""
        frame = bytes(frame)
        self._check_times(np.array([ts_ns], np.int64))
        cap = frame[:self.snaplen]
        wire = len(frame) if wirelen is None else wirelen
        if self._pcapng:
            blen = 32 + (len(cap) + 3) // 4 * 4
            head = struct.pack("<IIIIIII", PCAPNG_EPB, blen, 0, ts_ns >> 32, ts_ns & 0xFFFFFFFF,
                               len(cap), wire)
            record = head + cap + bytes(blen - 32 - len(cap)) + struct.pack("<I", blen)
        else:
            sec, nsec = divmod(ts_ns, 1_000_000_000)
            record = struct.pack("<IIII", sec, nsec // self._frac_div, len(cap), wire) + cap
        self._file.write(record)
        self.frames += 1

    def close(self) -> None:
        if not self._file.closed:
            self._file.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class PcapWriter(_Writer):
    """Classic pcap writer.

    Parameters: ``path``; ``nanosecond``: nanosecond magic (else microseconds, truncating);
    ``snaplen``: frames are cut to this many bytes (their wire length is kept).
    """

    def __init__(self, path, nanosecond: bool = True, snaplen: int = MAX_CAPLEN):
        magic = PCAP_MAGIC_NS if nanosecond else PCAP_MAGIC_US
        header = struct.pack("<IHHiIII", magic, 2, 4, 0, 0, snaplen, LINKTYPE_ETHERNET)
        super().__init__(path, header, snaplen, pcapng=False, frac_div=1 if nanosecond else 1000)


def _option(code: int, value: bytes) -> bytes:
    return struct.pack("<HH", code, len(value)) + value + bytes(-len(value) % 4)


class PcapngWriter(_Writer):
    """pcapng writer: one section, one Ethernet interface with ``if_tsresol`` = 9 (ns), EPBs.

    Parameters: ``path``; ``snaplen``: frames are cut to this many bytes.
    """

    def __init__(self, path, snaplen: int = MAX_CAPLEN):
        shb_body = struct.pack("<IHHq", PCAPNG_BYTE_ORDER_MAGIC, 1, 0, -1) + \
            _option(_OPT_SHB_USERAPPL, b"gradtap") + _option(_OPT_ENDOFOPT, b"")
        idb_body = struct.pack("<HHI", LINKTYPE_ETHERNET, 0, snaplen) + \
            _option(_OPT_IF_TSRESOL, bytes([9])) + _option(_OPT_ENDOFOPT, b"")
        header = b"".join(struct.pack("<II", btype, 12 + len(body)) + body +
                          struct.pack("<I", 12 + len(body))
                          for btype, body in ((PCAPNG_SHB, shb_body), (PCAPNG_IDB, idb_body)))
        super().__init__(path, header, snaplen, pcapng=True, frac_div=1)
