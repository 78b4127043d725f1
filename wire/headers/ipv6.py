"""IPv6 fixed header, RFC 8200 §3 (traffic class split per RFC 2474 §3 / RFC 3168 §5).

RoCEv2 over IPv6 puts UDP directly after this header (next header 17); extension headers
are not declared here.
"""

from gradtap.wire.headers.layout import Bits, Layout

IPV6 = Layout("IPV6", "RFC 8200 §3; traffic class = DSCP/ECN per RFC 2474 §3, RFC 3168 §5", (
    (Bits(("version", 4), ("dscp", 6), ("ecn", 2), ("flow_label", 20)), "I", 0x6000_0000),
    ("payload_length", "H", 0),
    ("next_header", "B", 17),
    ("hop_limit", "B", 64),
    ("src", "16s", b"\x00" * 16),
    ("dst", "16s", b"\x00" * 16),
))

# Derived from the IPV6 table above and written out so that readers and linters see
# them; tests/wire/test_headers.py holds them equal to IPV6.constants().
IPV6_LEN = 40
IPV6_OFF_VERSION = 0
IPV6_SIZE_VERSION = 4
IPV6_VERSION_MASK = 0xf0000000
IPV6_VERSION_SHIFT = 28
IPV6_OFF_DSCP = 0
IPV6_SIZE_DSCP = 4
IPV6_DSCP_MASK = 0xfc00000
IPV6_DSCP_SHIFT = 22
IPV6_OFF_ECN = 0
IPV6_SIZE_ECN = 4
IPV6_ECN_MASK = 0x300000
IPV6_ECN_SHIFT = 20
IPV6_OFF_FLOW_LABEL = 0
IPV6_SIZE_FLOW_LABEL = 4
IPV6_FLOW_LABEL_MASK = 0xfffff
IPV6_FLOW_LABEL_SHIFT = 0
IPV6_OFF_PAYLOAD_LENGTH = 4
IPV6_SIZE_PAYLOAD_LENGTH = 2
IPV6_PAYLOAD_LENGTH_MASK = 0xffff
IPV6_PAYLOAD_LENGTH_SHIFT = 0
IPV6_OFF_NEXT_HEADER = 6
IPV6_SIZE_NEXT_HEADER = 1
IPV6_NEXT_HEADER_MASK = 0xff
IPV6_NEXT_HEADER_SHIFT = 0
IPV6_OFF_HOP_LIMIT = 7
IPV6_SIZE_HOP_LIMIT = 1
IPV6_HOP_LIMIT_MASK = 0xff
IPV6_HOP_LIMIT_SHIFT = 0
IPV6_OFF_SRC = 8
IPV6_SIZE_SRC = 16
IPV6_OFF_DST = 24
IPV6_SIZE_DST = 16

pack = IPV6.pack
unpack = IPV6.unpack
