"""Datagram Extended Transport Header, IBTA Vol 1 Release 1.4 §9.3.2 (8 bytes).

Carried by every UD packet (e.g. connection management to QP1): Q_Key and source QP.
"""

from gradtap.wire.headers.layout import Bits, Layout

DETH = Layout("DETH", "IBTA Vol 1 Rel 1.4 §9.3.2", (
    ("qkey", "I", 0),
    (Bits(("resv8", 8), ("srcqp", 24)), "I", 0),
))

# Derived from the DETH table above and written out so that readers and linters see
# them; tests/wire/test_headers.py holds them equal to DETH.constants().
DETH_LEN = 8
DETH_OFF_QKEY = 0
DETH_SIZE_QKEY = 4
DETH_QKEY_MASK = 0xffffffff
DETH_QKEY_SHIFT = 0
DETH_OFF_RESV8 = 4
DETH_SIZE_RESV8 = 4
DETH_RESV8_MASK = 0xff000000
DETH_RESV8_SHIFT = 24
DETH_OFF_SRCQP = 4
DETH_SIZE_SRCQP = 4
DETH_SRCQP_MASK = 0xffffff
DETH_SRCQP_SHIFT = 0

pack = DETH.pack
unpack = DETH.unpack
