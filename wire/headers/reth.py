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

globals().update(RETH.constants())

pack = RETH.pack
unpack = RETH.unpack
