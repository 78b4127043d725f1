"""ERSPAN headers, draft-foschiano-erspan-03 ("ERSPAN Type II Feature Header", "ERSPAN Type
III Feature Header", "Platform Specific SubHeader"), after a GRE header (``wire/headers/gre.py``).

The encapsulated frame follows the ERSPAN header. Which header, if any, comes first:

- **type I**: GRE protocol 0x88BE without the sequence number; no ERSPAN header, the frame
  follows GRE at once (Linux ``erspan_ver 0``; Broadcom Trident 2 per Wireshark's
  ``packet-erspan.c``, which takes type I only when no GRE flag is set at all);
- **type II**: GRE protocol 0x88BE with the sequence number; ``ERSPAN2``, version 1, 8 bytes;
- **type III**: GRE protocol 0x22EB; ``ERSPAN3``, version 2, 12 bytes, then the 8-byte
  ``ERSPAN3_SUBHEADER`` when ``o`` is set. ``ft`` (frame type) 0 is Ethernet, 2 an IP packet.

The 10-bit session id is what a switch's session is configured with (NX-OS ``erspan-id``);
``t`` says the switch truncated the mirrored frame. Field meanings and bit positions agree
with Wireshark's ``packet-erspan.c`` (4.0) and scapy's ``scapy/contrib/erspan.py``.
"""

from gradtap.wire.headers.layout import Bits, Layout

ERSPAN_VERSION_II = 1
ERSPAN_VERSION_III = 2
ERSPAN_FT_ETHERNET = 0
ERSPAN_GRA_100NS = 1      # ERSPAN III ``gra``: the timestamp counts 100 ns (Wireshark's value names)

# The record's ``erspan_type`` (wire/frame_record.py): the ERSPAN type a frame came in.
ERSPAN_NONE, ERSPAN_TYPE_I, ERSPAN_TYPE_II, ERSPAN_TYPE_III = 0, 1, 2, 3

ERSPAN2 = Layout("ERSPAN2", "draft-foschiano-erspan-03, ERSPAN Type II Feature Header", (
    (Bits(("version", 4), ("vlan", 12)), "H", ERSPAN_VERSION_II << 12),
    (Bits(("cos", 3), ("en", 2), ("t", 1), ("session", 10)), "H", 0),
    (Bits(("reserved", 12), ("index", 20)), "I", 0),
))

ERSPAN3 = Layout("ERSPAN3", "draft-foschiano-erspan-03, ERSPAN Type III Feature Header", (
    (Bits(("version", 4), ("vlan", 12)), "H", ERSPAN_VERSION_III << 12),
    (Bits(("cos", 3), ("bso", 2), ("t", 1), ("session", 10)), "H", 0),
    ("timestamp", "I", 0),
    ("sgt", "H", 0),
    (Bits(("p", 1), ("ft", 5), ("hw", 6), ("d", 1), ("gra", 2), ("o", 1)), "H", 0),
))

ERSPAN3_SUBHEADER = Layout("ERSPAN3_SUB", "draft-foschiano-erspan-03, Platform Specific SubHeader", (
    (Bits(("platform_id", 6), ("info", 58)), "Q", 0),
))

