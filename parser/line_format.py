"""Which NCCL protocol a packet's payload is written in, from its bytes alone.

The three protocols look different on the wire (``docs/wire-format.md``):

- **LL**: 16-byte lines of two 4-byte data words, each followed by the same 4-byte flag, the
  connection's ``step + 1`` (nonzero), one flag for the whole message;
- **LL128**: 128-byte lines whose last 8-byte word is the flag ``step + 1`` (nonzero, below
  2**32 for any run of the counter a capture can show);
- **Simple**: the data as it is.

A packet is LL when every line of it shows LL's flags, LL128 when every line shows LL128's,
Simple when it shows neither, and undecided when it is too short to tell (under one 128-byte
line). The two flag patterns exclude each other (LL's second flag is the high half of LL128's
flag word, which would then be 2**32 or more). Simple data of one repeated nonzero 32-bit word
shows LL's flags; a reader that trusts the class must therefore check it against the sizes too
(``parser/resolve.py`` does).
"""

from __future__ import annotations

import numpy as np
from numba import njit

from gradtap.core.bytes import read_le_u64
from gradtap.core.jit import JIT
from gradtap.wire.ll import LL_FLAG1_OFF, LL_FLAG2_OFF, LL_HALF_BYTES, LL_LINE_BYTES
from gradtap.wire.ll128 import LL128_FLAG_OFF, LL128_LINE_BYTES, LL128_WORD_BYTES
from gradtap.wire.protocol import Protocol

LL128_FLAG_LIMIT = 1 << 32
UNDECIDED = -1                  # packet_protocols: the payload does not say
_LL, _LL128, _SIMPLE = int(Protocol.LL), int(Protocol.LL128), int(Protocol.SIMPLE)


@njit(**JIT)
def _line_flag(data, off, n, line_bytes, flag_off, flag_bytes):
    """The flag at ``flag_off`` of the first line if every ``line_bytes`` line of the packet
    ``data[off:off + n]`` holds the same one there; 0 otherwise (uint64)."""
    if n % line_bytes or off < 0 or off + n > len(data):
        return np.uint64(0)
    flag = read_le_u64(data, off + flag_off, flag_bytes)
    for line in range(off, off + n, line_bytes):
        if read_le_u64(data, line + flag_off, flag_bytes) != flag:
            return np.uint64(0)
    return flag


@njit(**JIT)
def is_ll(data, off, n):
    """Both 32-bit flags of every 16-byte line equal one nonzero flag."""
    flag = _line_flag(data, off, n, LL_LINE_BYTES, LL_FLAG1_OFF, LL_HALF_BYTES)
    return flag != 0 and _line_flag(data, off, n, LL_LINE_BYTES, LL_FLAG2_OFF, LL_HALF_BYTES) == flag


@njit(**JIT)
def is_ll128(data, off, n):
    """The last word of every 128-byte line equals one flag, nonzero and below 2**32."""
    flag = _line_flag(data, off, n, LL128_LINE_BYTES, LL128_FLAG_OFF, LL128_WORD_BYTES)
    return flag != 0 and flag < np.uint64(LL128_FLAG_LIMIT)


@njit(**JIT)
def _classify(offsets, lengths, data, out):
    for i in range(len(offsets)):
        n = lengths[i]
        if n < LL128_LINE_BYTES or offsets[i] < 0 or offsets[i] + n > len(data):
            out[i] = UNDECIDED
            continue
        if is_ll(data, offsets[i], n):
            out[i] = _LL
        elif is_ll128(data, offsets[i], n):
            out[i] = _LL128
        else:
            out[i] = _SIMPLE


def packet_protocols(records: np.ndarray, data: np.ndarray) -> np.ndarray:
    """int8 per decoded record: the :class:`Protocol` its payload is written in, or
    :data:`UNDECIDED` (see the module docstring). Reads only inside ``data``."""
    out = np.empty(len(records), np.int8)
    _classify(records["payload_off"].astype(np.int64), records["payload_len"].astype(np.int64), data, out)
    return out
