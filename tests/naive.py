"""Slow, obviously correct reference implementations that the fast paths must equal.

Everything here is written from the specifications (pcap/pcapng, IEEE 802.3/802.1Q, IPv4,
IPv6, UDP, IBTA Vol 1 §9 and Annex A17 for RoCEv2) and NCCL's CUDA source (v2.19.3-1),
one byte, one element or one GPU lane at a time, with nothing imported from the packages
it checks. Speed is irrelevant; clarity is the point.
"""

from __future__ import annotations

import ipaddress
import struct
import zlib
from fractions import Fraction

# ----------------------------------------------------------------------------------------
# Capture files: classic pcap (µs or ns) and pcapng (EPB, SPB).
# ----------------------------------------------------------------------------------------

LINKTYPE_ETHERNET = 1


def read_capture(path) -> list[tuple[int, bytes]]:
    """``[(timestamp_ns, frame bytes)]`` of every Ethernet frame in a pcap or pcapng file."""
    blob = open(path, "rb").read()
    magic = blob[:4]
    if magic == b"\x0a\x0d\x0d\x0a":
        return _read_pcapng(blob)
    for endian in "<>":
        (m,) = struct.unpack(endian + "I", magic)
        if m in (0xA1B2C3D4, 0xA1B23C4D):
            return _read_pcap(blob, endian, 1000 if m == 0xA1B2C3D4 else 1)
    raise ValueError(f"{path}: neither pcap nor pcapng (magic {magic.hex()})")


def _read_pcap(blob: bytes, e: str, ns_per_tick: int) -> list[tuple[int, bytes]]:
    linktype = struct.unpack(e + "I", blob[20:24])[0]
    if linktype != LINKTYPE_ETHERNET:
        raise ValueError(f"link type {linktype} is not Ethernet")
    frames, pos = [], 24
    while pos + 16 <= len(blob):
        sec, frac, incl, _orig = struct.unpack(e + "IIII", blob[pos:pos + 16])
        frames.append((sec * 1_000_000_000 + frac * ns_per_tick, blob[pos + 16:pos + 16 + incl]))
        pos += 16 + incl
    return frames


def _read_pcapng(blob: bytes) -> list[tuple[int, bytes]]:
    frames, pos, e = [], 0, "<"
    interfaces: list[tuple[int, int]] = []   # (linktype, ns per timestamp tick or -divisor)
    while pos + 12 <= len(blob):
        if blob[pos:pos + 4] == b"\x0a\x0d\x0d\x0a":   # section header: byte order may change
            e = "<" if struct.unpack("<I", blob[pos + 8:pos + 12])[0] == 0x1A2B3C4D else ">"
            interfaces = []
        btype, blen = struct.unpack(e + "II", blob[pos:pos + 8])
        body = blob[pos + 8:pos + blen - 4]
        if btype == 1:                                    # interface description
            linktype, _, _snap = struct.unpack(e + "HHI", body[:8])
            interfaces.append((linktype, _tsresol(body[8:], e)))
        elif btype == 6:                                  # enhanced packet
            iface, hi, lo, caplen, _orig = struct.unpack(e + "IIIII", body[:20])
            linktype, resol = interfaces[iface]
            if linktype != LINKTYPE_ETHERNET:
                raise ValueError(f"interface {iface} has link type {linktype}, not Ethernet")
            frames.append((_ns((hi << 32) | lo, resol), body[20:20 + caplen]))
        elif btype == 3:                                  # simple packet (no timestamp)
            (orig,) = struct.unpack(e + "I", body[:4])
            frames.append((0, body[4:4 + orig]))
        pos += blen
    return frames


def _tsresol(options: bytes, e: str) -> int:
    """The if_tsresol option as a power: 6 (µs, the default) or 9 (ns); -p for 2^-p."""
    pos = 0
    while pos + 4 <= len(options):
        code, length = struct.unpack(e + "HH", options[pos:pos + 4])
        if code == 0:
            break
        if code == 9:
            v = options[pos + 4]
            return -(v & 0x7F) if v & 0x80 else v
        pos += 4 + length + (-length % 4)
    return 6


