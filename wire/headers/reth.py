"""RDMA Extended Transport Header, IBTA Vol 1 Release 1.4 §9.3.3 (16 bytes).

Carried by RDMA WRITE First/Only and RDMA READ Request: the target virtual address, the
R_Key and the DMA length of the whole message.
"""

from gradtap.wire.headers.layout import Layout

RETH = Layout("RETH", "IBTA Vol 1 Rel 1.4 §9.3.3", (
    ("va", "Q", 0),
    ("rkey", "I", 0),
    ("dma_length", "I", 0),
))

# Derived from the RETH table above and written out so that readers and linters see
# them; tests/wire/test_headers.py holds them equal to RETH.constants().
RETH_LEN = 16
RETH_OFF_VA = 0
RETH_SIZE_VA = 8
RETH_VA_MASK = 0xffffffffffffffff
RETH_VA_SHIFT = 0
RETH_OFF_RKEY = 8
RETH_SIZE_RKEY = 4
RETH_RKEY_MASK = 0xffffffff
RETH_RKEY_SHIFT = 0
RETH_OFF_DMA_LENGTH = 12
RETH_SIZE_DMA_LENGTH = 4
RETH_DMA_LENGTH_MASK = 0xffffffff
RETH_DMA_LENGTH_SHIFT = 0

pack = RETH.pack
unpack = RETH.unpack