# Derived from the ERSPAN2 table above and written out so that readers and linters see
# them; tests/parser/test_erspan_headers.py holds them equal to ERSPAN2.constants().
ERSPAN2_LEN = 8
ERSPAN2_OFF_VERSION = 0
ERSPAN2_SIZE_VERSION = 2
ERSPAN2_VERSION_MASK = 0xf000
ERSPAN2_VERSION_SHIFT = 12
ERSPAN2_OFF_VLAN = 0
ERSPAN2_SIZE_VLAN = 2
ERSPAN2_VLAN_MASK = 0xfff
ERSPAN2_VLAN_SHIFT = 0
ERSPAN2_OFF_COS = 2
ERSPAN2_SIZE_COS = 2
ERSPAN2_COS_MASK = 0xe000
ERSPAN2_COS_SHIFT = 13
ERSPAN2_OFF_EN = 2
ERSPAN2_SIZE_EN = 2
ERSPAN2_EN_MASK = 0x1800
ERSPAN2_EN_SHIFT = 11
ERSPAN2_OFF_T = 2
ERSPAN2_SIZE_T = 2
ERSPAN2_T_MASK = 0x400
ERSPAN2_T_SHIFT = 10
ERSPAN2_OFF_SESSION = 2
ERSPAN2_SIZE_SESSION = 2
ERSPAN2_SESSION_MASK = 0x3ff
ERSPAN2_SESSION_SHIFT = 0
ERSPAN2_OFF_RESERVED = 4
ERSPAN2_SIZE_RESERVED = 4
ERSPAN2_RESERVED_MASK = 0xfff00000
ERSPAN2_RESERVED_SHIFT = 20
ERSPAN2_OFF_INDEX = 4
ERSPAN2_SIZE_INDEX = 4
ERSPAN2_INDEX_MASK = 0xfffff
ERSPAN2_INDEX_SHIFT = 0
# Derived from the ERSPAN3 table above, written out likewise.
ERSPAN3_LEN = 12
ERSPAN3_OFF_VERSION = 0
ERSPAN3_SIZE_VERSION = 2
ERSPAN3_VERSION_MASK = 0xf000
ERSPAN3_VERSION_SHIFT = 12
ERSPAN3_OFF_VLAN = 0
ERSPAN3_SIZE_VLAN = 2
ERSPAN3_VLAN_MASK = 0xfff
ERSPAN3_VLAN_SHIFT = 0
ERSPAN3_OFF_COS = 2
ERSPAN3_SIZE_COS = 2
ERSPAN3_COS_MASK = 0xe000
ERSPAN3_COS_SHIFT = 13
ERSPAN3_OFF_BSO = 2
ERSPAN3_SIZE_BSO = 2
ERSPAN3_BSO_MASK = 0x1800
ERSPAN3_BSO_SHIFT = 11
ERSPAN3_OFF_T = 2
ERSPAN3_SIZE_T = 2
ERSPAN3_T_MASK = 0x400
ERSPAN3_T_SHIFT = 10
ERSPAN3_OFF_SESSION = 2
ERSPAN3_SIZE_SESSION = 2
ERSPAN3_SESSION_MASK = 0x3ff
ERSPAN3_SESSION_SHIFT = 0
ERSPAN3_OFF_TIMESTAMP = 4
ERSPAN3_SIZE_TIMESTAMP = 4
ERSPAN3_TIMESTAMP_MASK = 0xffffffff
ERSPAN3_TIMESTAMP_SHIFT = 0
ERSPAN3_OFF_SGT = 8
ERSPAN3_SIZE_SGT = 2
ERSPAN3_SGT_MASK = 0xffff
ERSPAN3_SGT_SHIFT = 0
ERSPAN3_OFF_P = 10
ERSPAN3_SIZE_P = 2
ERSPAN3_P_MASK = 0x8000
ERSPAN3_P_SHIFT = 15
ERSPAN3_OFF_FT = 10
ERSPAN3_SIZE_FT = 2
ERSPAN3_FT_MASK = 0x7c00
ERSPAN3_FT_SHIFT = 10
ERSPAN3_OFF_HW = 10
ERSPAN3_SIZE_HW = 2
ERSPAN3_HW_MASK = 0x3f0
ERSPAN3_HW_SHIFT = 4
ERSPAN3_OFF_D = 10
ERSPAN3_SIZE_D = 2
ERSPAN3_D_MASK = 0x8
ERSPAN3_D_SHIFT = 3
ERSPAN3_OFF_GRA = 10
ERSPAN3_SIZE_GRA = 2
ERSPAN3_GRA_MASK = 0x6
ERSPAN3_GRA_SHIFT = 1
ERSPAN3_OFF_O = 10
ERSPAN3_SIZE_O = 2
ERSPAN3_O_MASK = 0x1
ERSPAN3_O_SHIFT = 0
# Derived from the ERSPAN3_SUBHEADER table above, written out likewise.
ERSPAN3_SUB_LEN = 8
ERSPAN3_SUB_OFF_PLATFORM_ID = 0
ERSPAN3_SUB_SIZE_PLATFORM_ID = 8
ERSPAN3_SUB_PLATFORM_ID_MASK = 0xfc00000000000000
ERSPAN3_SUB_PLATFORM_ID_SHIFT = 58
ERSPAN3_SUB_OFF_INFO = 0
ERSPAN3_SUB_SIZE_INFO = 8
ERSPAN3_SUB_INFO_MASK = 0x3ffffffffffffff
ERSPAN3_SUB_INFO_SHIFT = 0

pack2 = ERSPAN2.pack
unpack2 = ERSPAN2.unpack
pack3 = ERSPAN3.pack
unpack3 = ERSPAN3.unpack
pack_subheader = ERSPAN3_SUBHEADER.pack
unpack_subheader = ERSPAN3_SUBHEADER.unpack