def _ns(ticks: int, resol: int) -> int:
    if resol < 0:
        return ticks * 1_000_000_000 >> -resol
    return ticks * 10 ** 9 // 10 ** resol


# ----------------------------------------------------------------------------------------
# RoCEv2 frames
# ----------------------------------------------------------------------------------------

ROCE_PORT = 4791
VLAN_TPIDS = (0x8100, 0x88A8, 0x9100)

# IBTA Vol 1 §9.2 table 38: the extended headers each opcode carries after the BTH, and
# whether it carries a payload. RC (0x00-0x1F) and UC (0x20-0x3F, same numbering) writes,
# sends and acknowledgements; UD (0x60-0x7F) sends; 0x81 the RoCEv2 CNP (Annex A17.9.3).
_RC = {
    0x00: ((), True), 0x01: ((), True), 0x02: ((), True), 0x03: (("immdt",), True),
    0x04: ((), True), 0x05: (("immdt",), True),
    0x06: (("reth",), True), 0x07: ((), True), 0x08: ((), True), 0x09: (("immdt",), True),
    0x0A: (("reth",), True), 0x0B: (("reth", "immdt"), True),
    0x0C: (("reth",), False), 0x0D: (("aeth",), True), 0x0E: ((), True), 0x0F: (("aeth",), True),
    0x10: (("aeth",), True), 0x11: (("aeth",), False), 0x12: (("aeth", "atomicacketh"), False),
    0x13: (("atomiceth",), False), 0x14: (("atomiceth",), False),
    0x16: (("ieth",), True), 0x17: (("ieth",), True),
}
OPCODES = dict(_RC)
OPCODES.update({0x20 + op: v for op, v in _RC.items() if op <= 0x0B})
OPCODES.update({0x64: (("deth",), True), 0x65: (("deth", "immdt"), True), 0x81: ((), True)})
EXT_BYTES = {"reth": 16, "immdt": 4, "aeth": 4, "deth": 8, "ieth": 4, "atomiceth": 28, "atomicacketh": 8}


def decode_frame(frame: bytes) -> tuple[dict | None, str | None]:
    """Decode one Ethernet frame as RoCEv2: ``(fields, None)`` or ``(None, reason)``."""
    f: dict = {}
    if len(frame) < 14:
        return None, "eth.truncated"
    f["eth_dst"], f["eth_src"] = frame[0:6].hex(":"), frame[6:12].hex(":")
    pos, (ethertype,) = 12, struct.unpack("!H", frame[12:14])
    f["vlans"] = []
    while ethertype in VLAN_TPIDS:
        if len(frame) < pos + 6:
            return None, "vlan.truncated"
        (tci, ethertype) = struct.unpack("!HH", frame[pos + 2:pos + 6])
        f["vlans"].append(tci & 0x0FFF)
        pos += 4
    pos += 2
    if ethertype == 0x0800:
        ip, reason = _ipv4(frame, pos)
    elif ethertype == 0x86DD:
        ip, reason = _ipv6(frame, pos)
    else:
        return None, "eth.not_ip"
    if ip is None:
        return None, reason
    f.update(ip)
    if f["ip_proto"] != 17:
        return None, "ip.not_udp"
    udp = f["l4_start"]
    end = f["ip_end"]
    if end - udp < 8:
        return None, "udp.truncated"
    f["udp_sport"], f["udp_dport"], ulen, f["udp_checksum"] = struct.unpack("!HHHH", frame[udp:udp + 8])
    if f["udp_dport"] != ROCE_PORT:
        return None, "udp.not_roce"
    if ulen < 8 or udp + ulen > end:
        return None, "udp.bad_length"
    end = udp + ulen
    bth = udp + 8
    if end - bth < 12 + 4:
        return None, "bth.truncated"
    opcode, flags, pkey, resv8, qp_hi, qp_lo, ack, psn_hi, psn_lo = struct.unpack(
        "!BBHBBHBBH", frame[bth:bth + 12])
    f.update(opcode=opcode, se=flags >> 7, m=(flags >> 6) & 1, padcnt=(flags >> 4) & 3, tver=flags & 15,
             pkey=pkey, resv8=resv8, dest_qp=(qp_hi << 16) | qp_lo, ackreq=ack >> 7, resv7=ack & 0x7F,
             psn=(psn_hi << 16) | psn_lo)
    if opcode not in OPCODES:
        return None, "bth.unknown_opcode"
    exts, has_payload = OPCODES[opcode]
    pos = bth + 12
    for ext in exts:
        n = EXT_BYTES[ext]
        if end - 4 - pos < n:
            return None, f"{ext}.truncated"
        _ext(f, ext, frame[pos:pos + n])
        pos += n
    payload_end = end - 4 - f["padcnt"]
    if payload_end < pos or (not has_payload and payload_end != pos):
        return None, "payload.bad_length"
    f["payload"] = frame[pos:payload_end]
    f["icrc"] = struct.unpack("<I", frame[end - 4:end])[0]
    f["icrc_computed"] = icrc(frame, f["l3_start"], f["ip_version"], end - 4)
    f["icrc_ok"] = f["icrc"] == f["icrc_computed"]
    return f, None


