"""Packet descriptors to RoCEv2 Ethernet frames with a valid ICRC.

A packet is one row of :data:`PACKET_DTYPE`. Its addresses come from a *route*: the
Ethernet, IP and UDP headers of one (sender, receiver, UDP source port) triple, built once
with the declarative header layouts (``wire/headers``) and patched per packet by the
kernel (lengths, IPv4 checksum). BTH and the extension headers that the opcode carries are
written from the descriptor, the payload is copied from an arena, and the ICRC is computed
last over the finished frame. Nothing here is per-frame Python.

A mirror stream that reaches its CPU node over L3 (``MirrorSpec.encapsulation`` ``erspan2``
or ``erspan3``) carries each mirrored frame inside IPv4 + GRE + ERSPAN, as the switch sends
it: :class:`ErspanTunnel` wraps finished frames and numbers them per session.
"""

from __future__ import annotations

import ipaddress

import numpy as np
from numba import njit

from gradtap.core.bytes import read_be, write_be, write_le
from gradtap.core.jit import JIT
from gradtap.core.memory import copy_bytes
from gradtap.wire.headers import erspan, eth, gre, ipv4, ipv6, udp
from gradtap.wire.headers.aeth import AETH_OFF_SYNDROME, AETH_SIZE_SYNDROME
from gradtap.wire.headers.bth import BTH, BTH_ACKREQ_MASK, BTH_ACKREQ_SHIFT, BTH_DESTQP_MASK, BTH_DESTQP_SHIFT, \
    BTH_LEN, BTH_OFF_ACKREQ, BTH_OFF_DESTQP, BTH_OFF_OPCODE, BTH_OFF_PADCNT, BTH_OFF_PKEY, BTH_PADCNT_MASK, \
    BTH_PADCNT_SHIFT, BTH_PSN_MASK, BTH_PSN_SHIFT, BTH_SIZE_ACKREQ, BTH_SIZE_DESTQP, BTH_SIZE_OPCODE, \
    BTH_SIZE_PADCNT, BTH_SIZE_PKEY
from gradtap.wire.headers.deth import DETH_OFF_QKEY, DETH_OFF_SRCQP, DETH_SIZE_QKEY, DETH_SIZE_SRCQP
from gradtap.wire.headers.immdt import IMMDT_OFF_IMM, IMMDT_SIZE_IMM
from gradtap.wire.headers.erspan import ERSPAN3_OFF_TIMESTAMP, ERSPAN3_SIZE_TIMESTAMP, ERSPAN_GRA_100NS
from gradtap.wire.headers.eth import ETH_LEN
from gradtap.wire.headers.gre import GRE_SEQ_OFF_SEQ, GRE_SEQ_SIZE_SEQ
from gradtap.wire.headers.ipv4 import IPV4_LEN, IPV4_OFF_CHECKSUM, IPV4_OFF_TOTAL_LENGTH, IPV4_SIZE_CHECKSUM, \
    IPV4_SIZE_TOTAL_LENGTH
from gradtap.wire.headers.ipv6 import IPV6_LEN, IPV6_OFF_PAYLOAD_LENGTH, IPV6_SIZE_PAYLOAD_LENGTH
from gradtap.wire.headers.opcodes import OPCODE_AETH_OFF, OPCODE_DETH_OFF, OPCODE_EXT_LEN, OPCODE_IMMDT_OFF, \
    OPCODE_RETH_OFF
from gradtap.wire.headers.reth import RETH_OFF_DMA_LENGTH, RETH_OFF_RKEY, RETH_OFF_VA, RETH_SIZE_DMA_LENGTH, \
    RETH_SIZE_RKEY, RETH_SIZE_VA
from gradtap.wire.headers.udp import UDP_LEN, UDP_OFF_LENGTH, UDP_SIZE_LENGTH
from gradtap.wire.icrc import ICRC_LEN, icrc_frame

