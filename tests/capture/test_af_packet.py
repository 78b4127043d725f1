"""af_packet on real kernel networking: frames sent over a veth pair between two namespaces
arrive in the ring byte-identical and in order (VLAN tags the kernel strips put back),
with the kernel's timestamps; real NCCL RoCEv2 frames decode as they did in their file;
a tiny frame ring and a tiny kernel ring each drop exactly what they must and count it."""

from __future__ import annotations

import os
import time

import numpy as np
import pytest

from gradtap.capture.af_packet import AfPacketSource
from gradtap.capture.frames import FrameBatch
from gradtap.capture.pcap import read_pcap
from gradtap.capture.ring import FrameRing
from gradtap.core.errors import CaptureError
from gradtap.parser.decode import decode_batch
from tests.capture.netlab import collect, frame, mixed_frames, veth_lab
from tests.golden import CAPTURES as GOLDEN_CAPTURES

pytestmark = [pytest.mark.privileged, pytest.mark.timeout(60),
              pytest.mark.skipif(os.geteuid() != 0, reason="needs root for namespaces and raw sockets")]

CAPTURE_4K = GOLDEN_CAPTURES / "iter_40000_p2p_iter10_3.pcapng"   # RoCE MTU 4096 frames


@pytest.fixture
def lab():
    with veth_lab("p") as lab:
        yield lab


def source_for(lab, **options) -> AfPacketSource:
    """Not opened yet: ``with`` opens and closes it."""
    return AfPacketSource("rx0", netns=lab.rx, **options)


def test_every_frame_arrives_identical_in_order_with_kernel_times(lab):
    sent = mixed_frames(600, 9000)
    with FrameRing.create(1024, 9216, hugepages="off") as ring, source_for(lab) as source:
        tx = lab.sender()
        before = time.time_ns()
        for f in sent:
            tx.send(f)
        after = time.time_ns()
        tx.close()
        got = collect(source, ring, len(sent))
        stats = source.stats()
    assert [g[0] for g in got] == sent
    assert [g[1] for g in got] == [len(f) for f in sent]
    times = np.array([g[2] for g in got])
    assert np.all(np.diff(times) >= 0) and before <= times[0] and times[-1] <= after
    tagged = sum(f[12:14] in (b"\x81\x00", b"\x88\xa8") for f in sent)
    assert stats["vlan_restored"] == tagged > 0
    assert (stats["received"], stats["frames"], stats["tp_packets"]) == (600, 600, 600)
    assert (stats["kernel_drops"], stats["ring_drops"], stats["truncated"], stats["bad_blocks"]) == (0, 0, 0, 0)
    assert stats["blocks"] >= 2


def test_real_roce_frames_decode_as_in_their_file(lab):
    original = read_pcap(CAPTURE_4K)
    with FrameRing.create(1024, 4352, hugepages="off") as ring, source_for(lab, block_size=1 << 16) as source:
        tx = lab.sender()
        for i in range(len(original)):
            tx.send(original.frame(i))
        tx.close()
        got = collect(source, ring, len(original))
    received = FrameBatch.from_frames([g[0] for g in got])
    assert [g[0] for g in got] == [bytes(original.frame(i)) for i in range(len(original))]
    ours, ours_counts = decode_batch(received)
    theirs, their_counts = decode_batch(original)
    assert ours_counts.tolist() == their_counts.tolist()
    assert ours["icrc"].tolist() == theirs["icrc"].tolist() and ours["psn"].tolist() == theirs["psn"].tolist()


def test_a_full_frame_ring_drops_exactly_the_overflow(lab):
    sent = [frame(i, 200) for i in range(30)]
    with FrameRing.create(8, 256, hugepages="off") as ring, source_for(lab) as source:
        tx = lab.sender()
        for f in sent:
            tx.send(f)
        tx.close()
        got = collect(source, ring, len(sent))
        stats = source.stats()
    assert [g[0] for g in got] == sent[:8]
    assert (stats["received"], stats["frames"], stats["ring_drops"], stats["kernel_drops"]) == (30, 8, 22, 0)


def test_a_full_kernel_ring_is_counted_as_kernel_drops(lab):
    """Two 4 KiB blocks hold three 1000-byte frames each: the kernel must drop the rest of
    40 frames sent while nobody reads, and say so in PACKET_STATISTICS."""
    sent = [frame(i, 1000) for i in range(40)]
    with FrameRing.create(64, 1024, hugepages="off") as ring, \
            source_for(lab, block_size=4096, block_count=2, block_timeout_ms=1) as source:
        tx = lab.sender()
        for f in sent:
            tx.send(f)
        tx.close()
        time.sleep(0.05)
        got = collect(source, ring, len(sent), seconds=0.5)
        stats = source.stats()
    assert stats["tp_packets"] == 40
    assert stats["kernel_drops"] == stats["tp_drops"] > 0
    assert stats["received"] + stats["kernel_drops"] == 40
    assert stats["tp_freeze_q_cnt"] >= 1
    assert [g[0] for g in got] == sent[:stats["received"]]     # the kernel keeps the first ones


def test_long_frames_are_cut_at_the_slot_and_counted(lab):
    sent = [frame(i, 1000) for i in range(5)]
    with FrameRing.create(16, 128, hugepages="off") as ring, source_for(lab) as source:
        tx = lab.sender()
        for f in sent:
            tx.send(f)
        tx.close()
        got = collect(source, ring, len(sent))
        stats = source.stats()
    assert [(g[0], g[1]) for g in got] == [(f[:128], 1000) for f in sent]
    assert stats["truncated"] == 5


@pytest.mark.parametrize("check", ["open", "locate"])
def test_missing_interface_or_namespace_says_what_is_missing(lab, check):
    """``locate`` (what ``gradtap run`` checks before its start-up) names them as ``open`` does."""
    with pytest.raises(CaptureError, match=rf"no interface 'nope0' in network namespace '{lab.rx}'"):
        getattr(AfPacketSource("nope0", netns=lab.rx), check)()
    with pytest.raises(CaptureError, match="network namespace 'gtc-absent' does not exist"):
        getattr(AfPacketSource("rx0", netns="gtc-absent"), check)()
    AfPacketSource("rx0", netns=lab.rx).locate()


def test_a_ring_larger_than_memory_is_refused_before_the_kernel_tries(lab):
    with pytest.raises(CaptureError, match="exceeds half of the available memory"):
        AfPacketSource("rx0", netns=lab.rx, block_size=1 << 30, block_count=1 << 12).open()
