"""UDP header, RFC 768; RoCEv2's well-known destination port, IBTA Annex A17 (RoCEv2)."""

from gradtap.wire.headers.layout import Layout

ROCEV2_UDP_PORT = 4791

UDP = Layout("UDP", "RFC 768", (
    ("sport", "H", 0),
    ("dport", "H", ROCEV2_UDP_PORT),
    ("length", "H", 8),
    ("checksum", "H", 0),
))

globals().update(UDP.constants())

pack = UDP.pack
unpack = UDP.unpack