def _ipv4(frame: bytes, pos: int):
    if len(frame) < pos + 20:
        return None, "ipv4.truncated"
    vihl, tos, total, ident, frag, ttl, proto, csum = struct.unpack("!BBHHHBBH", frame[pos:pos + 12])
    ihl = (vihl & 15) * 4
    if vihl >> 4 != 4 or ihl < 20 or total < ihl or len(frame) < pos + total:
        return None, "ipv4.bad_header"
    if frag & 0x3FFF:   # MF set or a fragment offset: not a whole UDP datagram
        return None, "ipv4.fragment"
    return dict(ip_version=4, ip_src=str(ipaddress.IPv4Address(frame[pos + 12:pos + 16])),
                ip_dst=str(ipaddress.IPv4Address(frame[pos + 16:pos + 20])), ip_tos=tos, ip_ttl=ttl,
                ip_id=ident, ip_proto=proto, ip_checksum=csum, l3_start=pos, l4_start=pos + ihl,
                ip_end=pos + total), None


def _ipv6(frame: bytes, pos: int):
    if len(frame) < pos + 40:
        return None, "ipv6.truncated"
    vtf, plen, nxt, hlim = struct.unpack("!IHBB", frame[pos:pos + 8])
    if vtf >> 28 != 6 or len(frame) < pos + 40 + plen:
        return None, "ipv6.bad_header"
    return dict(ip_version=6, ip_src=str(ipaddress.IPv6Address(frame[pos + 8:pos + 24])),
                ip_dst=str(ipaddress.IPv6Address(frame[pos + 24:pos + 40])),
                ip_traffic_class=(vtf >> 20) & 0xFF, ip_flow_label=vtf & 0xFFFFF, ip_hop_limit=hlim,
                ip_proto=nxt, l3_start=pos, l4_start=pos + 40, ip_end=pos + 40 + plen), None


def _ext(f: dict, ext: str, b: bytes) -> None:
    if ext == "reth":
        f["reth_va"], f["reth_rkey"], f["reth_dma_len"] = struct.unpack("!QII", b)
    elif ext == "immdt":
        f["immdt_raw"] = b
        f["immdt_be"], f["immdt_le"] = struct.unpack("!I", b)[0], struct.unpack("<I", b)[0]
    elif ext == "aeth":
        (word,) = struct.unpack("!I", b)
        f["aeth_syndrome"], f["aeth_msn"] = word >> 24, word & 0xFFFFFF
    elif ext == "deth":
        f["deth_qkey"], src = struct.unpack("!II", b)
        f["deth_src_qp"] = src & 0xFFFFFF
    else:
        f[ext] = b


def icrc(frame: bytes, l3: int, version: int, end: int) -> int:
    """RoCEv2 ICRC (IBTA Annex A17.4.2): CRC-32 over 8 bytes of 0xFF (the masked LRH), the IP
    header with its variant fields set to ones, the UDP header with the checksum set to
    ones, the BTH with its resv8 byte set to ones, and everything after it up to ``end``."""
    ip = bytearray(frame[l3:])
    if version == 4:
        ihl = (ip[0] & 15) * 4
        ip[1] = 0xFF                      # type of service
        ip[8] = 0xFF                      # time to live
        ip[10:12] = b"\xff\xff"           # header checksum
        udp = ihl
    else:
        ip[0] |= 0x0F                     # traffic class (low nibble of byte 0, then byte 1)...
        ip[1:4] = b"\xff\xff\xff"         # ...and the flow label
        ip[7] = 0xFF                      # hop limit
        udp = 40
    ip[udp + 6:udp + 8] = b"\xff\xff"     # UDP checksum
    ip[udp + 8 + 4] = 0xFF                # BTH resv8
    return zlib.crc32(b"\xff" * 8 + bytes(ip[:end - l3])) & 0xFFFFFFFF