PACKET_DTYPE = np.dtype([
    ("ts_ns", "i8"),
    ("route", "i4"),          # row of the route table (addresses, UDP source port)
    ("opcode", "u1"),
    ("ackreq", "u1"),
    ("dest_qpn", "u4"),
    ("psn", "u4"),
    ("reth_va", "u8"),
    ("reth_rkey", "u4"),
    ("reth_len", "u4"),
    ("imm", "u4"),            # ImmDt, the four wire bytes read big-endian
    ("aeth", "u4"),           # syndrome << 24 | MSN
    ("payload_off", "i8"),    # first byte in the payload arena
    ("payload_len", "i4"),
    ("corrupt", "u1"),        # 1: flip a bit after the ICRC is computed (the ICRC then fails)
])

ROCE_DSCP = 0    # as in the real captures (traffic class 0x02); the ICRC masks it anyway
ROCE_ECN = 2     # ECT(0)
PREFIX_MAX = eth.ETH_LEN + IPV6_LEN + UDP_LEN
GSI_QKEY = 0x80010000  # the well-known Q_Key of QP1, which connection-manager MADs use (IBTA §13.5.1)
GSI_QPN = 1            # the source QP of those MADs
PKEY = BTH.fields["pkey"].default   # the default partition key, 0xFFFF
PAD_TO = 4             # the payload is padded to a multiple of 4 bytes (BTH PadCnt)


class Routes:
    """Header templates for (sender MAC/IP, receiver MAC/IP, UDP source port) triples."""

    def __init__(self, ipv6_family: bool):
        self.ipv6 = ipv6_family
        self._index: dict[tuple, int] = {}
        self._rows: list[bytes] = []

    def add(self, src_mac: str, dst_mac: str, src_ip: str, dst_ip: str, sport: int) -> int:
        key = (src_mac, dst_mac, src_ip, dst_ip, sport)
        if key not in self._index:
            self._index[key] = len(self._rows)
            self._rows.append(self._template(*key))
        return self._index[key]

    def _template(self, src_mac, dst_mac, src_ip, dst_ip, sport) -> bytes:
        mac = lambda m: bytes.fromhex(m.replace(":", ""))  # noqa: E731
        addr = lambda a: ipaddress.ip_address(a).packed  # noqa: E731
        ethertype = eth.ETHERTYPE_IPV6 if self.ipv6 else eth.ETHERTYPE_IPV4
        head = eth.pack(dst=mac(dst_mac), src=mac(src_mac), type=ethertype)
        if self.ipv6:
            head += ipv6.pack(dscp=ROCE_DSCP, ecn=ROCE_ECN, src=addr(src_ip), dst=addr(dst_ip))
        else:
            # Lengths and checksum are patched per packet; DF set as RoCE NICs do.
            head += ipv4.IPV4.pack(dscp=ROCE_DSCP, ecn=ROCE_ECN, flags=2, src=addr(src_ip), dst=addr(dst_ip))
        return head + udp.pack(sport=sport)

    def table(self) -> np.ndarray:
        """uint8[routes, prefix_len]: every template has the same length within one family."""
        if not self._rows:
            return np.zeros((0, PREFIX_MAX), np.uint8)
        return np.frombuffer(b"".join(self._rows), np.uint8).reshape(len(self._rows), -1).copy()


def frame_lengths(packets: np.ndarray, prefix_len: int) -> np.ndarray:
    """Length in bytes of each packet's frame (no FCS)."""
    pad = (-packets["payload_len"]) % PAD_TO
    ext = OPCODE_EXT_LEN[packets["opcode"]]
    return prefix_len + BTH_LEN + ext + packets["payload_len"] + pad + ICRC_LEN


