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

# Derived from the IPV4 table above and written out so that readers and linters see
# them; tests/wire/test_headers.py holds them equal to IPV4.constants().
IPV4_LEN = 20
IPV4_OFF_VERSION = 0
IPV4_SIZE_VERSION = 1
IPV4_VERSION_MASK = 0xf0
IPV4_VERSION_SHIFT = 4
IPV4_OFF_IHL = 0
IPV4_SIZE_IHL = 1
IPV4_IHL_MASK = 0xf
IPV4_IHL_SHIFT = 0
IPV4_OFF_DSCP = 1
IPV4_SIZE_DSCP = 1
IPV4_DSCP_MASK = 0xfc
IPV4_DSCP_SHIFT = 2
IPV4_OFF_ECN = 1
IPV4_SIZE_ECN = 1
IPV4_ECN_MASK = 0x3
IPV4_ECN_SHIFT = 0
IPV4_OFF_TOTAL_LENGTH = 2
IPV4_SIZE_TOTAL_LENGTH = 2
IPV4_TOTAL_LENGTH_MASK = 0xffff
IPV4_TOTAL_LENGTH_SHIFT = 0
IPV4_OFF_IDENT = 4
IPV4_SIZE_IDENT = 2
IPV4_IDENT_MASK = 0xffff
IPV4_IDENT_SHIFT = 0
IPV4_OFF_FLAGS = 6
IPV4_SIZE_FLAGS = 2
IPV4_FLAGS_MASK = 0xe000
IPV4_FLAGS_SHIFT = 13
IPV4_OFF_FRAG_OFFSET = 6
IPV4_SIZE_FRAG_OFFSET = 2
IPV4_FRAG_OFFSET_MASK = 0x1fff
IPV4_FRAG_OFFSET_SHIFT = 0
IPV4_OFF_TTL = 8
IPV4_SIZE_TTL = 1
IPV4_TTL_MASK = 0xff
IPV4_TTL_SHIFT = 0
IPV4_OFF_PROTO = 9
IPV4_SIZE_PROTO = 1
IPV4_PROTO_MASK = 0xff
IPV4_PROTO_SHIFT = 0
IPV4_OFF_CHECKSUM = 10
IPV4_SIZE_CHECKSUM = 2
IPV4_CHECKSUM_MASK = 0xffff
IPV4_CHECKSUM_SHIFT = 0
IPV4_OFF_SRC = 12
IPV4_SIZE_SRC = 4
IPV4_OFF_DST = 16
IPV4_SIZE_DST = 4


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