# IBTA Vol 1 §9.2 table 38: the RC (0x06-0x0B) and UC (0x26-0x2B) RDMA WRITE opcodes, first to
# only with immediate.
RDMA_WRITES = frozenset(range(0x06, 0x0C)) | frozenset(range(0x26, 0x2C))


def address16(address: str) -> bytes:
    """An address as 16 bytes: IPv6 as is, IPv4 mapped (``::ffff:a.b.c.d``, RFC 4291 §2.5.5.2)."""
    ip = ipaddress.ip_address(address)
    return ip.packed if ip.version == 6 else bytes(10) + b"\xff\xff" + ip.packed


def write_between(fields: dict | None, pairs: list[tuple[str, str]], icrc_checked: bool = True) -> int:
    """The index in ``pairs`` (source address, destination address) of the pair that a frame
    decoded by :func:`decode_frame` is an RDMA WRITE between; -1 when it is not a whole RoCEv2
    write (a bad ICRC too, when ``icrc_checked``) or between none of them. Addresses compare in
    their 16-byte form, an IPv4 pair's as its mapped IPv6 addresses."""
    if fields is None or fields["opcode"] not in RDMA_WRITES or (icrc_checked and not fields["icrc_ok"]):
        return -1
    ends = address16(fields["ip_src"]) + address16(fields["ip_dst"])
    return next((i for i, (src, dst) in enumerate(pairs) if ends == address16(src) + address16(dst)), -1)


def write_flow(fields: dict | None, flows: list[tuple[int, str, str]], icrc_checked: bool = True) -> int:
    """The index in ``flows`` (destination QPN, source address, destination address) of the
    flow that a frame is an RDMA WRITE of (as :func:`write_between`, and the QPN); -1 if none."""
    for i, (qpn, src, dst) in enumerate(flows):
        if write_between(fields, [(src, dst)], icrc_checked) == 0 and fields["dest_qp"] == qpn:
            return i
    return -1


# ----------------------------------------------------------------------------------------
# Protocol payloads (NCCL v2.19.3-1)
# ----------------------------------------------------------------------------------------

def decode_simple(payload: bytes) -> tuple[bytes, list[int]]:
    return bytes(payload), []


def decode_ll(payload: bytes) -> tuple[bytes, list[int]]:
    """LL: ``data1 flag1 data2 flag2`` per 16-byte line (prims_ll.h ``storeLL``).

    Returns the 8 data bytes of every line, concatenated, and the line flags; raises if a
    line's two flags differ or the payload is not whole lines."""
    if len(payload) % 16:
        raise ValueError(f"LL payload of {len(payload)} bytes is not whole 16-byte lines")
    data, flags = bytearray(), []
    for pos in range(0, len(payload), 16):
        d1, f1, d2, f2 = struct.unpack("<IIII", payload[pos:pos + 16])
        if f1 != f2:
            raise ValueError(f"LL line {pos // 16}: flags {f1:#x} and {f2:#x} differ")
        data += struct.pack("<II", d1, d2)
        flags.append(f1)
    return bytes(data), flags


WARP = 32