@njit(**JIT, inline="always")
def _set_ipv4_checksum(out, l3):
    """RFC 1071 checksum of the option-less IPv4 header at ``out[l3]``, stored in place."""
    total = 0
    for k in range(0, IPV4_LEN, IPV4_SIZE_CHECKSUM):
        if k != IPV4_OFF_CHECKSUM:
            total += read_be(out, l3 + k, IPV4_SIZE_CHECKSUM)
    while total >> 16:
        total = (total & 0xFFFF) + (total >> 16)
    write_be(out, l3 + IPV4_OFF_CHECKSUM, ~total & 0xFFFF, IPV4_SIZE_CHECKSUM)


@njit(**JIT, inline="always")
def _put_bth(out, b, p, pad):
    """The BTH of packet ``p`` at ``out[b]``: FECN, BECN, SE, M, TVer and reserved bits 0."""
    write_be(out, b + BTH_OFF_OPCODE, p["opcode"], BTH_SIZE_OPCODE)
    write_be(out, b + BTH_OFF_PADCNT, (np.int64(pad) << BTH_PADCNT_SHIFT) & BTH_PADCNT_MASK, BTH_SIZE_PADCNT)
    write_be(out, b + BTH_OFF_PKEY, PKEY, BTH_SIZE_PKEY)
    write_be(out, b + BTH_OFF_DESTQP, (np.int64(p["dest_qpn"]) << BTH_DESTQP_SHIFT) & BTH_DESTQP_MASK,
             BTH_SIZE_DESTQP)
    # AckReq and PSN share one word (BTH_OFF_ACKREQ == BTH_OFF_PSN).
    write_be(out, b + BTH_OFF_ACKREQ, ((np.int64(p["ackreq"]) << BTH_ACKREQ_SHIFT) & BTH_ACKREQ_MASK) |
             ((np.int64(p["psn"]) << BTH_PSN_SHIFT) & BTH_PSN_MASK), BTH_SIZE_ACKREQ)


@njit(**JIT, inline="always")
def _put_ext(out, e, p):
    """The extended transport headers the opcode of ``p`` carries, from ``out[e]`` on."""
    op = p["opcode"]
    if OPCODE_RETH_OFF[op] >= 0:
        r = e + OPCODE_RETH_OFF[op]
        write_be(out, r + RETH_OFF_VA, p["reth_va"], RETH_SIZE_VA)
        write_be(out, r + RETH_OFF_RKEY, p["reth_rkey"], RETH_SIZE_RKEY)
        write_be(out, r + RETH_OFF_DMA_LENGTH, p["reth_len"], RETH_SIZE_DMA_LENGTH)
    if OPCODE_IMMDT_OFF[op] >= 0:
        write_be(out, e + OPCODE_IMMDT_OFF[op] + IMMDT_OFF_IMM, p["imm"], IMMDT_SIZE_IMM)
    if OPCODE_DETH_OFF[op] >= 0:
        write_be(out, e + OPCODE_DETH_OFF[op] + DETH_OFF_QKEY, GSI_QKEY, DETH_SIZE_QKEY)
        write_be(out, e + OPCODE_DETH_OFF[op] + DETH_OFF_SRCQP, GSI_QPN, DETH_SIZE_SRCQP)
    if OPCODE_AETH_OFF[op] >= 0:
        write_be(out, e + OPCODE_AETH_OFF[op] + AETH_OFF_SYNDROME, p["aeth"], AETH_SIZE_SYNDROME)


