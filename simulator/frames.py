"""Packet descriptors to RoCEv2 Ethernet frames with a valid ICRC.

A packet is one row of :data:`PACKET_DTYPE`. Its addresses come from a *route*: the
Ethernet, IP and UDP headers of one (sender, receiver, UDP source port) triple, built once
with the declarative header layouts (``wire/headers``) and patched per packet by the
kernel (lengths, IPv4 checksum). BTH and the extension headers that the opcode carries are
written from the descriptor, the payload is copied from an arena, and the ICRC is computed
last over the finished frame. Nothing here is per-frame Python.
"""

from __future__ import annotations

import ipaddress

import numpy as np
from numba import njit

from gradtap.core.jit import JIT
from gradtap.wire.headers import eth, ipv4, ipv6, udp
from gradtap.wire.headers.aeth import AETH_OFF_SYNDROME
from gradtap.wire.headers.deth import DETH_OFF_QKEY, DETH_OFF_SRCQP
from gradtap.wire.headers.bth import BTH_LEN, BTH_OFF_DESTQP, BTH_OFF_OPCODE, BTH_OFF_PKEY, BTH_OFF_PSN, BTH_OFF_SE, \
    BTH_PADCNT_SHIFT, BTH_TVER_SHIFT
from gradtap.wire.headers.immdt import IMMDT_OFF_IMM
from gradtap.wire.headers.ipv4 import IPV4_LEN, IPV4_OFF_CHECKSUM, IPV4_OFF_TOTAL_LENGTH
from gradtap.wire.headers.ipv6 import IPV6_LEN, IPV6_OFF_PAYLOAD_LENGTH
from gradtap.wire.headers.opcodes import OPCODE_AETH_OFF, OPCODE_DETH_OFF, OPCODE_EXT_LEN, OPCODE_IMMDT_OFF, OPCODE_RETH_OFF
from gradtap.wire.headers.reth import RETH_OFF_DMA_LENGTH, RETH_OFF_RKEY, RETH_OFF_VA
from gradtap.wire.headers.udp import UDP_LEN, UDP_OFF_LENGTH
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
    pad = (-packets["payload_len"]) % 4
    ext = OPCODE_EXT_LEN[packets["opcode"]]
    return prefix_len + BTH_LEN + ext + packets["payload_len"] + pad + ICRC_LEN


@njit(**JIT, inline="always")
def _put(buf, at, value, size):
    for k in range(size):
        buf[at + k] = (value >> (8 * (size - 1 - k))) & 0xFF


@njit(**JIT)
def _encode(packets, routes, ipv6_family, arena, out, offsets, lengths):
    prefix = routes.shape[1]
    l3 = prefix - UDP_LEN - (IPV6_LEN if ipv6_family else IPV4_LEN)
    l4 = prefix - UDP_LEN
    for i in range(packets.shape[0]):
        p = packets[i]
        o = offsets[i]
        n = lengths[i]
        out[o:o + prefix] = routes[p.route]
        udp_len = n - l4
        if ipv6_family:
            _put(out, o + l3 + IPV6_OFF_PAYLOAD_LENGTH, udp_len, 2)
        else:
            _put(out, o + l3 + IPV4_OFF_TOTAL_LENGTH, n - l3, 2)
            total = 0
            for k in range(0, IPV4_LEN, 2):
                if k != IPV4_OFF_CHECKSUM:
                    total += (out[o + l3 + k] << 8) | out[o + l3 + k + 1]
            while total >> 16:
                total = (total & 0xFFFF) + (total >> 16)
            _put(out, o + l3 + IPV4_OFF_CHECKSUM, ~total & 0xFFFF, 2)
        _put(out, o + l4 + UDP_OFF_LENGTH, udp_len, 2)
        b = o + prefix
        pad = (-p.payload_len) % 4
        out[b + BTH_OFF_OPCODE] = p.opcode
        out[b + BTH_OFF_SE] = (pad << BTH_PADCNT_SHIFT) | (0 << BTH_TVER_SHIFT)
        _put(out, b + BTH_OFF_PKEY, 0xFFFF, 2)
        _put(out, b + BTH_OFF_DESTQP, p.dest_qpn & 0xFFFFFF, 4)
        _put(out, b + BTH_OFF_PSN, (p.ackreq << 31) | (p.psn & 0xFFFFFF), 4)
        e = b + BTH_LEN
        if OPCODE_RETH_OFF[p.opcode] >= 0:
            r = e + OPCODE_RETH_OFF[p.opcode]
            _put(out, r + RETH_OFF_VA, p.reth_va, 8)
            _put(out, r + RETH_OFF_RKEY, p.reth_rkey, 4)
            _put(out, r + RETH_OFF_DMA_LENGTH, p.reth_len, 4)
        if OPCODE_IMMDT_OFF[p.opcode] >= 0:
            _put(out, e + OPCODE_IMMDT_OFF[p.opcode] + IMMDT_OFF_IMM, p.imm, 4)
        if OPCODE_DETH_OFF[p.opcode] >= 0:
            _put(out, e + OPCODE_DETH_OFF[p.opcode] + DETH_OFF_QKEY, GSI_QKEY, 4)
            _put(out, e + OPCODE_DETH_OFF[p.opcode] + DETH_OFF_SRCQP, 1, 4)
        if OPCODE_AETH_OFF[p.opcode] >= 0:
            _put(out, e + OPCODE_AETH_OFF[p.opcode] + AETH_OFF_SYNDROME, p.aeth, 4)
        d = e + OPCODE_EXT_LEN[p.opcode]
        out[d:d + p.payload_len] = arena[p.payload_off:p.payload_off + p.payload_len]
        out[d + p.payload_len:d + p.payload_len + pad] = 0
        crc = icrc_frame(out, o + l3, ipv6_family, o + n)
        for k in range(ICRC_LEN):
            out[o + n - ICRC_LEN + k] = (crc >> (8 * k)) & 0xFF
        if p.corrupt:
            # Damage after the CRC: the last payload byte (or the ICRC itself when empty).
            out[o + n - ICRC_LEN - 1 - pad if p.payload_len else o + n - 1] ^= 0x01


def encode_frames(packets: np.ndarray, routes: Routes, arena: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Encode ``packets`` (PACKET_DTYPE) into one contiguous buffer.

    Returns ``(data uint8[total], offsets int64[n], lengths int32[n])``.
    """
    table = routes.table()
    lengths = frame_lengths(packets, table.shape[1]).astype(np.int64)
    offsets = np.zeros(len(packets), np.int64)
    np.cumsum(lengths[:-1], out=offsets[1:])
    data = np.empty(int(lengths.sum()), np.uint8)
    if len(packets):
        _encode(packets, table, routes.ipv6, arena, data, offsets, lengths)
    return data, offsets, lengths.astype(np.int32)
