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

# Derived from the ATOMICETH table above and written out so that readers and linters see
# them; tests/wire/test_headers.py holds them equal to ATOMICETH.constants().
ATOMICETH_LEN = 28
ATOMICETH_OFF_VA = 0
ATOMICETH_SIZE_VA = 8
ATOMICETH_VA_MASK = 0xffffffffffffffff
ATOMICETH_VA_SHIFT = 0
ATOMICETH_OFF_RKEY = 8
ATOMICETH_SIZE_RKEY = 4
ATOMICETH_RKEY_MASK = 0xffffffff
ATOMICETH_RKEY_SHIFT = 0
ATOMICETH_OFF_SWAP_ADD = 12
ATOMICETH_SIZE_SWAP_ADD = 8
ATOMICETH_SWAP_ADD_MASK = 0xffffffffffffffff
ATOMICETH_SWAP_ADD_SHIFT = 0
ATOMICETH_OFF_COMPARE = 20
ATOMICETH_SIZE_COMPARE = 8
ATOMICETH_COMPARE_MASK = 0xffffffffffffffff
ATOMICETH_COMPARE_SHIFT = 0
# Derived from the ATOMICACKETH table above and written out so that readers and linters see
# them; tests/wire/test_headers.py holds them equal to ATOMICACKETH.constants().
ATOMICACKETH_LEN = 8
ATOMICACKETH_OFF_ORIG_DATA = 0
ATOMICACKETH_SIZE_ORIG_DATA = 8
ATOMICACKETH_ORIG_DATA_MASK = 0xffffffffffffffff
ATOMICACKETH_ORIG_DATA_SHIFT = 0

pack = ATOMICETH.pack
unpack = ATOMICETH.unpack
pack_ack = ATOMICACKETH.pack
unpack_ack = ATOMICACKETH.unpack