@njit(**JIT)
def _encode(packets, routes, ipv6_family, arena, out, offsets, lengths):
    prefix = routes.shape[1]
    l3 = prefix - UDP_LEN - (IPV6_LEN if ipv6_family else IPV4_LEN)
    l4 = prefix - UDP_LEN
    for i in range(packets.shape[0]):
        p = packets[i]
        o = offsets[i]
        n = lengths[i]
        out[o:o + prefix] = routes[p["route"]]
        udp_len = n - l4
        if ipv6_family:
            write_be(out, o + l3 + IPV6_OFF_PAYLOAD_LENGTH, udp_len, IPV6_SIZE_PAYLOAD_LENGTH)
        else:
            write_be(out, o + l3 + IPV4_OFF_TOTAL_LENGTH, n - l3, IPV4_SIZE_TOTAL_LENGTH)
            _set_ipv4_checksum(out, o + l3)
        write_be(out, o + l4 + UDP_OFF_LENGTH, udp_len, UDP_SIZE_LENGTH)
        b = o + prefix
        pad = (-p["payload_len"]) % PAD_TO
        _put_bth(out, b, p, pad)
        e = b + BTH_LEN
        _put_ext(out, e, p)
        d = e + OPCODE_EXT_LEN[p["opcode"]]
        copy_bytes(out, d, arena, p["payload_off"], p["payload_len"])
        out[d + p["payload_len"]:d + p["payload_len"] + pad] = 0
        crc = icrc_frame(out, o + l3, ipv6_family, o + n)
        write_le(out, o + n - ICRC_LEN, crc, ICRC_LEN)
        if p["corrupt"]:
            # Damage after the CRC: the last payload byte (or the ICRC itself when empty).
            out[o + n - ICRC_LEN - 1 - pad if p["payload_len"] else o + n - 1] ^= 0x01


