"""A packet's gradient bytes: written into a gradient, or compared with what it holds.

A packet of an RDMA write carries ``length`` payload bytes that start ``wire_off`` bytes into
its message; the message holds ``nbytes`` of gradient starting at byte ``dest``. Simple
carries the bytes as they are; LL interleaves every 8 data bytes with two 32-bit flags
(``wire/ll.py``); LL128 puts a flag word in each 128-byte line (``wire/ll128.py``). The
flags themselves are checked before (``parser/assemble.py``); here only the data moves.
"""

from __future__ import annotations

from numba import njit

from gradtap.core.jit import JIT_NO_REFCOUNT
from gradtap.core.memory import compare_bytes, copy_bytes
from gradtap.wire.ll import LL_DATA1_OFF, LL_DATA2_OFF, LL_HALF_BYTES, LL_LINE_BYTES, LL_LINE_DATA_BYTES
from gradtap.wire.ll128 import LL128_SLICE_DATA_WORDS, LL128_SLICE_WIRE_WORDS, LL128_WIRE_TO_DATA, LL128_WORD_BYTES
from gradtap.wire.protocol import Protocol


@njit(**JIT_NO_REFCOUNT)
def store_payload(data, start, length, protocol, wire_off, grad, dest, nbytes, compare):
    """Write the data of ``length`` payload bytes (at ``wire_off`` in the message) into
    ``grad[dest : dest + nbytes]`` (the message's elements), never past ``nbytes``. With
    ``compare``, write nothing and return whether ``grad`` holds other bytes there."""
    if protocol == Protocol.SIMPLE:
        n = min(length, nbytes - wire_off)
        if n > 0:
            if compare:
                return compare_bytes(grad, dest + wire_off, data, start, n) != 0
            copy_bytes(grad, dest + wire_off, data, start, n)
    elif protocol == Protocol.LL:
        for j in range(length // LL_LINE_BYTES):
            d = (wire_off // LL_LINE_BYTES + j) * LL_LINE_DATA_BYTES
            line = start + LL_LINE_BYTES * j
            for half in range(2):
                src = line + (LL_DATA2_OFF if half else LL_DATA1_OFF)
                at = d + half * LL_HALF_BYTES
                for b in range(min(LL_HALF_BYTES, nbytes - at)):
                    if not compare:
                        grad[dest + at + b] = data[src + b]
                    elif grad[dest + at + b] != data[src + b]:
                        return True
    else:
        w0 = wire_off // LL128_WORD_BYTES
        for j in range(length // LL128_WORD_BYTES):
            w = w0 + j
            k = LL128_WIRE_TO_DATA[w % LL128_SLICE_WIRE_WORDS]
            if k < 0:
                continue
            d = ((w // LL128_SLICE_WIRE_WORDS) * LL128_SLICE_DATA_WORDS + k) * LL128_WORD_BYTES
            for b in range(min(LL128_WORD_BYTES, nbytes - d)):
                if not compare:
                    grad[dest + d + b] = data[start + LL128_WORD_BYTES * j + b]
                elif grad[dest + d + b] != data[start + LL128_WORD_BYTES * j + b]:
                    return True
    return False


@njit(**JIT_NO_REFCOUNT)
def data_differs(a, a_pos, b, b_pos, length, protocol, wire_off):
    """Whether two copies of the same ``length`` wire bytes (at ``wire_off`` in their
    messages) carry other data: LL and LL128 flags are not data (two hops of a chunk carry
    it with the flags of their own steps)."""
    if protocol == Protocol.SIMPLE:
        return compare_bytes(a, a_pos, b, b_pos, length) != 0
    if protocol == Protocol.LL:
        for j in range(length // LL_LINE_BYTES):
            for off in (LL_DATA1_OFF, LL_DATA2_OFF):
                at = LL_LINE_BYTES * j + off
                if compare_bytes(a, a_pos + at, b, b_pos + at, LL_HALF_BYTES) != 0:
                    return True
        return False
    w0 = wire_off // LL128_WORD_BYTES
    for j in range(length // LL128_WORD_BYTES):
        if LL128_WIRE_TO_DATA[(w0 + j) % LL128_SLICE_WIRE_WORDS] >= 0:
            at = LL128_WORD_BYTES * j
            if compare_bytes(a, a_pos + at, b, b_pos + at, LL128_WORD_BYTES) != 0:
                return True
    return False
