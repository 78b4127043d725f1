"""Fuzzing stage 1: random bytes, every truncation of valid frames, bit flips, and random
RoCEv2 frames aimed at a job's own addresses, ports and QPs.

For every input the kernel must return (no crash, no hang), count the frame exactly once,
and take the same accept/refuse decision as the naive decoder of ``tests/naive.py`` (through
``check_record`` of ``test_decode.py``, which lists the deliberate differences). Each frame is
decoded alone, as the last bytes of its batch's data array, so a read past its end is a read
past the array: ``tests/parser/test_under_boundscheck.py`` reruns this module in a subprocess
with ``NUMBA_BOUNDSCHECK=1`` (its kernels compiled with the checks, ``tests/core/boundscheck.py``),
where such a read raises ``IndexError``.
"""

from __future__ import annotations

import ipaddress
import struct

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from numba import config, njit

from gradtap.capture.frames import FrameBatch
from gradtap.core.bytes import read_le
from gradtap.core.jit import JIT
from gradtap.wire import events as ev
from gradtap.parser.decode import decode_batch, is_roce
from gradtap.wire.headers.opcodes import OPCODE_EXT_LEN, OPCODE_VALID, OPCODES
from tests import naive
from tests.parser.test_decode import CAPTURES, check_record
from tests.simulator.test_simulate import make_job, simulate
from gradtap.workload.layout import job_plan

