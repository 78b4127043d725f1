"""IPv4 header, RFC 791 §3.1 (TOS byte split per RFC 2474 §3 / RFC 3168 §5 into DSCP+ECN).

``pack`` fills in the header checksum (RFC 791 §3.1, RFC 1071) unless one is given. Options
are not declared: ``ihl`` says how long the header really is (``ihl * 4`` bytes).
"""

from gradtap.wire.headers.layout import Bits, Layout

IPPROTO_UDP = 17

IPV4 = Layout("IPV4", "RFC 791 §3.1; DSCP/ECN per RFC 2474 §3 and RFC 3168 §5", (
    (Bits(("version", 4), ("ihl", 4)), "B", 0x45),
    (Bits(("dscp", 6), ("ecn", 2)), "B", 0),
    ("total_length", "H", 20),
    ("ident", "H", 0),
    (Bits(("flags", 3), ("frag_offset", 13)), "H", 0),
    ("ttl", "B", 64),
    ("proto", "B", IPPROTO_UDP),
    ("checksum", "H", 0),
    ("src", "4s", b"\x00" * 4),
    ("dst", "4s", b"\x00" * 4),
))

globals().update(IPV4.constants())


def checksum(header: bytes) -> int:
    """RFC 1071 ones'-complement sum of ``header`` (with its checksum field zero)."""
    total = sum(int.from_bytes(header[i:i + 2], "big") for i in range(0, len(header), 2))
    while total >> 16:
        total = (total & 0xFFFF) + (total >> 16)
    return ~total & 0xFFFF


def pack(**fields) -> bytes:
    """The 20-byte header; ``checksum`` is computed when not given."""
    if "checksum" in fields:
        return IPV4.pack(**fields)
    raw = IPV4.pack(**fields)
    return IPV4.pack(**fields, checksum=checksum(raw))


unpack = IPV4.unpack
