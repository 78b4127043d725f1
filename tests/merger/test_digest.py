"""The block digest kernel against its plain-Python twin, and SipHash-2-4-128 against the
published vectors (the reference implementation's ``vectors.h``, key 00..0f, message 00..n-1)."""

from __future__ import annotations

import numpy as np
import pytest

from gradtap.core.errors import GradtapError
from gradtap.merger.digest import (DIGEST_BYTES, MAX_BLOCK_BYTES, block_digests, digest_key, new_secret,
                                   siphash128)
from tests.merger import naive_digest

# vectors_sip128[n] of github.com/veorq/SipHash, vectors.h
SIP128_VECTORS = {
    0: "a3817f04ba25a8e66df67214c7550293",
    1: "da87c1d86b99af44347659119b22fc45",
    7: "a1f1ebbed8dbc153c0b84aa61ff08239",
    8: "3b62a9ba6258f5610f83e264f31497b4",
    15: "5493e99933b0a8117e08ec0f97cfc3d9",
    16: "6ee2a4ca67b054bbfd3315bf85230577",
    40: "df6a301e95c95dad97ae0cc8c6913bd8",
    63: "5150d1772f50834a503e069a973fbd7c",
}


@pytest.mark.parametrize("n", sorted(SIP128_VECTORS))
def test_siphash128_known_answers(n):
    key, message = bytes(range(16)), bytes(range(n))
    assert siphash128(message, key).hex() == SIP128_VECTORS[n]
    assert naive_digest.siphash128(message, key).hex() == SIP128_VECTORS[n]


def twin(data: np.ndarray, start, nbytes, which, key) -> np.ndarray:
    out = np.zeros((len(start), DIGEST_BYTES), np.uint8)
    nh, sip = [int(x) for x in key.nh], key.sip.astype("<u8").tobytes()
    for j in np.flatnonzero(which):
        block = data[start[j]:start[j] + nbytes[j]].tobytes()
        out[j] = np.frombuffer(naive_digest.block_digest(block, nh, sip), np.uint8)
    return out


def test_the_kernel_equals_its_twin_on_every_length_and_alignment():
    rng = np.random.default_rng(5)
    key = digest_key(new_secret())
    sizes = [0, 1, 3, 4, 7, 8, 9, 15, 16, 2046, 4092, MAX_BLOCK_BYTES - 1, MAX_BLOCK_BYTES]
    start, at = [], 0
    for n in sizes:              # packed: every alignment of start and end occurs
        start.append(at)
        at += n + int(rng.integers(0, 3)) * 2 + 1
    start, nbytes = np.array(start, np.int64), np.array(sizes, np.int64)
    data = rng.integers(0, 256, at + 3, dtype=np.uint8)
    which = np.ones(len(sizes), bool)
    which[2] = False
    got = block_digests(data, start, nbytes, which, key)
    assert np.array_equal(got, twin(data, start, nbytes, which, key))
    assert not got[2].any()
    # the same block in place at an aligned start, and copied from an unaligned one
    aligned = np.zeros(2 * MAX_BLOCK_BYTES + 8, np.uint8)
    aligned[4:4 + 1000] = data[:1000]
    aligned[4096 + 2:4096 + 2 + 1000] = data[:1000]
    two = block_digests(aligned, np.array([4, 4098]), np.array([1000, 1000]), np.ones(2, bool), key)
    assert np.array_equal(two[0], two[1])


def test_a_changed_byte_a_changed_length_or_another_key_changes_the_digest():
    rng = np.random.default_rng(1)
    key = digest_key(bytes(32))
    data = rng.integers(0, 256, 4096, dtype=np.uint8)
    one = np.ones(1, bool)
    base = block_digests(data, np.array([0]), np.array([4096]), one, key)
    flipped = data.copy()
    flipped[4095] ^= 1
    assert not np.array_equal(base, block_digests(flipped, np.array([0]), np.array([4096]), one, key))
    padded = np.concatenate([data[:4088], np.zeros(8, np.uint8)])
    assert not np.array_equal(block_digests(padded, np.array([0]), np.array([4088]), one, key),
                              block_digests(padded, np.array([0]), np.array([4096]), one, key))
    assert not np.array_equal(base, block_digests(data, np.array([0]), np.array([4096]), one, digest_key(b"\1" * 32)))


def test_bad_blocks_and_secrets_are_refused():
    key = digest_key(new_secret())
    data = np.zeros(8192, np.uint8)
    with pytest.raises(GradtapError, match="at most 4096"):
        block_digests(data, np.array([0]), np.array([4097]), np.ones(1, bool), key)
    with pytest.raises(GradtapError, match="lie in the 8192 bytes"):
        block_digests(data, np.array([8000]), np.array([400]), np.ones(1, bool), key)
    with pytest.raises(GradtapError, match="expected 32"):
        digest_key(b"short")