FUZZ = settings(max_examples=600, deadline=None, database=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
BTH_FIELDS = ("ip_version", "src_ip", "dst_ip", "udp_sport", "opcode", "dest_qp", "psn", "padcnt")


def decode_one(frame: bytes, wirelen: int | None = None):
    """The record and counters of ``frame`` decoded alone: its last byte is the data's last."""
    batch = FrameBatch.from_frames([frame], wirelens=None if wirelen is None else [wirelen])
    assert len(batch.data) == len(frame)
    records, counters = decode_batch(batch)
    assert counters.sum() == 1 and counters[records[0]["event"]] == 1
    return batch, records[0]


def check(frame: bytes, wirelen: int | None = None):
    batch, rec = decode_one(frame, wirelen)
    try:
        check_record(rec, batch.data, frame, len(frame) if wirelen is None else wirelen)
    except AssertionError as exc:
        raise AssertionError(f"{frame.hex()} (wire length {wirelen}): {exc}") from None
    return rec


@pytest.fixture(scope="module")
def simulated(tmp_path_factory):
    """(job, capture) of a small simulated IPv4 job."""
    job = make_job(n=2, protocol="LL", ipv6=False)
    return job, simulate(tmp_path_factory.mktemp("fuzz"), job, iterations=1).streams[0].path


@pytest.fixture(scope="module")
def corpus(simulated) -> list[bytes]:
    """Valid RoCEv2 frames: one per (opcode, family, pad count) from the real captures
    (IPv6, 0xaa included) and from the simulated IPv4 job, and a third of them again with
    two VLAN tags."""
    frames = [f for path in sorted(CAPTURES.glob("*.pcapng")) for _, f in naive.read_capture(path)]
    frames += [f for _, f in naive.read_capture(simulated[1])]
    chosen: dict[tuple, bytes] = {}
    for frame in frames:
        _, rec = decode_one(frame)
        if rec["event"] in (ev.DECODE_OK, ev.DECODE_BTH_UNKNOWN_OPCODE):
            chosen.setdefault((int(rec["opcode"]), int(rec["ip_version"]), int(rec["padcnt"])), frame)
    tags = struct.pack("!HHHH", 0x88A8, 0x0123, 0x8100, 0x0456)
    return [*chosen.values(), *(f[:12] + tags + f[12:] for f in list(chosen.values())[::3])]


@pytest.fixture(scope="module")
def flows(simulated):
    """(src ip, dst ip, UDP source port, destination QP) of every flow of the simulated job."""
    job = simulated[0]
    ranks = job.ring.ranks
    return [(ranks[f["src"]].ip, ranks[f["dst"]].ip, int(f["udp_sport"]), int(f["dst_qpn"]))
            for f in job_plan(job).flows]


def test_corpus_covers_the_opcodes_nccl_sends(corpus):
    recs = [decode_one(f)[1] for f in corpus]
    seen = {(int(r["opcode"]), int(r["ip_version"])) for r in recs}
    assert {(op, 6) for op in (0x06, 0x07, 0x09, 0x0A, 0x0B, 0x11)} <= seen
    assert {(op, 4) for op in (0x06, 0x07, 0x09, 0x0A, 0x11)} <= seen
    assert (0xAA, 6) in seen and any(r["vlan"] for r in recs)


@pytest.mark.timeout(300)
def test_every_truncation_of_valid_frames(corpus):
    for frame in corpus:
        _, full = decode_one(frame)
        opcode = int(full["opcode"])
        bth_end = full["payload_off"] - (OPCODE_EXT_LEN[opcode] if OPCODE_VALID[opcode] else 0)
        for k in range(len(frame)):
            cut = check(frame[:k], wirelen=len(frame))       # cut on the way to the capture
            assert cut["event"] in (ev.DECODE_FRAME_TRUNCATED, full["event"])
            assert bool(is_roce(cut)) == (k >= bth_end)
            if is_roce(cut):
                assert all(np.array_equal(cut[name], full[name]) for name in BTH_FIELDS)
            check(frame[:k])                                  # whole, but its lengths lie


@pytest.mark.timeout(120)
@FUZZ
@given(st.binary(max_size=200), st.integers(0, 64))
def test_random_bytes(frame, missing):
    check(frame, len(frame) + missing)


@pytest.mark.timeout(120)
@FUZZ
@given(data=st.data())
def test_bit_flips(corpus, data):
    frame = bytearray(data.draw(st.sampled_from(corpus)))
    positions = data.draw(st.lists(st.integers(0, 1 << 16), min_size=1, max_size=4))
    for p in positions:
        # Most flips land in the headers, where the decisions are.
        bit = p % (8 * min(len(frame), 96)) if p & 1 else p % (8 * len(frame))
        frame[bit // 8] ^= 0x80 >> (bit % 8)
    check(bytes(frame))


def _ip_header(src: str, dst: str, length: int, ipv6: bool) -> bytes:
    if ipv6:
        return struct.pack("!IHBB", 6 << 28, length, 17, 64) + ipaddress.ip_address(src).packed + \
            ipaddress.ip_address(dst).packed
    return struct.pack("!BBHHHBBH", 0x45, 0, 20 + length, 0, 0x4000, 64, 17, 0) + \
        ipaddress.ip_address(src).packed + ipaddress.ip_address(dst).packed


def _length(draw, right: int, limit: int) -> int:
    """A length field: mostly ``right``, else near it (off by a header or a byte) or anything."""
    return draw(st.one_of(st.just(right), st.just(right), st.integers(max(0, right - 40), right + 4),
                          st.integers(0, limit)))


@st.composite
def job_frames(draw, flows):
    """A frame to one of the job's flows (addresses, ports, QP; IPv4 as simulated, or the
    same flow over IPv6), with a random BTH, extension headers and payload, lengths that fit
    or not, a correct ICRC or not, VLAN tags, an Ethernet trailer, and a cut."""
    src, dst, sport, qp = draw(st.sampled_from(flows))
    ipv6 = draw(st.booleans())
    if ipv6:
        src, dst = f"::ffff:{src}", f"fe80::{dst.replace('.', ':')}"
    opcode = draw(st.one_of(st.sampled_from(sorted(OPCODES)), st.integers(0, 255)))
    qp = draw(st.one_of(st.just(qp), st.integers(0, (1 << 24) - 1)))
    bth = struct.pack("!BBHII", opcode, draw(st.integers(0, 255)), 0xFFFF, qp, draw(st.integers(0, (1 << 32) - 1)))
    body = bth + draw(st.one_of(st.binary(max_size=40), st.binary(max_size=300)))
    udp_len = _length(draw, 8 + len(body) + 4, 0xFFFF)
    udp = struct.pack("!HHHH", sport, 4791, udp_len, 0)
    ip_len = _length(draw, 8 + len(body) + 4, 0xFFFF - 20)
    ip = _ip_header(src, dst, ip_len, ipv6)
    tags = b"".join(struct.pack("!HH", 0x8100, vid) for vid in draw(st.lists(st.integers(0, 4095), max_size=2)))
    eth = bytes(6) + bytes(6) + tags + struct.pack("!H", 0x86DD if ipv6 else 0x0800)
    frame = eth + ip + udp + body + bytes(4)
    end = len(eth) + len(ip) + udp_len
    if draw(st.booleans()) and 8 + len(body) + 4 == udp_len:
        icrc = naive.icrc(frame, len(eth), 6 if ipv6 else 4, end - 4)
        frame = frame[:end - 4] + struct.pack("<I", icrc)
    frame += draw(st.binary(max_size=8))                            # Ethernet trailer
    return frame, draw(st.integers(0, len(frame))) if draw(st.integers(0, 3)) == 0 else len(frame)


@pytest.mark.timeout(120)
@FUZZ
@given(data=st.data())
def test_random_frames_to_the_jobs_flows(flows, data):
    frame, caplen = data.draw(job_frames(flows))
    full = check(frame)
    if caplen < len(frame):
        cut = check(frame[:caplen], wirelen=len(frame))
        ip_fits = full["event"] not in (ev.DECODE_IPV4_TRUNCATED, ev.DECODE_IPV6_TRUNCATED)
        if ip_fits:
            assert cut["event"] in (ev.DECODE_FRAME_TRUNCATED, full["event"])


def test_batches_count_every_frame_once(corpus):
    frames = corpus + [f[:len(f) // 2] for f in corpus] + [b"", b"\x00" * 13]
    batch = FrameBatch.from_frames(frames)
    records, counters = decode_batch(batch)
    assert counters.sum() == len(frames) == len(records)
    assert np.array_equal(counters, np.bincount(records["event"], minlength=ev.N_EVENTS))


@pytest.mark.skipif(not config.BOUNDSCHECK, reason="runs in the NUMBA_BOUNDSCHECK=1 subprocess")
def test_boundscheck_is_on():
    @njit(**JIT)
    def past_the_end(a):
        return a[len(a)]

    with pytest.raises(IndexError):
        past_the_end(np.zeros(3, np.uint8))
    # A gradtap kernel as the fuzz tests get it, from the bounds-checked cache after the
    # first of them (tests/core/boundscheck.py): it checks its reads too.
    with pytest.raises(IndexError):
        read_le(np.zeros(3, np.uint8), 1, 4)

