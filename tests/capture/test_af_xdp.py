"""af_xdp on real kernel networking: with the XDP program attached natively and generically,
frames up to 9000 bytes (several UMEM chunks each) sent over a veth pair arrive in the ring
byte-identical and in order; a frame that fills a chunk takes one descriptor, one byte more
takes two; real NCCL RoCEv2 frames decode as in their file; the kernel's
drops (RX ring full) and the frame ring's drops are each counted exactly; and the program
is gone from the interface after close, after a failed open, and never taken from another
owner."""

from __future__ import annotations

import os
import time

import numpy as np
import pytest
from pyroute2 import IPRoute

from gradtap.capture import bpf
from gradtap.capture.af_xdp import CHUNK_SIZES, PAGE_SIZE, ROCE_4096_FRAME_BYTES, AfXdpSource, chunk_frame_bytes, \
    chunk_size_for
from gradtap.capture.frames import FrameBatch
from gradtap.capture.pcap import read_pcap
from gradtap.capture.ring import FrameRing
from gradtap.core.errors import CaptureError
from gradtap.parser.decode import decode_batch
from tests.capture.netlab import collect, frame, mixed_frames, veth_lab
from tests.golden import CAPTURES as GOLDEN_CAPTURES

pytestmark = [pytest.mark.privileged, pytest.mark.timeout(60),
              pytest.mark.skipif(os.geteuid() != 0, reason="needs root for namespaces and AF_XDP")]

CAPTURE_4K = GOLDEN_CAPTURES / "iter_40000_p2p_iter10_3.pcapng"   # RoCE MTU 4096 frames


@pytest.fixture
def lab():
    with veth_lab("x") as lab:
        yield lab


def open_source(lab, **options) -> AfXdpSource:
    source = AfXdpSource("rx0", netns=lab.rx, **options)
    source.open()
    return source


def source_for(lab, **options) -> AfXdpSource:
    """Not opened yet: ``with`` opens and closes it."""
    return AfXdpSource("rx0", netns=lab.rx, **options)


def attached(lab) -> bool:
    return lab.xdp_state().get("IFLA_XDP_PROG_ID") is not None


@pytest.mark.parametrize("attach", ["native", "generic"])
def test_every_frame_arrives_identical_and_in_order(lab, attach):
    sent = mixed_frames(600, 9000)
    with FrameRing.create(1024, 9216, hugepages="off") as ring:
        source = open_source(lab, attach=attach)
        try:
            assert (source.attach_mode, source.bound_mode, source.multibuffer) == (attach, "copy", True)
            mode = {"native": "xdp", "generic": "xdpgeneric"}[attach]
            assert lab.xdp_state()["IFLA_XDP_ATTACHED"] == mode
            tx = lab.sender()
            before = time.time_ns()
            for f in sent:
                tx.send(f)
            tx.close()
            got = collect(source, ring, len(sent))
            after = time.time_ns()
            stats = source.stats()
        finally:
            source.close()
    assert not attached(lab)
    assert [g[0] for g in got] == sent
    assert [g[1] for g in got] == [len(f) for f in sent]
    times = np.array([g[2] for g in got])
    assert np.all(np.diff(times) >= 0) and before <= times[0] and times[-1] <= after
    assert (stats["received"], stats["frames"], stats["kernel_drops"], stats["ring_drops"]) == (600, 600, 0, 0)
    assert stats["fragments"] > 600                     # jumbo frames came in several chunks
    assert (stats["bad_descs"], stats["rx_invalid_descs"], stats["truncated"]) == (0, 0, 0)


@pytest.mark.parametrize("chunk_size", CHUNK_SIZES)
def test_a_frame_that_fills_a_chunk_takes_one_descriptor_and_a_longer_one_two(lab, chunk_size):
    """A chunk holds ``chunk_size - 256`` bytes (XDP_PACKET_HEADROOM comes first): a frame of
    exactly that length is one descriptor, one byte more spans two chunks (multi-buffer);
    both arrive whole."""
    full = chunk_frame_bytes(chunk_size)
    sent = [frame(i, full) for i in range(20)] + [frame(20 + i, full + 1) for i in range(20)]
    with FrameRing.create(64, 4352, hugepages="off") as ring, source_for(lab, chunk_size=chunk_size) as source:
        assert source.info()["chunk_frame_bytes"] == full
        tx = lab.sender()
        for f in sent[:20]:
            tx.send(f)
        got = collect(source, ring, 20)
        one_each = source.stats()["fragments"]
        for f in sent[20:]:
            tx.send(f)
        tx.close()
        got += collect(source, ring, 40)              # counts are cumulative
        stats = source.stats()
    assert [g[0] for g in got] == sent
    assert one_each == 20 and stats["fragments"] == 20 + 2 * 20
    assert (stats["frames"], stats["bad_descs"], stats["truncated"], stats["kernel_drops"]) == (40, 0, 0, 0)


