"""NCCL's LL line: 8 data bytes and two copies of a 32-bit flag in 16 wire bytes.

``union ncclLLFifoLine`` (``src/include/device.h``, NCCL v2.19.3-1) is four little-endian
uint32 words ``data1 flag1 data2 flag2``: the low and high halves of one 8-byte data word,
each followed by the flag ``NCCL_LL_FLAG(step + 1)``, the low 32 bits of the connection's
FIFO step plus one (``storeLL`` in ``src/device/prims_ll.h``). All offsets are bytes from
the start of the line; ``simulator/payload.py`` writes lines, the parser and inspect read
them.
"""

LL_LINE_BYTES = 16        # sizeof(union ncclLLFifoLine)
LL_LINE_DATA_BYTES = 8    # data1 + data2
LL_DATA1_OFF = 0
LL_FLAG1_OFF = 4
LL_DATA2_OFF = 8
LL_FLAG2_OFF = 12
LL_HALF_BYTES = 4         # each of data1, flag1, data2, flag2
LL_FLAG_MASK = 0xFFFF_FFFF   # NCCL_LL_FLAG keeps the low 32 bits of step + 1 (sm70 and later)
