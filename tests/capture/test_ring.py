"""FrameRing: frames come out byte-identical and in order, full rings drop exactly what did
not fit (and count it), long frames are cut and counted, waits are bounded, batches are
views of the shared slots that the parser takes as they are, and a producer in another
process hands over millions of bytes without a torn frame."""

from __future__ import annotations

import logging
import multiprocessing
import time
import zlib

import numpy as np
import pytest

from gradtap.capture.frames import FrameBatch
from gradtap.capture.pcap import read_pcap
from gradtap.capture.ring import FrameRing, wait_until
from gradtap.core.errors import CaptureError
from gradtap.parser.decode import decode_batch
from tests.golden import CAPTURES as GOLDEN_CAPTURES

CAPTURE = GOLDEN_CAPTURES / "rdma32.pcapng"


def frames_of(batch: FrameBatch) -> list[bytes]:
    return [bytes(batch.frame(i)) for i in range(len(batch))]


def pattern(i: int, size: int) -> bytes:
    return i.to_bytes(4, "big") + bytes((i * 7 + k) & 0xFF for k in range(size - 4))


@pytest.fixture
def ring():
    r = FrameRing.create(16, 256, hugepages="off")
    yield r
    r.close()


def test_frames_round_trip_in_order_with_times_and_wire_lengths(ring):
    sent = [pattern(i, 60 + 13 * i) for i in range(12)]
    batch = FrameBatch.from_frames(sent, ts_ns=np.arange(12) * 1000 + 5, wirelens=[len(f) + 4 for f in sent])
    assert ring.push(batch) == 12
    out = ring.read(100, timeout=0)
    assert frames_of(out) == sent
    assert out.ts_ns.tolist() == batch.ts_ns.tolist()
    assert out.wirelens.tolist() == [len(f) + 4 for f in sent]
    assert ring.stats() == {"frames": 12, "bytes": sum(map(len, sent)), "ring_drops": 0, "truncated": 0,
                            "consumed": 0, "occupancy": 12}
    ring.release()
    assert ring.stats()["consumed"] == 12 and ring.stats()["occupancy"] == 0


def test_batches_stop_at_the_ring_end_and_wrap(ring):
    seq = 0
    for round_ in range(5):                      # 5 x 11 frames through 16 slots: wraps 3 times
        sent = [pattern(seq + k, 64) for k in range(11)]
        seq += 11
        assert ring.push(FrameBatch.from_frames(sent)) == 11
        got = []
        while len(got) < 11:
            out = ring.read(100, timeout=0)
            assert len(out) > 0
            first = int(out.offsets[0]) // ring.slot_size
            assert first + len(out) <= ring.slots          # one run of slots, never across the end
            got += frames_of(out)
        ring.release()                           # the slots of the last batch go back
        assert got == sent, round_
    assert ring.stats()["consumed"] == 55


def test_a_full_ring_drops_and_counts_exactly(ring):
    sent = [pattern(i, 64) for i in range(40)]
    assert ring.push(FrameBatch.from_frames(sent)) == 40          # live: every frame handled
    stats = ring.stats()
    assert (stats["frames"], stats["ring_drops"]) == (16, 24)
    assert frames_of(ring.read(100, timeout=0)) == sent[:16]        # the first 16 kept, in order
    ring.release()
    assert ring.push(FrameBatch.from_frames(sent[:3])) == 3
    assert ring.stats()["ring_drops"] == 24


def test_a_file_source_push_waits_instead_of_dropping(ring):
    batch = FrameBatch.from_frames([pattern(i, 64) for i in range(40)])
    assert ring.push(batch, drop=False) == 16
    assert ring.push(batch, drop=False, start=16) == 16             # still full: nothing moves
    assert ring.stats()["ring_drops"] == 0
    ring.read(4, timeout=0)
    ring.release()
    assert ring.push(batch, drop=False, start=16) == 20


def test_long_frames_are_cut_at_the_slot_and_counted(ring):
    sent = [pattern(0, 256), pattern(1, 257), pattern(2, 4000)]
    ring.push(FrameBatch.from_frames(sent))
    out = ring.read(timeout=0)
    assert out.caplens.tolist() == [256, 256, 256]
    assert out.wirelens.tolist() == [256, 257, 4000]
    assert frames_of(out) == [f[:256] for f in sent]
    assert ring.stats()["truncated"] == 2


def test_read_waits_a_bounded_time_and_honours_stop_and_end(ring):
    t = time.monotonic()
    assert len(ring.read(timeout=0.05)) == 0
    assert 0.04 < time.monotonic() - t < 2

    class Stop:
        def is_set(self):
            return True
    t = time.monotonic()
    assert len(ring.read(timeout=30, stop=Stop())) == 0
    assert time.monotonic() - t < 2

    ring.push(FrameBatch.from_frames([pattern(0, 64)]))
    ring.close_producer()
    assert not ring.finished                                        # a frame is still waiting
    assert len(ring.read(timeout=30)) == 1
    assert not ring.finished                                        # read, not yet released
    t = time.monotonic()
    assert len(ring.read(timeout=30)) == 0                          # closed: no wait
    assert time.monotonic() - t < 2
    assert ring.finished


