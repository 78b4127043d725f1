"""Invalidate Extended Transport Header, IBTA Vol 1 Release 1.4 §9.3.8 (4 bytes).

Carried by SEND Last/Only with Invalidate: the R_Key the responder invalidates.
"""

from gradtap.wire.headers.layout import Layout

IETH = Layout("IETH", "IBTA Vol 1 Rel 1.4 §9.3.8", (
    ("rkey", "I", 0),
))

# Derived from the IETH table above and written out so that readers and linters see
# them; tests/wire/test_headers.py holds them equal to IETH.constants().
IETH_LEN = 4
IETH_OFF_RKEY = 0
IETH_SIZE_RKEY = 4
IETH_RKEY_MASK = 0xffffffff
IETH_RKEY_SHIFT = 0

pack = IETH.pack
unpack = IETH.unpack
