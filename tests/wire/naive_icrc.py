"""Slow, obviously correct ICRC: zlib.crc32 over a masked copy of the packet.

Offsets are written out from the specifications (RFC 791, RFC 8200, RFC 768, IBTA §9.2),
independently of ``gradtap.wire.headers``, so the twin also checks the derived constants.
"""

import struct
import zlib


def naive_icrc(frame: bytes) -> int:
    """ICRC of the RoCEv2 packet in an Ethernet frame (optionally VLAN-tagged)."""
    l3 = 14
    ethertype = struct.unpack_from("!H", frame, 12)[0]
    while ethertype in (0x8100, 0x88A8):
        ethertype = struct.unpack_from("!H", frame, l3 + 2)[0]
        l3 += 4
    packet = bytearray(frame[l3:])
    if ethertype == 0x0800:
        ip_len = (packet[0] & 0x0F) * 4
        packet[1] = 0xFF  # TOS: DSCP + ECN
        packet[8] = 0xFF  # TTL
        packet[10:12] = b"\xff\xff"  # header checksum
    else:
        ip_len = 40
        packet[0] |= 0x0F  # low nibble: top of the traffic class
        packet[1:4] = b"\xff\xff\xff"  # rest of the traffic class, flow label
        packet[7] = 0xFF  # hop limit
    udp_len = struct.unpack_from("!H", packet, ip_len + 4)[0]
    packet[ip_len + 6:ip_len + 8] = b"\xff\xff"  # UDP checksum
    packet[ip_len + 8 + 4] = 0xFF  # BTH byte 4: FECN, BECN, reserved
    end = ip_len + udp_len - 4  # the ICRC itself is not covered
    return zlib.crc32(b"\xff" * 8 + bytes(packet[:end]))
