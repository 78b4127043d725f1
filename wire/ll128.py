"""NCCL's LL128 lines and warp slices: where each data word of a send sits on the wire.

From ``src/include/device.h`` and ``src/device/prims_ll128.h`` (NCCL v2.19.3-1): a line is
128 bytes of 16 little-endian uint64 words, word 15 the flag ``step + 1`` (all 64 bits). A
warp of 32 threads moves a *slice* of 8 words per thread: 256 wire words (2048 B, 16 lines)
carrying 240 data words (1920 B). Successive slices of a send's data go to successive wire
slices. Inside a slice the data words are interleaved over the lines as the warp's
registers fall; the derivation is written out in ``simulator/payload.py``'s docstring. The
simulator encodes with :data:`LL128_DATA_TO_WIRE`, the parser decodes with
:data:`LL128_WIRE_TO_DATA`.

Names say their unit: ``_BYTES``, ``_WORDS`` (uint64 words) or ``_LINES``; ``LINE_`` counts
within one 128-byte line, ``SLICE_`` within one warp slice.
"""

import numpy as np

WARP_SIZE = 32                      # device.h: threads per warp
LL128_WORD_BYTES = 8                # sizeof(uint64_t)
LL128_LINE_BYTES = 128              # NCCL_LL128_LINESIZE
LL128_LINE_WORDS = LL128_LINE_BYTES // LL128_WORD_BYTES        # NCCL_LL128_LINEELEMS = 16
LL128_LINE_DATA_WORDS = LL128_LINE_WORDS - 1                   # NCCL_LL128_DATAELEMS = 15
LL128_FLAG_WORD = LL128_LINE_WORDS - 1                         # the last word of a line
LL128_FLAG_OFF = LL128_FLAG_WORD * LL128_WORD_BYTES            # byte 120 of a line
LL128_SHMEM_WORDS_PER_THREAD = 8    # NCCL_LL128_SHMEM_ELEMS_PER_THREAD
LL128_SLICE_WIRE_WORDS = WARP_SIZE * LL128_SHMEM_WORDS_PER_THREAD                    # 256
LL128_SLICE_DATA_WORDS = LL128_SLICE_WIRE_WORDS // LL128_LINE_WORDS * LL128_LINE_DATA_WORDS  # 240
LL128_SLICE_LINES = LL128_SLICE_WIRE_WORDS // LL128_LINE_WORDS                        # 16
LL128_SLICE_WIRE_BYTES = LL128_SLICE_WIRE_WORDS * LL128_WORD_BYTES                    # 2048
LL128_SLICE_DATA_BYTES = LL128_SLICE_DATA_WORDS * LL128_WORD_BYTES                    # 1920


def _ll128_data_to_wire() -> np.ndarray:
    """``[240]`` wire word (0..255) of each data word of an LL128 warp slice (see above)."""
    wid = np.arange(WARP_SIZE)
    flag_thread = wid % 8 == 7
    perm = np.full(LL128_SLICE_DATA_WORDS, -1, dtype=np.int64)
    for g in range(4):  # the register groups of loadRegsBegin; vectorised over the 32 lanes
        loads = ~flag_thread if g % 2 else np.ones(WARP_SIZE, dtype=bool)
        ix = 32 * g - 4 * (g // 2) + wid - (g % 2) * (wid // 8)
        perm[2 * ix[loads]] = 64 * g + 2 * wid[loads]
        second = np.where(flag_thread, 64 * (g + 1) + 2 * wid, 64 * g + 2 * wid + 1)
        perm[2 * ix[loads] + 1] = second[loads]
    flags = np.arange(LL128_FLAG_WORD, LL128_SLICE_WIRE_WORDS, LL128_LINE_WORDS)
    assert (np.sort(perm) == np.setdiff1d(np.arange(LL128_SLICE_WIRE_WORDS), flags)).all()
    return perm


LL128_DATA_TO_WIRE = _ll128_data_to_wire()
LL128_WIRE_TO_DATA = np.full(LL128_SLICE_WIRE_WORDS, -1, dtype=np.int64)  # -1: a flag word
LL128_WIRE_TO_DATA[LL128_DATA_TO_WIRE] = np.arange(LL128_SLICE_DATA_WORDS)
LL128_DATA_TO_WIRE.flags.writeable = False
LL128_WIRE_TO_DATA.flags.writeable = False
