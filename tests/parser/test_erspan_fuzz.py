"""Fuzzing stage 1's decapsulation: truncations, bit flips and random GRE/ERSPAN headers
around valid RoCEv2 frames.

For every input the kernel must return, count the frame exactly once, and decode it as
``test_erspan.check_erspan_record`` says (the struct-based reading of the outer headers, then
the inner frame against ``tests/naive.py``). Each frame is decoded alone, as the last bytes of
its batch's data array, so a read past its end is a read past the array:
``tests/parser/test_under_boundscheck.py`` reruns this module in a subprocess with
``NUMBA_BOUNDSCHECK=1`` (``tests/core/boundscheck.py``), where such a read raises ``IndexError``.
``test_erspan.py::test_without_jit_the_records_are_the_same`` covers the plain-Python run.
"""

from __future__ import annotations

import ipaddress
import struct

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gradtap.capture.frames import FrameBatch
from gradtap.parser.decode import decode_batch
from gradtap.wire import events as ev
from tests.parser.test_erspan import KINDS, check_erspan_record, decode_one, inner_corpus, wrap

FUZZ = settings(max_examples=600, deadline=None, database=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
HEADERS = 14 + 4 + 40 + 16 + 12 + 8       # outer headers at most (tags, IPv6, GRE, ERSPAN III + subheader)


def check(frame: bytes, wirelen: int | None = None):
    wirelen = len(frame) if wirelen is None else wirelen
    batch, rec = decode_one(frame, wirelen)
    assert len(batch.data) == len(frame)
    try:
        check_erspan_record(rec, batch.data, frame, wirelen)
    except AssertionError as exc:
        raise AssertionError(f"{frame.hex()} (wire length {wirelen}): {exc}") from None
    return rec


@pytest.fixture(scope="module")
def inner() -> list[bytes]:
    return inner_corpus()


@pytest.fixture(scope="module")
def corpus(inner) -> list[bytes]:
    """Every encapsulation around every inner frame."""
    return [wrap(f, kind, seq=i, session=i) for kind in KINDS for i, f in enumerate(inner)]


@pytest.mark.timeout(600)
def test_every_truncation_of_encapsulated_frames(corpus):
    for frame in corpus[::2]:
        full = check(frame)
        assert full["event"] in (ev.DECODE_OK, ev.DECODE_BTH_UNKNOWN_OPCODE)
        # Every cut through the headers, then every 13th byte of the payload.
        for k in [*range(min(len(frame), HEADERS + 80)), *range(HEADERS + 80, len(frame), 13)]:
            cut = check(frame[:k], wirelen=len(frame))        # cut on the way to the capture
            assert cut["event"] in (ev.DECODE_FRAME_TRUNCATED, full["event"])
            check(frame[:k])                                  # whole, but its lengths lie


@pytest.mark.timeout(300)
@FUZZ
@given(data=st.data())
def test_bit_flips(corpus, data):
    frame = bytearray(data.draw(st.sampled_from(corpus)))
    for p in data.draw(st.lists(st.integers(0, 1 << 16), min_size=1, max_size=4)):
        # Most flips land in the outer and inner headers, where the decisions are.
        bit = p % (8 * min(len(frame), HEADERS + 60)) if p & 1 else p % (8 * len(frame))
        frame[bit // 8] ^= 0x80 >> (bit % 8)
    check(bytes(frame))


@st.composite
def encapsulations(draw, inner):
    """A frame of ``inner`` behind random but plausible outer headers: GRE flags, protocol,
    optional words, an ERSPAN header of any version, frame type, T and O bits, a subheader
    or not, an IP length that fits or not, an Ethernet trailer, and a cut."""
    frame = draw(st.sampled_from(inner))
    flags = draw(st.one_of(st.sampled_from([0x0000, 0x1000, 0x3000, 0xB000, 0x9000]), st.integers(0, 0xFFFF)))
    proto = draw(st.sampled_from([0x88BE, 0x88BE, 0x22EB, 0x22EB, 0x0800, 0x6558]))
    gre = struct.pack("!HH", flags, proto) + b"".join(
        struct.pack("!I", draw(st.integers(0, (1 << 32) - 1))) for bit in (0x8000, 0x2000, 0x1000) if flags & bit)
    version = draw(st.sampled_from([1, 2, draw(st.integers(0, 15))]))
    word1 = draw(st.integers(0, 0xFFFF))
    if proto == 0x22EB or draw(st.booleans()) and proto != 0x88BE:
        last = draw(st.one_of(st.sampled_from([0x8000, 0x8001, 0x8801]), st.integers(0, 0xFFFF)))
        erspan = struct.pack("!HHIHH", version << 12 | draw(st.integers(0, 0xFFF)), word1, 0, 0, last)
        if last & 1:
            erspan += draw(st.binary(min_size=8, max_size=8))
    elif flags & 0x1000 or draw(st.integers(0, 3)) == 0:
        erspan = struct.pack("!HHI", version << 12, word1, draw(st.integers(0, (1 << 32) - 1)))
    else:
        erspan = b""
    body = gre + erspan + frame
    total = draw(st.one_of(st.just(20 + len(body)), st.just(20 + len(body)), st.integers(0, 20 + len(body) + 8)))
    ip = struct.pack("!BBHHHBBH", 0x45, 0, total, 0, 0, 64, 47, 0) + ipaddress.ip_address("192.0.2.1").packed + \
        ipaddress.ip_address("192.0.2.2").packed
    out = bytes(12) + b"\x08\x00" + ip + body + draw(st.binary(max_size=8))
    return out, draw(st.integers(0, len(out))) if draw(st.integers(0, 3)) == 0 else len(out)


@pytest.mark.timeout(300)
@FUZZ
@given(data=st.data())
def test_random_encapsulation_headers(inner, data):
    frame, caplen = data.draw(encapsulations(inner))
    check(frame)
    if caplen < len(frame):
        check(frame[:caplen], wirelen=len(frame))


def test_batches_count_every_frame_once(corpus):
    frames = corpus + [f[:len(f) // 2] for f in corpus] + [f[:40] for f in corpus] + [b"", b"\x00" * 13]
    batch = FrameBatch.from_frames(frames)
    records, counters = decode_batch(batch, decapsulate=True)
    assert counters.sum() == len(frames) == len(records)
    assert np.array_equal(counters, np.bincount(records["event"], minlength=ev.N_EVENTS))

