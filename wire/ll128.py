"""NCCL's LL128 line layout: where each data word of a warp slice sits on the wire.

The derivation from ``src/device/prims_ll128.h`` (NCCL v2.19.3-1) is written out in
``simulator/payload.py``'s docstring; the simulator encodes with :data:`LL128_DATA_TO_WIRE`
and the parser decodes with :data:`LL128_WIRE_TO_DATA`. A slice is 256 wire words (2048 B,
16 lines of 128 B) carrying 240 data words (1920 B); word 15 of every line is the flag.
"""

import numpy as np

from gradtap.workload.nccl import LL128_DATA_WORDS_PER_WARP, LL128_LINE_WORDS, LL128_WIRE_WORDS_PER_WARP, WARP_SIZE

LL128_SLICE_DATA = LL128_DATA_WORDS_PER_WARP * 8   # 1920 data bytes per warp slice
LL128_SLICE_WIRE = LL128_WIRE_WORDS_PER_WARP * 8   # 2048 wire bytes per warp slice


def _ll128_data_to_wire() -> np.ndarray:
    """``[240]`` wire word (0..255) of each data word of an LL128 warp slice (see above)."""
    wid = np.arange(WARP_SIZE)
    flag_thread = wid % 8 == 7
    perm = np.full(LL128_DATA_WORDS_PER_WARP, -1, dtype=np.int64)
    for g in range(4):  # the register groups of loadRegsBegin; vectorised over the 32 lanes
        loads = ~flag_thread if g % 2 else np.ones(WARP_SIZE, dtype=bool)
        ix = 32 * g - 4 * (g // 2) + wid - (g % 2) * (wid // 8)
        perm[2 * ix[loads]] = 64 * g + 2 * wid[loads]
        second = np.where(flag_thread, 64 * (g + 1) + 2 * wid, 64 * g + 2 * wid + 1)
        perm[2 * ix[loads] + 1] = second[loads]
    assert (np.sort(perm) == np.setdiff1d(np.arange(LL128_WIRE_WORDS_PER_WARP),
                                          np.arange(LL128_LINE_WORDS - 1, LL128_WIRE_WORDS_PER_WARP,
                                                    LL128_LINE_WORDS))).all()
    return perm


LL128_DATA_TO_WIRE = _ll128_data_to_wire()
LL128_WIRE_TO_DATA = np.full(LL128_WIRE_WORDS_PER_WARP, -1, dtype=np.int64)  # -1: a flag word
LL128_WIRE_TO_DATA[LL128_DATA_TO_WIRE] = np.arange(LL128_DATA_WORDS_PER_WARP)