def test_batches_are_views_of_the_ring_that_the_decoder_takes():
    """Real NCCL RoCEv2 frames through the ring decode exactly as read from their file."""
    original = read_pcap(CAPTURE)
    with FrameRing.create(256, 1152, hugepages="off") as ring:
        assert ring.push(original) == len(original) and ring.stats()["ring_drops"] == 0
        out = ring.read(timeout=0)
        assert len(out) == len(original)
        assert np.shares_memory(out.data, np.frombuffer(ring.memory.buf, np.uint8))
        ours, counters = decode_batch(out)
        theirs, expected = decode_batch(original)
        for field in ours.dtype.names:
            if field not in ("l3_off", "payload_off"):                  # offsets differ: slots vs packed
                assert np.array_equal(ours[field], theirs[field]), field
        # Relative to its frame, each offset is the same.
        for field in ("l3_off", "payload_off"):
            read = ours[field] >= 0
            assert np.array_equal(read, theirs[field] >= 0)
            assert np.array_equal(ours[field][read] - out.offsets[read], theirs[field][read] - original.offsets[read])
        for i in np.flatnonzero(ours["payload_len"] > 0):
            a, b, n = ours["payload_off"][i], theirs["payload_off"][i], ours["payload_len"][i]
            assert out.data[a:a + n].tobytes() == original.data[b:b + n].tobytes()
        assert counters.tolist() == expected.tolist()
        del out


def test_misuse_is_refused(ring):
    with pytest.raises(ValueError, match="max_frames"):
        ring.read(0)
    with pytest.raises(ValueError, match="Ethernet"):
        ring.push(FrameBatch.from_frames([pattern(0, 64)], linktype=101))


@pytest.mark.parametrize("slots,slot_size", [(1, 256), (16, 100), (16, 32)])
def test_bad_geometry_is_refused(slots, slot_size):
    with pytest.raises(ValueError, match="slot"):
        FrameRing.create(slots, slot_size, hugepages="off")


def _produce(ring: FrameRing, n: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    sizes = rng.integers(60, ring.slot_size + 1, n)
    sent, deadline = 0, time.monotonic() + 100
    while sent < n and time.monotonic() < deadline:
        chunk = sizes[sent:sent + 257]
        frames = [pattern(sent + k, int(s)) for k, s in enumerate(chunk)]
        batch = FrameBatch.from_frames(frames, ts_ns=np.arange(sent, sent + len(frames)))
        start = 0
        while start < len(batch) and time.monotonic() < deadline:
            start = ring.push(batch, drop=False, start=start)
        sent += len(frames)
    ring.close_producer()


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_producer_process_hands_over_every_frame_intact():
    """Spawned producer, this process consumes: a torn or reordered frame would change the
    CRC of its bytes or its sequence number (the ring is small, so it wraps ~600 times)."""
    n = 20000
    ring = FrameRing.create(32, 512, hugepages="off")
    sizes = np.random.default_rng(7).integers(60, 513, n)
    expect = [zlib.crc32(pattern(i, int(s))) for i, s in enumerate(sizes)]
    proc = multiprocessing.get_context("spawn").Process(target=_produce, args=(ring, n, 7))
    proc.start()
    try:
        got, deadline = 0, time.monotonic() + 100
        while not ring.finished and time.monotonic() < deadline:
            batch = ring.read(64, timeout=0.5)
            for k in range(len(batch)):
                assert batch.ts_ns[k] == got
                assert zlib.crc32(batch.frame(k)) == expect[got], got
                got += 1
        assert got == n
    finally:
        proc.join(10)
        if proc.is_alive():                     # a failed check left it waiting for room
            proc.kill()
            proc.join()
        ring.close()
    assert proc.exitcode == 0


def test_huge_pages_required_but_missing_is_an_error_that_says_what_to_do(monkeypatch):
    import gradtap.capture.shared_memory as shm
    monkeypatch.setattr(shm.os, "MFD_HUGETLB", 1 << 30)        # an unknown flag: memfd_create fails
    with pytest.raises(CaptureError, match="vm.nr_hugepages"):
        FrameRing.create(16, 256, hugepages="require")


def test_without_huge_pages_auto_falls_back_with_one_log_line(monkeypatch, caplog):
    import gradtap.capture.shared_memory as shm
    monkeypatch.setattr(shm.os, "MFD_HUGETLB", 1 << 30)
    with caplog.at_level(logging.WARNING, logger="gradtap.capture.shared_memory"):
        r = FrameRing.create(16, 256, hugepages="auto")
    assert (r.hugepages, r.page_size) == (False, 4096)
    assert len(caplog.records) == 1 and "no huge pages" in caplog.records[0].getMessage()
    r.close()


def test_wait_until_asks_at_least_once_and_gives_up_at_the_timeout():
    calls = []
    assert wait_until(lambda: calls.append(1) or True, timeout=0) and len(calls) == 1
    start = time.monotonic()
    assert not wait_until(lambda: calls.append(1) or False, timeout=0.05)
    waited = time.monotonic() - start
    assert 0.05 <= waited < 2 and 2 < len(calls) < 600      # backed-off sleeps, not a spin
    answers = iter([False, False, True])
    assert wait_until(lambda: next(answers), timeout=5)
