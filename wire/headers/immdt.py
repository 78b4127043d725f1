"""Immediate Data Extended Transport Header, IBTA Vol 1 Release 1.4 §9.3.7 (4 bytes).

The spec treats the 32 bits as opaque data handed to the receiver's completion. ``imm`` is
the big-endian reading of the four wire bytes; a sender may have meant another byte order
(NCCL before 2.29 writes its size little-endian, see docs/wire-format.md).
"""

from gradtap.wire.headers.layout import Layout

IMMDT = Layout("IMMDT", "IBTA Vol 1 Rel 1.4 §9.3.7", (
    ("imm", "I", 0),
))

# Derived from the IMMDT table above and written out so that readers and linters see
# them; tests/wire/test_headers.py holds them equal to IMMDT.constants().
IMMDT_LEN = 4
IMMDT_OFF_IMM = 0
IMMDT_SIZE_IMM = 4
IMMDT_IMM_MASK = 0xffffffff
IMMDT_IMM_SHIFT = 0

pack = IMMDT.pack
unpack = IMMDT.unpack
