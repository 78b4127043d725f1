"""UDP header, RFC 768; RoCEv2's well-known destination port, IBTA Annex A17 (RoCEv2)."""

from gradtap.wire.headers.layout import Layout

ROCEV2_UDP_PORT = 4791

UDP = Layout("UDP", "RFC 768", (
    ("sport", "H", 0),
    ("dport", "H", ROCEV2_UDP_PORT),
    ("length", "H", 8),
    ("checksum", "H", 0),
))

# Derived from the UDP table above and written out so that readers and linters see
# them; tests/wire/test_headers.py holds them equal to UDP.constants().
UDP_LEN = 8
UDP_OFF_SPORT = 0
UDP_SIZE_SPORT = 2
UDP_SPORT_MASK = 0xffff
UDP_SPORT_SHIFT = 0
UDP_OFF_DPORT = 2
UDP_SIZE_DPORT = 2
UDP_DPORT_MASK = 0xffff
UDP_DPORT_SHIFT = 0
UDP_OFF_LENGTH = 4
UDP_SIZE_LENGTH = 2
UDP_LENGTH_MASK = 0xffff
UDP_LENGTH_SHIFT = 0
UDP_OFF_CHECKSUM = 6
UDP_SIZE_CHECKSUM = 2
UDP_CHECKSUM_MASK = 0xffff
UDP_CHECKSUM_SHIFT = 0

pack = UDP.pack
unpack = UDP.unpack
