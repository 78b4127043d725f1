"""Unsigned integers read from and written to byte arrays, in either byte order.

The one set of byte readers and writers of every kernel: header fields (big-endian, network
order), pcap records (the file's order), LL/LL128 flags and the ICRC (little-endian). Each is
a Numba function inlined into its caller and runs as plain Python under
``NUMBA_DISABLE_JIT=1``; each byte is widened before it is shifted, so both give the same
result. ``buf`` is a 1-D uint8 array; the caller checks that ``buf[pos:pos + size]`` lies
inside it (these functions do not).

Readers return int64 for ``size <= 7`` bytes (``read_be``, ``read_le``, ``read_uint``) and
uint64 for up to 8 bytes (``read_be_u64``, ``read_le_u64``); writers store the low
``size * 8`` bits of ``value``.
"""

import numpy as np
from numba import njit

from gradtap.core.jit import JIT


@njit(**JIT, inline="always")
def read_be(buf, pos, size):
    """The big-endian unsigned integer of ``size`` (at most 7) bytes at ``buf[pos]``, int64."""
    word = np.int64(0)
    for k in range(size):
        word = (word << 8) | np.int64(buf[pos + k])
    return word


@njit(**JIT, inline="always")
def read_le(buf, pos, size):
    """The little-endian unsigned integer of ``size`` (at most 7) bytes at ``buf[pos]``, int64."""
    word = np.int64(0)
    for k in range(size - 1, -1, -1):
        word = (word << 8) | np.int64(buf[pos + k])
    return word


@njit(**JIT, inline="always")
def read_uint(buf, pos, size, big):
    """:func:`read_be` if ``big`` else :func:`read_le` (a file in either byte order)."""
    return read_be(buf, pos, size) if big else read_le(buf, pos, size)


@njit(**JIT, inline="always")
def read_be_u64(buf, pos, size):
    """The big-endian unsigned integer of ``size`` (at most 8) bytes at ``buf[pos]``, uint64."""
    word = np.uint64(0)
    for k in range(size):
        word = (word << np.uint64(8)) | np.uint64(buf[pos + k])
    return word


@njit(**JIT, inline="always")
def read_le_u64(buf, pos, size):
    """The little-endian unsigned integer of ``size`` (at most 8) bytes at ``buf[pos]``, uint64."""
    word = np.uint64(0)
    for k in range(size - 1, -1, -1):
        word = (word << np.uint64(8)) | np.uint64(buf[pos + k])
    return word


@njit(**JIT, inline="always")
def write_be(buf, pos, value, size):
    """Store the low ``size`` bytes of ``value`` (an integer >= 0) big-endian at ``buf[pos]``."""
    for k in range(size):
        buf[pos + k] = (value >> (8 * (size - 1 - k))) & 0xFF


@njit(**JIT, inline="always")
def write_le(buf, pos, value, size):
    """Store the low ``size`` bytes of ``value`` (an integer >= 0) little-endian at ``buf[pos]``."""
    for k in range(size):
        buf[pos + k] = (value >> (8 * k)) & 0xFF
