"""The pcap source: every frame of a capture file reaches the ring in order with its
recorded time, through a ring much smaller than the file (it waits, never drops), and the
source says when the file is over."""

from __future__ import annotations

import threading

import pytest

from gradtap.capture.pcap import read_pcap
from gradtap.capture.pcap_source import PcapSource
from gradtap.capture.ring import FrameRing
from gradtap.core.errors import CaptureError
from tests.golden import CAPTURES as GOLDEN_CAPTURES

CAPTURE = GOLDEN_CAPTURES / "iter_40000_p2p_iter10_3.pcapng"


def test_a_file_goes_through_a_small_ring_whole_and_in_order():
    original = read_pcap(CAPTURE)
    got = []
    with FrameRing.create(32, 4352, hugepages="off") as ring, PcapSource(CAPTURE, max_frames=100) as source:
        stop = threading.Event()
        runner = threading.Thread(target=lambda: (source.run(ring, stop), ring.close_producer()))
        runner.start()
        try:
            while not ring.finished:
                batch = ring.read(16, timeout=1)
                got += [(bytes(batch.frame(i)), int(batch.ts_ns[i]), int(batch.wirelens[i]))
                        for i in range(len(batch))]
        finally:
            stop.set()
            runner.join(10)
        stats = source.stats()
    assert got == [(bytes(original.frame(i)), int(original.ts_ns[i]), int(original.wirelens[i]))
                   for i in range(len(original))]
    assert (stats["received"], stats["frames"], stats["ring_drops"], stats["kernel_drops"]) == \
        (len(original), len(original), 0, 0)


def test_receive_says_when_the_file_is_over():
    with FrameRing.create(1024, 4352, hugepages="off") as ring, PcapSource(CAPTURE) as source:
        assert source.receive(ring, 0.1) == 665
        assert source.receive(ring, 0.1) is None


def test_a_full_ring_makes_receive_wait_a_bounded_time():
    with FrameRing.create(8, 4352, hugepages="off") as ring, PcapSource(CAPTURE) as source:
        assert source.receive(ring, 0.01) == 8
        assert source.receive(ring, 0.01) == 0           # nobody reads: nothing moves, nothing drops
        assert source.stats()["ring_drops"] == 0


def test_a_missing_file_is_named(tmp_path):
    for check in ("open", "locate"):
        with pytest.raises(CaptureError, match="absent.pcap: no such file"):
            getattr(PcapSource(tmp_path / "absent.pcap"), check)()
