"""The block digest of ``merger/digest.py``, written plainly from its definition (Python ints,
``struct``), as the slow twin the kernel must equal."""

from __future__ import annotations

import struct

M64 = (1 << 64) - 1


def _rotl(x: int, b: int) -> int:
    return ((x << b) | (x >> (64 - b))) & M64


def _sipround(v: list[int]) -> None:
    v[0] = (v[0] + v[1]) & M64
    v[1] = _rotl(v[1], 13) ^ v[0]
    v[0] = _rotl(v[0], 32)
    v[2] = (v[2] + v[3]) & M64
    v[3] = _rotl(v[3], 16) ^ v[2]
    v[0] = (v[0] + v[3]) & M64
    v[3] = _rotl(v[3], 21) ^ v[0]
    v[2] = (v[2] + v[1]) & M64
    v[1] = _rotl(v[1], 17) ^ v[2]
    v[2] = _rotl(v[2], 32)


def siphash128(message: bytes, key: bytes) -> bytes:
    """SipHash-2-4 with 128-bit output, as the SipHash paper and reference code define it."""
    k0, k1 = struct.unpack("<QQ", key)
    v = [k0 ^ 0x736F6D6570736575, k1 ^ 0x646F72616E646F6D ^ 0xEE, k0 ^ 0x6C7967656E657261, k1 ^ 0x7465646279746573]
    n = len(message)
    padded = message[:n - n % 8] + (message[n - n % 8:] + bytes(7))[:7] + bytes([n & 0xFF])
    for (m,) in struct.iter_unpack("<Q", padded):
        v[3] ^= m
        _sipround(v)
        _sipround(v)
        v[0] ^= m
    v[2] ^= 0xEE
    for _ in range(4):
        _sipround(v)
    a = v[0] ^ v[1] ^ v[2] ^ v[3]
    v[1] ^= 0xDD
    for _ in range(4):
        _sipround(v)
    b = v[0] ^ v[1] ^ v[2] ^ v[3]
    return struct.pack("<QQ", a, b)


def block_digest(block: bytes, nh_key: list[int], sip_key: bytes) -> bytes:
    """NH with four Toeplitz-shifted sums over the zero-padded block, then SipHash-2-4-128 of
    the sums and the length."""
    padded = block + bytes(-len(block) % 8)
    words = [w for (w,) in struct.iter_unpack("<I", padded)]
    sums = []
    for t in range(4):
        h = 0
        for i in range(0, len(words), 2):
            a = (words[i] + nh_key[i + 4 * t]) % 2**32
            b = (words[i + 1] + nh_key[i + 1 + 4 * t]) % 2**32
            h = (h + a * b) % 2**64
        sums.append(h)
    return siphash128(struct.pack("<5Q", *sums, len(block)), sip_key)
