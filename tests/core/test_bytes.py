"""The byte readers and writers against ``struct`` (their slow twin), compiled and without the JIT."""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest

from gradtap.core.bytes import read_be, read_be_u64, read_le, read_le_u64, read_uint, write_be, write_le
from tests.core.no_jit import run_without_jit

BUF = np.frombuffer(bytes([0x81, 0x02, 0xF3, 0x04, 0x05, 0xF6, 0x07, 0x88, 0x09, 0xFA]), np.uint8)
FORMATS = {1: "B", 2: "H", 4: "I", 8: "Q"}


def results() -> dict:
    """Every reader at every offset and size, and the writers' bytes, as JSON-ready values."""
    out = {}
    for pos in range(3):
        for size in (1, 2, 3, 4, 7):
            out[f"be {pos} {size}"] = int(read_be(BUF, pos, size))
            out[f"le {pos} {size}"] = int(read_le(BUF, pos, size))
            out[f"uint {pos} {size}"] = [int(read_uint(BUF, pos, size, True)), int(read_uint(BUF, pos, size, False))]
        for size in (1, 4, 8):
            out[f"be64 {pos} {size}"] = int(read_be_u64(BUF, pos, size))
            out[f"le64 {pos} {size}"] = int(read_le_u64(BUF, pos, size))
    buf = np.zeros(16, np.uint8)
    write_be(buf, 1, np.uint64(0xF1E2D3C4B5A69788), 8)
    write_le(buf, 9, 0x0A0B0C0D, 4)
    write_be(buf, 13, 0x1234, 2)
    out["written"] = buf.tobytes().hex()
    return out


@pytest.mark.parametrize("pos", range(3))
@pytest.mark.parametrize("size", [1, 2, 4, 8])
def test_readers_equal_struct(pos, size):
    raw = BUF.tobytes()
    big, little = (struct.unpack_from(o + FORMATS[size], raw, pos)[0] for o in "><")
    assert (read_be_u64(BUF, pos, size), read_le_u64(BUF, pos, size)) == (big, little)
    if size < 8:
        assert (read_be(BUF, pos, size), read_le(BUF, pos, size)) == (big, little)
        assert (read_uint(BUF, pos, size, True), read_uint(BUF, pos, size, False)) == (big, little)


def test_odd_sizes_and_writers():
    r = results()
    assert r["be 0 3"] == 0x8102F3 and r["le 0 3"] == 0xF30281
    assert r["be 1 7"] == int.from_bytes(BUF[1:8].tobytes(), "big")
    assert r["written"] == "00f1e2d3c4b5a697880d0c0b0a123400"


def test_without_jit_they_give_the_same():
    plain = run_without_jit("import json\nfrom tests.core.test_bytes import results\nprint(json.dumps(results()))")
    assert json.loads(plain) == json.loads(json.dumps(results()))