def test_auto_chunk_size_holds_the_whole_frame_where_the_page_allows():
    assert chunk_size_for(1024 + 78) == 2048                       # RoCE MTU 1024: one 2 KiB chunk
    assert chunk_size_for(1792) == 2048 and chunk_size_for(1793) == 4096
    assert chunk_size_for(ROCE_4096_FRAME_BYTES, page_size=4096) == 4096    # spans two: no larger chunk
    assert chunk_size_for(ROCE_4096_FRAME_BYTES, page_size=16384) == 8192   # 16 KiB pages: one chunk
    assert chunk_frame_bytes(chunk_size_for(ROCE_4096_FRAME_BYTES, page_size=65536)) >= ROCE_4096_FRAME_BYTES
    assert AfXdpSource("rx0").chunk_size == chunk_size_for(ROCE_4096_FRAME_BYTES) == min(8192, PAGE_SIZE)
    assert AfXdpSource("rx0", frame_bytes=1100).chunk_size == 2048
    with pytest.raises(ValueError, match="chunk_size = 3000"):
        AfXdpSource("rx0", chunk_size=3000)


def test_real_roce_frames_decode_as_in_their_file(lab):
    original = read_pcap(CAPTURE_4K)
    with FrameRing.create(1024, 4352, hugepages="off") as ring, source_for(lab) as source:
        tx = lab.sender()
        for i in range(len(original)):
            tx.send(original.frame(i))
        tx.close()
        got = collect(source, ring, len(original))
    assert [g[0] for g in got] == [bytes(original.frame(i)) for i in range(len(original))]
    ours, ours_counts = decode_batch(FrameBatch.from_frames([g[0] for g in got]))
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


def test_a_full_rx_ring_is_counted_as_kernel_drops(lab):
    """64 RX entries and 64 chunks, 200 frames sent while nobody reads: the kernel keeps 64
    and must count every other frame as dropped."""
    sent = [frame(i, 100) for i in range(200)]
    with FrameRing.create(256, 256, hugepages="off") as ring, source_for(lab, frames=64, rx_size=64) as source:
        tx = lab.sender()
        for f in sent:
            tx.send(f)
        tx.close()
        time.sleep(0.05)
        got = collect(source, ring, len(sent), seconds=0.5)
        stats = source.stats()
    assert stats["received"] == 64 and [g[0] for g in got] == sent[:64]
    assert stats["kernel_drops"] == stats["rx_ring_full"] + stats["rx_dropped"] == 136


def test_another_owners_program_is_left_alone(lab):
    map_fd = bpf.create_xskmap(1)
    prog_fd = bpf.load_xdp_program(bpf.xsk_redirect_program(map_fd), frags=True)
    try:
        with IPRoute(netns=lab.rx) as ipr:
            ipr.link("set", index=ipr.link_lookup(ifname="rx0")[0], xdp_fd=prog_fd)
        foreign = lab.xdp_state()["IFLA_XDP_PROG_ID"]
        with pytest.raises(CaptureError, match="already has an XDP program attached"):
            open_source(lab)
        assert lab.xdp_state()["IFLA_XDP_PROG_ID"] == foreign       # still theirs
    finally:
        os.close(prog_fd)
        os.close(map_fd)


def test_a_queue_taken_by_another_socket_is_named(lab):
    first = open_source(lab)
    try:
        with pytest.raises(CaptureError, match="another AF_XDP socket is bound to queue 0"):
            open_source(lab)
        assert attached(lab)                            # the failed open took nothing away
    finally:
        first.close()
    assert not attached(lab)
    open_source(lab).close()                            # the queue is free again


def test_missing_things_are_named(lab):
    with pytest.raises(CaptureError, match=rf"no interface 'nope0' in network namespace '{lab.rx}'"):
        AfXdpSource("nope0", netns=lab.rx).open()
    with pytest.raises(CaptureError, match=rf"no interface 'nope0' in network namespace '{lab.rx}'"):
        AfXdpSource("nope0", netns=lab.rx).locate()
    AfXdpSource("rx0", netns=lab.rx).locate()           # opens nothing
    with pytest.raises(CaptureError, match="zero-copy"):
        open_source(lab, mode="zerocopy")               # veth has copy mode only
    with pytest.raises(CaptureError, match="queue 9"):
        open_source(lab, queue=9)
    with pytest.raises(CaptureError, match="exceeds half of the available memory"):
        open_source(lab, frames=1 << 30)
    assert not attached(lab)
