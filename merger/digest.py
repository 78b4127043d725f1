"""Keyed 128-bit digests of a bucket's coverage blocks, all blocks in one call, in parallel.

The nodes of a mirror group compare their copies of a block by digest (``merger/group.py``),
and fetch a remote copy only when the digests differ. Mirrored traffic is untrusted, so a
digest collision must not be something a sender of crafted frames can aim at: the digest
is keyed, with a key the nodes agree at rendezvous (random per group run,
``merger/group_link.py``) and never put on the mirrored wire.

**The construction** (NH, then SipHash-2-4-128; the shape of UMAC's hash-then-PRF). A block
of ``L <= MAX_BLOCK_BYTES`` bytes is zero-padded to whole 8-byte pairs of little-endian
``uint32`` words ``m[0..2p)``; with the secret ``uint32`` key ``K`` of
:data:`NH_KEY_WORDS` words, four NH sums are taken, Toeplitz-shifted by 4 words each::

    h_t = sum_{i<p} ((m[2i] + K[2i + 4t]) mod 2^32) * ((m[2i+1] + K[2i+1 + 4t]) mod 2^32)   mod 2^64

and the digest is SipHash-2-4 with 128-bit output, under the secret 128-bit key
``(k0, k1)``, of the 40 bytes ``h_0 | h_1 | h_2 | h_3 | L`` (little-endian ``uint64``).

*Why a crafted collision is not practical.* For two different blocks of the same length,
NH with 32-bit words is 2^-32-almost-universal and its Toeplitz extension to four sums is
2^-128-almost-universal (Black, Halevi, Krawczyk, Krovetz, Rogaway, "UMAC: fast and secure
message authentication", CRYPTO 1999, NH and its Toeplitz construction): over the random
key, the four sums collide with probability at most 2^-128, whatever two blocks the sender
chose without knowing the key. Blocks of different lengths differ in SipHash's input. The
digest is then SipHash-2-4-128 (Aumasson and Bernstein, a PRF), so distinct inputs collide
only as a random 128-bit function's would, and the digests the nodes exchange show nothing
of the NH key. A sender who cannot see the key (it is drawn by ``os.urandom`` at rendezvous
and crosses only the group's own link) thus hits a collision with probability about 2^-127
per pair of blocks; 2^40 crafted blocks leave it below 2^-87.

**Speed.** The NH sums are the work: per 8 bytes and sum, one 32x32->64 multiply and two
32-bit adds, over the block and the key read as 64-bit words in place (little-endian: a
word's low half is the first 32-bit word); SipHash runs once per block on 40 bytes. Blocks are spread
over Numba's threads (``prange``), each writing its own row of the output.
``benchmarks/digest.py`` measures GB/s against memcpy in the same run;
``tests/merger/test_digest.py`` checks it against a plain-Python twin and SipHash's
published vectors.
"""

from __future__ import annotations

import hashlib
import os
import sys
from typing import NamedTuple

import numpy as np
from numba import njit, prange

from gradtap.core.errors import GradtapError
from gradtap.core.jit import JIT, JIT_PARALLEL

DIGEST_BYTES = 16
MAX_BLOCK_BYTES = 4096            # a coverage block is at most one 4096-byte packet's data (wire_plan)
NH_LANES = 4
NH_KEY_WORDS = MAX_BLOCK_BYTES // 4 + 4 * (NH_LANES - 1)
SECRET_BYTES = 32
_KEY_LABEL = b"gradtap mirror-group block digest key v1"
_M32 = np.uint64(0xFFFFFFFF)


class DigestKey(NamedTuple):
    """The expanded key: ``nh`` ``uint32[NH_KEY_WORDS]``, ``sip`` ``uint64[2]`` (k0, k1)."""

    nh: np.ndarray
    sip: np.ndarray


def new_secret() -> bytes:
    """A fresh random secret for one group run (rank 0 draws it and sends it to its peers)."""
    return os.urandom(SECRET_BYTES)


def digest_key(secret: bytes) -> DigestKey:
    """The key expanded from ``secret`` (SHAKE-256 as the expander)."""
    if len(secret) != SECRET_BYTES:
        raise GradtapError(f"digest key: the secret has {len(secret)} bytes; expected {SECRET_BYTES}")
    raw = hashlib.shake_256(_KEY_LABEL + secret).digest(NH_KEY_WORDS * 4 + 16)
    return DigestKey(np.frombuffer(raw, "<u4", NH_KEY_WORDS).astype(np.uint32),
                     np.frombuffer(raw, "<u8", 2, NH_KEY_WORDS * 4).astype(np.uint64))


