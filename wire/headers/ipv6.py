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

globals().update(IPV6.constants())

pack = IPV6.pack
unpack = IPV6.unpack
