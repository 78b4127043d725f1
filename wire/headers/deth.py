"""Datagram Extended Transport Header, IBTA Vol 1 Release 1.4 §9.3.2 (8 bytes).

Carried by every UD packet (e.g. connection management to QP1): Q_Key and source QP.
"""

from gradtap.wire.headers.layout import Bits, Layout

DETH = Layout("DETH", "IBTA Vol 1 Rel 1.4 §9.3.2", (
    ("qkey", "I", 0),
    (Bits(("resv8", 8), ("srcqp", 24)), "I", 0),
))

globals().update(DETH.constants())

pack = DETH.pack
unpack = DETH.unpack
