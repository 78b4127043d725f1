"""Invalidate Extended Transport Header, IBTA Vol 1 Release 1.4 §9.3.8 (4 bytes).

Carried by SEND Last/Only with Invalidate: the R_Key the responder invalidates.
"""

from gradtap.wire.headers.layout import Layout

IETH = Layout("IETH", "IBTA Vol 1 Rel 1.4 §9.3.8", (
    ("rkey", "I", 0),
))

globals().update(IETH.constants())

pack = IETH.pack
unpack = IETH.unpack
