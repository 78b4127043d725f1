"""Atomic Extended Transport Headers, IBTA Vol 1 Release 1.4 §9.3.4 (AtomicETH, 28 bytes,
carried by CmpSwap/FetchAdd requests) and §9.3.6 (AtomicAckETH, 8 bytes, carried by the
ATOMIC Acknowledge after its AETH)."""

from gradtap.wire.headers.layout import Layout

ATOMICETH = Layout("ATOMICETH", "IBTA Vol 1 Rel 1.4 §9.3.4", (
    ("va", "Q", 0),
    ("rkey", "I", 0),
    ("swap_add", "Q", 0),
    ("compare", "Q", 0),
))

ATOMICACKETH = Layout("ATOMICACKETH", "IBTA Vol 1 Rel 1.4 §9.3.6", (
    ("orig_data", "Q", 0),
))

globals().update(ATOMICETH.constants())
globals().update(ATOMICACKETH.constants())

pack = ATOMICETH.pack
unpack = ATOMICETH.unpack
pack_ack = ATOMICACKETH.pack
unpack_ack = ATOMICACKETH.unpack