def _lane_blocks(wid: int) -> list[tuple[int, int]]:
    """(g, 16-byte block index) each lane loads in loadRegsBegin (prims_ll128.h)."""
    flag_thread = wid % 8 == 7
    out = []
    for g in range(4):
        ix = g * WARP - 4 * (g // 2) + wid - (g % 2) * (wid // 8)
        if not flag_thread or g % 2 == 0:
            out.append((g, ix))
    return out


def ll128_encode_slice(data_words: list[int | None], flag: int) -> list[int]:
    """One warp's LL128 slice: 240 data words (``None`` = past the data, not loaded) to 256
    wire words, lane by lane as loadRegsBegin, loadRegsFinish and recvReduceSendCopy do."""
    wire = [None] * 256
    for wid in range(WARP):
        flag_thread = wid % 8 == 7
        regs = [0] * 8   # never-loaded registers: NCCL leaves them stale, we use zero
        for g, ix in _lane_blocks(wid):
            if data_words[2 * ix] is not None:
                regs[2 * g], regs[2 * g + 1] = data_words[2 * ix], data_words[2 * ix + 1]
        for g in (1, 3):            # loadRegsFinish
            if flag_thread:
                regs[2 * g] = regs[2 * g - 1]
        for u in (0, 2, 4, 6):      # store128(ptr + u*WARP_SIZE, v[u], flagThread ? flag : v[u+1])
            wire[u * WARP + 2 * wid] = regs[u]
            wire[u * WARP + 2 * wid + 1] = flag if flag_thread else regs[u + 1]
    return wire


def ll128_decode_slice(wire: list[int]) -> tuple[list[int], list[int]]:
    """The receiving warp: load128 of each lane's pairs, storeRegs' inverse of loadRegsFinish,
    then each lane's blocks back to data order. Returns (240 data words, 16 line flags)."""
    data = [None] * 240
    for wid in range(WARP):
        flag_thread = wid % 8 == 7
        regs = [0] * 8
        for u in (0, 2, 4, 6):
            regs[u], regs[u + 1] = wire[u * WARP + 2 * wid], wire[u * WARP + 2 * wid + 1]
        for g in (1, 3):            # storeRegs: regs[2g-1] = regs[2g] on flag threads
            if flag_thread:
                regs[2 * g - 1] = regs[2 * g]
        for g, ix in _lane_blocks(wid):
            data[2 * ix], data[2 * ix + 1] = regs[2 * g], regs[2 * g + 1]
    flags = [wire[16 * line + 15] for line in range(16)]
    return data, flags


def decode_ll128(payload: bytes) -> tuple[bytes, list[int]]:
    """LL128: every 2048-byte warp slice back to its 1920 data bytes; returns the data of all
    slices concatenated and the flag of every 128-byte line."""
    if len(payload) % 2048:
        raise ValueError(f"LL128 payload of {len(payload)} bytes is not whole 2048-byte slices")
    data, flags = bytearray(), []
    for pos in range(0, len(payload), 2048):
        words = list(struct.unpack("<256Q", payload[pos:pos + 2048]))
        d, fl = ll128_decode_slice(words)
        data += struct.pack("<240Q", *d)
        flags += fl
    return bytes(data), flags


def encode_ll128(data: bytes, flag: int) -> bytes:
    """The slow twin of the LL128 encoder: 1920-byte slices through :func:`ll128_encode_slice`."""
    out = bytearray()
    for pos in range(0, len(data), 1920):
        chunk = data[pos:pos + 1920]
        words: list[int | None] = []
        for w in range(240):
            block = chunk[16 * (w // 2):16 * (w // 2) + 16]
            if not block:
                words.append(None)          # a block past the end of the data: not loaded
            else:
                half = (block + bytes(16))[8 * (w % 2):8 * (w % 2) + 8]
                words.append(struct.unpack("<Q", half)[0])
        out += struct.pack("<256Q", *ll128_encode_slice(words, flag))
    return bytes(out)


# ----------------------------------------------------------------------------------------
# Floating-point addition, exactly: rational sum, rounded once to nearest even.
# ----------------------------------------------------------------------------------------

FORMATS = {"fp32": (8, 23), "fp16": (5, 10), "bf16": (8, 7)}   # exponent bits, fraction bits


def to_fraction(bits: int, fmt: str):
    """``(sign, value)``: value a Fraction, or ``"inf"``/``"nan"``."""
    eb, fb = FORMATS[fmt]
    sign = bits >> (eb + fb)
    exp = (bits >> fb) & ((1 << eb) - 1)
    frac = bits & ((1 << fb) - 1)
    bias = (1 << (eb - 1)) - 1
    if exp == (1 << eb) - 1:
        return sign, ("nan" if frac else "inf")
    if exp == 0:
        value = Fraction(frac) * Fraction(2) ** (1 - bias - fb)
    else:
        value = Fraction(frac + (1 << fb)) * Fraction(2) ** (exp - bias - fb)
    return sign, (-value if sign else value)


def from_fraction(q: Fraction, fmt: str) -> int:
    """The bits of ``q`` rounded to nearest, ties to even, in format ``fmt`` (q != 0)."""
    eb, fb = FORMATS[fmt]
    bias = (1 << (eb - 1)) - 1
    sign = 1 if q < 0 else 0
    a = abs(q)
    e = a.numerator.bit_length() - a.denominator.bit_length()
    if Fraction(2) ** e > a:
        e -= 1
    e = max(e, 1 - bias)                       # below the normal range: subnormal spacing
    scaled = a / Fraction(2) ** (e - fb)       # significand in units of the last place
    n = scaled.numerator // scaled.denominator
    rest = scaled - n
    if rest > Fraction(1, 2) or (rest == Fraction(1, 2) and n % 2):
        n += 1
    if n == 1 << (fb + 1):                     # rounding carried into the next binade
        n, e = n >> 1, e + 1
    if e > bias:                               # overflow: infinity
        return (sign << (eb + fb)) | (((1 << eb) - 1) << fb)
    if n < 1 << fb:                            # subnormal (or zero)
        return (sign << (eb + fb)) | n
    return (sign << (eb + fb)) | ((e + bias) << fb) | (n - (1 << fb))


def add(a: int, b: int, fmt: str) -> int:
    """IEEE 754 addition of two bit patterns in ``fmt``, correctly rounded."""
    eb, fb = FORMATS[fmt]
    (sa, va), (sb, vb) = to_fraction(a, fmt), to_fraction(b, fmt)
    quiet_nan = (((1 << eb) - 1) << fb) | (1 << (fb - 1))
    if "nan" in (va, vb) or (va == "inf" and vb == "inf" and sa != sb):
        return quiet_nan
    if va == "inf" or vb == "inf":
        return a if va == "inf" else b
    total = va + vb
    if total == 0:                             # exact zero: -0 only from (-0) + (-0)
        return (1 << (eb + fb)) if (sa and sb and va == 0 and vb == 0) else 0
    return from_fraction(total, fmt)


# ----------------------------------------------------------------------------------------
# The ring allreduce, one rank buffer per position, runRing step by step.
# ----------------------------------------------------------------------------------------

def ring_allreduce(inputs: list[list[int]], sends: dict, fmt: str):
    """Walk NCCL's runRing (src/device/all_reduce.h) over ``n`` rank buffers.

    ``inputs[p]`` are position ``p``'s element bit patterns; ``sends[(p, s)]`` lists the
    ``(offset, nelem)`` element ranges position ``p`` sends at ring step ``s``. Returns
    ``(sent, final)``: ``sent[s][i]`` the bits sent for element ``i`` at step ``s`` and
    ``final[p]`` position ``p``'s buffer after the call.
    """
    n, count = len(inputs), len(inputs[0])
    buf = [list(row) for row in inputs]
    sent = [[None] * count for _ in range(2 * (n - 1))]
    inbox: dict = {}                            # (receiver, offset) -> values in flight
    for s in range(2 * (n - 1)):
        arriving = {}
        for p in range(n):
            for off, k in sends.get((p, s), ()):
                if s == 0:                                      # prims.send
                    vals = [buf[p][off + j] for j in range(k)]
                else:
                    got = inbox.pop((p, off))
                    if s < n - 1:                               # recvReduceSend
                        vals = [add(got[j], buf[p][off + j], fmt) for j in range(k)]
                    elif s == n - 1:                            # directRecvReduceCopySend
                        vals = [add(got[j], buf[p][off + j], fmt) for j in range(k)]
                        buf[p][off:off + k] = vals
                    else:                                       # directRecvCopySend
                        vals = got
                        buf[p][off:off + k] = vals
                arriving[((p + 1) % n, off)] = vals
                for j in range(k):
                    sent[s][off + j] = vals[j]
        inbox = arriving
    for (p, off), vals in inbox.items():                        # final directRecv
        buf[p][off:off + len(vals)] = vals
    return sent, buf