@njit(**JIT, inline="always")
def _rotl(x, b):
    return (x << np.uint64(b)) | (x >> np.uint64(64 - b))


@njit(**JIT, inline="always")
def _round(v0, v1, v2, v3):
    v0 += v1
    v1 = _rotl(v1, 13)
    v1 ^= v0
    v0 = _rotl(v0, 32)
    v2 += v3
    v3 = _rotl(v3, 16)
    v3 ^= v2
    v0 += v3
    v3 = _rotl(v3, 21)
    v3 ^= v0
    v2 += v1
    v1 = _rotl(v1, 17)
    v1 ^= v2
    v2 = _rotl(v2, 32)
    return v0, v1, v2, v3


@njit(**JIT, inline="always")
def _compress(v0, v1, v2, v3, m):
    v3 ^= m
    v0, v1, v2, v3 = _round(v0, v1, v2, v3)
    v0, v1, v2, v3 = _round(v0, v1, v2, v3)
    v0 ^= m
    return v0, v1, v2, v3


@njit(**JIT, inline="always")
def _init(k0, k1):
    return (k0 ^ np.uint64(0x736F6D6570736575), k1 ^ np.uint64(0x646F72616E646F6D) ^ np.uint64(0xEE),
            k0 ^ np.uint64(0x6C7967656E657261), k1 ^ np.uint64(0x7465646279746573))


@njit(**JIT, inline="always")
def _final(v0, v1, v2, v3, out, row):
    """SipHash-128's finalisation; the two output words little-endian into ``out[row]``."""
    v2 ^= np.uint64(0xEE)
    for _ in range(4):
        v0, v1, v2, v3 = _round(v0, v1, v2, v3)
    a = v0 ^ v1 ^ v2 ^ v3
    v1 ^= np.uint64(0xDD)
    for _ in range(4):
        v0, v1, v2, v3 = _round(v0, v1, v2, v3)
    b = v0 ^ v1 ^ v2 ^ v3
    for i in range(8):
        out[row, i] = np.uint8((a >> np.uint64(8 * i)) & np.uint64(0xFF))
        out[row, 8 + i] = np.uint8((b >> np.uint64(8 * i)) & np.uint64(0xFF))


@njit(**JIT)
def _siphash128(data, k0, k1, out):
    """SipHash-2-4-128 of all of ``data`` (``uint8``) into ``out[0]`` (``uint8[1, 16]``)."""
    n = len(data)
    v0, v1, v2, v3 = _init(k0, k1)
    whole = n - n % 8
    for at in range(0, whole, 8):
        m = np.uint64(0)
        for i in range(8):
            m |= np.uint64(data[at + i]) << np.uint64(8 * i)
        v0, v1, v2, v3 = _compress(v0, v1, v2, v3, m)
    last = np.uint64(n & 0xFF) << np.uint64(56)
    for i in range(n - whole):
        last |= np.uint64(data[whole + i]) << np.uint64(8 * i)
    v0, v1, v2, v3 = _compress(v0, v1, v2, v3, last)
    _final(v0, v1, v2, v3, out, 0)


@njit(**JIT)
def _block(w64, lo, n, k64, k0, k1, out, row):
    """The digest of the block of ``n`` bytes starting at ``w64[lo]`` (``uint64``, the block's
    bytes 8-byte aligned; bytes past ``n`` in its last word are ignored) into ``out[row]``.
    ``k64``: the NH key's words in pairs, little-endian (word ``2i`` low, ``2i + 1`` high), as
    ``w64`` holds the block's (so lane t's key pair for word pair i is ``k64[i + 2t]``)."""
    h0 = np.uint64(0)
    h1 = np.uint64(0)
    h2 = np.uint64(0)
    h3 = np.uint64(0)
    pairs = n // 8
    for i in range(pairs + (1 if n % 8 else 0)):
        w = w64[lo + i]
        if i == pairs:                 # the zero-padded tail
            w &= (np.uint64(1) << np.uint64(8 * (n % 8))) - np.uint64(1)
        a = w & _M32
        b = w >> np.uint64(32)
        k = k64[i]
        h0 += ((a + (k & _M32)) & _M32) * ((b + (k >> np.uint64(32))) & _M32)
        k = k64[i + 2]
        h1 += ((a + (k & _M32)) & _M32) * ((b + (k >> np.uint64(32))) & _M32)
        k = k64[i + 4]
        h2 += ((a + (k & _M32)) & _M32) * ((b + (k >> np.uint64(32))) & _M32)
        k = k64[i + 6]
        h3 += ((a + (k & _M32)) & _M32) * ((b + (k >> np.uint64(32))) & _M32)
    v0, v1, v2, v3 = _init(k0, k1)
    v0, v1, v2, v3 = _compress(v0, v1, v2, v3, h0)
    v0, v1, v2, v3 = _compress(v0, v1, v2, v3, h1)
    v0, v1, v2, v3 = _compress(v0, v1, v2, v3, h2)
    v0, v1, v2, v3 = _compress(v0, v1, v2, v3, h3)
    v0, v1, v2, v3 = _compress(v0, v1, v2, v3, np.uint64(n))
    v0, v1, v2, v3 = _compress(v0, v1, v2, v3, np.uint64(40) << np.uint64(56))
    _final(v0, v1, v2, v3, out, row)