def encode_frames(packets: np.ndarray, routes: Routes, arena: np.ndarray,
                  scratch: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Encode ``packets`` (PACKET_DTYPE) into one contiguous buffer.

    ``scratch``: a uint8 buffer to encode into when it is large enough (the caller reuses it
    from batch to batch, so its pages fault in once); the data returned is then its first
    bytes, valid until the caller reuses it.

    Returns ``(data uint8[total], offsets int64[n], lengths int32[n])``.
    """
    table = routes.table()
    lengths = frame_lengths(packets, table.shape[1]).astype(np.int64)
    offsets = np.zeros(len(packets), np.int64)
    np.cumsum(lengths[:-1], out=offsets[1:])
    total = int(lengths.sum())
    data = scratch[:total] if scratch is not None and len(scratch) >= total else np.empty(total, np.uint8)
    if len(packets):
        _encode(packets, table, routes.ipv6, arena, data, offsets, lengths)
    return data, offsets, lengths.astype(np.int32)


# Where a simulated ERSPAN session runs, when nothing says otherwise: documentation addresses
# (RFC 5737 TEST-NET-1) and locally administered MACs, none of them a rank's or a peer's.
ERSPAN_SWITCH_IP = "192.0.2.1"       # the switch's ERSPAN source address (origin)
ERSPAN_COLLECTOR_IP = "192.0.2.2"    # the CPU node's address that receives the session
ERSPAN_SWITCH_MAC = "02:00:00:fe:00:01"
ERSPAN_COLLECTOR_MAC = "02:00:00:fe:00:02"
ERSPAN_TICK_NS = 100                 # the ERSPAN III timestamp's unit (ERSPAN_GRA_100NS)
GRE_SEQ_MODULUS = 1 << (8 * GRE_SEQ_SIZE_SEQ)


class ErspanTunnel:
    """One ERSPAN session: IPv4 + GRE (with sequence number) + ERSPAN type II or III.

    Parameters
    ----------
    encapsulation:
        ``"erspan2"`` (GRE 0x88BE, 8-byte header) or ``"erspan3"`` (GRE 0x22EB, 12-byte header
        whose timestamp is the frame's time in 100 ns units, modulo 2**32; ``p`` = 1 and
        ``ft`` = 0, an Ethernet frame, as Linux's ``erspan_build_header_v2`` sends).
    session:
        The 10-bit ERSPAN session id.
    switch_ip, collector_ip, switch_mac, collector_mac:
        Outer addresses (IPv4): the switch that encapsulates and the CPU node it sends to.

    The GRE sequence number counts the session's frames from 0 (modulo 2**32) in the order
    the switch sends them, across calls of :meth:`encapsulate`, so frames lost after the
    switch (on the mirror path) leave gaps.
    """

    def __init__(self, encapsulation: str, session: int, *, switch_ip: str = ERSPAN_SWITCH_IP,
                 collector_ip: str = ERSPAN_COLLECTOR_IP, switch_mac: str = ERSPAN_SWITCH_MAC,
                 collector_mac: str = ERSPAN_COLLECTOR_MAC):
        if encapsulation not in ("erspan2", "erspan3"):
            raise ValueError(f"encapsulation {encapsulation!r} is not 'erspan2' or 'erspan3'")
        mac = lambda m: bytes.fromhex(m.replace(":", ""))  # noqa: E731
        addr = lambda a: ipaddress.IPv4Address(a).packed  # noqa: E731
        self.encapsulation, self.session, self.next_seq = encapsulation, session, 0
        three = encapsulation == "erspan3"
        head = eth.pack(dst=mac(collector_mac), src=mac(switch_mac), type=eth.ETHERTYPE_IPV4)
        # Total length and checksum are patched per frame.
        head += ipv4.IPV4.pack(proto=gre.IPPROTO_GRE, src=addr(switch_ip), dst=addr(collector_ip))
        head += gre.pack(seq=0, proto=gre.GRE_PROTO_ERSPAN3 if three else gre.GRE_PROTO_ERSPAN2)
        self._seq_at = len(head) - GRE_SEQ_SIZE_SEQ + GRE_SEQ_OFF_SEQ
        self._ts_at = len(head) + ERSPAN3_OFF_TIMESTAMP if three else -1
        head += erspan.pack3(session=session, p=1, gra=ERSPAN_GRA_100NS) if three else erspan.pack2(session=session)
        self.head = np.frombuffer(head, np.uint8).copy()

    def encapsulate(self, data: np.ndarray, offsets: np.ndarray, lengths: np.ndarray, ts_ns: np.ndarray,
                    order: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Frames ``data[offsets[i]:offsets[i] + lengths[i]]`` (sent at ``ts_ns[i]``, in the order
        ``order`` lists them) encapsulated, in the same index order.

        Returns ``(data uint8[total], offsets int64[n], lengths int32[n])``.
        """
        n = len(offsets)
        seq = np.empty(n, np.int64)
        seq[order] = (self.next_seq + np.arange(n)) % GRE_SEQ_MODULUS
        self.next_seq = (self.next_seq + n) % GRE_SEQ_MODULUS
        out_lengths = np.asarray(lengths, np.int64) + len(self.head)
        out_offsets = np.zeros(n, np.int64)
        np.cumsum(out_lengths[:-1], out=out_offsets[1:])
        out = np.empty(int(out_lengths.sum()), np.uint8)
        if n:
            _encapsulate(self.head, self._seq_at, self._ts_at, data, np.asarray(offsets, np.int64),
                         np.asarray(lengths, np.int64), np.asarray(ts_ns, np.int64), seq, out, out_offsets)
        return out, out_offsets, out_lengths.astype(np.int32)


@njit(**JIT)
def _encapsulate(head, seq_at, ts_at, data, offsets, lengths, ts_ns, seq, out, out_offsets):
    h = head.shape[0]
    l3 = ETH_LEN
    for i in range(offsets.shape[0]):
        o = out_offsets[i]
        out[o:o + h] = head
        write_be(out, o + l3 + IPV4_OFF_TOTAL_LENGTH, h - l3 + lengths[i], IPV4_SIZE_TOTAL_LENGTH)
        _set_ipv4_checksum(out, o + l3)
        write_be(out, o + seq_at, seq[i], GRE_SEQ_SIZE_SEQ)
        if ts_at >= 0:
            write_be(out, o + ts_at, (ts_ns[i] // ERSPAN_TICK_NS) % (1 << 32), ERSPAN3_SIZE_TIMESTAMP)
        copy_bytes(out, o + h, data, offsets[i], lengths[i])
