"""Ethernet II header and the IEEE 802.1Q VLAN tag.

Ethernet II (DIX) framing as carried by IEEE 802.3 §3.2 with a type field; the 802.1Q tag
(IEEE 802.1Q-2018 §9.6) sits between the source address and the type: its TPID takes the
place of the outer type field, followed by the TCI (PCP, DEI, VID) and the inner type, which
is what ``VLAN`` declares. Captures carry no FCS.
"""

from gradtap.wire.headers.layout import Bits, Layout

ETHERTYPE_IPV4 = 0x0800
ETHERTYPE_IPV6 = 0x86DD
ETHERTYPE_ARP = 0x0806
ETHERTYPE_VLAN = 0x8100  # 802.1Q C-tag
ETHERTYPE_QINQ = 0x88A8  # 802.1ad S-tag, same tag layout

ETH = Layout("ETH", "IEEE 802.3 §3.2 (Ethernet II type field)", (
    ("dst", "6s", b"\x00" * 6),
    ("src", "6s", b"\x00" * 6),
    ("type", "H", ETHERTYPE_IPV6),
))

# The four bytes after an outer type of ETHERTYPE_VLAN/QINQ.
VLAN = Layout("VLAN", "IEEE 802.1Q-2018 §9.6 (VLAN tag: TCI + encapsulated type)", (
    (Bits(("pcp", 3), ("dei", 1), ("vid", 12)), "H", 0),
    ("type", "H", ETHERTYPE_IPV6),
))

# Derived from the ETH table above and written out so that readers and linters see
# them; tests/wire/test_headers.py holds them equal to ETH.constants().
ETH_LEN = 14
ETH_OFF_DST = 0
ETH_SIZE_DST = 6
ETH_OFF_SRC = 6
ETH_SIZE_SRC = 6
ETH_OFF_TYPE = 12
ETH_SIZE_TYPE = 2
ETH_TYPE_MASK = 0xffff
ETH_TYPE_SHIFT = 0
# Derived from the VLAN table above and written out so that readers and linters see
# them; tests/wire/test_headers.py holds them equal to VLAN.constants().
VLAN_LEN = 4
VLAN_OFF_PCP = 0
VLAN_SIZE_PCP = 2
VLAN_PCP_MASK = 0xe000
VLAN_PCP_SHIFT = 13
VLAN_OFF_DEI = 0
VLAN_SIZE_DEI = 2
VLAN_DEI_MASK = 0x1000
VLAN_DEI_SHIFT = 12
VLAN_OFF_VID = 0
VLAN_SIZE_VID = 2
VLAN_VID_MASK = 0xfff
VLAN_VID_SHIFT = 0
VLAN_OFF_TYPE = 2
VLAN_SIZE_TYPE = 2
VLAN_TYPE_MASK = 0xffff
VLAN_TYPE_SHIFT = 0

pack = ETH.pack
unpack = ETH.unpack
pack_vlan = VLAN.pack
unpack_vlan = VLAN.unpack