@njit(**JIT_PARALLEL)
def _blocks(data, start, nbytes, which, k64, k0, k1, out):
    """Every block ``j`` with ``which[j]``: its digest into ``out[j]``. A block at an 8-byte
    aligned start is read in place; another is first gathered into an aligned buffer."""
    w64 = data[:len(data) - len(data) % 8].view(np.uint64)
    for j in prange(len(start)):
        if not which[j]:
            continue
        lo, n = start[j], nbytes[j]
        if lo % 8 == 0 and lo + (n + 7) // 8 * 8 <= len(w64) * 8:
            _block(w64, lo // 8, n, k64, k0, k1, out, j)
        else:
            buf = np.zeros(MAX_BLOCK_BYTES // 8 + 1, np.uint64)
            for b in range(n):
                buf[b >> 3] |= np.uint64(data[lo + b]) << np.uint64(8 * (b & 7))
            _block(buf, 0, n, k64, k0, k1, out, j)


def block_digests(data: np.ndarray, start: np.ndarray, nbytes: np.ndarray, which: np.ndarray,
                  key: DigestKey) -> np.ndarray:
    """``uint8[k, DIGEST_BYTES]``: the digest of each block ``j`` where ``which[j]`` (zeros
    elsewhere). ``data``: ``uint8`` (a bucket's bytes); block ``j`` is
    ``data[start[j]:start[j] + nbytes[j]]`` (``int64[k]`` each), at most
    :data:`MAX_BLOCK_BYTES` bytes."""
    start = np.ascontiguousarray(start, np.int64)
    nbytes = np.ascontiguousarray(nbytes, np.int64)
    which = np.ascontiguousarray(which, np.bool_)
    if sys.byteorder != "little":
        raise GradtapError("block_digests reads words little-endian in place; this host is big-endian")
    if data.dtype != np.uint8 or data.ndim != 1:
        raise GradtapError(f"block_digests: data must be 1-D uint8, not {data.ndim}-D {data.dtype}")
    if not len(start) == len(nbytes) == len(which):
        raise GradtapError(f"block_digests: {len(start)} starts, {len(nbytes)} sizes, {len(which)} flags")
    chosen = which.nonzero()[0]
    if len(chosen):
        lo, n = start[chosen], nbytes[chosen]
        if (lo < 0).any() or (n < 0).any() or (lo + n > len(data)).any() or (n > MAX_BLOCK_BYTES).any():
            raise GradtapError(f"block_digests: blocks must lie in the {len(data)} bytes and hold at most "
                               f"{MAX_BLOCK_BYTES} bytes each")
    out = np.zeros((len(start), DIGEST_BYTES), np.uint8)
    if len(chosen):
        data = np.ascontiguousarray(data)
        if data.ctypes.data % 8:
            data = data.copy()          # the in-place word reads need an 8-byte aligned buffer
        _blocks(data, start, nbytes, which, key.nh.view(np.uint64), key.sip[0], key.sip[1], out)
    return out


def siphash128(message: bytes, key: bytes) -> bytes:
    """SipHash-2-4 with 128-bit output of ``message`` under the 16-byte ``key`` (the digest's
    finaliser; for its known-answer test)."""
    if len(key) != 16:
        raise GradtapError(f"siphash128: the key has {len(key)} bytes; expected 16")
    k = np.frombuffer(key, "<u8", 2)
    out = np.zeros((1, DIGEST_BYTES), np.uint8)
    _siphash128(np.frombuffer(message, np.uint8), np.uint64(k[0]), np.uint64(k[1]), out)
    return out[0].tobytes()
